"""Hugging Face safetensors files as a source: their headers, checked, become manifest entries.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and ``data_offsets`` (relative to the data section), then the raw bytes: each tensor
is one whole chunk at ``8 + header_len + begin``. Every header is treated as hostile: its length is
bounded, every offset lies inside the file, sizes equal elements x item size, tensors do not
overlap, dtypes are known (sub-byte ones are refused by name), names are unique across the files.
No torch here: a header is parsed as plain JSON.
"""

from __future__ import annotations

import json
import math
import re
import struct
from typing import Any

from ...errors import CorruptCheckpointError, UnsupportedValueError
from ...format.layout import SAFETENSORS_DTYPES, Chunk, Entry, file_generation
from ...format.tensor_check import ITEMSIZES, MAX_INT, MAX_NDIM
from ...storage import Storage, check_name

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # what the safetensors library itself reads at most
MAX_INDEX_BYTES = 64 << 20
FIRST_READ = 256 << 10  # bytes read at first: the header's length and, for nearly every file, the header itself

# safetensors dtype -> (the manifest's dtype name, bytes per element)
DTYPES = {st: (name, ITEMSIZES[name]) for st, name in SAFETENSORS_DTYPES.items()}
_SHARD = re.compile(r"-\d{5}-of-(\d{5})\.safetensors$")  # transformers' shard names: model-00001-of-00003
SUB_BYTE = frozenset({"F4", "F6_E2M3", "F6_E3M2", "I4", "U4", "I2", "U2", "I1", "U1"})


def is_hf_file(name: str) -> bool:
    """A safetensors file of a Hugging Face checkpoint (a zerostall data file is not one)."""
    return name.endswith(".safetensors") and file_generation(name) is None


