"""The files an export writes, from a :class:`~zerostall.loading.tensor_stream.TensorStream`:
Hugging Face safetensors files (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
shards split as ``save_pretrained`` splits them, and ``model.safetensors.index.json``), or one
``torch.load``-able file. Every file is written under a temporary name and renamed once complete
(the index last), so an interrupted export never leaves files that look complete.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from ..format.layout import Entry
from ..format.safetensors_file import FileItem, safetensors_header
from ..loading.tensor_stream import TensorStream
from ..storage.local import fsync_dir
from .torch_file import write_torch_file

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
_HF_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")
LEFT_BY_AN_EXPORT = re.compile(r"^\.model.*\.[0-9a-f]{8}\.tmp$")  # the temporary files an interrupted export left


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


def _write_file(path: str, parts: Iterable[memoryview]) -> None:
    """Create ``path`` (it must not exist) holding ``parts``, durably; nothing is left if that fails."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    writing = False  # else reading the source, whose errors name their own file
    try:
        for part in parts:
            writing = True
            while len(part):
                part = part[os.write(fd, part):]
            writing = False
        writing = True
        os.fsync(fd)
    except BaseException as exc:
        os.close(fd)
        os.unlink(path)
        if writing and isinstance(exc, OSError) and exc.filename is None:
            exc.filename = path  # os.write does not say which file filled the disk
        raise
    os.close(fd)


def _file_parts(stream: TensorStream, items: list[Item], progress: Callable[[int], None]) -> Iterator[memoryview]:
    """A safetensors file of ``items``: its header, then every tensor's bytes as they are read."""
    items = sorted(items, key=lambda i: -i.dtype.itemsize)  # stable: save order within an itemsize
    header, _ = safetensors_header((FileItem(i.key, i.dtype, i.shape, i.nbytes) for i in items), {"format": "pt"},
                                   every=True)
    yield memoryview(header)
    for part in stream.parts((i.entry, i.dtype) for i in items):
        yield part
        progress(len(part))


def _replace(directory: str, temp: str, name: str) -> None:
    os.replace(os.path.join(directory, temp), os.path.join(directory, name))


def write_hf(stream: TensorStream, items: list[Item], path: str, max_shard_size: int,
             progress: Callable[[int], None]) -> list[str]:
    """Write the safetensors files (and the index, when more than one) into directory ``path``:
    under temporary names, then renamed, the index last, so an interrupted export never leaves a
    directory that looks complete."""
    shards = shard(items, max_shard_size)
    names = [HF_WEIGHTS] if len(shards) == 1 else \
        [f"model-{n:05d}-of-{len(shards):05d}.safetensors" for n in range(1, len(shards) + 1)]
    token = secrets.token_hex(4)
    temps = [f".{name}.{token}.tmp" for name in [*names, HF_INDEX]]
    with _folder(path), _removed_on_failure(path, temps):
        for temp, files in zip(temps, shards):
            _write_file(os.path.join(path, temp), _file_parts(stream, files, progress))
        stale = [n for n in os.listdir(path) if (_HF_FILE.match(n) and n not in names)
                 or (LEFT_BY_AN_EXPORT.match(n) and n not in temps)]
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
    return [os.path.join(path, name) for name in names] + ([os.path.join(path, HF_INDEX)] if len(shards) > 1 else [])


def write_torch(stream: TensorStream, items: list[Item], tied: dict[str, str], path: str,
                progress: Callable[[int], None]) -> list[str]:
    """Write one ``torch.save`` file at ``path`` (under a temporary name, then renamed), holding one
    tensor in memory at a time, in a buffer reused for every tensor; a key of ``tied`` shares the
    storage of the key it maps to."""
    directory, name = os.path.split(path)
    temp = f".{name}.{secrets.token_hex(4)}.tmp"
    buf = torch.empty(max(i.nbytes for i in items), dtype=torch.uint8)
    index = {item.key: n for n, item in enumerate(items)}
    shared = {index[key]: index[kept] for key, kept in tied.items()}

    def data(n: int) -> torch.Tensor:
        item = items[n]
        stream.read(item.entry, item.dtype, buf)
        progress(item.nbytes)
        return buf[:item.nbytes]

    with _folder(directory), _removed_on_failure(directory, [temp]):
        write_torch_file(os.path.join(directory, temp), [(i.key, i.dtype, i.shape) for i in items], data, shared)
        fd = os.open(os.path.join(directory, temp), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(os.path.join(directory, temp), path)
        fsync_dir(directory)
    return [path]


@contextlib.contextmanager
def _folder(path: str) -> Iterator[None]:
    """Make folder ``path`` if it is not there; if the block fails, remove it again when this made it
    (and nothing else is in it), so a failed export leaves nothing behind."""
    made = not os.path.isdir(path)
    os.makedirs(path, exist_ok=True)
    try:
        yield
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise


@contextlib.contextmanager
def _removed_on_failure(directory: str, temps: list[str]) -> Iterator[None]:
    """Delete the temporary files ``temps`` of ``directory`` if the block fails."""
    try:
        yield
    except BaseException:
        for temp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, temp))
        raise
