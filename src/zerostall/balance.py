"""The one balancer: items, largest first, each to the least-loaded of the bins it may go to.

Deterministic (ties go to the lower bin), so ranks that run it on the same input agree with no
messages. Used to spread a rank's writes over its data files, replicated chunks over the ranks
that hold them and broadcast reads over ranks.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence


def balance(sizes: Sequence[int], bins: int, *, order: Sequence[int] | None = None,
            allowed: Callable[[int], Sequence[int]] | None = None) -> tuple[list[int], list[int]]:
    """The bin of each item and the load of each bin. Items are placed in ``order`` (default:
    largest first, ties by index), each onto its least-loaded bin among ``allowed(item)`` (default:
    all ``bins``)."""
    if order is None:
        order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    where = [0] * len(sizes)
    load = [0] * bins
    if allowed is None:
        heap = [(0, b) for b in range(bins)]
        for i in order:
            total, b = heap[0]
            where[i] = b
            heapq.heapreplace(heap, (total + sizes[i], b))
        for total, b in heap:
            load[b] = total
        return where, load
    for i in order:
        b = min(allowed(i), key=lambda r: (load[r], r))
        where[i] = b
        load[b] += sizes[i]
    return where, load
