"""Collect: flatten the state and list what this rank holds, before any collective.

Each leaf becomes an entry (a tensor's dtype, global shape and this rank's box, a python value
encoded, or an alias of a tensor seen before), a structure row for planning, and for tensors a
write item pointing at the bytes to store. Nothing is copied: write items reference the tensors.
"""

from __future__ import annotations

import itertools
import json
import operator
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any, Iterable, Sequence

import torch

from ..errors import UnsupportedValueError
from ..format import codec, subclass
from ..format.boxes import Grid, grid_of, local_box
from ..format.layout import Entry, dtype_name
from ..format.tensor_check import dtype_itemsize
from ..state import Flat, Path, flatten, fqn
from ..views import ViewIndex


ChunkKey = tuple[str, tuple[int, ...]]  # a leaf's path key and a box's offsets: one chunk of the global state


@dataclass(slots=True)
class WriteItem:
    """One chunk to write: the source tensor (contiguous), its name in the data file, its entry
    (which receives the chunk once written) and its key."""

    entry: Entry
    name: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    key: ChunkKey = ("", ())
    rank_local: bool = False
    watch: torch.Tensor | None = None  # the leaf, when it is not ``tensor``'s own: its in-place changes count too

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes


Version = tuple[int, int] | None  # a tensor's version counter and its leaf's (-1: none); None: it keeps none
_VERSION = operator.attrgetter("_version")


def versions(items: Sequence[WriteItem]) -> list[Version]:
    """Each item's version now: its tensor's and its leaf's (None where a tensor keeps none:
    inference-mode tensors)."""
    return versions_of([item.tensor for item in items], [item.watch for item in items])


def versions_of(tensors: Sequence[torch.Tensor], watches: Sequence[torch.Tensor | None] | None) -> list[Version]:
    """Each tensor's version now and its watched leaf's (-1 where none is watched, or ``watches``
    is None; see :func:`versions`)."""
    try:  # the common case read in C: a save may hold 100,000 tensors
        return list(zip(map(_VERSION, tensors), itertools.repeat(-1) if watches is None else
                        [-1 if watch is None else watch._version for watch in watches]))
    except RuntimeError:  # an inference-mode tensor among them
        return list(map(current_version, tensors, itertools.repeat(None) if watches is None else watches))


