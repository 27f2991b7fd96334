"""Pausing automatic garbage collection while per-leaf bookkeeping is built.

A save or load of a state with thousands of leaves creates tens of thousands of small objects that
live until it ends and then die by reference counting. Each batch of them triggers the cyclic
collector, and its full collections walk every object of the process (a torch process holds
hundreds of thousands), which can take a large share of a save of many small tensors. Paused, the
objects come and go without a single collection.

Blocking calls (``save``, ``load``) pause for their whole duration: the caller waits anyway. Work
that runs beside training (an asynchronous save's writer) pauses only around its bookkeeping, so
the trainer's own collections are never held off for the length of an upload.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic collection inside the block; the outermost block (across threads)
    restores the state it found, so a caller's own ``gc.disable()`` is respected."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
