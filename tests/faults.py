"""Fault injection through the storage interface: a :class:`FaultyStorage` wraps any backend and
fails, blocks, calls back or crashes at a named operation. Tests that inject faults this way keep
injecting them however the library's code is moved between modules (patching a module attribute
silently stops doing anything once the code no longer looks the attribute up there). A
:class:`GatedLocalStorage` holds the writer process of ``AsyncSaver(writer="process")``, which a
FaultyStorage cannot reach, before its writes; a :class:`CommitHeldByLock` holds any process's
commits into a local directory until another process lets go of a lock or dies.
"""

from __future__ import annotations

import copy
import fcntl
import fnmatch
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from zerostall.storage import FileStat, LocalStorage, Storage

GATE_TIMEOUT = 120.0  # a gate nobody opens fails the test instead of hanging it (not a timing bound)
POINTS = ("before", "after", "before_replace")  # before the inner call, after it returned, at the switch


@dataclass(eq=False)
class Fault:
    """One injected fault: the calls it applies to, where in them it acts and what it does.
    ``count`` says how often it acted and ``fired`` is set the first time (before it acts), so a
    test can assert that its fault happened and wait for the moment it does."""

    op: str
    action: Callable[[str, str, str], None]  # called with (op, name, where it fires)
    name: str | Callable[[str], bool] | None
    from_call: int
    times: int | None
    at: str
    after_bytes: int | None
    seen: int = 0  # calls that matched op and name
    claimed: int = 0  # calls it was armed for (from the from_call-th on, at most ``times``)
    count: int = 0
    fired: threading.Event = field(default_factory=threading.Event)

    def _claims(self, op: str, name: str) -> bool:
        """Whether this call is one the fault acts on (called under the storage's lock)."""
        if op != self.op or not self._names(name):
            return False
        self.seen += 1
        if self.seen < self.from_call or (self.times is not None and self.claimed >= self.times):
            return False
        self.claimed += 1
        return True

    def _names(self, name: str) -> bool:
        if self.name is None:
            return True
        return self.name(name) if callable(self.name) else fnmatch.fnmatchcase(name, self.name)

    def _fire(self, lock: threading.Lock, name: str, where: str) -> None:
        with lock:
            self.count += 1
        self.fired.set()
        self.action(self.op, name, where)


