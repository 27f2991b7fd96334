"""PyTorch DCP (``torch.distributed.checkpoint``) checkpoints as a source: entries from its metadata.

A DCP checkpoint is a ``.metadata`` pickle (torch's ``Metadata``: each tensor's chunks, each item's
file, offset and length) and ``*.distcp`` files. Each tensor item is a ``torch.save`` archive,
whose storage is stored uncompressed: its zip directory and ``data.pkl`` (read with
``weights_only=True`` onto the meta device, so no tensor bytes are read) say where the raw bytes
lie, and each chunk becomes one manifest chunk pointing at them, so loads read only the byte ranges
they need. Non-tensor items (an int step, an LR scheduler's dict) are ``torch.save`` pickles, read
whole at open. Everything here unpickles, so only with ``allow_pickle=True``.
"""

from __future__ import annotations

import io
import logging
import math
import pickle
from typing import Any

import torch

from ...errors import CorruptCheckpointError, UnsupportedValueError
from ...format import codec
from ...format.layout import Chunk, Entry, dtype_name
from ...format.manifest_check import max_manifest_bytes
from ...format.tensor_check import tiled
from ...state import fqn
from ...storage import FileTooLargeError, Storage, check_name

log = logging.getLogger(__name__)

METADATA_NAME = ".metadata"
MAX_VALUE_BYTES = 1 << 30  # a non-tensor item is read whole into memory
_ZIP_MAGIC = b"PK\x03\x04"

Path = tuple[Any, ...]


def pickle_refusal(location: str) -> UnsupportedValueError:
    """The error for opening a DCP checkpoint without ``allow_pickle``."""
    return UnsupportedValueError(
        f"{location} is a PyTorch DCP checkpoint: its .metadata and its non-tensor items are pickles, which can run "
        "code when read; open it only if you trust it, with allow_pickle=True (zs.load(state, path, "
        "allow_pickle=True), zs.open(path, allow_pickle=True), zerostall import --allow-pickle)")


def dcp_entries(storage: Storage, allow_pickle: bool) -> tuple[list[Entry], dict[str, int], list[str]]:
    """The entries of the DCP checkpoint at ``storage`` (tensor chunks without checksums, python
    values decoded) and the sizes of the files they lie in."""
    if not allow_pickle:
        raise pickle_refusal(storage.location)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    where = f"{storage.location}/{METADATA_NAME}"
    try:
        metadata = pickle.loads(storage.read_bytes(METADATA_NAME, max_manifest_bytes()))
    except FileTooLargeError as exc:
        raise CorruptCheckpointError(f"{where} has {exc.size} bytes, more than zerostall reads") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where} is not a DCP metadata pickle: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP Metadata")
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    items = _Items(storage, metadata.storage_data or {})
    tensors: list[Entry] = []
    values: list[tuple[Path, Any]] = []
    for key, md in metadata.state_dict_metadata.items():
        path = tuple(paths.get(key) or (key,))
        if isinstance(md, TensorStorageMetadata):
            try:
                tensors.append(items.tensor(key, path, md))
            except UnsupportedValueError as exc:  # one tensor's layout: the rest of the checkpoint still loads
                log.warning("%s; it is left out: a load that wants it reports it missing", exc)
                items.left_out.append(key)
        elif isinstance(md, BytesStorageMetadata):
            values.append((path, items.value(key)))
        else:
            raise CorruptCheckpointError(f"{where}: item {key!r} has unknown metadata {type(md).__name__}")
    return tensors + _values(tensors, values), items.sizes, items.left_out


