"""Optimizer state keyed by parameter name (DCP's ``get_state_dict``) loaded into an optimizer object.

A torch optimizer's ``state_dict()`` keys its state by parameter index; DCP (and zerostall, when
given ``get_state_dict``'s dicts) saves it by parameter name, with the names listed in order in
``param_groups``. When a load meets an optimizer object and the checkpoint's ``param_groups`` there
name the same number of parameters, the target's state is keyed by those names, position for
position (as ``Optimizer.load_state_dict`` itself maps saved to current parameters), and the
loaded state is handed back to the optimizer keyed by index again. Groups of other sizes are a
mismatch found while planning, before any byte moves.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..format import codec
from ..format.layout import Entry
from ..state import Flat, Path, fqn


class _ByName:
    """An optimizer whose ``load_state_dict`` takes state keyed by parameter name."""

    def __init__(self, optim: torch.optim.Optimizer, index: dict[str, int]) -> None:
        self.optim, self.index = optim, index

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        index = self.index
        groups = [{**g, "params": [index.get(p, p) for p in g["params"]]} for g in sd["param_groups"]]
        self.optim.load_state_dict({**sd, "state": {index.get(k, k): v for k, v in sd["state"].items()},
                                    "param_groups": groups})


def match_optimizer(flat: Flat, path: Path, source: dict[Path, Entry], rel: Callable[[Path], Path],
                    allow_pickle: bool) -> str | None:
    """Match the optimizer flattened at ``path`` with the checkpoint's ``param_groups`` there
    (``source``: its entries by relative path, ``rel`` giving a target path's). Returns why they
    cannot go into it (another number of groups, or of parameters in a group:
    ``Optimizer.load_state_dict`` would refuse them only once every tensor is filled), else None;
    where they name the parameters, the optimizer's state is keyed by those names."""
    entry = source.get(rel(path + ("param_groups",)))
    if entry is None or entry.kind != "object":
        return None
    saved = _saved_groups(entry, allow_pickle)
    have = [len(g["params"]) for g in flat.statefuls[path][1]["param_groups"]]
    if saved and [len(g["params"]) for g in saved] != have:
        return (f"{fqn(path)}.param_groups (the checkpoint's groups hold {[len(g['params']) for g in saved]} "
                f"parameters, the optimizer's {have}: build the optimizer with the same parameter groups)")
    _key_by_name(flat, path, [p for g in saved for p in g["params"]])
    return None


def _key_by_name(flat: Flat, path: Path, names: list[Any]) -> None:
    """Key the state of the optimizer flattened at ``path`` by ``names``, the parameters the
    checkpoint's ``param_groups`` list in order (as many as it has), when they are names."""
    optim, sd = flat.statefuls[path]
    if not names or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        return
    ids = [p for g in sd["param_groups"] for p in g["params"]]
    name_of = dict(zip(ids, names))
    at = len(path) + 1
    renamed = {}
    for leaf, value in flat.leaves.items():
        if leaf[:at] == path + ("state",) and len(leaf) > at and leaf[at] in name_of:
            leaf = leaf[:at] + (name_of[leaf[at]],) + leaf[at + 1:]
        renamed[leaf] = value
    flat.leaves = renamed
    sd = {**sd, "state": {name_of.get(k, k): v for k, v in sd["state"].items()}}
    flat.statefuls[path] = (_ByName(optim, {n: i for i, n in name_of.items()}), sd)


def _saved_groups(entry: Entry, allow_pickle: bool) -> list[dict[str, Any]]:
    """The checkpoint's ``param_groups`` (``entry``) as dicts with a list of ``params``; [] when they are not."""
    saved = codec.decode(entry.value, where=entry.fqn, allow_pickle=allow_pickle)
    ok = isinstance(saved, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved)
    return saved if ok else []