class FaultyStorage(Storage):
    """A storage that delegates every operation to ``inner`` and applies the faults added to it.

    Operations are the names of the :class:`Storage` methods (``"write"``, ``"publish"``,
    ``"delete"``, ``"read_into"``, ``"read_into_many"``, ``"create"``, ``"list"``, ...); the name a
    fault matches is the file's (``publish``: the final name, not the temporary one; ``""`` for
    ``create``, ``exists``, ``list`` and ``close``). ``calls`` records every ``(op, name)`` seen.
    """

    def __init__(self, inner: Storage, *, parent: FaultyStorage | None = None, prefix: str = "") -> None:
        self.inner = inner
        self.location = inner.location
        self.remote, self.read_grid = inner.remote, inner.read_grid
        self.requests_in_flight = inner.requests_in_flight
        self._prefix = prefix
        if parent is None:
            self.calls: list[tuple[str, str]] = []
            self._faults: list[Fault] = []
            self._lock = threading.Lock()
        else:  # a sub-location: the parent's faults apply, its log records
            self.calls, self._faults, self._lock = parent.calls, parent._faults, parent._lock

    # -- adding faults -------------------------------------------------------------------------
    def fail(self, op: str, error: BaseException, *, name: str | Callable[[str], bool] | None = None,
             from_call: int = 1, times: int | None = None, at: str = "before",
             after_bytes: int | None = None) -> Fault:
        """Raise (a copy of) ``error``.

        The fault applies to calls of ``op`` whose file name matches ``name`` (a glob or a
        predicate; None: every call), from the ``from_call``-th such call on, at most ``times``
        calls (None: all). It acts ``at`` "before" the inner call, "after" it returned (its effect
        is then done: e.g. the manifest switched) or, for ``publish``, at "before_replace" (the
        temporary file is written, the switch not made). For ``write``, ``after_bytes=K`` acts in
        the stream of parts once the inner write has taken exactly ``K`` bytes (a partly written
        file, like a disk filling up)."""
        return self._add(op, lambda op, name, where: _raise(error), name, from_call, times, at, after_bytes)

    def block(self, op: str, gate: threading.Event, *, name: str | Callable[[str], bool] | None = None,
              from_call: int = 1, times: int | None = None, at: str = "before",
              after_bytes: int | None = None) -> Fault:
        """Wait until ``gate`` is set (a slow operation); where and when as for :meth:`fail`."""
        def wait(op: str, name: str, where: str) -> None:
            if not gate.wait(GATE_TIMEOUT):
                raise TimeoutError(f"faults: the gate at {where} was never opened")

        return self._add(op, wait, name, from_call, times, at, after_bytes)

    def call(self, op: str, hook: Callable[[str, str], None], *, name: str | Callable[[str], bool] | None = None,
             from_call: int = 1, times: int | None = None, at: str = "before",
             after_bytes: int | None = None) -> Fault:
        """Call ``hook(op, name)`` (run another save at that instant, say); what it raises
        propagates. Where and when as for :meth:`fail`."""
        return self._add(op, lambda op, name, where: hook(op, name), name, from_call, times, at, after_bytes)

    def crash(self, op: str, *, name: str | Callable[[str], bool] | None = None, from_call: int = 1,
              times: int | None = None, at: str = "before", after_bytes: int | None = None) -> Fault:
        """SIGKILL this process (for crash tests in a child process), after writing
        ``faults: SIGKILL at <where>`` to stderr. Where and when as for :meth:`fail`."""
        return self._add(op, _kill, name, from_call, times, at, after_bytes)

    def _add(self, op: str, action: Callable[[str, str, str], None], name: str | Callable[[str], bool] | None,
             from_call: int, times: int | None, at: str, after_bytes: int | None) -> Fault:
        if not callable(getattr(Storage, op, None)) or op.startswith("_"):
            raise ValueError(f"no storage operation {op!r}")
        if at not in POINTS or (at == "before_replace" and op != "publish"):
            raise ValueError(f"a fault on {op} cannot act at {at!r}")
        if after_bytes is not None and (op != "write" or at != "before"):
            raise ValueError("after_bytes is for write faults only (and replaces `at`)")
        fault = Fault(op, action, name, from_call, times, at, after_bytes)
        with self._lock:
            self._faults.append(fault)
        return fault

    def names(self, op: str) -> list[str]:
        """The names of the calls of ``op`` seen so far, in order."""
        with self._lock:
            return [name for o, name in self.calls if o == op]

    # -- applying them ---------------------------------------------------------------------------
    def _enter(self, op: str, name: str) -> list[Fault]:
        """Record the call and pick the faults that act on it (one lock: a consistent call count)."""
        with self._lock:
            self.calls.append((op, name))
            return [f for f in self._faults if f._claims(op, name)]

    def _at(self, faults: list[Fault], point: str, op: str, name: str) -> None:
        for fault in faults:
            if fault.at == point and fault.after_bytes is None:
                fault._fire(self._lock, name, f"{point} {op} of {name}")

    def _stream(self, parts: Iterable[memoryview], faults: list[Fault], name: str) -> Iterator[memoryview]:
        """``parts``, cut so that each fault acts once the consumer has taken exactly its bytes."""
        pending = sorted(faults, key=lambda f: f.after_bytes or 0)
        done = 0

        def fire_due() -> None:
            while pending and (pending[0].after_bytes or 0) <= done:
                pending.pop(0)._fire(self._lock, name, f"write of {name} after {done} bytes")

        fire_due()
        for part in parts:
            while len(part):
                cut = min(len(part), (pending[0].after_bytes or 0) - done) if pending else len(part)
                yield part[:cut]
                done += cut
                part = part[cut:]
                fire_due()

    # -- the Storage interface, delegated ----------------------------------------------------
    def _run(self, op: str, name: str, call: Callable[[], Any]) -> Any:
        """Record the call of ``op`` on ``name``, act "before", make the inner call, act "after"."""
        name = self._prefix + name
        faults = self._enter(op, name)
        self._at(faults, "before", op, name)
        result = call()
        self._at(faults, "after", op, name)
        return result

    def create(self) -> None:
        self._run("create", "", self.inner.create)

    def exists(self) -> bool:
        return self._run("exists", "", self.inner.exists)

    def list(self) -> list[str]:
        return self._run("list", "", self.inner.list)

    def child(self, name: str) -> FaultyStorage:
        """The wrapped sub-location: it shares this wrapper's faults and call log, and the names it
        reports are ``"<name>/<file>"`` (so one fault can target a file of a checkpoint under a root)."""
        return self._run("child", name, lambda: FaultyStorage(self.inner.child(name), parent=self,
                                                              prefix=f"{self._prefix}{name}/"))

    def parent(self) -> FaultyStorage:
        """The wrapped location one level up (a checkpoint's root): faults and log shared."""
        up = self._prefix.rstrip("/").rpartition("/")[0]
        return self._run("parent", "", lambda: FaultyStorage(self.inner.parent(), parent=self,
                                                             prefix=f"{up}/" if up else ""))

    def sibling(self, name: str) -> FaultyStorage:
        """Through :meth:`parent` and :meth:`child`, both wrapped."""
        return self.parent().child(name)

    def children(self) -> list[str]:
        return self._run("children", "", self.inner.children)

    def links(self) -> list[str]:
        return self._run("links", "", self.inner.links)

    def size(self, name: str) -> int:
        return self._run("size", name, lambda: self.inner.size(name))

    def sizes(self) -> dict[str, int] | None:
        return self._run("sizes", "", self.inner.sizes)

    def stat(self, name: str) -> FileStat:
        return self._run("stat", name, lambda: self.inner.stat(name))

    def write(self, name: str, parts: Iterable[memoryview]) -> int:
        full = self._prefix + name
        faults = self._enter("write", full)
        self._at(faults, "before", "write", full)
        streamed = [f for f in faults if f.after_bytes is not None]
        result = self.inner.write(name, self._stream(parts, streamed, full) if streamed else parts)
        self._at(faults, "after", "write", full)
        return result

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._run("read_into", name, lambda: self.inner.read_into(name, offset, out))

    def read_into_many(self, name: str, offset: int, outs: list[memoryview]) -> None:
        self._run("read_into_many", name, lambda: self.inner.read_into_many(name, offset, outs))

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        return self._run("read_bytes", name, lambda: self.inner.read_bytes(name, limit))

    def read_head(self, name: str, n: int) -> bytes:
        return self._run("read_head", name, lambda: self.inner.read_head(name, n))

    def publish(self, name: str, tmp_name: str, data: bytes,
                before_replace: Callable[[], None] | None = None) -> None:
        full = self._prefix + name
        faults = self._enter("publish", full)
        self._at(faults, "before", "publish", full)

        def at_the_switch() -> None:  # the faults first, then the caller's last-moment check
            self._at(faults, "before_replace", "publish", full)
            if before_replace is not None:
                before_replace()

        self.inner.publish(name, tmp_name, data, at_the_switch)
        self._at(faults, "after", "publish", full)

    def put(self, name: str, data: bytes) -> None:
        """Through this wrapper's own ``publish``, so faults on "publish" reach small files too."""
        self._run("put", name, lambda: Storage.put(self, name, data))

    def create_exclusive(self, name: str, data: bytes) -> bool:
        return self._run("create_exclusive", name, lambda: self.inner.create_exclusive(name, data))

    def delete(self, name: str) -> None:
        self._run("delete", name, lambda: self.inner.delete(name))

    def delete_tree(self, name: str) -> None:
        self._run("delete_tree", name, lambda: self.inner.delete_tree(name))

    def move(self, src: str, dst: str) -> None:
        self._run("move", src, lambda: self.inner.move(src, dst))

    def abort_uploads(self, name: str = "", which: Callable[[str], bool] | None = None) -> int:
        return self._run("abort_uploads", name, lambda: self.inner.abort_uploads(name, which))

    def memory_map(self, name: str) -> memoryview | None:
        return self._run("memory_map", name, lambda: self.inner.memory_map(name))

    def close(self) -> None:
        self._run("close", "", self.inner.close)


