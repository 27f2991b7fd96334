"""The dicts of ``collections`` as the integrations store them: their items as a plain dict, and
what else makes them what they were, so that they come back as that class. An ``OrderedDict``
keeps its ``_metadata`` (a module's state dict: the versions its load reads); a ``defaultdict``
its factory (a builtin type by name; another through the codec, so only with ``allow_pickle``);
a ``Counter`` needs nothing more. The codec alone decodes them as plain dicts."""

from __future__ import annotations

import collections
from typing import Any

from ..errors import CorruptCheckpointError
from . import codec

KINDS = {cls.__qualname__: cls for cls in (collections.OrderedDict, collections.Counter, collections.defaultdict)}
_FACTORIES = {t.__name__: t for t in (list, dict, set, frozenset, int, float, complex, str, bytes, tuple, bool)}


def describe(node: dict, where: str, allow_pickle: bool) -> Any:
    """What ``node`` (a dict of a class in :data:`KINDS`, or another dict subclass an integration
    rebuilds) needs besides its items, as JSON-ready data: a ``defaultdict``'s factory, else its
    ``_metadata``; ``where`` names its key in an error."""
    if isinstance(node, collections.defaultdict):
        factory = node.default_factory
        if factory is None or _FACTORIES.get(getattr(factory, "__name__", "")) is factory:
            return getattr(factory, "__name__", None)
        return {"encoded": codec.encode(factory, where=f"{where}.default_factory", allow_pickle=allow_pickle)}
    return codec.encode(getattr(node, "_metadata", None), where=f"{where}._metadata", allow_pickle=allow_pickle)


def rebuild(qualname: Any, items: Any, data: Any, where: str, allow_pickle: bool) -> dict:
    """The dict of class ``qualname`` that :func:`describe` described as ``data``, holding ``items``."""
    if qualname not in KINDS or type(items) is not dict:
        raise CorruptCheckpointError(f"{where}: a stored {qualname!r} is not one of {', '.join(KINDS)} holding a dict")
    if qualname == "defaultdict":
        if isinstance(data, dict) and "encoded" in data:
            factory = codec.decode(data["encoded"], where=f"{where}.default_factory", allow_pickle=allow_pickle)
        elif data is None or data in _FACTORIES:
            factory = None if data is None else _FACTORIES[data]
        else:
            raise CorruptCheckpointError(f"{where}: a stored defaultdict's factory {data!r} is not a builtin type")
        if factory is not None and not callable(factory):
            raise CorruptCheckpointError(f"{where}: a stored defaultdict's factory is not callable")
        return collections.defaultdict(factory, items)
    rebuilt: Any = KINDS[qualname](items)
    if qualname == "OrderedDict":
        metadata = codec.decode(data, where=f"{where}._metadata")
        if metadata is not None:
            rebuilt._metadata = metadata
    return rebuilt
