"""The on-disk format: the manifest (the only commit point) and safetensors-valid data files.

A checkpoint is a directory (or object prefix) holding ``manifest.json`` and data files named
``<generation>-r<rank>-<n>.safetensors``. The manifest lists every entry (tensor, python value or
alias) with its chunks: a box in the global tensor, the data file, the byte range and one xxh3-64
checksum per fixed-size block. See docs/format.md for the full description.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import xxhash

from ..errors import CorruptCheckpointError
from .checksums import checksum
from .codec import decode_path, encode_path

if TYPE_CHECKING:  # reading a manifest needs no torch: only dtype_from_name imports it
    import torch

FORMAT_NAME = "zerostall"
FORMAT_VERSION = 4  # the version written, and the newest this zerostall reads
SUBCLASS_VERSION = 2  # the first version with "subclass" entries (tensor subclasses stored as their inner tensors)
HEADERS_VERSION = 2  # the first version whose every data file has its header checksum in "headers"
REFS_VERSION = 3  # the first version whose chunks may lie in data files of other checkpoints of the root ("refs")
ARRAY_CHUNKS_VERSION = 4  # the first version whose chunks are arrays naming their file by its index in "files"
CHUNK_FIELDS = ("offsets", "sizes", "file", "offset", "nbytes", "checksums")  # a chunk array's items, in order
MANIFEST_NAME = "manifest.json"
SUPERSEDED_NAME = ".superseded"  # in a manager's root: the checkpoints a rollback set aside, by tag
DEFAULT_BLOCK_SIZE = 4 << 20
RNG_KEY = "__rng__"  # the top-level key under which a CheckpointManager saves every rank's RNG states
INTERNAL_KEYS = frozenset({RNG_KEY})  # top-level keys zerostall adds for itself: never a user's unexpected keys

_GEN = r"(?P<gen>[0-9a-f]+-[0-9a-f]+)"
_DATA_FILE_RE = re.compile(rf"^{_GEN}-r(?P<rank>\d+)-(?P<n>\d+)\.safetensors$")
_RECORD_RE = re.compile(rf"^{_GEN}(-r(?P<rank>\d+)\.(?P<kind>done|failed)|\.abort)$")
_MANIFEST_TMP_RE = re.compile(rf"^manifest\.json\.{_GEN}$")  # after the ".tmp" suffix is removed
_TMP_SUFFIX = re.compile(r"(\.[0-9a-f]{8})?\.tmp$")  # a temp file's suffix (see Storage.put)

# safetensors dtype -> the manifest's dtype name (see dtype_name), for every one zerostall reads
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64"}


def dump_json(obj: Any) -> bytes:
    """Compact JSON: orjson (much faster than the standard library on a manifest of thousands of
    entries), the standard library for what orjson refuses (integers beyond 64 bits), so no value
    ever changes. Non-finite floats never get here: the codec tags them."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


_DIGIT_RUNS = bytes(ord("0") if ord("0") <= i <= ord("9") else ord(" ") for i in range(256))


def load_json(data: bytes) -> Any:
    """Parse JSON exactly like the standard library, faster on a big manifest: orjson, unless
    ``data`` holds a run of 19 or more digits (possibly an integer beyond 64 bits, which orjson would
    silently turn into a float) or orjson refuses it (lone surrogates, which the standard library
    writes as escapes). Raises ``ValueError`` on malformed input."""
    if b"0" * 19 not in data.translate(_DIGIT_RUNS):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def generation_time(generation: str) -> int:
    """The creation time (ns) encoded in a generation id; ids compare by it."""
    return int(generation.split("-", 1)[0], 16)


def generation_id(clock_ns: int, seed: int) -> str:
    """A per-save id: the coordinator's clock (so ids are time-ordered) and 32 bits mixed from it and
    the coordinator's random ``seed``, so two saves never share file names."""
    return f"{clock_ns:x}-{xxhash.xxh3_64_intdigest(clock_ns.to_bytes(8, 'little'), seed) & 0xFFFFFFFF:08x}"


