"""ZeRO state offloaded to NVMe: a rank's swap files as checkpoint entries under names that survive
a restart, and their restore in place.

DeepSpeed names a swap file by ``ds_id``, a counter that numbers parameters in the order a process
creates them; a checkpoint names each file by the parameters it holds instead (optimizer state:
its state and the names of the first and last parameter of its sub-group, ``exp_avg[0.weight..2.bias]``;
a parameter: its name). Gradient files are scratch and left out. A file is saved from a memory map
of it (no copy of its own in memory) and restored into a new file, read and checked a buffer at a
time while the buffer before is written, then renamed over the old one.
"""

from __future__ import annotations

import logging
import os
import re
from concurrent import futures
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ...errors import CheckpointError, InsufficientSpaceError
from ...format import codec
from ...loading.checkpoint import Checkpoint
from ...storage.base import free_bytes

log = logging.getLogger(__name__)

KEY = "offloaded_tensors"  # the entries' first key (DeepSpeed's own copy used this folder name)
OPTIMIZER = "optimizer"
_OPTIMIZER_FILE = re.compile(r"(?:(?P<state>[A-Za-z0-9_]+)-)?(?P<first>\d+)_(?P<last>\d+)\.tensor\.swp")
_PARAM_FILE = re.compile(r"(?P<id>\d+)_param\.tensor\.swp")
_GROUP_NAME = re.compile(r"(?P<state>[A-Za-z0-9_]+)\[(?P<first>[^\[\]]+)\.\.(?P<last>[^\[\]]+)\]")
_FILE = "file:"  # a file in a swap folder that is none of DeepSpeed's known kinds: stored by its own name
_INCOMING = ".zerostall-incoming"
_PIECE = 64 << 20  # bytes of a swap file restored at a time


