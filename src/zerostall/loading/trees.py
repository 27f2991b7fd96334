"""The saved state as nested containers: the manifest's tree with each entry put in its place,
and values put at key paths (entries that only other ranks held, subtrees a load asks for)."""

from __future__ import annotations

from typing import Any, Callable

from ..format import codec
from ..state import Path


def build(node: Any, value: Callable[[int], Any]) -> Any:
    """The manifest's tree with each entry reference replaced by ``value(index)``."""
    if isinstance(node, codec.Ref):
        return value(node.index)
    if isinstance(node, dict):
        return {k: build(v, value) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(build(v, value) for v in node)
    return node


def insert(tree: dict[Any, Any], path: Path, value: Any) -> None:
    """Put ``value`` at ``path`` in nested dicts, creating them; a path that runs into a non-dict
    node is skipped."""
    node: Any = tree
    for key in path[:-1]:
        node = node.setdefault(key, {}) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node[path[-1]] = value
