"""Capture: copy the state into host buffers that are allocated once and reused.

The copy of a CUDA tensor runs on a side stream of the tensor's device that first waits for an
event recorded on the caller's current stream of that device when the save was requested, so
every kernel queued before the save that writes the state is included, and the copies overlap
what the caller queues next; capture is done once every device's side stream is (see
:mod:`zerostall.devices`). CPU tensors are copied too (snapshotted, never aliased), so the caller
may mutate them once capture is done.

A tensor changed in place before its copy finished would make a torn checkpoint: each tensor's
version counter is recorded when the save is requested and compared once its copy is done (host
tensors once all of them are copied, CUDA tensors once their copies are complete), and a change
fails the save, naming the key. Where the stored tensor is part of a leaf (a DTensor's local shard, a tensor
subclass's inner tensor), the leaf's counter is compared too: changes made through the leaf
reach the part without counting on it.
"""

from __future__ import annotations

import bisect
import errno
import logging
import math
import operator
import os
import secrets
import time
import weakref
from concurrent import futures
from concurrent.futures import Executor
from typing import Callable, Sequence

import torch

from ..devices import CallerStreams, cuda_devices, host_register, host_unregister, on_stream, worker_device
from ..errors import SharedMemoryError, StateChangedError
from ..gcpause import gc_paused
from ..memory import host_empty
from ..storage.base import free_bytes
from .collect import Version, WriteItem, counters, versions_of
from .recollect import Snapshot

log = logging.getLogger(__name__)

_ALIGN = 64
_SHM = "/dev/shm"
Key = tuple[tuple[tuple[torch.dtype, tuple[int, ...]], ...], bool]  # each buffer's dtype and shape; pinned
_DTYPE_SHAPE = operator.attrgetter("dtype", "shape")
_IS_CUDA = operator.attrgetter("is_cuda")
_HAND_OVER_S = 0.0002  # long enough for a woken thread to take the interpreter lock


