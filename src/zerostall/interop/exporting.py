"""Export: a checkpoint's model weights as files other tools read, consolidated from any number of
ranks and streamed (``zs.export``, ``zerostall export``).

``hf``: the Hugging Face layout (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
shards and ``model.safetensors.index.json``); ``torch``: one file that ``torch.load`` reads as a
flat ``{key: tensor}`` dict. Tensors are read a slab at a time by the checked byte-range reads
loads use (:mod:`zerostall.loading.tensor_stream` over a ``Fetcher``: every block's checksum verified),
the next slab while the last is written, so memory holds two slabs (for ``torch``, the largest
tensor), never the model. Files are written under temporary names and renamed at the end, the
index last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from ..errors import CheckpointExistsError, CheckpointNotFoundError, ExportError
from ..format import codec
from ..format.layout import Entry, FileItem, Manifest, safetensors_dtype, safetensors_header
from ..loading.checkpoint import Checkpoint
from ..loading.reader import resolve
from ..loading.tensor_stream import TensorStream
from ..options import LoadOptions, _Options, default_threads
from ..roots.root import named_instead
from ..storage import Storage, storage_for
from ..storage.local import check_path, fsync_dir
from .torch_file import write_torch_file

log = logging.getLogger(__name__)

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
SLAB_BYTES = 16 << 20  # of a tensor read (and cast) at a time, into one of two reused buffers
_HF_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")
_TEMP = re.compile(r"^\.model.*\.[0-9a-f]{8}\.tmp$")  # what an interrupted export left
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes in ``value``: an int, or a string as ``save_pretrained`` takes (``"5GB"`` is 5 * 10**9
    bytes, ``"256MiB"`` 256 * 2**20)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a size: give bytes, or a number with a unit (500MB, 5GB, 256MiB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


@dataclass(frozen=True)
class ExportOptions(_Options):
    """What an export writes (``zs.export``, ``zerostall export``)."""

    format: str = "hf"
    """``"hf"``: Hugging Face safetensors files (sharded, with an index, when more than one);
    ``"torch"``: one file that ``torch.load(path, weights_only=True)`` reads as ``{key: tensor}``."""

    prefix: str | None = None
    """Export only the entries under this dotted prefix, with the prefix stripped: ``"model."``
    makes ``{"model": module}`` export the module's own ``state_dict`` keys. A trailing ``.`` is
    implied; a prefix that selects nothing is an error naming the top-level keys."""

    rename: tuple[tuple[str, str], ...] = ()
    """Rules ``(regex, replacement)`` (or ``"REGEX=REPLACEMENT"`` strings, split at the last ``=``)
    applied in order to every key, after the prefix, by ``re.sub``; two keys renamed onto one name
    are an error naming both."""

    dtype: Any = None
    """Cast floating tensors to this floating dtype (``torch.bfloat16`` or ``"bfloat16"``); other
    tensors keep theirs. None: every tensor as saved."""

    max_shard_size: int | str = "5GB"
    """The most bytes of one ``hf`` file, as ``save_pretrained`` takes it (an int, ``"5GB"`` = 5 *
    10**9, ``"256MiB"``); a larger tensor gets a file of its own. Read as bytes (an int)."""

    overwrite: bool = False
    """Write into a non-empty directory (replacing its model files, keeping the others) or over an
    existing ``torch`` file; without it that is refused before anything is read."""

    threads: int | None = None
    """Reader threads; None: one per core, at least 2, at most 8."""

    def __post_init__(self) -> None:
        self._check("format", self.format in ("hf", "torch"), '"hf" or "torch"')
        self._check("prefix", self.prefix is None or isinstance(self.prefix, str), "None or a str")
        rules = []
        for rule in self.rename:
            if isinstance(rule, str):
                pattern, sep, replacement = rule.rpartition("=")
                self._check("rename", bool(sep), 'rules "REGEX=REPLACEMENT" or (regex, replacement) pairs')
                rule = (pattern, replacement)
            self._check("rename", isinstance(rule, tuple) and len(rule) == 2 and all(isinstance(r, str) for r in rule),
                        'rules "REGEX=REPLACEMENT" or (regex, replacement) pairs')
            try:
                re.compile(rule[0])
            except re.error as exc:
                raise ValueError(f"ExportOptions.rename: {rule[0]!r} is not a regular expression: {exc}") from None
            rules.append(rule)
        object.__setattr__(self, "rename", tuple(rules))
        dtype = codec.torch_dtype(self.dtype) if isinstance(self.dtype, str) else self.dtype
        self._check("dtype", dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point,
                    "None or a floating dtype (bfloat16, float16, float32...)")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size))
        self._check("max_shard_size", self.max_shard_size >= 1, "at least 1 byte")
        self._check_bools("overwrite")
        self._check_threads()


@dataclass
class ExportInfo:
    """What an export wrote."""

    format: str
    path: str
    files: list[str]  # paths of the files written, the index last
    keys: list[str]  # the exported keys, in save order
    bytes: int  # tensor bytes written
    skipped: list[str]  # entries that are not model weights: rank-local, python values, tensor subclasses


@dataclass
class Item:
    """One exported tensor: its key, the checkpoint's name for it, the entry holding its values and
    the dtype it is written in."""

    key: str
    source: str
    entry: Entry
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry.shape or ())

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def select(manifest: Manifest, where: str, options: ExportOptions) -> tuple[list[Item], list[str]]:
    """The tensors to export (under the prefix, renamed, in save order) and the selected entries
    skipped as not model weights; raises :class:`ExportError` for a prefix that selects nothing,
    a name collision, or a dtype the format cannot hold."""
    prefix = options.prefix or ""
    if prefix and not prefix.endswith("."):
        prefix += "."
    lost = [key for key in manifest.left_out if key.startswith(prefix)]
    if lost:  # a foreign checkpoint's tensors that cannot be read in place: an export holds them all, or nothing
        raise ExportError(f"{where} has {len(lost)} tensor item(s) zerostall cannot read in place under the prefix "
                          f"({', '.join(lost[:10])}; the warnings logged when it was opened say why)")
    items: list[Item] = []
    skipped: list[str] = []
    names: dict[str, str] = {}
    matched = False
    for entry in manifest.entries:
        if entry.inner_of is not None:  # part of a tensor subclass entry
            continue
        name = entry.fqn if entry.rank is None else f"{entry.fqn}@rank{entry.rank}"
        if not name.startswith(prefix):
            continue
        matched = True
        target = resolve(manifest, entry, where)
        if entry.rank is not None or target.kind != "tensor":
            skipped.append(name)
            continue
        key = name[len(prefix):]
        for pattern, replacement in options.rename:
            key = re.sub(pattern, replacement, key)
        if not key or key == "__metadata__":
            raise ExportError(f"entry {name} of {where} would be exported as {key!r}, a name no file may hold: "
                              "change the prefix or the rename rules")
        if key in names:
            raise ExportError(f"entries {names[key]} and {name} of {where} are both exported as {key!r}: change the "
                              "rename rules so that they differ")
        names[key] = name
        stored = target.torch_dtype
        dtype = options.dtype if options.dtype is not None and stored.is_floating_point else stored
        items.append(Item(key, name, target, dtype))
    if not matched:
        tops = sorted({str(e.path[0]) for e in manifest.entries if e.path})
        raise ExportError(f"prefix {options.prefix!r} selects no entry of {where}; its top-level keys are: "
                          f"{', '.join(tops) or '(none)'}")
    if not items:
        raise ExportError(f"{where} holds no tensors to export under prefix {options.prefix!r} (skipped as not "
                          f"model weights: {', '.join(skipped[:10])})")
    if options.format == "hf":
        bad = [f"{i.source} ({i.dtype})" for i in items if safetensors_dtype(i.dtype) is None]
        if bad:
            raise ExportError(f"safetensors cannot hold the dtype of {', '.join(bad[:10])} in {where}: export with "
                              "format torch, or cast floating tensors with dtype")
    return items, skipped


def shard(items: list[Item], max_bytes: int) -> list[list[Item]]:
    """Items in files of at most ``max_bytes``, in order, as ``save_pretrained`` splits them: a new
    file when the next tensor would overflow this one; a larger tensor alone in its own."""
    shards: list[list[Item]] = []
    current: list[Item] = []
    size = 0
    for item in items:
        if item.nbytes > max_bytes:
            shards.append([item])
            continue
        if current and size + item.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def export_checkpoint(ckpt: str | os.PathLike[str] | Storage | Checkpoint, out: str | os.PathLike[str],
                      options: ExportOptions, progress: Callable[[int], None] | None = None) -> ExportInfo:
    """Export the checkpoint ``ckpt`` (a path or URL, a root: its newest, or an open
    :class:`Checkpoint`) to ``out`` as ``options`` say; ``progress(nbytes)`` is called as tensor
    bytes are written."""
    target = os.fspath(out)
    if "://" in target and not target.startswith("file://"):
        raise ExportError(f"export writes to a local path, not {target!r}: export there, then copy the files")
    target = os.path.abspath(check_path(target.removeprefix("file://")))
    _check_out(target, options)
    with _opened(ckpt, options) as ck:
        items, skipped = select(ck.manifest, ck.path, options)
        if skipped:
            log.warning("export of %s skips %d entries that are not model weights (rank-local, python values, "
                        "tensor subclasses): %s", ck.path, len(skipped), ", ".join(skipped))
        write = _write_hf if options.format == "hf" else _write_torch
        threads = options.threads or ck.options.threads or default_threads()
        stream = TensorStream(ck.storage, ck.manifest, threads, SLAB_BYTES, ck.options.max_staging_bytes)
        try:
            files = write(stream, items, target, options, progress or (lambda n: None))
        finally:
            stream.close()
    return ExportInfo(options.format, target, files, [i.key for i in items], sum(i.nbytes for i in items), skipped)


@contextlib.contextmanager
def _opened(ckpt: str | os.PathLike[str] | Storage | Checkpoint, options: ExportOptions) -> Iterator[Checkpoint]:
    """A read session on ``ckpt`` (a root, ``ROOT/latest`` or ``ROOT/<step>``: see
    :func:`~zerostall.roots.root.named_instead`), closed after, unless the caller opened it."""
    if isinstance(ckpt, Checkpoint):
        yield ckpt
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:  # opening by path would wait for every rank
        raise ExportError(f"export reads {os.fspath(ckpt)} in one process, but torch.distributed is initialized "
                          f"with {torch.distributed.get_world_size()} ranks: open it with zs.open(...) on every "
                          "rank and pass that checkpoint to zs.export on one rank")
    storage = storage_for(ckpt)
    load = LoadOptions(threads=options.threads)
    try:
        ck = Checkpoint(storage, load)
    except CheckpointNotFoundError:
        instead = named_instead(ckpt)
        if instead is None:
            raise
        ck = Checkpoint(instead, load)
    with ck:
        yield ck


def _check_out(path: str, options: ExportOptions) -> None:
    """Refuse a target that holds something, before anything is read (unless ``overwrite``)."""
    if options.format == "hf":
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ExportError(f"{path} is a file: a hf export writes a directory")
        held = sorted(os.listdir(path)) if os.path.isdir(path) else []
        if held and not options.overwrite:
            raise CheckpointExistsError(f"{path} is not empty ({len(held)} entries: {', '.join(held[:5])}): pass "
                                        "overwrite=True (--overwrite) to replace its model files")
    elif os.path.isdir(path):
        raise ExportError(f"{path} is a directory: a torch export writes one file")
    elif os.path.lexists(path) and not options.overwrite:
        raise CheckpointExistsError(f"{path} exists: pass overwrite=True (--overwrite) to replace it")


def _write_file(path: str, parts: Iterable[memoryview]) -> None:
    """Create ``path`` (it must not exist) holding ``parts``, durably; nothing is left if that fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        for part in parts:
            while len(part):
                part = part[os.write(fd, part):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def _file_parts(stream: TensorStream, items: list[Item], progress: Callable[[int], None]) -> Iterator[memoryview]:
    """A safetensors file of ``items``: its header, then every tensor's bytes as they are read."""
    items = sorted(items, key=lambda i: -i.dtype.itemsize)  # stable: save order within an itemsize
    header, _ = safetensors_header((FileItem(i.key, i.dtype, i.shape, i.nbytes) for i in items), {"format": "pt"})
    yield memoryview(header)
    for part in stream.parts((i.entry, i.dtype) for i in items):
        yield part
        progress(len(part))


def _replace(directory: str, temp: str, name: str) -> None:
    os.replace(os.path.join(directory, temp), os.path.join(directory, name))


def _write_hf(stream: TensorStream, items: list[Item], path: str, options: ExportOptions,
              progress: Callable[[int], None]) -> list[str]:
    """Write the safetensors files (and the index, when more than one) into directory ``path``:
    under temporary names, then renamed, the index last, so an interrupted export never leaves a
    directory that looks complete."""
    shards = shard(items, options.max_shard_size)
    names = [HF_WEIGHTS] if len(shards) == 1 else \
        [f"model-{n:05d}-of-{len(shards):05d}.safetensors" for n in range(1, len(shards) + 1)]
    os.makedirs(path, exist_ok=True)
    token = secrets.token_hex(4)
    temps = [f".{name}.{token}.tmp" for name in [*names, HF_INDEX]]
    try:
        for temp, files in zip(temps, shards):
            _write_file(os.path.join(path, temp), _file_parts(stream, files, progress))
        stale = [n for n in os.listdir(path) if (_HF_FILE.match(n) and n not in names) or (_TEMP.match(n) and
                                                                                          n not in temps)]
        for name in sorted(stale, key=lambda n: n != HF_INDEX):  # the old index first: never one naming new files
            os.unlink(os.path.join(path, name))
        for temp, name in zip(temps, names):
            _replace(path, temp, name)
        if len(shards) > 1:
            weight_map = {item.key: name for name, files in zip(names, shards) for item in files}
            index = {"metadata": {"total_size": sum(i.nbytes for i in items)}, "weight_map": weight_map}
            _write_file(os.path.join(path, temps[-1]), [memoryview(json.dumps(index, indent=2, sort_keys=True)
                                                                   .encode() + b"\n")])
            _replace(path, temps[-1], HF_INDEX)
        fsync_dir(path)
    except BaseException:
        for temp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(path, temp))
        raise
    return [os.path.join(path, name) for name in names] + ([os.path.join(path, HF_INDEX)] if len(shards) > 1 else [])


def _write_torch(stream: TensorStream, items: list[Item], path: str, options: ExportOptions,
                 progress: Callable[[int], None]) -> list[str]:
    """Write one ``torch.save`` file at ``path`` (under a temporary name, then renamed), holding one
    tensor in memory at a time, in a buffer reused for every tensor."""
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    temp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
    buf = torch.empty(max(i.nbytes for i in items), dtype=torch.uint8)

    def data(n: int) -> torch.Tensor:
        item = items[n]
        for first, last in stream.steps(item.entry, item.dtype):
            stream.read(item.entry, item.dtype, first, last, buf[first * item.dtype.itemsize:])
        progress(item.nbytes)
        return buf[:item.nbytes]

    try:
        write_torch_file(temp, [(i.key, i.dtype, i.shape) for i in items], data)
        fd = os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
        fsync_dir(directory)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    return [path]
