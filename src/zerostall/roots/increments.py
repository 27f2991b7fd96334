"""A manager's incremental saves: each rank's chunks of the last committed save, which the next
save refers to where their bytes are unchanged, and when a save must be full instead."""

from __future__ import annotations

from ..options import SaveOptions
from ..saving.incremental import Reuse
from ..saving.pipeline import SaveInfo
from .root import step_tag


class Increments:
    """What this rank's next save may refer to. Every rank decides alike from what every rank
    knows (its saves, their steps and outcomes), so no message is needed: a failed save, a step
    saved at or below the last one (which sets that one aside) and every ``full_save_every``-th
    save make the next save full. A checkpoint under a name of its own (``tag="best"``) is saved
    full and no save refers to it: saving that name again replaces it, which must break no other
    checkpoint (and a checkpoint of steps refers only to earlier steps, which no rollback sets aside)."""

    def __init__(self, options: SaveOptions) -> None:
        self.options = options
        self._last: Reuse | None = None
        self._taken: Reuse | None = None  # the base the save in flight refers to, until it commits
        self._saves = 0

    def base(self, step: int, tag: str) -> Reuse | None:
        """What the save of ``step`` (as ``tag``) may refer to; None for a full save. Taken: until
        this save commits (:meth:`committed`), the next one gets nothing."""
        if not self.options.incremental:
            return None
        if tag != step_tag(step):  # saved whole; the later steps it sets aside are no base any more
            if self._last is not None and self._last.step is not None and self._last.step > step:
                self._last = None
            return None
        last, self._last = self._last, None
        self._saves += 1
        every = self.options.full_save_every
        if last is None or (every is not None and (self._saves - 1) % every == 0):
            return None
        if last.tag == tag or (last.step is not None and last.step >= step):
            return None  # the manager sets that checkpoint aside before this save
        self._taken = last
        return last

    def committed(self, info: SaveInfo) -> None:
        """The save just committed: the next one may refer to its chunks (not a named one's)."""
        if info.reuse is None or info.reuse.step is None or info.reuse.tag == step_tag(info.reuse.step):
            self._last = info.reuse
            self._taken = None  # it refers to its base through its manifest now

    def pinned(self, steps: set[int]) -> set[int]:
        """``steps``, the step of the checkpoint the next save may refer to and that of the one the
        save in flight refers to, which retention must keep too (a tagged save of a later step,
        committed meanwhile, may rank above them)."""
        return set(steps) | {r.step for r in (self._last, self._taken) if r is not None and r.step is not None}
