"""Flatten nested training state into leaves keyed by path, and put loaded leaves back.

A path is a tuple of keys (dict keys of any hashable type, list/tuple indices), so keys that
contain "." or are not strings never collide. Objects with ``state_dict()``/``load_state_dict()``
are replaced by their state dict; containers with no tensor anywhere below them are kept whole
as one python-value leaf (an LR scheduler's state, an optimizer's ``param_groups``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from .errors import StateMismatchError, UnsupportedValueError
from .format.codec import MAX_DEPTH, Ref  # MAX_DEPTH: containers nested in a state, as deep as a saved value may nest

Path = tuple[Any, ...]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, schedulers…"""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class RankLocal:
    """Marks a value as this rank's own (RNG state, data-loader position): saved per rank, left
    out of the cross-rank agreement check, and restored by rank index."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"rank_local({self.value!r})"


def rank_local(value: Any) -> RankLocal:
    """Mark ``value`` (a tensor, python value or nested state) as per-rank state."""
    return value if isinstance(value, RankLocal) else RankLocal(value)


_PLAIN = frozenset((dict, list, tuple, str, int, float, bool, type(None), torch.Tensor, torch.nn.Parameter))
_SCALARS = frozenset((str, int, float, bool, type(None)))  # leaves a walk meets and keeps as they are


def is_stateful(obj: Any) -> bool:
    # the type test first: a runtime Protocol check is slow, paid only by unusual objects
    return type(obj) not in _PLAIN and not isinstance(obj, (dict, torch.Tensor, type)) and isinstance(obj, Stateful)


def is_container(node: Any) -> bool:
    """Dicts, lists and tuples are walked into; ``torch.Size`` and other tuple types are values."""
    return isinstance(node, dict) or type(node) in (list, tuple)


def fqn(path: Path) -> str:
    """The dotted name users see (``model.layers.0.weight``); paths stay the real keys."""
    return ".".join(map(str, path))


@dataclass
class Flat:
    """A flattened state: tensor and python-value leaves, plus the stateful objects met.

    With ``skeleton``, also the state's shape for the manifest: its containers (state dicts in
    place of stateful objects) with a :class:`~zerostall.format.codec.Ref` in place of each leaf, and
    those refs by leaf path, for the caller to number once entries are known.
    """

    leaves: dict[Path, Any] = field(default_factory=dict)
    rank_local: set[Path] = field(default_factory=set)
    statefuls: dict[Path, tuple[Any, Any]] = field(default_factory=dict)
    skeleton: Any = None
    refs: dict[Path, Ref] = field(default_factory=dict)
    shape: Shape | None = None


@dataclass(slots=True)
class Shape:
    """A container that held a tensor when walked, for :func:`rewalk`: its kind, keys and their
    types, whether a :class:`RankLocal` or a stateful object held it, and per child its shape,
    ``TENSOR`` (a plain tensor) or ``OTHER`` (a leaf walked again)."""

    kind: Any
    keys: list[Any]
    types: list[type]
    children: list[Any]
    wrapped: bool = False
    stateful: bool = False
    tensors_only: bool = False  # every child a plain tensor: the children are taken in one step


TENSOR, OTHER = 0, 1
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # leaves a re-walk takes by a type test
_PLAIN_TENSOR_TYPES = frozenset(PLAIN_TENSORS)


class Changed(Exception):
    """:func:`rewalk` met a state whose shape is not the one it was given."""


def flatten(state: Any, *, prepare: Callable[[Path, Any], None] | None = None, skeleton: bool = False,
            shape: bool = False) -> Flat:
    """Walk ``state`` once. ``prepare(path, obj)`` runs on each stateful object before its
    ``state_dict()`` is taken (the loader uses it to create a fresh optimizer's state). With
    ``shape``, also record the state's :class:`Shape` (None when no tensor is in it)."""
    walker = _Flattener(prepare, skeleton, shape)
    _, _, walker.flat.skeleton, walker.flat.shape = walker.walk(state, ())
    return walker.flat


def rewalk(state: Any, shape: Shape) -> tuple[list[Any], dict[Path, tuple[Any, Any]], set[Path]]:
    """The leaf values (in :func:`flatten`'s order), stateful objects and rank-local paths of a
    state whose :class:`Shape` a walk found before: its containers are checked against it (kind,
    keys, key types) and a plain tensor costs a type test. Raises :class:`Changed` where the state's
    shape differs (walk it again then)."""
    walker = _Flattener(None, False, False)
    values: list[Any] = []
    walker.rewalk(state, (), shape, values, False)
    return values, walker.flat.statefuls, walker.flat.rank_local


class _Flattener:
    """One walk over a state (a class, not a recursive closure: a closure that calls itself is a
    reference cycle, which would keep every per-leaf object alive until a cyclic collection)."""

    __slots__ = ("flat", "order", "prepare", "skeleton", "shape")

    def __init__(self, prepare: Callable[[Path, Any], None] | None, skeleton: bool, shape: bool) -> None:
        self.flat = Flat()
        self.order: list[Path] = []  # flat.leaves' keys in insertion order, so a subtree's leaves can be dropped
        self.prepare = prepare
        self.skeleton = skeleton
        self.shape = shape

    def walk(self, node: Any, path: Path, local: bool = False) -> tuple[bool, Any, Any, Shape | None]:
        """Whether a tensor lies below ``node``, its plain value (what a leaf stores), its skeleton
        and (when recording) its shape, for a container holding a tensor."""
        flat, order = self.flat, self.order
        if len(path) > MAX_DEPTH:
            raise UnsupportedValueError(f"{fqn(path[:4])}…: the state nests more than {MAX_DEPTH} containers deep "
                                        "(the most zerostall walks, well inside Python's recursion limit)")
        if isinstance(node, RankLocal):
            walked = self.walk(node.value, path, True)
            if walked[3] is not None:
                walked[3].wrapped = True
            return walked
        if local:
            flat.rank_local.add(path)
        stateful = is_stateful(node)
        if stateful:
            if self.prepare is not None:
                self.prepare(path, node)
            sd = node.state_dict()
            flat.statefuls[path] = (node, sd)
            node = sd
        if isinstance(node, torch.Tensor):
            return True, node, self.leaf(path, node), None
        if is_container(node) and len(node) > 0:
            start = len(order)
            items = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
            scalars = _SCALARS.issuperset(map(type, node.values() if isinstance(node, dict) else node))
            if scalars and len(path) < MAX_DEPTH:  # a container of scalars: one value, as walking it would find
                node = _same_container(node, items)
                return False, node, self.leaf(path, node), None
            walked = [(k, *self.walk(v, path + (k,), local)) for k, v in items]
            if any(has_tensor for _, has_tensor, _, _, _ in walked):
                skeleton = _same_container(node, [(k, skel) for k, _, _, skel, _ in walked]) if self.skeleton else None
                return True, None, skeleton, self.shape_of(node, items, walked, stateful)
            for p in order[start:]:
                del flat.leaves[p]
                flat.rank_local.discard(p)
                flat.refs.pop(p, None)
            del order[start:]
            node = _same_container(node, [(k, plain) for k, _, plain, _, _ in walked])
        return False, node, self.leaf(path, node), None

    def shape_of(self, node: Any, items: list[tuple[Any, Any]], walked: list[tuple[Any, ...]],
                 stateful: bool) -> Shape | None:
        """The shape of a container holding a tensor, when recording."""
        if not self.shape:
            return None
        keys = [k for k, _ in items]
        children = [shape if shape is not None else TENSOR if type(v) in PLAIN_TENSORS else OTHER
                    for (_, v), (_, _, _, _, shape) in zip(items, walked)]
        return Shape("dict" if isinstance(node, dict) else type(node), keys, list(map(type, keys)), children,
                     stateful=stateful, tensors_only=all(child is TENSOR for child in children))

    def rewalk(self, node: Any, path: Path, shape: Shape, values: list[Any], local: bool) -> None:
        """:meth:`walk` of a node that had ``shape``: its leaves' values appended to ``values``."""
        if shape.wrapped:
            if not isinstance(node, RankLocal):
                raise Changed(path)
            node, local = node.value, True
        if local:
            self.flat.rank_local.add(path)
        if shape.stateful:
            if not is_stateful(node):
                raise Changed(path)
            sd = node.state_dict()
            self.flat.statefuls[path] = (node, sd)
            node = sd
        if shape.kind == "dict" and isinstance(node, dict) and list(node) == shape.keys and \
                list(map(type, node)) == shape.types:
            children: Any = node.values()
        elif type(node) is shape.kind and len(node) == len(shape.keys):
            children = node
        else:
            raise Changed(path)
        if shape.tensors_only and not local and _PLAIN_TENSOR_TYPES.issuperset(map(type, children)):
            values.extend(children)  # the usual optimizer-state dict: no per-child step in Python
            return
        for k, v, child in zip(shape.keys, children, shape.children):
            if child is TENSOR and type(v) in PLAIN_TENSORS:
                if local:
                    self.flat.rank_local.add(path + (k,))
                values.append(v)
            elif type(child) is Shape:
                self.rewalk(v, path + (k,), child, values, local)
            elif child is OTHER:
                has_tensor, plain, _, _ = self.walk(v, path + (k,), local)
                if has_tensor and self.order[-1:] != [path + (k,)]:  # a tensor below, where a leaf was
                    raise Changed(path + (k,))
                values.append(plain)
            else:
                raise Changed(path + (k,))

    def leaf(self, path: Path, value: Any) -> Ref | None:
        self.flat.leaves[path] = value
        self.order.append(path)
        if not self.skeleton:
            return None
        self.flat.refs[path] = ref = Ref(-1)
        return ref


def _same_container(node: Any, items: list[tuple[Any, Any]]) -> Any:
    if isinstance(node, dict):
        return {k: v for k, v in items}
    values = [v for _, v in items]
    return tuple(values) if isinstance(node, tuple) else values


def rebuild(state: Any, flat: Flat, replacements: dict[Path, Any], *, assign: bool = False) -> Any:
    """Put loaded python values back and hand state dicts to their objects.

    Dicts and lists are updated in place; tuples (immutable) are rebuilt, which is why the
    caller gets the result back. Stateful objects receive ``load_state_dict`` with their state
    dict, whose tensors the loader already filled in place. ``assign`` makes modules take the
    loaded tensors as their parameters (needed when they were on the meta device).
    """
    return _Rebuilder(flat, replacements, assign).visit(state, ())


class _Rebuilder:
    """One walk of :func:`rebuild` (a class for the same reason as :class:`_Flattener`)."""

    __slots__ = ("flat", "replacements", "assign")

    def __init__(self, flat: Flat, replacements: dict[Path, Any], assign: bool) -> None:
        self.flat, self.replacements, self.assign = flat, replacements, assign

    def hand_over(self, obj: Any, sd: Any, path: Path) -> None:
        try:
            if self.assign and isinstance(obj, torch.nn.Module):
                obj.load_state_dict(sd, assign=True)
            else:
                obj.load_state_dict(sd)
        except (ValueError, KeyError, RuntimeError) as exc:  # its own checks: the tensors are filled by now
            raise StateMismatchError(f"{fqn(path) or 'the state'}: its load_state_dict refused what was loaded "
                                     f"({type(exc).__name__}: {exc}); the state may be partly loaded") from exc

    def visit(self, node: Any, path: Path) -> Any:
        if isinstance(node, RankLocal):
            node.value = self.visit(node.value, path)
            return node
        if path in self.flat.statefuls:
            obj, sd = self.flat.statefuls[path]
            self.hand_over(obj, self.visit_plain(sd, path), path)
            return obj
        return self.visit_plain(node, path)

    def visit_plain(self, node: Any, path: Path) -> Any:
        if path in self.replacements:
            return self.merge(node, path, self.replacements[path])
        if isinstance(node, dict):
            for k in list(node):
                new = self.visit(node[k], path + (k,))
                if new is not node[k]:
                    node[k] = new
            return node
        if is_container(node):
            return _refill(node, [self.visit(v, path + (i,)) for i, v in enumerate(node)])
        return node

    def merge(self, node: Any, path: Path, new: Any) -> Any:
        """Replace ``node`` by the loaded value ``new``, keeping container and object identity."""
        if isinstance(node, RankLocal):
            node.value = self.merge(node.value, path, new)
            return node
        statefuls = self.flat.statefuls
        if path in statefuls and node is not statefuls[path][1]:
            obj, sd = statefuls[path]
            self.hand_over(obj, self.merge(sd, path, new), path)
            return obj
        if isinstance(node, dict) and isinstance(new, dict):
            merged = {k: self.merge(node.get(k), path + (k,), v) for k, v in new.items()}
            node.clear()
            node.update(merged)
            return node
        if isinstance(node, list) and isinstance(new, list):
            return _refill(node, [self.merge(node[i] if i < len(node) else None, path + (i,), v)
                                  for i, v in enumerate(new)])
        return new


def _refill(node: list | tuple, values: list[Any]) -> list | tuple:
    if isinstance(node, list):
        node[:] = values
        return node
    return type(node)(*values) if hasattr(node, "_fields") else type(node)(values)


def init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state (as DCP does) so a checkpoint can be loaded into it.

    Runs one step with zero gradients and a learning rate of 0, which leaves the parameters
    unchanged, then restores the learning rates and gradients.
    """
    if optim.state:
        return
    saved_grads = {}
    saved_lrs = []
    for group in optim.param_groups:
        lr = group.get("lr")
        saved_lrs.append(lr.clone() if isinstance(lr, torch.Tensor) else lr)
        if isinstance(lr, torch.Tensor):
            lr.fill_(0.0)
        elif lr is not None:
            group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad:
                saved_grads[p] = p.grad
                p.grad = torch.zeros_like(p)
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, saved_lrs):
            if isinstance(lr, torch.Tensor):
                group["lr"].copy_(lr)
            elif lr is not None:
                group["lr"] = lr
        for p, grad in saved_grads.items():
            p.grad = grad


def rng_state() -> dict[str, Any]:
    """This process's random number generators' states: torch, CUDA (when available), python, numpy (when installed)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back the states :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])