def counters(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    """Each tensor's version counter alone (None where it keeps none): ints, which the cyclic
    collector never tracks, for a record taken in the caller's thread."""
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:  # an inference-mode tensor among them
        return [_counter(t) for t in tensors]


def _counter(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:
        return None


def current_version(tensor: torch.Tensor, watch: torch.Tensor | None) -> Version:
    """``tensor``'s version now, and ``watch``'s (see :func:`versions`)."""
    counter, watched = _counter(tensor), -1 if watch is None else _counter(watch)
    return None if counter is None or watched is None else (counter, watched)


@dataclass(slots=True)
class Row:
    """One global leaf as one rank holds it: a tensor box, an alias or a python value."""

    key: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    nbytes: int = 0
    alias_of: str | None = None
    subclass: str | None = None  # a tensor subclass's class name
    grid: Grid | None = None  # a DTensor box's place in its layout (see format.boxes.grid_of)


def check_tensor(t: torch.Tensor, where: str) -> None:
    """Refuse tensors whose bytes are not plain strided data we can store and restore exactly
    (wrapper subclasses are stored as their inner tensors before this check)."""
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise UnsupportedValueError(
            f"{where}: tensor subclass {type(t).__module__}.{type(t).__qualname__} is not supported: zerostall stores "
            "plain tensors, Parameters, DTensors and wrapper subclasses with __tensor_flatten__/__tensor_unflatten__ "
            "(float8, NF4...); a subclass without them may mean more than its strided data (its attributes are not "
            "saved), so save t.as_subclass(torch.Tensor) if its data is all there is")
    if t.layout != torch.strided or t.is_quantized:
        kind = "quantized" if t.is_quantized else str(t.layout)
        raise UnsupportedValueError(f"{where}: {kind} tensors are not supported; convert to a dense tensor")
    if t.is_meta:
        raise UnsupportedValueError(f"{where}: tensor is on the meta device and has no data to save")
    check_dtype(t, where)


def check_dtype(t: torch.Tensor, where: str) -> None:
    """Refuse a dtype no checkpoint stores, as verify and load would: a quantized one reached
    through ``.view()``, whose scale and zero point are not in its bytes."""
    if dtype_itemsize(dtype_name(t.dtype)) is None:
        raise UnsupportedValueError(
            f"{where}: {t.dtype} tensors are not supported (a quantized dtype's scale and zero point are not in its "
            "bytes); save t.dequantize() for a quantized tensor, or t.view(torch.uint8) for the raw bytes")


def check_keys(path: Path) -> None:
    """Refuse a key a checkpoint cannot give back equal to itself (a NaN, or a tuple holding one)
    or cannot write (an int too long for JSON): each entry is found by its key path, so verify
    and load would refuse the checkpoint, and a load could not match the key."""
    for i, k in enumerate(path):
        kind = type(k)
        if kind is str or kind is int and k.bit_length() <= codec.MAX_INT_BITS:
            continue
        encoded = codec.encode(k, where=f"{fqn(path[:i]) or '<root>'} (a key)", hint=_KEY_HINT)
        if codec.decode(encoded) != codec.decode(encoded):
            raise UnsupportedValueError(
                f"{fqn(path[:i + 1])}: the key {k!r} does not equal itself once stored (it is or holds a NaN), so "
                "no checkpoint could find the value under it again; use a key that equals itself, a string say")


_KEY_HINT = "keys are never pickled: use a str, an int or another plain python value"


def check_shaped(t: torch.Tensor, where: str) -> None:
    """Refuse tensors that have no plain shape to take a box of: lazy modules' parameters before
    their first forward, nested (jagged) tensors."""
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
        raise UnsupportedValueError(f"{where}: an uninitialized lazy parameter (of a LazyLinear, say) has no shape or "
                                    "data yet: run one forward pass through the module before saving it")
    if t.is_nested:
        raise UnsupportedValueError(f"{where}: nested tensors are not supported; save a dense (padded) tensor, or "
                                    "the list of its components (t.unbind())")


def plain_source(t: torch.Tensor) -> torch.Tensor:
    """``t`` as plain contiguous bytes with no autograd history: the tensor itself when it already
    is (an optimizer state), else a detached, resolved, contiguous view or copy."""
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.contiguous()


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def plain_sources(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`plain_source` of each tensor: the list itself when every one already is plain (read
    in C: a state may hold 100,000 tensors)."""
    T = torch.Tensor
    if any(map(_REQUIRES_GRAD, tensors)) or any(map(T.is_conj, tensors)) or any(map(T.is_neg, tensors)) or \
            not all(map(T.is_contiguous, tensors)):
        return list(map(plain_source, tensors))
    return tensors


_KEY_ENCODER = json.JSONEncoder(separators=(",", ":"))


def path_key(path: Path) -> str:
    """A canonical string for a key path, identical on every rank (used in plans and records): the
    compact JSON of its encoding, built directly when every key is a str or an int (the usual case,
    where the JSON encoder's per-call set-up would dominate over thousands of leaves)."""
    parts = []
    for k in path:
        kind = type(k)
        if kind is str:
            parts.append(encode_basestring_ascii(k))
        elif kind is int:
            parts.append(int.__repr__(k))
        else:
            return _KEY_ENCODER.encode(codec.encode_path(path))
    return "[" + ",".join(parts) + "]"


@dataclass
class Collected:
    """What this rank holds, ready to plan and write: no collective has run yet."""

    entries: dict[str, Entry] = field(default_factory=dict)
    rank_local: list[Entry] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    items: list[WriteItem] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    shards: dict[ChunkKey, dict[str, Any]] = field(default_factory=dict)  # subclass boxes: descriptions
    skeleton: Any = None
    refs: dict[Path, codec.Ref] = field(default_factory=dict)
    keys: dict[Path, str] = field(default_factory=dict)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    digest: int | None = None  # of ``rows``, when already known (see plan.structure_digest)


def optimizers_in(statefuls: Iterable[tuple[Any, Any]]) -> list[torch.optim.Optimizer]:
    """The optimizers among the state's stateful objects, and those one attribute inside one (an
    app state holding a model and its optimizer): their steps change the state in place."""
    found: dict[int, torch.optim.Optimizer] = {}
    for obj, _ in statefuls:
        candidates = [obj] if isinstance(obj, torch.optim.Optimizer) else list(getattr(obj, "__dict__", {}).values())
        for value in candidates:
            for item in value if type(value) in (list, tuple) else (value,):
                if isinstance(item, torch.optim.Optimizer):
                    found.setdefault(id(item), item)
    return list(found.values())


def collect(state: Any, rank: int, *, allow_pickle: bool, flat: Flat | None = None,
            encoded: dict[Path, Any] | None = None) -> Collected:
    """Flatten ``state`` (unless ``flat`` is its flattening already) into entries, structure rows
    for planning, and the tensors to write. ``encoded``: python values encoded already, by path."""
    if flat is None:
        flat = flatten(state, skeleton=True)
    out = Collected(skeleton=flat.skeleton, refs=flat.refs, optimizers=optimizers_in(flat.statefuls.values()))
    seen = ViewIndex()  # view -> the key of the leaf that first held it
    seen_objects: dict[int, str] = {}  # id of a subclass or DTensor leaf -> its key (a subclass's views have no
    # data pointer; a DTensor's piece may be empty on some rank, where no pointer tells it is met again)
    names = {"__metadata__"}  # reserved in a safetensors header
    for path, value in flat.leaves.items():
        check_keys(path)
        name, key, local = fqn(path), path_key(path), path in flat.rank_local
        out.keys[path] = key
        if not isinstance(value, torch.Tensor):
            stored = encoded[path] if encoded is not None else encode_value(value, path, allow_pickle)
            if local:
                out.rank_local.append(Entry(name, path, "object", value=stored, rank=rank))
            else:
                out.rows.append(Row(key, "object"))
                out.objects[key] = stored
            continue
        check_shaped(value, name)
        piece, offsets, sizes = local_box(value, name)
        if subclass.is_wrapper(piece):
            first = None if local else seen_objects.setdefault(id(value), key)
            if first is not None and first != key:
                out.rows.append(Row(key, "alias", alias_of=first))
            else:
                _collect_subclass(out, names, path, key, value, piece, offsets, sizes, rank if local else None)
            continue
        check_tensor(piece, name)
        first = None if local or piece is value else seen_objects.setdefault(id(value), key)  # a DTensor met again
        if first == key or first is None:
            first = None if local or not piece.numel() else seen.first(piece, key)  # empty ones share pointer 0
        if first is not None:
            out.rows.append(Row(key, "alias", alias_of=first))
            continue
        entry = Entry(name, path, "tensor", dtype=dtype_name(value.dtype), shape=tuple(value.shape),
                      rank=rank if local else None)
        _add_tensor(out, names, entry, key, plain_source(piece), offsets, sizes, value if piece is not value else None,
                    grid_of(value) if piece is not value else None)
    return out


def encode_value(value: Any, path: Path, allow_pickle: bool) -> Any:
    """A python leaf as the manifest stores it."""
    if isinstance(value, torch.utils.data.DataLoader):
        raise UnsupportedValueError(
            f"{fqn(path)}: a torch DataLoader has no state_dict(), so where it stopped cannot be saved (pickling "
            "it would not restore its position either); use torchdata's StatefulDataLoader, or any loader "
            "with state_dict()/load_state_dict(), or leave the loader out of the state")
    return codec.encode(value, where=fqn(path), allow_pickle=allow_pickle)


def _add_tensor(out: Collected, names: set[str], entry: Entry, key: str, source: torch.Tensor,
                offsets: tuple[int, ...], sizes: tuple[int, ...], watch: torch.Tensor | None,
                grid: Grid | None = None) -> None:
    """List a tensor entry holding ``source`` as its box (offsets, sizes), and the write of its bytes."""
    local = entry.rank is not None
    shape = entry.shape or ()
    if local:
        out.rank_local.append(entry)
    else:
        out.entries[key] = entry
        out.rows.append(Row(key, "tensor", entry.dtype, shape, offsets, sizes, source.nbytes, grid=grid))
    file_name = entry.fqn if sizes == shape else f"{entry.fqn}@{','.join(map(str, offsets))}"
    file_name = file_name.encode("utf-8", "backslashreplace").decode()  # a lone surrogate is not UTF-8
    while file_name in names:
        file_name += "#"
    names.add(file_name)
    out.items.append(WriteItem(entry, file_name, source, offsets, (key, offsets), local, watch))


def _collect_subclass(out: Collected, names: set[str], path: Path, key: str, value: torch.Tensor,
                      piece: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], rank: int | None) -> None:
    """A wrapper subclass leaf (``piece``, this rank's box of ``value``): a subclass entry describing
    this box, and a tensor entry per inner tensor (see :mod:`zerostall.format.subclass`)."""
    name = fqn(path)
    check_dtype(value, name)
    node = subclass.describe(piece, name)
    dtype, shape = dtype_name(value.dtype), tuple(value.shape)
    entry = Entry(name, path, "subclass", dtype=dtype, shape=shape, rank=rank, cls=node.cls, shards=[])
    if rank is not None:
        out.rank_local.append(entry)
    else:
        out.entries[key] = entry
        out.rows.append(Row(key, "subclass", dtype, shape, offsets, sizes, 0, subclass=node.cls))
    sharded = piece is not value  # a DTensor's local tensor: whole-stored inner tensors are named by their box
    for attrs, tensor in list(node.leaves()):
        box = tuple(tensor.shape) == sizes
        ipath = subclass.inner_path(path, attrs, box, offsets if sharded else None)
        ikey = path_key(ipath)
        iname = fqn(ipath)
        check_dtype(tensor, iname)
        ientry = Entry(iname, ipath, "tensor", dtype=dtype_name(tensor.dtype),
                       shape=shape if box else tuple(tensor.shape), rank=rank)
        zeros = (0,) * tensor.dim()
        _add_tensor(out, names, ientry, ikey, plain_source(tensor), offsets if box else zeros,
                    sizes if box else tuple(tensor.shape), value)
        node.set(attrs, subclass.Ref(ikey, box))
    shard = subclass.shard_json(node, offsets)
    if rank is not None:
        entry.shards = [shard]
    else:
        out.shards[(key, offsets)] = shard