class _Items:
    """Reads the items of one DCP checkpoint's files, each file's size looked up once."""

    def __init__(self, storage: Storage, storage_data: dict[Any, Any]) -> None:
        self.storage = storage
        self.by_key = storage_data
        self.sizes: dict[str, int] = {}
        self.left_out: list[str] = []  # tensor items that cannot be read in place

    def _info(self, key: str, offsets: Any = None) -> tuple[str, int, int]:
        """The file, offset and length of the item ``key`` (at chunk ``offsets``), checked."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.by_key.get(MetadataIndex(key, offsets))
        where = f"{self.storage.location}: item {key!r}" + (f" at {list(offsets)}" if offsets is not None else "")
        if info is None:
            raise CorruptCheckpointError(f"{where} has no storage record in .metadata")
        name, offset, length = info.relative_path, info.offset, info.length
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedValueError(f"{where} is stored transformed ({list(info.transform_descriptors)}, e.g. "
                                        "compressed): zerostall reads DCP items stored plain only")
        check_name(name)
        if name not in self.sizes:
            self.sizes[name] = self.storage.size(name)
        if type(offset) is not int or type(length) is not int or not 0 <= offset <= offset + length <= self.sizes[name]:
            raise CorruptCheckpointError(f"{where}: bytes {offset}+{length} lie outside {name} "
                                         f"({self.sizes[name]} bytes)")
        return name, offset, length

    def tensor(self, key: str, path: Path, md: Any) -> Entry:
        """The entry of tensor item ``key``: each chunk located in its ``torch.save`` archive."""
        dtype, shape = md.properties.dtype, tuple(md.size)
        chunks = []
        for c in md.chunks:
            offsets, sizes = tuple(c.offsets), tuple(c.sizes)
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, shape)):
                raise CorruptCheckpointError(f"{self.storage.location}: item {key!r} has a chunk {list(offsets)} "
                                             f"{list(sizes)} outside its shape {list(shape)}")
            if math.prod(sizes) == 0:
                continue
            name, start, length = self._info(key, c.offsets)
            at, nbytes = self._locate(key, name, start, length, dtype, sizes)
            chunks.append(Chunk(offsets, sizes, name, at, nbytes, []))
        if not tiled([(list(c.offsets), list(c.sizes)) for c in chunks], sum(math.prod(c.sizes) for c in chunks),
                     list(shape)):
            raise CorruptCheckpointError(f"{self.storage.location}: the chunks .metadata gives item {key!r} do not "
                                         f"tile its shape {list(shape)} exactly (each element in exactly one chunk: "
                                         "some are missing or overlap); nothing of it can be read as it was saved")
        return Entry(fqn(path), path, "tensor", dtype_name(dtype), shape, chunks)

    def _locate(self, key: str, name: str, start: int, length: int, dtype: torch.dtype,
                sizes: tuple[int, ...]) -> tuple[int, int]:
        """Where the raw bytes of the tensor archived at bytes ``start``+``length`` of ``name`` lie
        (file offset, length), read from its zip directory and ``data.pkl`` only."""
        where = f"{self.storage.location}/{name}: item {key!r}"
        view = _FileView(self.storage, name, start, length)
        if view.read(4) != _ZIP_MAGIC:
            raise UnsupportedValueError(f"{where} is not a torch.save archive (saved with serialization_format="
                                        "SAFETENSORS?): zerostall reads DCP items in the default torch.save format")
        view.seek(0)
        try:
            t = torch.load(view, map_location="meta", weights_only=True)
        except Exception as exc:  # a damaged archive: torch raises many kinds
            raise CorruptCheckpointError(f"{where} is not a readable torch.save archive: {exc}") from None
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            raise CorruptCheckpointError(f"{where} holds a {type(t).__name__}, not a tensor")
        if t.dtype != dtype or tuple(t.shape) != sizes:
            raise CorruptCheckpointError(f"{where} holds a {t.dtype} tensor of shape {list(t.shape)}; .metadata "
                                         f"says {dtype} {list(sizes)}")
        if not t.is_contiguous():
            raise UnsupportedValueError(f"{where} is stored non-contiguous (strides {list(t.stride())}): zerostall "
                                        "reads DCP tensors stored in row-major order only")
        record = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        first, nbytes = t.storage_offset() * t.itemsize, t.numel() * t.itemsize
        if type(record) is not int or record < 0 or first + nbytes > t.untyped_storage().nbytes() \
                or record + first + nbytes > length:
            raise CorruptCheckpointError(f"{where}: its tensor bytes lie outside the item")
        return start + record + first, nbytes

    def value(self, key: str) -> Any:
        """The python value of non-tensor item ``key``: ``torch.load`` with ``weights_only=True``,
        else (the caller allowed pickle) a full unpickling."""
        name, start, length = self._info(key)
        if length > MAX_VALUE_BYTES:
            raise CorruptCheckpointError(f"{self.storage.location}/{name}: item {key!r} has {length} bytes, more "
                                         f"than the {MAX_VALUE_BYTES} zerostall reads for a value")
        data = bytearray(length)
        self.storage.read_into(name, start, memoryview(data))
        try:
            try:
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except pickle.UnpicklingError:
                log.debug("item %s of %s needs a full unpickling", key, self.storage.location)
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        except Exception as exc:
            raise CorruptCheckpointError(f"{self.storage.location}/{name}: item {key!r} cannot be read: "
                                         f"{type(exc).__name__}: {exc}") from None


def _values(tensors: list[Entry], values: list[tuple[Path, Any]]) -> list[Entry]:
    """Object entries for the non-tensor items, regrouped as zerostall keys a state: a container
    with no tensor below it is one value (DCP flattens it item by item: an optimizer's
    ``param_groups``), lists where the keys are indices (as DCP unflattens them)."""
    holding = {e.path[:i] for e in tensors for i in range(len(e.path) + 1)}
    groups: dict[Path, list[tuple[Path, Any]]] = {}
    for path, value in values:
        cut = next((i for i in range(len(path) + 1) if path[:i] not in holding), len(path))
        groups.setdefault(path[:cut], []).append((path[cut:], value))
    return [Entry(fqn(path), path, "object", value=codec.encode(_assemble(parts), where=fqn(path), allow_pickle=True))
            for path, parts in groups.items()]


def _assemble(parts: list[tuple[Path, Any]]) -> Any:
    """The container holding each value at its relative path (a lone value at ``()`` is itself)."""
    if len(parts) == 1 and parts[0][0] == ():
        return parts[0][1]
    children: dict[Any, list[tuple[Path, Any]]] = {}
    for rel, value in parts:
        if rel == ():
            raise CorruptCheckpointError(f"a DCP item is both a value and a container of {len(parts) - 1} more")
        children.setdefault(rel[0], []).append((rel[1:], value))
    built = {key: _assemble(sub) for key, sub in children.items()}
    if all(type(k) is int for k in built) and sorted(built) == list(range(len(built))):
        return [built[i] for i in range(len(built))]
    return built


class _FileView(io.RawIOBase):
    """Bytes ``start``..``start+length`` of a storage file as a seekable file (what ``torch.load``
    reads). An archive's records and zip directory lie in its first and last KiB or so, around the
    tensor bytes: those two windows are read once each (one request each on an object store),
    instead of the twenty-odd small reads of parsing them."""

    WINDOW = 8 << 10

    def __init__(self, storage: Storage, name: str, start: int, length: int) -> None:
        super().__init__()
        self.storage, self.name, self.start, self.length, self.pos = storage, name, start, length, 0
        self._windows: dict[int, bytes] = {}  # window start (in the item) -> its bytes

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = max(0, offset if whence == 0 else self.pos + offset if whence == 1 else self.length + offset)
        return self.pos

    def readinto(self, out: Any) -> int:
        n = max(0, min(len(out), self.length - self.pos))
        if n:
            view = memoryview(out).cast("B")[:n]
            for lo in (0, max(0, self.length - self.WINDOW)):
                if lo <= self.pos and self.pos + n <= min(self.length, lo + self.WINDOW):
                    if lo not in self._windows:
                        self._windows[lo] = self._read(lo, min(self.length, lo + self.WINDOW) - lo)
                    view[:] = self._windows[lo][self.pos - lo:self.pos - lo + n]
                    break
            else:
                view[:] = self._read(self.pos, n)
            self.pos += n
        return n

    def _read(self, at: int, n: int) -> bytes:
        data = bytearray(n)
        try:
            self.storage.read_into(self.name, self.start + at, memoryview(data))
        except EOFError:
            raise CorruptCheckpointError(f"{self.storage.location}/{self.name} is truncated") from None
        return bytes(data)
