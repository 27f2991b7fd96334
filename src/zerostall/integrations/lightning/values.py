"""Lightning's checkpoint dict as a zerostall state, and back.

Tensors stay where they are and are stored natively; so do dicts, lists, tuples and the plain
values our encoding holds. Lightning's own python objects are stored by an explicit policy, as
plain data plus a record of what to rebuild (the ``objects`` table, kept in the manifest's
metadata), without running any of their code on load:

- the dicts of ``collections`` (``OrderedDict``: a module's ``state_dict``, with its ``_metadata``
  of module versions; ``Counter``; ``defaultdict``, its factory a builtin type or pickled) as
  :mod:`zerostall.format.dicts` stores them, and Lightning's ``AttributeDict`` (``hparams``):
  their items, rebuilt as that class;
- ``nn.Parameter``: its tensor, rebuilt as a parameter with its ``requires_grad``;
- ``argparse.Namespace``: its attributes, rebuilt as a Namespace;
- OmegaConf ``DictConfig``/``ListConfig`` (hyper-parameters): their container, interpolations
  unresolved, and their struct and read-only flags and structured class, rebuilt with
  ``OmegaConf.create`` (``OmegaConf.structured`` for a class found among the modules imported);
- a class (``hparams_type``) that its module names: its module and name, looked up on load among
  the modules already imported (nothing is imported);
- anything else our encoding cannot hold: pickled with ``allow_pickle=True``, else refused with an
  :class:`~zerostall.errors.UnsupportedValueError` naming its key (on load, a pickled value needs
  ``allow_pickle`` too).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Mapping

import torch

from ...errors import CheckpointError, CorruptCheckpointError
from ...format import codec, dicts
from ...state import is_stateful

METADATA_KEY = "lightning"  # the manifest metadata key holding the objects table (and the layout)
SHARDED = "sharded"  # the layout of a strategy's sharded checkpoint (a CheckpointIO's names none)
REST = "lightning"  # there, Lightning's dict but the weights and optimizer states: one python value
REST_TENSORS = "lightning_tensors"  # and the tensors of that rest, by name
_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")  # whose dict subclasses are rebuilt by class
_SCALARS = (str, int, float, bool, type(None))
_HINT = ("not a tensor, a plain python value or one of Lightning's objects zerostall stores; pass "
         "allow_pickle=True to ZeroStallCheckpointIO to store it with pickle")


def split(checkpoint: dict[str, Any], *, allow_pickle: bool,
          apart: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, Any], list[list[Any]]]:
    """``checkpoint`` as a tree of dicts, lists, tuples, tensors and plain values, and the table of
    objects to rebuild: ``[key path, kind, data]``, parents before what they hold. With ``apart``,
    the tensors go there instead, by name (the tree is then one python value, read in one go).
    The caller's dict is not modified."""
    objects: list[list[Any]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> Any:
        cls = type(node)
        if isinstance(node, torch.Tensor) and apart is not None:
            name = str(len(apart))
            apart[name] = node
            objects.append([path, "tensor", name])
            return None
        if isinstance(node, torch.nn.Parameter):
            objects.append([path, "parameter", node.requires_grad])
            return node
        if cls in _SCALARS or isinstance(node, torch.Tensor):
            return node
        if cls is dict:
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if cls is list or cls is tuple:
            items = [walk(v, path + (i,)) for i, v in enumerate(node)]
            return items if cls is list else tuple(items)
        if dicts.KINDS.get(cls.__qualname__) is cls or (isinstance(node, dict)
                                                         and cls.__module__.split(".")[0] in _PACKAGES):
            objects.append([path, "dict", [cls.__module__, cls.__qualname__,
                                           dicts.describe(node, _dotted(path), allow_pickle)]])
            return {k: walk(v, path + (k,)) for k, v in node.items()}
        if cls is argparse.Namespace:
            objects.append([path, "namespace", None])
            return {k: walk(v, path + (k,)) for k, v in vars(node).items()}
        if _is_omegaconf(node):
            from omegaconf import OmegaConf

            objects.append([path, "omegaconf", _omegaconf_kind(node)])
            return walk(OmegaConf.to_container(node, resolve=False), path)
        if isinstance(node, type) and _named(node):
            objects.append([path, "type", [node.__module__, node.__qualname__]])
            return None
        if isinstance(node, dict) or is_stateful(node):  # the save would walk into these: the codec decides here
            objects.append([path, "value", _encoded(node, path, allow_pickle)])
            return None
        return node  # a plain value, or one the save pickles (allow_pickle) or refuses, naming its key

    return walk(checkpoint, ()), objects


def join(tree: Any, objects: Any, *, allow_pickle: bool, where: str,
         tensor: Callable[[torch.Tensor], torch.Tensor] | None = None,
         apart: Mapping[str, torch.Tensor] | None = None) -> Any:
    """The checkpoint dict that :func:`split` took apart: ``tree`` (loaded) with the objects of
    ``objects`` rebuilt, each after what it holds, the tensors kept ``apart`` put back, and each
    tensor passed through ``tensor`` (once per tensor: a tensor met twice stays shared)."""
    try:
        table = {tuple(path): (kind, data) for path, kind, data in objects}
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: the stored table of Lightning objects is malformed: {exc!r}") from None
    moved: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        if tensor is None:
            return t
        if id(t) not in moved:
            moved[id(t)] = tensor(t)
        return moved[id(t)]

    def walk(node: Any, path: tuple[Any, ...]) -> Any:
        found = table.get(path)
        if found is not None and found[0] == "tensor":
            return move(_kept_apart(apart, found[1], path, where))
        if isinstance(node, torch.Tensor):
            node = move(node)
        elif type(node) is dict:
            node = {k: walk(v, path + (k,)) for k, v in node.items()}
        elif type(node) in (list, tuple):
            node = type(node)(walk(v, path + (i,)) for i, v in enumerate(node))
        return node if found is None else _rebuild(*found, node, path, allow_pickle, where)

    return walk(tree, ())


def _kept_apart(apart: Mapping[str, torch.Tensor] | None, name: Any, path: tuple[Any, ...],
                where: str) -> torch.Tensor:
    """The tensor :func:`split` kept apart under ``name``."""
    found = apart.get(name) if apart is not None and type(name) is str else None
    if not isinstance(found, torch.Tensor):
        raise CorruptCheckpointError(f"{where}, key {_dotted(path)}: its tensor {name!r} is not in the checkpoint")
    return found


def _rebuild(kind: Any, data: Any, node: Any, path: tuple[Any, ...], allow_pickle: bool, where: str) -> Any:
    at = f"{where}, key {_dotted(path)}"
    try:
        if kind == "parameter":
            if not isinstance(node, torch.Tensor) or type(data) is not bool:
                raise CorruptCheckpointError(f"{at}: a stored parameter is not a tensor")
            return torch.nn.Parameter(node, requires_grad=data)
        if kind == "dict":
            module, qualname, versions = data
            if module == "collections":
                return dicts.rebuild(qualname, node, versions, at, allow_pickle)
            cls = _lookup(module, qualname, at)
            if not (issubclass(cls, dict) and module.split(".")[0] in _PACKAGES):
                raise CorruptCheckpointError(f"{at}: refusing to rebuild {module}.{qualname}: not a dict of "
                                             "collections or a dict class of Lightning's")
            rebuilt = dict.__new__(cls)  # no code of Lightning's class runs
            dict.update(rebuilt, node)
            versions = codec.decode(versions, where=at)
            if versions is not None:
                rebuilt._metadata = versions
            return rebuilt
        if kind == "namespace":
            return argparse.Namespace(**{str(k): v for k, v in node.items()})
        if kind == "omegaconf":
            try:
                from omegaconf import OmegaConf
            except ImportError:
                raise CheckpointError(f"{at} holds an OmegaConf container: pip install omegaconf to load it") from None
            return _omegaconf(OmegaConf, node, data, at)
        if kind == "type":
            module, qualname = data
            return _lookup(module, qualname, at)
        if kind == "value":
            return codec.decode(data, where=at, allow_pickle=allow_pickle)
    except CheckpointError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{at}: the stored Lightning object is malformed: {exc!r}") from None
    raise CorruptCheckpointError(f"{at}: unknown kind of stored Lightning object {kind!r}")


def _omegaconf_kind(node: Any) -> dict[str, Any]:
    """What an OmegaConf container is besides its content: its struct and read-only flags, and the
    class of a structured config (when found again by module and name)."""
    from omegaconf import OmegaConf

    cls = OmegaConf.get_type(node)
    typed = isinstance(cls, type) and cls not in (dict, list) and _named(cls)
    return {"struct": OmegaConf.is_struct(node), "readonly": OmegaConf.is_readonly(node),
            "type": [cls.__module__, cls.__qualname__] if typed else None}


def _omegaconf(omegaconf: Any, node: Any, kind: Any, at: str) -> Any:
    """The OmegaConf container of content ``node`` as :func:`_omegaconf_kind` described it
    (``kind`` None: stored before the flags were)."""
    kind = kind if isinstance(kind, dict) else {}
    typed = kind.get("type")
    if typed:
        config = omegaconf.merge(omegaconf.structured(_lookup(*typed, at)), node)
    else:
        config = omegaconf.create(node)
    omegaconf.set_struct(config, bool(kind.get("struct")) or None)
    omegaconf.set_readonly(config, bool(kind.get("readonly")) or None)
    return config


def _lookup(module: Any, qualname: Any, at: str) -> type:
    """The class ``module.qualname`` from the modules already imported (none is imported here)."""
    if type(module) is not str or type(qualname) is not str:
        raise CorruptCheckpointError(f"{at}: a stored class name is not a string")
    found: Any = sys.modules.get(module)
    if found is None:
        raise CheckpointError(f"{at} holds the class {module}.{qualname}, but {module} is not imported: "
                              f"import it before loading (zerostall imports nothing named by a checkpoint)")
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if not isinstance(found, type):
        raise CorruptCheckpointError(f"{at}: {module}.{qualname} is not a class")
    return found


def _named(cls: type) -> bool:
    """Whether ``cls`` is found again by its module and name (not a class made inside a function)."""
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def _encoded(value: Any, path: tuple[Any, ...], allow_pickle: bool) -> Any:
    return codec.encode(value, where=_dotted(path), allow_pickle=allow_pickle, hint=_HINT)


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path)) or "<root>"


def _is_omegaconf(node: Any) -> bool:
    """An OmegaConf container (checked without importing omegaconf where the program did not)."""
    module = sys.modules.get("omegaconf")
    return module is not None and isinstance(node, module.Container)
