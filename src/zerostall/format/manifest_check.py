"""The manifest's schema: what the format allows, checked once, where a manifest is read.

A checkpoint is input from outside (another team, a bucket, a disk that lies). The checksum
envelope proves that a manifest is intact, not that its numbers are sane. :func:`parse_manifest` is
the one place where manifest bytes become a :class:`~zerostall.format.layout.Manifest`, and it checks every
field against what the format allows: the head (``head_check``: plain data-file names of this
generation with their sizes, the metadata), known entry kinds and dtypes, non-negative shapes,
chunks inside the tensor and inside the files the manifest lists, ``nbytes`` = elements × item
size, one checksum per block, chunks that tile each tensor exactly and each data file back to back
(``tensor_check``), aliases of tensor entries, tensor subclass descriptions, key paths unique and
matching the tree, python values of known tags at most :data:`~zerostall.format.codec.MAX_DEPTH`
containers deep (``value_check``). A session's first reads may check only the entry they read, with
the same checks and those of the data files it lies in (:meth:`_Body.one`). Loaders, ``verify``
and the CLI then trust these numbers. Anything else is a
:class:`~zerostall.errors.CorruptCheckpointError` naming the field. The limits are documented in
docs/format.md §10, "What a reader accepts".
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from ..gcpause import gc_paused
from . import codec
from .envelope import manifest_body, manifest_head_body
from .head_check import check_head
from .layout import SUBCLASS_VERSION, Entry, Manifest, ManifestHead, chunk_items, file_names
from .tensor_check import (FieldError, check_packed, check_shape, check_tensor, clip, dtype_itemsize, explain_chunk,
                           field, int_field)
from .value_check import check_value

MAX_MANIFEST_BYTES = 1 << 30
"""The largest manifest read (1 GiB): ~18 million chunks, e.g. 6,000 tensors (2,000 parameters and
two Adam moments each) sharded over 3,000 ranks; a 100,000-tensor single-process checkpoint needs
~20 MB. The environment variable ``ZEROSTALL_MAX_MANIFEST_BYTES`` raises (or lowers) it."""
MANIFEST_BYTES_ENV = "ZEROSTALL_MAX_MANIFEST_BYTES"

_HEXES = re.compile(r"[0-9a-f]*")
_INT = {int}
_STR_INT = {str, int}
_SCALARS = {str, int, float, bool}  # key-path items a parsed list compares as their decoded keys do
_TENSORS = ("tensor", "subclass")  # what an alias may stand for


def max_manifest_bytes() -> int:
    """The largest manifest zerostall reads: ``ZEROSTALL_MAX_MANIFEST_BYTES`` or :data:`MAX_MANIFEST_BYTES`."""
    text = os.environ.get(MANIFEST_BYTES_ENV, "")
    if not text:
        return MAX_MANIFEST_BYTES
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"{MANIFEST_BYTES_ENV}={text!r} is not a positive number of bytes")
    return int(text)


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """The manifest ``raw`` (read from ``where``): its checksum, then every field checked, then
    built; :class:`CorruptCheckpointError` naming the first field the format does not allow."""
    return _checked_manifest(manifest_body(raw, where), where)


def _checked_manifest(d: Any, where: str) -> Manifest:
    """The manifest of the body ``d`` (its checksum and format checked), every field checked."""
    try:
        check_head(d)
        entries = field(d, "entries", list)
        numbers: list[Any] = []  # every int of every chunk, checked at once (and named only when one is wrong)
        digests: list[Any] = []  # every block checksum, likewise
        spans: dict[str, list[tuple[int, int]]] = {name: [] for name in d["files"]}  # non-empty chunks, by file
        names = file_names(d)
        kinds = [_check_entry(d, i, e, numbers, digests, spans, names) for i, e in enumerate(entries)]
        if not (set(map(type, numbers)) <= _INT and _checksums_are_hex(digests)):
            _explain_all(d, entries, kinds, names)
        check_packed(spans, d["files"], loose=d.get("refs", {}))
        for i, e in enumerate(entries):
            target = e["alias_of"] if kinds[i] == "alias" else 0
            if kinds[i] == "alias" and (target >= len(entries) or kinds[target] not in _TENSORS
                                        or entries[target].get("inner_of") is not None):
                raise FieldError(_name(i, e, "alias_of"), f"{target} is not the index of a tensor entry")
        field(d, "tree", object)
        manifest = Manifest.from_json(d)
        _check_paths(manifest)
        if "subclass" in kinds or any(e.inner_of is not None for e in manifest.entries):
            from . import subclass  # imports torch: only for a checkpoint holding a tensor subclass

            faults = subclass.check(manifest.entries, where)
            if faults:
                raise FieldError("entries", faults[0])
    except (FieldError, CheckpointError) as exc:  # CheckpointError: a python value or key path the codec refuses
        raise CorruptCheckpointError(f"manifest {where} is malformed: {exc}") from None
    return manifest


def _checksums_are_hex(digests: list[Any]) -> bool:
    try:
        joined = "".join(digests)
    except TypeError:
        return False
    return len(joined) == 16 * len(digests) and _HEXES.fullmatch(joined) is not None


def _explain_all(d: dict[str, Any], entries: list[Any], kinds: list[str], names: list[str] | None) -> None:
    """Name the chunk whose numbers or checksums the checks in bulk found wrong."""
    for i, e in enumerate(entries):
        if kinds[i] == "tensor":
            try:
                dtype, shape = e["dtype"], e["shape"]
                for j, c in enumerate(e["chunks"]):
                    explain_chunk(j, c, shape, dtype, dtype_itemsize(dtype), d["files"], d["block_size"], names,
                                  always=False)
            except FieldError as exc:
                raise FieldError(_name(i, e, exc.field), exc.why) from None
    raise FieldError("entries", "malformed")  # not reached: the bulk checks failed on some chunk


def parse_deferred(raw: bytes, where: str) -> Manifest:
    """The manifest ``raw`` with its leading fields checked now and its entries and tree parsed
    and checked when first used (:meth:`Manifest.deferred`): a reader that reads few entries, or
    none, does not wait for a hundred thousand to be built."""
    d = manifest_head_body(raw, where, headers=True)
    try:
        check_head(d)
    except (FieldError, CheckpointError) as exc:
        raise CorruptCheckpointError(f"manifest {where} is malformed: {exc}") from None
    return Manifest.deferred(d, _Body(raw, where))


class _Body:
    """A deferred manifest's bytes, parsed and checked whole when first needed, or one entry at a
    time (:meth:`one`) before that."""

    ALONE = 4
    """Reads that :meth:`one` serves (each looks through every entry); after them, building them all costs less."""

    def __init__(self, raw: bytes, where: str) -> None:
        self.raw, self.where = raw, where
        self._alone = 0

    def whole(self) -> Manifest:
        with gc_paused():
            return parse_manifest(self.raw, self.where)

    def one(self, key: str | tuple[Any, ...]) -> Entry | None:
        """The one tensor or python-value entry named ``key`` (its dotted name, or its key path),
        checked as :func:`parse_manifest` checks it, with every chunk of the data files its own
        chunks lie in (those files hold each byte in exactly one chunk); None wherever one entry
        cannot be told apart from the rest (no such entry or several, an alias, a tensor
        subclass, a rank-local entry, anything the whole check would refuse, or after :attr:`ALONE`
        reads): then the caller builds every entry, which refuses what is wrong and names the field."""
        self._alone += 1
        if self._alone > self.ALONE:
            return None
        with gc_paused():  # the parsed body is freed before collections resume: none walks it
            try:
                return _one(manifest_body(self.raw, self.where), key)
            except Exception:  # noqa: BLE001 - whatever is wrong, the whole check names it
                return None


def _one(d: Any, key: str | tuple[Any, ...]) -> Entry | None:
    entries = d["entries"]
    if isinstance(key, str):
        found = [i for i, e in enumerate(entries) if type(e) is dict and e.get("fqn") == key]
    else:
        path = codec.encode_path(key)
        found = [i for i, e in enumerate(entries) if type(e) is dict and e.get("path") == path]
    if len(found) != 1:
        return None
    i = found[0]
    e = entries[i]
    if e.get("rank") is not None or e.get("inner_of") is not None or e.get("kind") not in ("tensor", "object") \
            or type(e.get("path")) is not list or not _STR_INT.issuperset(map(type, e["path"])):
        return None
    numbers: list[Any] = []
    digests: list[Any] = []
    spans: dict[str, list[tuple[int, int]]] = {name: [] for name in d["files"]}
    names = file_names(d)
    _check_entry(d, i, e, numbers, digests, spans, names)
    if not (set(map(type, numbers)) <= _INT and _checksums_are_hex(digests)):
        return None
    entry = Entry.from_json(e, names)
    mine = {name: got for name, got in spans.items() if got}
    for j, other in enumerate(entries):  # its key path is its own; every other chunk in its files (packing)
        if j == i:
            continue
        path = other["path"]
        if other.get("rank") is None and (path == e["path"] or not _SCALARS.issuperset(map(type, path))
                                          and codec.decode_path(path) == entry.path):
            return None
        for c in other["chunks"] if other.get("kind") == "tensor" else ():
            _, _, file, offset, nbytes, _ = chunk_items(c, names)  # another form: refused by one()
            if file in mine and nbytes:
                if type(offset) is not int or type(nbytes) is not int:
                    return None
                mine[file].append((offset, offset + nbytes))
    check_packed(mine, d["files"], loose=d.get("refs", {}))
    return entry


def parse_head(raw: bytes, where: str) -> ManifestHead:
    """The head of the manifest ``raw`` (what listing needs), its fields checked as
    :func:`parse_manifest` checks them; the checksum is checked over the whole body."""
    d = manifest_head_body(raw, where)
    try:
        check_head(d)
    except (FieldError, CheckpointError) as exc:
        raise CorruptCheckpointError(f"manifest {where} is malformed: {exc}") from None
    return ManifestHead.from_json(d)


# -- entries ---------------------------------------------------------------------------------------

def _name(i: int, e: Any, field: str = "") -> str:
    fqn = e.get("fqn") if type(e) is dict else None
    at = f"entries[{i}]" + (f" ({clip(fqn)})" if type(fqn) is str else "")
    return f"{at}.{field}" if field else at


def _check_entry(d: dict[str, Any], i: int, e: Any, numbers: list[Any], digests: list[Any],
                 spans: dict[str, list[tuple[int, int]]], names: list[str] | None) -> str:
    """Check entry ``i``; returns its kind. Field names are only spelled out for an error. The
    chunks' ints are added to ``numbers`` and their checksums to ``digests``, checked in bulk;
    ``names``: the files its chunks index (version 4 on; see ``layout.file_names``)."""
    try:
        if type(e) is not dict:
            raise FieldError("", f"{clip(e)} is not an object")
        if type(e.get("fqn")) is not str:
            field(e, "fqn", str)
        path = e.get("path")
        if type(path) is not list or not set(map(type, path)) <= _STR_INT:  # others checked one by one
            for k, key in enumerate(field(e, "path", list)):
                if type(key) is not str:
                    check_value(key, f"path[{k}]", key=True)
        rank = e.get("rank")
        if rank is not None:
            int_field(rank, "rank", 0, d["world_size"] - 1)
        kind = e.get("kind")
        if kind == "tensor":
            check_tensor(d, e, numbers, digests, spans, names)
            if e.get("inner_of") is not None:
                int_field(e["inner_of"], "inner_of")
        elif kind == "object":
            check_value(field(e, "value", object), "value")
        elif kind == "alias":
            int_field(field(e, "alias_of", int), "alias_of")
        elif kind == "subclass" and d["version"] >= SUBCLASS_VERSION:
            _check_subclass(e)
        else:
            raise FieldError("kind", f"{clip(kind)} is not an entry kind of format version {d['version']} (tensor, "
                                     "object, alias" + (", subclass)" if d["version"] >= SUBCLASS_VERSION else ")"))
        return kind
    except FieldError as exc:
        raise FieldError(_name(i, e, exc.field), exc.why) from None
    except CorruptCheckpointError as exc:  # from check_value, which names the field
        raise FieldError(_name(i, e), str(exc)) from None


def _check_subclass(e: dict[str, Any]) -> None:
    """A tensor subclass entry's own fields (format.md §2.1); how its shards refer to its inner
    tensor entries is checked by :func:`zerostall.format.subclass.check` once the entries are built."""
    field(e, "class", str)
    itemsize = dtype_itemsize(e.get("dtype"))
    if itemsize is None:
        raise FieldError("dtype", f"{clip(e.get('dtype'))} is not a torch dtype")
    check_shape(e, itemsize)
    for j, shard in enumerate(field(e, "shards", list)):
        if type(shard) is not dict:
            raise FieldError(f"shards[{j}]", f"{clip(shard)} is not an object")
        check_value(shard, f"shards[{j}]")  # plain JSON, the flatten contexts tagged; at most MAX_DEPTH deep


# -- key paths and the tree ------------------------------------------------------------------------

def _check_paths(manifest: Manifest) -> None:
    """Each (key path, rank) names one entry, and the tree puts each entry where its path says:
    what a load matches by path, ``state()`` rebuilds from the tree."""
    seen: dict[tuple[Any, int | None], int] = {}
    for i, entry in enumerate(manifest.entries):
        first = seen.setdefault((entry.path, entry.rank), i)
        if first != i:
            same = "key path" if entry.rank is None else f"key path and rank {entry.rank}"
            raise FieldError(f"entries[{i}] ({clip(entry.fqn)}).path", f"entry {first} has the same {same}")
    _check_tree(manifest.tree, manifest.entries)


def _check_tree(tree: Any, entries: list[Entry]) -> None:
    """The tree holds containers (dicts, lists, tuples) and entry references only, at most
    :data:`~zerostall.format.codec.MAX_DEPTH` deep, each reference at the key path of the entry it names."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        kind = type(node)
        tag = key if kind is dict and len(node) == 1 and (key := next(iter(node))).startswith("$") else ""
        body = node[tag] if tag else node
        if tag == "$ref":
            _check_ref(body, path, entries)
            continue
        if len(path) >= codec.MAX_DEPTH:
            raise FieldError(f"tree at {clip(list(path[:4]))}…", f"nests more than {codec.MAX_DEPTH} containers deep")
        if (kind is list or tag == "$tuple") and type(body) is list:
            items: Any = enumerate(body)
        elif tag == "$dict" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            for k, _ in body:
                check_value(k, f"tree at {clip(list(path))}: a key", key=True)
            items = ((codec.decode(k, where="tree"), v) for k, v in body)
        elif kind is dict and not tag and not any(k.startswith("$") for k in node):
            items = node.items()
        else:
            raise FieldError(f"tree at {clip(list(path))}", f"{clip(node)}: the tree holds containers (dicts, "
                                                            "lists, tuples) and references to entries only")
        for k, v in items:
            if type(v) is dict and len(v) == 1 and "$ref" in v:  # a leaf: checked here, the common case
                _check_ref(v["$ref"], path + (k,), entries)
            else:
                stack.append((v, path + (k,)))


def _check_ref(index: Any, path: tuple[Any, ...], entries: list[Entry]) -> None:
    if type(index) is not int or not 0 <= index < len(entries):
        raise FieldError(f"tree at {clip(list(path))}", f"{clip(index)} is not the index of an entry")
    if entries[index].path != path:
        raise FieldError(f"tree at {clip(list(path))}", f"refers to entry {index}, whose key path is "
                                                        f"{clip(list(entries[index].path))}")
