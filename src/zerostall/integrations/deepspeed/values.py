"""One DeepSpeed file's state dict as zerostall entries: its tensors stored natively under their
dotted key paths, and one python value holding the rest, with where each tensor and each of
DeepSpeed's own objects goes back.

DeepSpeed puts a few objects of its own in its files (the loss scaler, ``ZeroStageEnum``, fragment
addresses). They are stored as their class name and their attributes, plain values only, and
rebuilt on load without running any code of theirs (no ``__init__``, no unpickling, no import):
only classes of ``deepspeed`` modules already imported are rebuilt. The dicts of ``collections``
come back as what they were: an ``OrderedDict`` with its ``_metadata`` (a module's state dict and
the versions its load reads), a ``Counter``, a ``defaultdict`` whose factory is a builtin type;
so does an ``nn.Parameter``, with its ``requires_grad``. Other objects our encoding cannot hold
(a ``defaultdict``'s own factory function too) are pickled when ``allow_pickle`` is given, else
refused with the key that holds them (by the save's encoder).
"""

from __future__ import annotations

import enum
import sys
from typing import Any, Callable

import torch

from ...errors import CorruptCheckpointError
from ...format import dicts

TENSORS = "tensors"  # a file's tensors, by dotted key path
VALUE = "value"  # the rest of the file, with the places of its tensors and objects

_OURS = "deepspeed"  # the package whose plain-data objects are stored by class and attributes


def split(state_dict: Any, *, allow_pickle: bool = False, where: str = "") -> dict[str, Any]:
    """``state_dict`` (what DeepSpeed passes to ``CheckpointEngine.save``; ``where``: its file) as
    ``{"tensors": {name: tensor}, "value": {...}}``. A tensor met twice is stored once, and comes
    back shared."""
    splitter = _Splitter(allow_pickle, where)
    tree = splitter.walk(state_dict, ())
    return {TENSORS: splitter.tensors,
            VALUE: {"tree": tree, "tensors": splitter.slots, "objects": splitter.objects, "dicts": splitter.dicts,
                    "parameters": splitter.parameters}}


def tensors_of(state_dict: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``state_dict`` by the names :func:`split` gives them (the rest not described)."""
    splitter = _Splitter(False, "", describe=False)
    splitter.walk(state_dict, ())
    return splitter.tensors


class _Splitter:
    __slots__ = ("tensors", "slots", "objects", "dicts", "parameters", "names", "allow_pickle", "where", "describe")

    def __init__(self, allow_pickle: bool, where: str, describe: bool = True) -> None:
        self.allow_pickle, self.where, self.describe = allow_pickle, where, describe
        self.tensors: dict[str, torch.Tensor] = {}
        self.slots: list[list[Any]] = []  # [key path, tensor name]
        self.objects: list[list[Any]] = []  # [key path, module, class name, attributes or enum value]
        self.dicts: list[list[Any]] = []  # [key path, class name, its _metadata or defaultdict factory]
        self.parameters: dict[str, bool] = {}  # tensor name -> requires_grad, of the nn.Parameters
        self.names: dict[int, str] = {}  # id(tensor) -> its name: a tensor met again is the same entry

    def walk(self, node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, torch.Tensor):
            name = self.names.get(id(node))
            if name is None:
                name = base = ".".join(map(str, path)) or "tensor"
                while name in self.tensors:  # two key paths with one dotted spelling
                    name = f"{base}#{len(self.tensors)}"
                self.tensors[name] = node
                self.names[id(node)] = name
                if isinstance(node, torch.nn.Parameter):
                    self.parameters[name] = node.requires_grad
            self.slots.append([list(path), name])
            return None
        if isinstance(node, dict) and type(node).__module__ in ("builtins", "collections"):
            if type(node) is not dict and self.describe:
                at = ".".join(map(str, (self.where, *path) if self.where else path))
                self.dicts.append([list(path), type(node).__qualname__, dicts.describe(node, at, self.allow_pickle)])
            return {k: self.walk(v, path + (k,)) for k, v in node.items()}
        if type(node) in (list, tuple):
            items = [self.walk(v, path + (i,)) for i, v in enumerate(node)]
            return items if type(node) is list else tuple(items)
        cls = type(node)
        if cls.__module__.split(".")[0] == _OURS:
            if isinstance(node, enum.Enum):
                self.objects.append([list(path), cls.__module__, cls.__qualname__, node.value])
                return None
            if hasattr(node, "__dict__") and not hasattr(cls, "__slots__"):
                self.objects.append([list(path), cls.__module__, cls.__qualname__, dict(vars(node))])
                return None
        return node  # a plain value, or one the encoder pickles (allow_pickle) or refuses, naming its key


def join(value: Any, tensors: Callable[[list[str]], list[torch.Tensor]], where: str, *,
         allow_pickle: bool = False) -> Any:
    """The state dict that :func:`split` took apart, ``tensors(names)`` reading the stored tensors."""
    try:
        tree, slots, objects = value["tree"], value["tensors"], value["objects"]
        for path, qualname, data in sorted(value.get("dicts", []), key=lambda d: -len(d[0])):  # inner first
            at = f"{where}, key {'.'.join(map(str, path))}"
            tree = _place(tree, tuple(path), dicts.rebuild(qualname, _at(tree, path), data, at, allow_pickle))
        for path, module, qualname, data in objects:
            tree = _place(tree, tuple(path), _rebuild(module, qualname, data, where))
        names = list(dict.fromkeys(name for _, name in slots))
        parameters = value.get("parameters", {})
        read = {name: torch.nn.Parameter(t, requires_grad=bool(parameters[name])) if name in parameters else t
                for name, t in zip(names, tensors(names))}
        for path, name in slots:
            tree = _place(tree, tuple(path), read[name])
        return tree
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{where}: the stored DeepSpeed file is malformed: {exc!r}") from None


def _place(node: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``node`` with ``value`` at ``path`` (dicts and lists in place, tuples rebuilt)."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(node, dict):
        node[key] = _place(node[key], rest, value)
        return node
    if type(node) not in (list, tuple) or type(key) is not int:
        raise TypeError(f"no container at {key!r}")
    items = list(node)
    items[key] = _place(items[key], rest, value)
    if type(node) is list:
        node[key] = items[key]
        return node
    return tuple(items)


def _at(tree: Any, path: list[Any]) -> Any:
    """The node of ``tree`` at ``path``."""
    for key in path:
        tree = tree[key]
    return tree


def _rebuild(module: str, qualname: str, data: Any, where: str) -> Any:
    """An object of DeepSpeed's class ``module.qualname`` from what :func:`split` stored: an enum
    by value, another object by its attributes (no code of the class runs)."""
    if type(module) is not str or module.split(".")[0] != _OURS or type(qualname) is not str:
        raise CorruptCheckpointError(f"{where}: refusing to rebuild {module}.{qualname}: only DeepSpeed's own "
                                     "classes are stored by class name")
    cls: Any = sys.modules.get(module)
    if cls is None:
        raise CorruptCheckpointError(f"{where}: {module}.{qualname} is stored, but {module} is not imported: "
                                     "attach zerostall to a DeepSpeed engine before loading")
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not isinstance(cls, type) or cls.__module__ != module:
        raise CorruptCheckpointError(f"{where}: {module}.{qualname} is not a class of DeepSpeed's")
    if issubclass(cls, enum.Enum):
        return cls(data)
    if type(data) is not dict:
        raise CorruptCheckpointError(f"{where}: the attributes of a stored {qualname} are not a dict")
    obj = cls.__new__(cls)
    obj.__dict__.update(data)
    return obj
