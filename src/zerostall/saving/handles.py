"""The handles of asynchronous saves: a save's two futures (staged, committed), whose failures count
as seen once raised to someone, and a done-callback that lets go of what it calls."""

from __future__ import annotations

import threading
from concurrent import futures
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from .capture import Captured
from .collect import WriteItem
from .pipeline import SaveInfo


class _Watched(Future):
    """A future whose failure, once :meth:`result` raised it or :meth:`exception` returned it, is
    ``seen``: the saver does not raise it again at the next save or close. The library's own
    waits and callbacks use the ``unseen_`` methods, which do not count."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False
        self._settled = threading.Event()  # done, and its done callbacks have run
        self._settler: int | None = None  # the thread that runs them

    def set_result(self, result: Any) -> None:
        self._settler = threading.get_ident()
        super().set_result(result)  # wakes the waiters, then runs the callbacks
        self._settled.set()

    def set_exception(self, exception: BaseException | None) -> None:
        self._settler = threading.get_ident()
        super().set_exception(exception)
        self._settled.set()

    def settle(self) -> None:
        """Wait until done and its done callbacks have run (one of them may see its failure);
        at once in the thread that runs them."""
        if self._settler != threading.get_ident():
            futures.wait([self])
            self._settled.wait()

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        except BaseException as exc:
            if self.done() and exc is super().exception(0):  # the save's failure, not this wait's timeout
                self.seen = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        failure = super().exception(timeout)
        self.seen = self.seen or failure is not None
        return failure

    def cancel(self) -> bool:
        """A save once started cannot be called off (the saver's worker sets its outcome)."""
        return False

    def unseen_result(self) -> Any:
        """Wait and return (or raise) the outcome without counting it as seen: the saver's own waits."""
        self.settle()
        return super().result()

    def unseen_exception(self) -> BaseException | None:
        """The failure of a done future, or None, without counting it as seen: for the library's own
        done callbacks (the manager's commit step), after which the failure is still the user's to see."""
        return super().exception(0)


class SaveHandle:
    """The two futures of one asynchronous save. A failure raised or returned by either future (or
    by :meth:`result`, :meth:`wait_staged`) has been seen: the saver does not raise it again at the
    next save or close."""

    def __init__(self, path: str, step: int | None, captured: Captured | None = None) -> None:
        self.path = path
        self.step = step
        self.staged = _Watched()
        self.committed = _Watched()
        self.captured = captured
        """Where the capture put each tensor, once ``staged`` and until this saver's next save:
        another save of this step may read them there."""

    @property
    def failure_seen(self) -> bool:
        """Whether this save's failure was raised or returned to someone already."""
        return self.staged.seen or self.committed.seen

    def quiet(self) -> "SaveHandle":
        """The caller deals with this save's failure itself (logs and counts it): the saver does
        not raise it at the next save, wait or close; :meth:`result` still does."""
        self.committed.seen = True
        return self

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state has been captured: call this before mutating it (optimizer step)."""
        self.staged.result(timeout)

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Block until committed; raises what the background raised."""
        return self.committed.result(timeout)

    def done(self) -> bool:
        return self.committed.done()

    def lend(self, items: Sequence[WriteItem], recorded: list[Any]) -> None:
        """Once this save is staged, point another save's ``items`` of the same tensors at this
        one's captured copies (see :class:`Captured`); if its capture failed, they stay as they are."""
        futures.wait([self.staged])
        if self.captured is not None and self.staged.unseen_exception() is None:
            self.captured.take(items, recorded)


class OneShot:
    """A done-callback that lets go of what it calls once it has run: a finished future keeps its
    callbacks, so one holding the manager would tie manager, saver and handle into a cycle."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[[Future], None]) -> None:
        self._call: Callable[[Future], None] | None = call

    def __call__(self, fut: Future) -> None:
        call, self._call = self._call, None
        if call is not None:
            call(fut)