def data_file_name(generation: str, rank: int, index: int) -> str:
    return f"{generation}-r{rank:05d}-{index:03d}.safetensors"


def data_file_parts(name: str) -> tuple[str, int, int] | None:
    """(generation, rank, index) of a data file's name exactly as :func:`data_file_name` spells
    it; None for any other name."""
    match = _DATA_FILE_RE.match(name)
    if match is None:
        return None
    parts = match["gen"], int(match["rank"]), int(match["n"])
    return parts if data_file_name(*parts) == name else None


def enveloped(body: bytes, member: str = "manifest") -> bytes:
    """``{"checksum": H, MEMBER: BODY}`` with H the xxh3-64 of ``body``: how a manifest (and a
    retained record) is stored, checked byte for byte by ``format.envelope``."""
    return b'{"checksum":"%s","%s":%s}\n' % (checksum(body).encode(), member.encode(), body)


def record_name(generation: str, rank: int, kind: str) -> str:
    """A rank's commit record: ``done`` (its files, sizes and checksums) or ``failed``."""
    return f"{generation}-r{rank:05d}.{kind}"


def abort_name(generation: str) -> str:
    return f"{generation}.abort"


def parse_record(name: str) -> tuple[str, int | None, str] | None:
    """(generation, rank, kind) of a commit record name; kind "abort" has no rank."""
    match = _RECORD_RE.match(name)
    if not match:
        return None
    rank = match.group("rank")
    return match.group("gen"), int(rank) if rank else None, match.group("kind") or "abort"


def manifest_tmp_name(generation: str) -> str:
    return f"{MANIFEST_NAME}.{generation}.tmp"


def file_generation(name: str) -> str | None:
    """The generation a data file or manifest temp file belongs to; None for foreign files."""
    base = _TMP_SUFFIX.sub("", name)  # temp files of records and manifests belong to their generation
    match = _DATA_FILE_RE.match(base) or _RECORD_RE.match(base) or _MANIFEST_TMP_RE.match(base)
    return match.group("gen") if match else None


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of ``dtype``: ``float32``."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def dtype_from_name(name: str) -> torch.dtype:
    """The dtype a manifest names (the one place torch is imported here, on first use)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest")
    return dtype


@dataclass(slots=True)
class Chunk:
    """One stored piece of a tensor: a box of the global tensor and where its bytes live."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    checksums: list[str] = field(default_factory=list)

    def to_array(self, file_index: dict[str, int]) -> list[Any]:
        """The manifest's form since version 4: ``[offsets, sizes, file, offset, nbytes, checksums]``
        with ``file`` the index of the data file among the manifest's ``files``."""
        return [self.offsets, self.sizes, file_index[self.file], self.offset, self.nbytes, self.checksums]

    @classmethod
    def from_json(cls, c: Any, names: list[str] | None) -> "Chunk":
        """The chunk ``c`` of a manifest or record, in either form (see :func:`chunk_items`)."""
        offsets, sizes, file, offset, nbytes, checksums = chunk_items(c, names)
        return cls(tuple(offsets), tuple(sizes), file, offset, nbytes, list(checksums))


