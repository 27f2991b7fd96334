"""Which checkpoint a path names when it holds none itself: a root (its newest committed checkpoint),
``ROOT/latest`` (the same) or ``ROOT/<step>`` (the newest of that step). Every reader takes these
names: ``zs.load``/``open``/``verify``/``export`` and the command line."""

from __future__ import annotations

import functools
import os

from ..storage import Storage, storage_for
from .root import CheckpointRoot


class Naming:
    """What ``path``, holding no checkpoint itself, names: ``ROOT/latest`` the newest committed
    checkpoint under ROOT, ``ROOT/<step>`` the newest of that step, a root its newest. Built on
    every rank without I/O; one rank lists (:meth:`tag`) and every rank opens :meth:`child` of its answer."""

    def __init__(self, path: str | os.PathLike[str] | Storage) -> None:
        self.path = path
        self.step: int | None = None
        self.named = False  # ROOT/latest or ROOT/<step>: a root without that checkpoint is an error
        if not isinstance(path, Storage):
            parent, slash, name = os.fspath(path).rstrip("/").rpartition("/")
            if (name == "latest" or name.isascii() and name.isdigit()) and not parent.endswith(":/"):  # not a bucket
                self.path, self.named = parent or slash or ".", True  # "/latest": the root directory's
                self.step = None if name == "latest" else int(name)

    @functools.cached_property
    def root(self) -> CheckpointRoot:
        """The root named (its storage made on first use: only the ranks that need it pay for it)."""
        return CheckpointRoot(storage_for(self.path))

    def tag(self) -> str | None:
        """The tag of the checkpoint named, None where a plain path is no root of committed
        checkpoints; a :class:`CheckpointNotFoundError` where ``ROOT/latest`` or ``ROOT/<step>`` names none."""
        return self.root.newest(self.step) if self.named else self.root.latest()

    def child(self, tag: str) -> Storage:
        """The storage of checkpoint ``tag`` of the root."""
        return self.root.child(tag)


def named_instead(path: str | os.PathLike[str] | Storage) -> Storage | None:
    """The storage of the checkpoint that ``path``, holding none itself, names (see :class:`Naming`);
    None when it names none."""
    naming = Naming(path)
    tag = naming.tag()
    return None if tag is None else naming.child(tag)