@dataclass(frozen=True)
class SwapFolders:
    """Where this rank's engine swaps to (``{kind: directory}``, kind ``optimizer`` or DeepSpeed's
    parameter folder name such as ``float32params``) and its parameters' names by ``ds_id``."""

    folders: dict[str, str]
    names: dict[int, str]

    @classmethod
    def of(cls, engine: Any) -> "SwapFolders":
        """The swap folders of a DeepSpeed engine (none without NVMe offload)."""
        folders: dict[str, str] = {}
        swapper = getattr(engine.optimizer, "optimizer_swapper", None)
        if getattr(engine.optimizer, "swap_optimizer", False) and swapper is not None:
            folders[OPTIMIZER] = swapper.swap_folder
        names: dict[int, str] = {}
        for name, param in engine.module.named_parameters():
            if hasattr(param, "ds_id"):
                names[param.ds_id] = name
            nvme = getattr(param, "nvme_swapper", None)
            if nvme is not None:
                folders.setdefault(os.path.basename(os.path.dirname(nvme.swap_folder)), nvme.swap_folder)
        return cls(folders, names)

    def __bool__(self) -> bool:
        return bool(self.folders)

    # -- saving --------------------------------------------------------------------------------
    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{kind: {stable name: the file's bytes, memory-mapped}}`` of every file to save."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for kind, folder in self.folders.items():
            files = out.setdefault(kind, {})
            for entry in sorted(os.scandir(folder), key=lambda e: e.name):
                if not entry.is_file() or entry.name.endswith(_INCOMING) or (kind == OPTIMIZER and "gradient" in entry.name):
                    continue
                files[self.stable_name(kind, entry.name)] = _mapped(entry.path, entry.stat().st_size)
        return out

    def stable_name(self, kind: str, filename: str) -> str:
        """The name a swap file is saved under: from parameter names, else its own (with a warning)."""
        try:
            if kind == OPTIMIZER and (m := _OPTIMIZER_FILE.fullmatch(filename)):
                first, last = self.names[int(m["first"])], self.names[int(m["last"])]
                return f"{m['state'] or 'fp32'}[{first}..{last}]"
            if kind != OPTIMIZER and (m := _PARAM_FILE.fullmatch(filename)):
                return self.names[int(m["id"])]
        except KeyError:
            pass
        log.warning("swap file %s in %s does not name known parameters: saved under its own name, which a "
                    "restarted process may not use", filename, self.folders[kind])
        return _FILE + filename

    # -- restoring -----------------------------------------------------------------------------
    def filename(self, kind: str, stable: str, where: str) -> str:
        """The file that holds ``stable`` in this process (parameter names to today's ``ds_id``)."""
        if stable.startswith(_FILE):
            name = stable[len(_FILE):]
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise CheckpointError(f"{where}: swap file name {name!r} is not a plain file name")
            return name
        ids = {name: ds_id for ds_id, name in self.names.items()}
        try:
            if kind == OPTIMIZER:
                m = _GROUP_NAME.fullmatch(stable)
                if m is None:
                    raise KeyError(stable)
                state = "" if m["state"] == "fp32" else f"{m['state']}-"
                return f"{state}{ids[m['first']]}_{ids[m['last']]}.tensor.swp"
            return f"{ids[stable]}_param.tensor.swp"
        except KeyError:
            raise CheckpointError(f"{where}: the checkpoint's offloaded {kind} state {stable!r} names parameters this "
                                  "model does not have: load it into the model it was saved from") from None

    def restore(self, ck: Checkpoint, rank: int, optimizer: bool = True) -> int:
        """Write this rank's saved swap files into place (each into a new file, then renamed over
        the old one), every block verified; returns the bytes written. The space they need is
        checked first. Without ``optimizer`` (a load of weights alone) the optimizer's files stay as they are."""
        where = f"checkpoint {ck.path}"
        ours = [e for e in ck.manifest.entries if e.rank == rank and e.path[:1] == (KEY,)]
        saved = [e for e in ours if len(e.path) == 3]
        kinds = {e.path[1] for e in ours if len(e.path) > 1}
        for e in ours:  # a kind whose folder held no file is an empty value (all of them empty: one value)
            value = codec.decode(e.value, where=where) if e.kind == "object" and len(e.path) == 1 else None
            kinds.update(value if isinstance(value, dict) else ())
        if kinds != set(self.folders):
            raise CheckpointError(f"{where} holds offloaded state for {sorted(kinds) or 'nothing'} on rank {rank}, but "
                                  f"this engine offloads {sorted(self.folders) or 'nothing'} to NVMe: load it with the "
                                  "offload settings it was saved with")
        targets = [(e, os.path.join(self.folders[e.path[1]], self.filename(e.path[1], e.path[2], where)))
                   for e in saved if optimizer or e.path[1] != OPTIMIZER]
        _check_space(targets)
        block = ck.manifest.block_size
        piece = max(block, _PIECE // block * block)  # whole blocks: each is read and checked once
        piece = min(piece, max((e.nbytes for e, _ in targets), default=0))
        buffers = [torch.empty(piece, dtype=torch.uint8) for _ in range(2)]
        with ThreadPoolExecutor(1, thread_name_prefix="zerostall-swap-write") as writer:
            for entry, target in targets:
                _restore_file(ck, entry, target, buffers, writer)
        return sum(entry.nbytes for entry, _ in targets)


def _mapped(path: str, size: int) -> torch.Tensor:
    """The bytes of the file ``path`` as a uint8 tensor mapped from it, read-only in effect (a
    write would stay private)."""
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)


def _restore_file(ck: Checkpoint, entry: Any, target: str, buffers: list[torch.Tensor], writer: Executor) -> None:
    """Entry ``entry`` into a new file beside ``target``, a buffer's worth at a time (read and
    checked into one buffer while ``writer`` writes the other), renamed over ``target`` once
    whole; removed if anything fails."""
    size, incoming = entry.nbytes, target + _INCOMING
    fd = os.open(incoming, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pending: Future | None = None
    try:
        step = buffers[0].numel()
        for n, offset in enumerate(range(0, size, step)):
            length = min(step, size - offset)
            piece = buffers[n % 2][:length]
            ck.read(entry.path, box=((offset,), (length,)), out=piece)
            if pending is not None:
                pending.result()
            pending = writer.submit(_write, fd, memoryview(piece.numpy()), offset)
        if pending is not None:
            pending.result()
        os.close(fd)
        fd = -1
        os.replace(incoming, target)
    except BaseException:
        if pending is not None:
            futures.wait([pending])
        if fd >= 0:
            os.close(fd)
        _unlink(incoming)
        raise


def _write(fd: int, data: memoryview, offset: int) -> None:
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], offset + written)


def _check_space(targets: Iterable[tuple[Any, str]]) -> None:
    """Each file is replaced one at a time: a file system needs room for the new files and for the
    largest one that replaces an old one."""
    need: dict[int, list[int]] = {}
    where: dict[int, str] = {}
    for entry, target in targets:
        folder = os.path.dirname(target)
        dev = os.stat(folder).st_dev
        where[dev] = folder
        new, largest = need.setdefault(dev, [0, 0])
        if os.path.exists(target):
            need[dev][1] = max(largest, entry.nbytes)
        else:
            need[dev][0] = new + entry.nbytes
    for dev, (new, largest) in need.items():
        free = free_bytes(where[dev])
        if new + largest > free:
            raise InsufficientSpaceError(
                f"restoring the offloaded state into {where[dev]} needs {new + largest} bytes free, but its file "
                f"system has {free}: free space there; nothing was written")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