@dataclass(slots=True)
class Entry:
    """A leaf of the saved state. ``kind`` is "tensor", "object" (a python value), "alias" or
    "subclass" (a tensor subclass: ``cls`` names it, ``shards`` describe it box by box and point at
    the tensor entries holding its inner tensors, whose ``inner_of`` points back)."""

    fqn: str
    path: tuple[Any, ...]
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    chunks: list[Chunk] = field(default_factory=list)
    value: Any = None
    alias_of: int | None = None
    rank: int | None = None
    cls: str | None = None
    shards: list[dict[str, Any]] | None = None
    inner_of: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def torch_dtype(self) -> torch.dtype:
        assert self.dtype is not None
        return dtype_from_name(self.dtype)

    def to_json(self, file_index: dict[str, int]) -> dict[str, Any]:
        """The entry as JSON, its chunks as arrays naming their files by ``file_index`` (the place of
        each among the manifest's, or a commit record's, ``files``)."""
        d: dict[str, Any] = {"fqn": self.fqn, "path": encode_path(self.path), "kind": self.kind}
        if self.rank is not None:
            d["rank"] = self.rank
        if self.kind == "tensor":
            d["dtype"] = self.dtype
            d["shape"] = self.shape or ()
            d["chunks"] = [c.to_array(file_index) for c in self.chunks]
            if self.inner_of is not None:
                d["inner_of"] = self.inner_of
        elif self.kind == "subclass":
            d.update({"class": self.cls, "dtype": self.dtype, "shape": self.shape or (), "shards": self.shards or []})
        elif self.kind == "object":
            d["value"] = self.value
        else:
            d["alias_of"] = self.alias_of
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], names: list[str] | None = None) -> "Entry":
        """The entry of :meth:`to_json`'s form; ``names``: the manifest's files in order, when its
        chunks are arrays (version 4 on)."""
        get = d.get
        if d["kind"] == "tensor":  # positional: thousands of entries, keyword matching shows
            return cls(d["fqn"], decode_path(d["path"]), "tensor", d["dtype"], tuple(d["shape"]),
                       [Chunk.from_json(c, names) for c in d["chunks"]], None, None, get("rank"), None, None,
                       get("inner_of"))
        if d["kind"] == "subclass":
            return cls(d["fqn"], decode_path(d["path"]), "subclass", d["dtype"], tuple(d["shape"]), rank=get("rank"),
                       cls=d["class"], shards=list(d["shards"]))
        return cls(d["fqn"], decode_path(d["path"]), d["kind"], value=get("value"), alias_of=get("alias_of"),
                   rank=get("rank"))


@dataclass
class Manifest:
    """Everything needed to read a checkpoint: no process group and no model code required."""

    generation: str
    entries: list[Entry]
    files: dict[str, int]
    tree: Any
    world_size: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    step: int | None = None
    metadata: Any = None
    created: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION  # as read; always written as FORMAT_VERSION
    headers: dict[str, str] = field(default_factory=dict)  # file -> xxh3-64 of its safetensors header
    refs: dict[str, str] = field(default_factory=dict)  # file of another checkpoint of the root -> its tag
    foreign: str | None = None  # read in place of ours ("dcp", "safetensors"): no checksums; never written
    left_out: list[str] = field(default_factory=list)  # a foreign one's items that cannot be read in place, named

    @property
    def total_bytes(self) -> int:
        """The bytes of the checkpoint's own data files (those it refers to are other checkpoints')."""
        return own_bytes(self.files, self.refs)

    @classmethod
    def deferred(cls, head: dict[str, Any], body: Any) -> "Manifest":
        """A manifest built from its leading fields alone (``head``, checked); its entries and tree
        are taken from ``body.whole()`` (the whole manifest, parsed and checked) when first used, once."""
        manifest = cls.__new__(cls)
        manifest.__dict__.update(
            generation=head["generation"], files=dict(head["files"]), world_size=head["world_size"],
            block_size=head["block_size"], step=head["step"], metadata=head["metadata"], created=head["created"],
            version=head["version"], headers=dict(head.get("headers", {})), refs=dict(head.get("refs", {})),
            foreign=None, left_out=[], _body=body, _lock=threading.Lock())
        return manifest

    def __getattr__(self, name: str) -> Any:
        """``entries`` and ``tree`` of a :meth:`deferred` manifest, built on first use."""
        state = self.__dict__
        if name not in ("entries", "tree") or "_lock" not in state:
            raise AttributeError(name)
        with state["_lock"]:
            if name not in state:
                whole = state["_body"].whole()
                twice = [k for k in ("generation", "files", "headers", "refs", "block_size", "world_size")
                         if getattr(whole, k) != state[k]]
                if twice:  # a member given twice: the head took the first, the whole parse the last
                    raise CorruptCheckpointError(f"manifest {state['_body'].where} gives {', '.join(twice)} twice, "
                                                 "differently: it is damaged or forged")
                state.update(entries=whole.entries, tree=whole.tree, _body=None)
        return state[name]

    def entry(self, key: str | tuple[Any, ...]) -> Entry | None:
        """Before a :meth:`deferred` manifest builds its entries: the one named ``key`` (a dotted
        name or a key path), checked on its own (see ``manifest_check``); None once they are built,
        for a manifest read whole, or where one entry cannot be told apart (build them all then)."""
        state = self.__dict__
        if "_lock" not in state:
            return None
        with state["_lock"]:
            body = state["_body"]
            return body.one(key) if body is not None else None

    def to_bytes(self) -> bytes:
        """Serialize as ``{"checksum": H, "manifest": BODY}`` where H is the xxh3-64 of BODY."""
        file_index = {name: i for i, name in enumerate(self.files)}
        body = dump_json({
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "generation": self.generation,
            "created": self.created, "step": self.step, "world_size": self.world_size,
            "block_size": self.block_size, "checksum": "xxh3_64", "refs": self.refs, "files": self.files,
            "headers": self.headers, "metadata": self.metadata,
            "tree": self.tree, "entries": [e.to_json(file_index) for e in self.entries],
        })
        return enveloped(body)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Manifest":
        """The manifest of a body already checked (``zerostall.format.manifest_check.parse_manifest``: the
        one place a manifest read from storage becomes a ``Manifest``)."""
        names = file_names(d)
        return cls(
            generation=d["generation"], entries=[Entry.from_json(e, names) for e in d["entries"]],
            files=dict(d["files"]), tree=d["tree"], world_size=d["world_size"],
            block_size=d["block_size"], step=d["step"], metadata=d["metadata"],
            created=d["created"], version=d["version"], headers=dict(d.get("headers", {})),
            refs=dict(d.get("refs", {})),
        )


