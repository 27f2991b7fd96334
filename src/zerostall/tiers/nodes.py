"""Nodes: which node each rank runs on, and on which other nodes a rank's replicas are kept.

A node is named by its hostname and boot id (a rebooted machine is a new node: its RAM disk is
empty), or by ``ZEROSTALL_NODE_ID`` where the job sets it (tests simulate nodes that way). Nodes
are ordered by their smallest rank, so the order, and with it where replicas go, stays the same
across restarts under torchrun (a node's ranks follow its node rank, and a spare node that takes
a lost node's place gets the same ranks).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from ..collectives import Group

NODE_ENV = "ZEROSTALL_NODE_ID"
"""The environment variable that names this process's node, instead of its hostname and boot id."""

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def node_id() -> str:
    """This process's node: ``$ZEROSTALL_NODE_ID`` if set (stripped, non-empty), else the hostname
    and the first 8 characters of the boot id (only the hostname where there is no boot id)."""
    named = os.environ.get(NODE_ENV, "").strip()
    if named:
        return named
    host = socket.gethostname()
    try:
        with open(BOOT_ID) as f:
            boot = f.read().strip()
    except OSError:
        return host
    return f"{host}-{boot[:8]}" if boot else host


@dataclass(frozen=True)
class Nodes:
    """The node of every rank, and the placement of replicas over the nodes."""

    ids: tuple[str, ...]
    """The node id of every rank, by rank."""

    _order: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _index: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranks: dict[str, list[int]] = {}
        for rank, node in enumerate(self.ids):  # in rank order: each node first seen at its smallest rank
            ranks.setdefault(node, []).append(rank)
        order = tuple(tuple(r) for r in ranks.values())
        index = [0] * len(self.ids)
        for i, on_node in enumerate(order):
            for rank in on_node:
                index[rank] = i
        object.__setattr__(self, "ids", tuple(self.ids))
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_index", tuple(index))

    @property
    def count(self) -> int:
        """The number of nodes."""
        return len(self._order)

    def index(self, rank: int) -> int:
        """The index of ``rank``'s node (nodes ordered by their smallest rank)."""
        return self._index[rank]

    def ranks_on(self, node: int) -> list[int]:
        """The ranks on node ``node`` (an index), ascending."""
        return list(self._order[node])

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` is its node's first: the one that works on the node's shared directory."""
        return self._order[self._index[rank]][0] == rank

    def holders(self, rank: int, replicas: int) -> list[int]:
        """The ranks that keep ``rank``'s replicas when each rank's state has ``replicas`` copies (its
        own included): one on each of the next ``replicas - 1`` nodes (as many as there are other
        nodes), at ``rank``'s position on its node (modulo the other node's size). A ring with a
        stride: never on ``rank``'s own node, never two on one node; none with one node."""
        node = self._index[rank]
        position = self._order[node].index(rank)
        out = []
        for j in range(1, min(replicas, self.count)):
            target = self._order[(node + j) % self.count]
            out.append(target[position % len(target)])
        return out

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose replicas ``rank`` keeps (the inverse of :meth:`holders`), ascending."""
        return [r for r in range(len(self.ids)) if rank in self.holders(r, replicas)]


def gather_nodes(group: Group) -> Nodes:
    """Every rank's node in ``group`` (collective: one all-gather of :func:`node_id`)."""
    return Nodes(tuple(group.all_gather_object(node_id())))
