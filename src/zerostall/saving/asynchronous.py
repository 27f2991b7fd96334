"""Asynchronous saving: return once the save is enqueued; capture and persist in the background.

An :class:`AsyncSaver` owns a reused buffer pool and one background worker, so one save is in
flight at a time. The worker captures in a thread; it persists in that thread (``writer="thread"``:
writes and hashing release the GIL) or hands the captured shared-memory buffers to a persistent
spawned process (``writer="process"``) that finishes the commit even if the training process dies.
Threads are the default (bench/async_save.py compares the two): no shared memory to allocate and
no process to spawn; choose the process for crash survival. ``save`` runs the collective part
(planning) in the caller's thread, records where the caller's CUDA stream is, and returns a
:class:`SaveHandle` whose ``staged`` future is done when the state has been copied (the caller may
mutate it from then on) and whose ``committed`` future is done when the checkpoint is durable and
visible. A background failure is raised on ``committed.result()``; a failure nobody has seen there
is raised once more, on the next ``save``, ``wait`` or ``close``. In one process, a later save of a
structure saved before does less in the caller's thread: it walks the state, records the version
counters and encodes the python values; the worker copies the tensors, and then collects and plans
(see :class:`~zerostall.saving.pipeline.Deferred`).

At interpreter exit (the end of the script, an exception escaping it, ``sys.exit``, Ctrl-C) every
saver not closed is closed: the save in flight commits first, a failure is logged, and the writer
process is told to stop, so the exit never waits for a writer that waits for more work.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import weakref
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import torch

from ..collectives import Group
from ..devices import CallerStreams
from ..errors import CheckpointError
from ..gcpause import gc_paused
from ..options import SaveOptions
from ..storage import Storage
from .capture import BufferPool, Captured, capture, copy_first, hand_over, record_caller_stream
from .collect import Version, versions
from .handles import SaveHandle
from .incremental import Reuse
from .pipeline import Deferred, Prepared, SaveInfo, abandon, for_writer_process, persist, prepare, request
from .recollect import CollectCache
from .writer_process import WriterProcess

log = logging.getLogger(__name__)


class AsyncSaver:
    """Owns the capture buffers and the background writer of asynchronous saves.

    ``if_busy="wait"`` makes a new save wait for the previous one to commit; ``"skip"`` returns
    ``None`` instead while one is in flight (on any rank: the ranks skip together). ``pin_memory``/``shared_memory`` configure the
    buffer pool (see :class:`zerostall.saving.capture.BufferPool`). ``drain_on_signals`` (e.g.
    ``[signal.SIGTERM]``, from the main thread) lets the save in flight commit before the signal
    takes its previous course, so a job stopped by its scheduler keeps its last checkpoint.
    """

    def __init__(self, *, pin_memory: bool | None = None, shared_memory: bool = False,
                 if_busy: str = "wait", writer: str = "thread", drain_on_signals: Sequence[int] = ()) -> None:
        if if_busy not in ("wait", "skip"):
            raise ValueError(f"if_busy must be 'wait' or 'skip', not {if_busy!r}")
        if writer not in ("thread", "process"):
            raise ValueError(f"writer must be 'thread' or 'process', not {writer!r}")
        self.pool = BufferPool(pin_memory=pin_memory, shared_memory=shared_memory or writer == "process")
        self._process = WriterProcess() if writer == "process" else None
        self.if_busy = if_busy
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerostall-async")
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerostall-copy")  # see copy_first
        self.collections = CollectCache()
        """The last save's structure: the next save of the same structure collects from it."""
        self._current: SaveHandle | None = None
        self._failure: tuple[BaseException, SaveHandle] | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._hooks: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
        self._previous_handlers = {sig: signal.signal(sig, self._drain_then_deliver) for sig in drain_on_signals}
        self._pid = os.getpid()  # its threads and writer process are this process's: a forked child has none
        _open_savers.add(self)

    def _drain_then_deliver(self, signum: int, frame: Any) -> None:
        """Wait for the save in flight, then let the signal do what it did before we came."""
        log.warning("signal %d: finishing the checkpoint in flight first", signum)
        current = self._current
        if current is not None:
            futures.wait([current.committed])  # a failure is logged by the worker and raised later
        previous = self._previous_handlers.pop(signum, signal.SIG_DFL)
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)

    def save(self, state: Any, path: str | os.PathLike[str] | Storage, options: SaveOptions | None = None, *,
             process_group: Any = None, step: int | None = None, metadata: Mapping[str, Any] | None = None,
             share: SaveHandle | None = None, reuse: Reuse | None = None, **overrides: Any) -> SaveHandle | None:
        """Start saving ``state`` (collective when distributed); the arguments are those of
        :func:`zerostall.save`. Returns None when skipped (``if_busy="skip"``). ``share``: another
        saver's save of the same tensors (another tier's), whose captured copies this one copies
        from host memory once that one is staged, instead of from the device. ``reuse``: an
        incremental save's chunks to refer to where unchanged (see :mod:`zerostall.saving.incremental`)."""
        if self._closed:
            raise CheckpointError("this AsyncSaver is closed")
        if os.getpid() != self._pid:
            raise CheckpointError(f"this AsyncSaver belongs to process {self._pid}, which this one was forked from "
                                  "(its worker threads are not here): make a new AsyncSaver in this process")
        options = SaveOptions.of(options, overrides)
        if self.if_busy == "wait" and self._current is not None:  # done on every rank before the check of
            futures.wait([self._current.committed])  # failures: one arriving later would be raised by one rank
        if self._ranks_refuse_or_skip(process_group, path):
            log.info("skipping the save to %s: a save is still in flight", path)
            return None
        if self._current is not None:  # done: waited for above, or done on every rank (else skipped)
            self._current.captured = None  # its buffers are this save's now (or freed, for another structure)
        asked, buffers, ready, recorded = self._ask(state, path, options, process_group, step, metadata, reuse)
        handle = SaveHandle(asked.storage.location, asked.step)
        self._current = handle
        self._worker.submit(self._run, asked, buffers, ready, recorded, handle, share)
        return handle

    @gc_paused()  # the caller waits: no cyclic collections over the per-leaf objects (and none paused once the
    # worker starts, so the caller never waits for the worker at the pause's lock on its way out)
    def _ask(self, state: Any, path: Any, options: SaveOptions, process_group: Any, step: int | None,
             metadata: Mapping[str, Any] | None, reuse: Reuse | None
             ) -> tuple[Prepared | Deferred, list[torch.Tensor] | None, CallerStreams | None, list[Version] | None]:
        """The caller's part of a save: the request, and what the worker needs with it."""
        asked = request(state, path, options, process_group=process_group, step=step, metadata=metadata,
                        cache=self.collections, reuse=reuse, defer=self.pool.allocated)  # the buffers of a
        # structure are allocated here, in the caller's thread: a shortage of memory is raised by save()
        try:
            if isinstance(asked, Deferred):  # collected and planned in the worker, from a snapshot taken here
                self.hold_steps(asked.snapshot.optimizers)
                devices = asked.snapshot.devices
                return asked, None, CallerStreams(devices) if devices else None, None
            self.hold_steps(asked.collected.optimizers)
            recorded = versions(asked.items) if asked.versions is None else asked.versions
            return asked, self.pool.buffers(asked.items), record_caller_stream(asked.items), recorded
        except BaseException as exc:
            abandon(asked, exc)
            raise

    def hold_steps(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Make each optimizer's ``step()`` wait for the capture of the save in flight (a step
        pre-hook, once per optimizer and saver, kept until :meth:`close`), so a forgotten
        ``wait_staged()`` cannot tear the checkpoint; after the capture it costs one check. Saves
        do this for the optimizers in their state; a caller saving a view of the state names them."""
        for optimizer in optimizers:
            if optimizer not in self._hooks:
                hook = functools.partial(_before_step, weakref.ref(self))
                self._hooks[optimizer] = optimizer.register_step_pre_hook(hook)

    def _await_capture(self) -> None:
        """Wait until the save in flight (if any) has captured the state, whatever its outcome (a
        failure is raised by the save's handle, the next save or close, not by the optimizer)."""
        current = self._current
        if current is not None and not current.staged.done():
            futures.wait([current.staged])

    def _ranks_refuse_or_skip(self, process_group: Any, path: Any) -> bool:
        """Raise an earlier save's failure not yet seen, on every rank if any rank has one (a rank
        that raised alone would leave the others waiting in the save's collectives); then whether
        to skip (``if_busy="skip"`` and a save in flight on any rank). When distributed, one small
        all-reduce: each rank finishes a save at its own moment (rank 0 commits, the others see the
        commit) and sees a failure where its caller looks, so their own answers can differ."""
        unseen = self._take_unseen()
        busy = self.if_busy == "skip" and self._current is not None and not self._current.done()
        group = Group(process_group)
        failed, busy_anywhere = group.all_reduce_ints([int(unseen is not None), int(busy)]) if group.size > 1 \
            else (0, busy)
        if unseen is not None:
            raise _previous_failed(unseen)
        if failed:
            raise CheckpointError(f"a previous asynchronous save failed on {failed} other rank(s) (their errors say "
                                  f"why), so the save to {path} was not started on any rank")
        return busy_anywhere > 0

    def reserve(self, state: Any, options: SaveOptions | None = None, *, process_group: Any = None,
                **overrides: Any) -> float:
        """Allocate the buffer pool for ``state``'s structure now (collective when distributed), so
        the first save costs no more than the rest; returns the seconds spent (0 when the pool
        already fits). Reserve with the structure you will save: an optimizer's state appears only
        after its first step. Waits for the save in flight first, whose copies and writes may still
        use the buffers (its failure stays for that save's handle, the next save or close)."""
        if self._current is not None:  # first: its worker may still be collecting through the cache
            futures.wait([self._current.committed])
        prepared = prepare(state, os.devnull, SaveOptions.of(options, overrides), process_group=process_group,
                           cache=self.collections)
        allocations = self.pool.allocations
        self.pool.buffers(prepared.items)
        return self.pool.alloc_s if self.pool.allocations != allocations else 0.0

    def _run(self, asked: Prepared | Deferred, buffers: list[Any] | None, ready: CallerStreams | None,
             recorded: list[Any] | None, handle: SaveHandle, share: SaveHandle | None) -> None:
        try:
            reusable = type(asked) is Deferred and not share
            copied = copy_first(asked.snapshot, self.pool, ready, self._copier) if reusable else None
            if copied is not None:
                sources, recorded, buffers = copied
                handle.captured = Captured(sources, buffers)
                if self._process is None:  # the copies are all a thread writer needs: the caller may go on
                    _wake(handle.staged)
                asked, recorded = asked.prepare(buffers, recorded)
            else:
                if isinstance(asked, Deferred):
                    asked, recorded = asked.prepare()
                    buffers = self.pool.buffers(asked.items)
                assert buffers is not None and recorded is not None
                sources = [i.tensor for i in asked.items]
                if share is not None:
                    share.lend(asked.items, recorded)
                capture(asked.items, buffers, ready, recorded)
                handle.captured = Captured(sources, buffers)
        except BaseException as exc:
            abandon(asked, exc)
            self._fail(handle, exc, staged=not handle.staged.done())
            return
        prepared = asked
        try:
            if self._process is not None:
                self._replace_dead_writer()
                self._process.submit(for_writer_process(prepared))  # before `staged`: a crash now loses nothing
                _wake(handle.staged)
                handle.committed.set_result(self._process.result())
            else:
                if not handle.staged.done():
                    _wake(handle.staged)
                handle.committed.set_result(persist(prepared))
        except BaseException as exc:
            if not handle.staged.done():  # handed to no writer: this rank's part was never written
                abandon(prepared, exc)
            self._fail(handle, exc, staged=not handle.staged.done())

    def _replace_dead_writer(self) -> None:
        """Start a new writer process if the last one died (killed by the OOM killer, say): one
        lost save is reported, not every later one."""
        assert self._process is not None
        if not self._process.alive:
            log.warning("the writer process died (exit code %s); starting a new one", self._process.exitcode)
            self._process.close()
            self._process = WriterProcess()

    def _fail(self, handle: SaveHandle, exc: BaseException, *, staged: bool) -> None:
        log.error("asynchronous save to %s failed: %s", handle.path, exc)
        with self._lock:
            self._failure = (exc, handle)
        if staged:
            handle.staged.set_exception(exc)
        handle.committed.set_exception(exc)

    def _take_unseen(self) -> BaseException | None:
        """The failure of a save in the background that its handle has not raised, taken (it is
        raised once)."""
        with self._lock:
            failure, self._failure = self._failure, None
        if failure is not None:
            failure[1].committed.settle()  # a done callback may see it first
        if failure is None or failure[1].failure_seen:
            return None
        failure[1].committed.seen = True
        return failure[0]

    def _raise_failure(self) -> None:
        """Raise the failure of a save in the background, once, unless its handle already did."""
        unseen = self._take_unseen()
        if unseen is not None:
            raise _previous_failed(unseen)

    def wait_staged(self) -> None:
        """Block until the save in flight (if any) has captured the state; raises its failure
        unless its handle already did."""
        self._settle(lambda current: current.staged.unseen_result())

    def wait(self) -> SaveInfo | None:
        """Block until the save in flight (if any) commits; raises its failure unless its handle
        already did."""
        return self._settle(lambda current: current.committed.unseen_result())

    def await_done(self) -> None:
        """Block until the save in flight (if any) is done, committed or failed, without raising:
        its failure stays for its handle, the next save, :meth:`wait` or :meth:`close`."""
        if self._current is not None:
            futures.wait([self._current.committed])

    def _settle(self, wait: Any) -> Any:
        current = self._current
        if current is None:
            return None
        try:
            return wait(current)
        except BaseException:
            if current.failure_seen:
                return None
            self._raise_failure()
            raise

    def close(self) -> None:
        """Finish the save in flight, free the buffers, stop the worker; raises a pending failure.
        In a process forked from its owner it only closes this process's copy (the owner's save
        and writer process go on)."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True
            return
        try:
            self.wait()
            self._raise_failure()
        finally:
            self._closed = True
            _open_savers.discard(self)
            self._worker.shutdown(wait=True)
            self._copier.shutdown(wait=True)
            if self._process is not None:
                self._process.close()
            self.pool.close()
            for hook in list(self._hooks.values()):
                hook.remove()
            self._hooks.clear()
            for sig, previous in self._previous_handlers.items():
                signal.signal(sig, previous)
            self._previous_handlers.clear()

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _previous_failed(exc: BaseException) -> CheckpointError:
    """The error a later call raises for an earlier save's failure that nobody has seen."""
    error = CheckpointError(f"a previous asynchronous save failed: {exc}")
    error.__cause__ = exc
    return error


_open_savers: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()
os.register_at_fork(after_in_child=_open_savers.clear)  # a forked child exits without the parent's saves


def close_at_exit() -> None:
    """Close every saver still open. Called at interpreter exit by the threading exit hook that
    ``import zerostall`` registers (see ``zerostall/__init__.py``), which runs before
    ``multiprocessing`` joins its children (a writer process waiting for its next job)."""
    for saver in list(_open_savers):
        try:
            saver.close()
        except BaseException as exc:  # at exit there is no caller left to raise to
            log.error("asynchronous save failed at exit: %s", exc)


def _before_step(saver: weakref.ref[AsyncSaver], optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """An optimizer step pre-hook: wait for the capture of ``saver``'s save in flight."""
    live = saver()
    if live is not None:
        live._await_capture()


def _wake(staged: Future[None]) -> None:
    """Mark the capture done, and let the trainer waiting on it (in ``wait_staged``) go on before
    this worker goes on with the Python work of the write."""
    staged.set_result(None)
    hand_over()