class GatedLocalStorage(LocalStorage):
    """A local storage that travels to the writer process of ``AsyncSaver(writer="process")`` (which
    takes only local storage) with one end of a pipe: before each data file's write it sends
    ``"held"`` through ``gate`` and waits for any message back, so the test decides when (and
    whether) the writer goes on."""

    def __init__(self, root: str, gate: Connection | None = None, *, fsync: bool = True) -> None:
        super().__init__(root, fsync=fsync)
        self.gate = gate

    def __getstate__(self) -> dict[str, object]:
        return {**super().__getstate__(), "gate": self.gate}

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        self.gate = state["gate"]  # type: ignore[assignment]

    def write(self, name: str, parts: Iterable[memoryview]) -> int:
        if self.gate is not None and name.endswith(".safetensors"):
            self.gate.send("held")
            if not self.gate.poll(GATE_TIMEOUT):
                raise TimeoutError(f"faults: the gate before the write of {name} was never opened")
            self.gate.recv()
        return super().write(name, parts)


class CommitHeldByLock(LocalStorage):
    """A local directory whose manifest switch waits until it can take an exclusive ``flock`` on the
    file ``lock``: a process holding that lock holds every commit into the directory back until it
    lets go or dies (the kernel releases it then), whichever process commits. A writer process
    gets it by pickle, path and lock file name, as it gets a :class:`LocalStorage`, which
    :class:`FaultyStorage` is not."""

    def __init__(self, root: str, *, lock: str, fsync: bool = True) -> None:
        super().__init__(root, fsync=fsync)
        self.lock = lock

    def __getstate__(self) -> dict[str, object]:
        return {**super().__getstate__(), "lock": self.lock}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(str(state["location"]), lock=str(state["lock"]), fsync=bool(state["fsync"]))

    def publish(self, name: str, tmp_name: str, data: bytes,
                before_replace: Callable[[], None] | None = None) -> None:
        if name == "manifest.json":
            with open(self.lock, "rb") as held:
                fcntl.flock(held, fcntl.LOCK_EX)  # let go when the file closes, right after the switch
                super().publish(name, tmp_name, data, before_replace)
            return
        super().publish(name, tmp_name, data, before_replace)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` (another process's state, say) until it holds; one that never does fails
    the test after ``GATE_TIMEOUT`` instead of hanging it."""
    deadline = time.monotonic() + GATE_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _raise(error: BaseException) -> None:
    raise copy.copy(error)  # a fresh instance per call: threads raising it do not share a traceback


def _kill(op: str, name: str, where: str) -> None:
    sys.stderr.write(f"faults: SIGKILL at {where}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


_UNDELEGATED = sorted(m for m, v in vars(Storage).items()
                      if callable(v) and not m.startswith("_") and m not in vars(FaultyStorage))
if _UNDELEGATED:  # an optional method added to Storage would otherwise bypass the wrapper unseen
    raise TypeError(f"FaultyStorage does not delegate Storage.{', Storage.'.join(_UNDELEGATED)}")
