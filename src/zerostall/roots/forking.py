"""Forking a root: a run that goes on from a step below the root's newest checkpoints (a rollback,
or a new run over an older one's root) leaves those checkpoints' timeline, so they are moved into
``.superseded/`` before anything of the new timeline is saved: by the root's own save of that step,
or, when the node-local tier saves first, as soon as the run goes on (else a restart would take
them, newer than the tier's steps, over the run's own)."""

from __future__ import annotations

from typing import Callable

from ..errors import CheckpointError
from .described import CheckpointInfo
from .root import LATEST_NAME, CheckpointRoot, step_tag, tag_step


def later(root: CheckpointRoot, step: int, tag: str | None = None,
          found: list[CheckpointInfo] | None = None) -> list[str]:
    """The checkpoints of ``root`` past ``step`` (those of ``tag`` too): committed ones of later
    steps, and those whose damaged manifest's tag names a later step. ``found``: its listing, if made."""
    found = root.checkpoints() if found is None else found
    return [i.name for i in found if (i.step is not None and i.step > step) or i.name == tag] + [
        name for name in root.unreadable  # a damaged manifest's step is its tag's
        if name == tag or (tag_step(name) is not None and tag_step(name) > step)]


def set_aside(root: CheckpointRoot, going: list[str], step: int, tag: str) -> None:
    """Move ``going`` into ``.superseded/`` before ``step`` is saved as ``tag`` (see
    :meth:`CheckpointRoot.set_aside`); an error names them."""
    try:
        root.set_aside(going, step, tag)
    except OSError as exc:
        raise CheckpointError(f"cannot set {', '.join(going)} aside under {root.location} before the run goes on "
                              f"from step {step}: {exc}") from exc


def fork(root: CheckpointRoot, step: int, fence: Callable[[], None]) -> None:
    """On the writer (``fence`` raises unless it still is one): set the checkpoints past ``step``
    aside and point ``latest`` at the newest left."""
    found = root.checkpoints()  # oldest step first
    going = later(root, step, found=found)
    if not going:
        return
    fence()
    set_aside(root, going, step, step_tag(step))
    newest = next((i for i in reversed(found) if i.name not in going), None)
    try:
        if newest is not None:
            root.write_latest(newest.name, newest.step)
    except OSError as exc:
        raise CheckpointError(f"{root.where(LATEST_NAME)} could not be pointed at {newest.name}, the newest "
                              f"checkpoint left once {', '.join(going)} were set aside: {exc}") from exc