def hf_files(storage: Storage, names: list[str]) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of the checkpoint at ``storage`` (whose files are ``names``): those
    its ``model.safetensors.index.json`` maps keys to, with that map, else every ``*.safetensors``
    file (None for the map). Shards of several (``-00001-of-00003``) without an index are refused:
    the index says which shard holds each tensor, and its absence (a save or copy killed half-way)
    leaves nothing to tell a whole set from a mixed one."""
    if INDEX_NAME not in names:
        files = [n for n in names if is_hf_file(n)]
        shards = [n for n in files if (m := _SHARD.search(n)) and int(m.group(1)) > 1]
        if shards:
            raise CorruptCheckpointError(
                f"{storage.location} holds shards of a sharded checkpoint ({shards[0]}...) but no {INDEX_NAME}, which "
                "says which shard holds each tensor: a save or copy that did not finish? Save or copy it again")
        return files, None
    where = f"{storage.location}/{INDEX_NAME}"
    index = _json(storage.read_bytes(INDEX_NAME, MAX_INDEX_BYTES), where)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpointError(f"{where} has no weight_map of key -> file name")
    files = sorted(set(weight_map.values()))
    for name in files:
        if not name.endswith(".safetensors"):
            raise CorruptCheckpointError(f"{where} maps keys to {name!r}, not a .safetensors file")
        check_name(name)
    return files, weight_map


def hf_entries(storage: Storage, files: list[str],
               weight_map: dict[str, str] | None = None) -> tuple[list[Entry], dict[str, int]]:
    """One tensor entry per tensor of the safetensors ``files`` (each one chunk, without checksums)
    and the files' sizes; :class:`CorruptCheckpointError` naming the file and key at fault, also
    where the files do not hold exactly the tensors ``weight_map`` (the index's) puts in them."""
    entries: list[Entry] = []
    sizes: dict[str, int] = {}
    owner: dict[str, str] = {}
    listed = (storage.sizes() if len(files) > 1 else None) or {}  # one listing, where it gives sizes
    for name in files:
        sizes[name] = listed[name] if name in listed else storage.size(name)
        for key, dtype, shape, offset, nbytes in read_header(storage, name, sizes[name]):
            if key in owner:
                raise CorruptCheckpointError(f"tensor {key!r} is in both {owner[key]} and {name} of "
                                             f"{storage.location}")
            owner[key] = name
            chunk = Chunk((0,) * len(shape), shape, name, offset, nbytes, [])
            entries.append(Entry(key, (key,), "tensor", dtype, shape, [chunk]))
    wrong = [] if weight_map is None else [(k, n) for k, n in weight_map.items() if owner.get(k) != n] + \
        [(k, None) for k in owner if k not in weight_map]
    if wrong:
        key, name = wrong[0]
        said = f"does not name tensor {key!r}, which {owner[key]} holds" if name is None else \
            f"puts tensor {key!r} in {name}, " + (f"but {owner[key]} holds it" if key in owner else "which does not hold it")
        raise CorruptCheckpointError(f"{storage.location}/{INDEX_NAME} {said}: the index and the shards are of two "
                                     "saves (one killed half-way?); save or copy it again")
    return entries, sizes


def read_header(storage: Storage, name: str, size: int) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """The tensors of the safetensors file ``name`` (``size`` bytes): key, dtype name, shape,
    absolute offset and length of its bytes, all checked against the file."""
    where = f"{storage.location}/{name}"
    if size < 8:
        raise CorruptCheckpointError(f"{where} has {size} bytes: too short for a safetensors header")
    head = bytearray(min(size, FIRST_READ))  # one read (one request) for the length and the header
    storage.read_into(name, 0, memoryview(head))
    length = struct.unpack("<Q", head[:8])[0]
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise CorruptCheckpointError(f"{where}: its header claims {length} bytes, more than the "
                                     f"{min(size - 8, MAX_HEADER_BYTES)} it may have")
    if 8 + length > len(head):  # a header larger than the first read: the rest of it
        rest = bytearray(8 + length - len(head))
        storage.read_into(name, len(head), memoryview(rest))
        head += rest
    header = _json(bytes(head[8:8 + length]), where)
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: its header is not a JSON object")
    data_start, data_len = 8 + length, size - 8 - length
    tensors = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype, itemsize = _dtype(info, key, where)
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if (not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape)
                or len(shape) > MAX_NDIM or math.prod(n or 1 for n in shape) * itemsize > MAX_INT  # (of 0 elements)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(n) is int for n in offsets)):
            raise CorruptCheckpointError(f"{where}: tensor {key!r} has no valid shape and data_offsets")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise CorruptCheckpointError(f"{where}: tensor {key!r} has data_offsets {offsets} outside the "
                                         f"{data_len} data bytes of the file")
        if end - begin != math.prod(shape) * itemsize:
            raise CorruptCheckpointError(f"{where}: tensor {key!r} of shape {shape} and dtype {info['dtype']} "
                                         f"needs {math.prod(shape) * itemsize} bytes, its data_offsets hold "
                                         f"{end - begin}")
        tensors.append((key, dtype, tuple(shape), data_start + begin, end - begin))
    previous = None
    for t in sorted(tensors, key=lambda t: (t[3], t[4])):
        if previous is not None and t[4] and t[3] < previous[3] + previous[4]:
            raise CorruptCheckpointError(f"{where}: tensors {previous[0]!r} and {t[0]!r} overlap")
        if t[4]:
            previous = t
    return tensors


def _dtype(info: Any, key: str, where: str) -> tuple[str, int]:
    name = info.get("dtype") if isinstance(info, dict) else None
    if name in DTYPES:
        return DTYPES[name]
    if name in SUB_BYTE:
        raise UnsupportedValueError(f"{where}: tensor {key!r} has the sub-byte dtype {name}, which zerostall "
                                    "does not load")
    raise CorruptCheckpointError(f"{where}: tensor {key!r} has an unknown dtype {name!r}")


def _json(data: bytes, where: str) -> Any:
    """JSON with no duplicate keys (a later one would silently win)."""
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        d = dict(pairs)
        if len(d) != len(pairs):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise CorruptCheckpointError(f"{where}: key {dup!r} appears twice")
        return d

    try:
        return json.loads(data, object_pairs_hook=unique)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where} is not valid JSON: {exc}") from None