class BufferPool:
    """Host buffers for one structure's captured copies: one arena, allocated on first use (or by
    :meth:`reserve`), reused while the structure stays the same, released by :meth:`close` (or,
    for a pool dropped without it, when the pool is collected).

    ``pin_memory`` (default: when the state has CUDA tensors) pins the arena for every device, so
    device-to-host copies are fast and asynchronous; if pinning fails the pool says so in a
    warning and stays unpinned (copies are slower, not wrong). ``shared_memory`` puts the arena
    in shared memory (``/dev/shm``) for a writer process, and raises :class:`SharedMemoryError`
    there when it does not fit.
    ``allocations`` counts the arenas allocated so far; ``alloc_s`` is the last one's time.
    """

    def __init__(self, *, pin_memory: bool | None = None, shared_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self.shared_memory = shared_memory
        self._key: Key | None = None
        self._arena: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._unpin: weakref.finalize | None = None
        self.allocations = 0
        self.alloc_s = 0.0

    @property
    def nbytes(self) -> int:
        return 0 if self._arena is None else self._arena.numel()

    @property
    def allocated(self) -> bool:
        """Whether an arena is allocated (for the structure of the last save that used the pool)."""
        return self._key is not None

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the arena pinned in place (torch's pinned-memory statistics do not count them)."""
        return self.nbytes if self._unpin is not None else 0

    def buffers(self, items: Sequence[WriteItem]) -> list[torch.Tensor]:
        """One host tensor per item (same dtype and shape), reusing the arena when it fits."""
        tensors = [i.tensor for i in items]
        return self.buffers_for(tuple(map(_DTYPE_SHAPE, tensors)), cuda_devices(tensors))

    def buffers_for(self, shapes: tuple[tuple[torch.dtype, tuple[int, ...]], ...], devices: list[int]) -> list[torch.Tensor]:
        """One host tensor per (dtype, shape) of ``shapes``, for tensors on the CUDA ``devices``."""
        pin = bool(devices) if self.pin_memory is None else self.pin_memory
        key = (shapes, pin)
        if key != self._key:
            self._allocate(key, devices)
        return self._views

    def _allocate(self, key: Key, devices: list[int]) -> None:
        start = time.perf_counter()
        self.close()
        shapes, pin = key
        offsets, total = [], 0
        for dtype, shape in shapes:
            offsets.append(total)
            total += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        size = max(total, 1)
        arena = _shared_arena(size) if self.shared_memory else host_empty(size)
        arena.zero_()  # touch every page now: first-touch faults are slow, and belong to allocation
        if pin:
            self._pin(arena, devices)
        self._views = [arena[o:o + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
                       for o, (dtype, shape) in zip(offsets, shapes)]
        self._arena, self._key = arena, key
        self.allocations += 1
        self.alloc_s = time.perf_counter() - start
        log.debug("allocated a %d-byte capture pool in %.3f s", total, self.alloc_s)

    def _pin(self, arena: torch.Tensor, devices: list[int]) -> None:
        """Register the arena in place rather than take it from torch's pinned cache, which rounds
        sizes up to a power of two and keeps the memory after it is released. The finalizer
        holds the arena, so its pages are unpinned before they are freed (pages freed while
        pinned could come back at the same address, which CUDA then refuses to pin again)."""
        device = worker_device(torch.cuda.current_device(), devices)
        code = host_register(arena.data_ptr(), arena.numel(), device)
        if code:
            log.warning("could not pin the %d-byte capture pool (%s): device-to-host copies of asynchronous "
                        "saves will be slower", arena.numel(), torch.cuda.CudaError(code))
            return
        self._unpin = weakref.finalize(self, _unpin_arena, arena)
        self._unpin.atexit = False  # at exit the process's pages go anyway; CUDA may be shutting down

    def close(self) -> None:
        """Release the arena (unpinned and freed; allocated again on the next use). Call it once
        no copy into the arena is in flight."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self._arena, self._views, self._key = None, [], None


def _unpin_arena(arena: torch.Tensor) -> None:
    code = host_unregister(arena.data_ptr())
    if code:
        log.warning("could not unpin the capture pool (%s)", torch.cuda.CudaError(code))


def _shared_arena(nbytes: int) -> torch.Tensor:
    """``nbytes`` of shared memory that a writer process can map, as a uint8 tensor.

    Its pages are allocated here (``posix_fallocate``): on a full tmpfs, a mapping whose pages were
    never allocated kills the process with SIGBUS at the first touch, so a shortage must show now,
    as a :class:`SharedMemoryError`. The file is unlinked at once (the memory lives while mapped),
    so nothing is left in ``/dev/shm`` whatever happens next.
    """
    if nbytes > _shm_free():  # the cheap check first; the allocation below is the reliable one
        raise SharedMemoryError(_shortage(nbytes))
    name = os.path.join(_SHM, f"zerostall-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.unlink(name)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise
            raise SharedMemoryError(_shortage(nbytes)) from exc
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # maps a duplicate of fd
    finally:
        os.close(fd)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _shm_free() -> int:
    return free_bytes(_SHM)


def _shortage(nbytes: int) -> str:
    gib = -(-nbytes // (1 << 30))
    return (f"the capture buffers of this save need {nbytes} bytes ({nbytes / 2**20:.1f} MiB) of shared memory in "
            f"{_SHM}, which has {_shm_free()} bytes free; save without shared memory (AsyncSaver(writer=\"thread\"), "
            f"the default) or give {_SHM} more room (in Docker: docker run --shm-size={gib}g or more)")


class Captured:
    """Where one save's capture puts each tensor it copies, so that another save of the same step
    (another tier) reads them from host memory instead of copying them from the device again.
    Valid once that save is staged, until its buffers are reused by its saver's next save."""

    def __init__(self, sources: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        self._pairs: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = (sources, buffers)  # grouped
        # only if another save asks (most never do); the sources are held until then, so no other tensor can
        # take their memory and be mistaken for one of them
        self._regions: dict[tuple[torch.device, torch.dtype], list[tuple[int, int, torch.Tensor]]] = {}
        self._starts: dict[tuple[torch.device, torch.dtype], list[int]] = {}

    def _grouped(self) -> dict[tuple[torch.device, torch.dtype], list[tuple[int, int, torch.Tensor]]]:
        if self._pairs is not None:
            sources, buffers = self._pairs
            regions: dict[tuple[torch.device, torch.dtype], list[tuple[int, int, torch.Tensor]]] = {}
            for source, buf in zip(sources, buffers):
                if source.numel() and source.is_contiguous():
                    regions.setdefault((source.device, source.dtype), []).append((source.data_ptr(), source.numel(), buf))
            self._regions = {key: sorted(found, key=lambda r: r[0]) for key, found in regions.items()}
            self._starts = {key: [r[0] for r in found] for key, found in self._regions.items()}
            self._pairs = None
        return self._regions

    def view_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The captured copy of ``t`` (a contiguous tensor whose bytes lie inside one captured
        tensor's), or None."""
        key = (t.device, t.dtype)
        regions = self._grouped()
        if not t.numel() or not t.is_contiguous() or key not in regions:
            return None
        at = bisect.bisect_right(self._starts[key], t.data_ptr()) - 1
        if at < 0:
            return None
        start, numel, buf = regions[key][at]
        offset, rest = divmod(t.data_ptr() - start, t.element_size())
        if rest or offset + t.numel() > numel:
            return None
        return buf.view(-1)[offset:offset + t.numel()].view(t.shape)

    def take(self, items: Sequence[WriteItem], recorded: list[Version]) -> int:
        """Point each item found here at its captured copy, which :func:`capture` then copies from
        host memory with no version check (the first capture made it); returns how many were."""
        found = 0
        for n, item in enumerate(items):
            view = self.view_of(item.tensor)
            if view is not None:
                item.tensor, recorded[n] = view, None
                found += 1
        return found


def record_caller_stream(items: Sequence[WriteItem]) -> CallerStreams | None:
    """Where the caller's CUDA work stands on each device the items are on (an event on its
    current stream of each), recorded in the caller's thread at the save; None without CUDA items."""
    return CallerStreams.of(i.tensor for i in items)


def capture(items: Sequence[WriteItem], buffers: Sequence[torch.Tensor], ready: CallerStreams | None,
            recorded: Sequence[Version]) -> None:
    """Copy every item's tensor into its buffer and make the item point at the copy; raise
    :class:`StateChangedError` if a tensor changed since ``recorded`` (its version at the save)
    before its copy was complete (see :func:`copy_checked`)."""
    copy_checked([i.tensor for i in items], buffers, ready, recorded, [i.watch for i in items],
                 lambda n: items[n].entry.fqn)
    for item, buf in zip(items, buffers):
        item.tensor = buf
        item.watch = None  # the captured copy is all a writer needs (a writer process gets the items pickled)


@gc_paused()  # a tuple per tensor: no cyclic collections over the process meanwhile
def copy_first(snap: Snapshot, pool: BufferPool, ready: CallerStreams | None, helper: Executor
               ) -> tuple[list[torch.Tensor], list[Version], list[torch.Tensor]] | None:
    """Copy the tensor leaves of a snapshot into ``pool`` before collecting it, when the last
    collection still describes them (:meth:`~zerostall.saving.recollect.Snapshot.matches`), so the
    caller may change the state sooner: the leaves, their recorded versions and their copies; None
    when it does not. The leaves are copied as they are: a copy resolves views, conjugation and
    negation, and needs no detaching. Host leaves are copied on ``helper`` while the fingerprints
    are compared here (the copy leaves the interpreter free), the copy kept only if they match."""
    if snap.template.on_cuda:
        if not snap.matches():
            return None
        buffers = pool.buffers_for(snap.template.shapes, ready.devices if ready is not None else [])
        recorded = snap.recorded()
        copy_checked(snap.tensors, buffers, ready, recorded, None, snap.name)
        return snap.tensors, recorded, buffers
    buffers = pool.buffers_for(snap.template.shapes, [])
    recorded = snap.recorded()
    copying = helper.submit(_copy_host, buffers, snap.tensors)
    hand_over()  # the helper enters the copy now, not after the comparison's first switch interval
    try:
        matched = snap.matches()
    finally:
        futures.wait([copying])  # no copy may still land in the buffers once this returns
    if not matched:
        return None
    copying.result()
    _check(range(len(buffers)), snap.tensors, None, recorded, snap.name)
    return snap.tensors, recorded, buffers


def hand_over() -> None:
    """Step aside for a moment, so a thread just woken or given work takes the interpreter lock now
    rather than after the interpreter's switch interval."""
    time.sleep(_HAND_OVER_S)


def _copy_host(buffers: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    with torch.no_grad():
        torch._foreach_copy_(buffers, sources)


def copy_checked(sources: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], ready: CallerStreams | None,
                 recorded: Sequence[Version], watches: Sequence[torch.Tensor | None] | None, name: Callable[[int], str]
                 ) -> None:
    """Copy each source into its buffer; raise :class:`StateChangedError` naming ``name(n)`` if
    source ``n`` (or the leaf ``watches[n]`` it is part of, when given) changed since its version
    ``recorded[n]`` (None: not checked) before its copy was complete. Runs in a worker thread:
    ``ready`` gives it the device to make current and the caller's streams to wait for. Host
    tensors are copied in one call (a state may hold 100,000 small ones) and checked once all are."""
    on_cuda = list(map(_IS_CUDA, sources))
    check_devices([t for t, on in zip(sources, on_cuda) if on], ready)
    streams = {}
    if ready is not None:
        ready.enter()
        streams = {device: ready.side_stream(device) for device in ready.devices}
    cuda = [n for n, on in enumerate(on_cuda) if on] if any(on_cuda) else []
    host = [n for n, on in enumerate(on_cuda) if not on] if cuda else range(len(sources))
    try:
        with torch.no_grad():
            for n in cuda:
                stream = streams[sources[n].device.index]
                with on_stream(stream):
                    buffers[n].copy_(sources[n], non_blocking=True)
                sources[n].record_stream(stream)
            if host:
                torch._foreach_copy_([buffers[n] for n in host], [sources[n] for n in host])
            _check(host, sources, watches, recorded, name)
    finally:
        if ready is not None:
            ready.synchronize()  # also when a check failed: no copy may still land in a reused buffer
    _check(cuda, sources, watches, recorded, name)


def check_devices(tensors: Sequence[torch.Tensor], ready: CallerStreams | None) -> None:
    """Refuse to copy from a CUDA device the save did not record the caller's streams on: a tensor
    that moved there after the save was requested (its data replaced through ``.data``)."""
    moved = set(cuda_devices(tensors)) - set(ready.devices if ready is not None else ())
    if moved:
        raise StateChangedError(
            f"a tensor of the state moved to cuda:{min(moved)} while an asynchronous save was capturing it, so the "
            "checkpoint could hold values from after the save; the save was not committed. Call wait_staged() on "
            "the saver (or the handle) before changing the state after an asynchronous save")


def _check(which: Sequence[int], sources: Sequence[torch.Tensor], watches: Sequence[torch.Tensor | None] | None,
           recorded: Sequence[Version], name: Callable[[int], str]) -> None:
    """Raise if a source among ``which`` changed since its version ``recorded``, naming the first."""
    picked, then = [sources[n] for n in which], [recorded[n] for n in which]
    if watches is None and counters(picked) == [v if v is None else v[0] for v in then]:
        return  # no leaf watched: the counters alone say it (ints, no tuple a tensor)
    now = versions_of(picked, None if watches is None else [watches[n] for n in which])
    if now == then:
        return
    for n, current in zip(which, now):
        if recorded[n] is not None and current != recorded[n]:
            raise StateChangedError(
                f"{name(n)} was changed in place while an asynchronous save was capturing it, so the checkpoint "
                "would mix values from before and after the change; the save was not committed. Call "
                "wait_staged() on the saver (or the handle) before changing the state after an asynchronous save")