def own_bytes(files: dict[str, int], refs: dict[str, str]) -> int:
    """The bytes of the data files in ``files`` that are not another checkpoint's (``refs``)."""
    return sum(size for name, size in files.items() if name not in refs)


def chunk_items(c: Any, names: list[str] | None) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The items of the chunk ``c`` in :data:`CHUNK_FIELDS` order, its file by name: ``c`` an array
    whose file is an index into ``names`` (version 4 on), or, where ``names`` is None, an object
    naming its file. Another form raises ``TypeError``, ``KeyError``, ``IndexError`` or ``ValueError``
    (the items themselves are not checked: see ``format.tensor_check``)."""
    if names is None:
        return c["offsets"], c["sizes"], c["file"], c["offset"], c["nbytes"], c["checksums"]
    offsets, sizes, index, offset, nbytes, checksums = c if type(c) is list else ()
    if type(index) is not int or index < 0:
        raise TypeError(f"{index!r} is not the index of a file")
    return offsets, sizes, names[index], offset, nbytes, checksums


def file_names(d: dict[str, Any]) -> list[str] | None:
    """The data files of the manifest body ``d`` in order, which its chunks index (version 4 on);
    None for an older manifest, whose chunks name their files."""
    return list(d["files"]) if d["version"] >= ARRAY_CHUNKS_VERSION else None


@dataclass
class ManifestHead:
    """A manifest without its entries and tree: what listing and ranking checkpoints need, read
    from the leading fields of the body (whose checksum is still checked whole), so a
    checkpoint of a hundred thousand entries is listed in milliseconds."""

    generation: str
    files: dict[str, int]
    world_size: int
    block_size: int
    step: int | None
    metadata: Any
    created: float
    version: int
    headers: dict[str, str]
    refs: dict[str, str]  # the files that lie in other checkpoints of the root, with their tags

    @property
    def total_bytes(self) -> int:
        """The bytes of the checkpoint's own data files (those it refers to are other checkpoints')."""
        return own_bytes(self.files, self.refs)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ManifestHead":
        """The head of leading members already checked (``zerostall.format.manifest_check.parse_head``)."""
        return cls(generation=d["generation"], files=dict(d["files"]), world_size=d["world_size"],
                   block_size=d["block_size"], step=d["step"], metadata=d["metadata"], created=d["created"],
                   version=d["version"], headers=dict(d.get("headers", {})), refs=dict(d.get("refs", {})))
