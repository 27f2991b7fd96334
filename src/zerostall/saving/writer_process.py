"""The writer process of ``AsyncSaver(writer="process")``: a persistent spawned process that persists
the saves handed over (their captured buffers in shared memory) and commits them even if the
training process dies meanwhile.
"""

from __future__ import annotations

import signal
from typing import Any

from ..errors import CheckpointError
from .pipeline import Prepared, SaveInfo, persist


class WriterProcess:
    """A persistent spawned process that persists captured saves sent to it, one at a time.

    It is not a daemon: when the training process dies after handing over a save, the writer
    still completes the commit, then exits when it finds its pipe closed.
    """

    def __init__(self) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_writer_main, args=(child,), name="zerostall-writer", daemon=False)
        self._proc.start()
        child.close()

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def submit(self, job: Prepared) -> None:
        """Hand a save over; returns once the writer holds the shared buffers (they travel as file
        descriptors served by this process, so it must be alive until then)."""
        try:
            self._conn.send(job)
        except OSError:
            raise self._died() from None
        except Exception as exc:  # pickling it: a before_commit of a lambda or a closure, say
            raise CheckpointError(f"this save cannot be handed to a writer process: {type(exc).__name__}: {exc} "
                                  "(its options, such as before_commit, must pickle): use writer='thread'") from None
        self._expect_ack()

    def _died(self) -> CheckpointError:
        self._proc.join(timeout=5)
        return CheckpointError(f"the writer process died (exit code {self._proc.exitcode})")

    def _expect_ack(self) -> None:
        try:
            ack = self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if ack != "received":
            raise CheckpointError(f"unexpected answer from the writer process: {ack!r}")

    def result(self) -> SaveInfo:
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()


def _writer_main(conn: Any) -> None:
    """The writer process: persist each job received, answer (ok, SaveInfo | exception).

    It ignores SIGINT and SIGTERM: Ctrl-C in a terminal, ``kill`` of a job or Slurm's ``scancel``
    reach the whole process group, and the save handed over must still commit; the writer stops
    when the training process closes the pipe or dies (SIGKILL still ends it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            conn.send("received")
        except OSError:
            pass  # the training process is gone: commit what it handed over all the same
        try:
            reply = (True, persist(job))
        except BaseException as exc:  # the caller re-raises it
            reply = (False, _bare(exc))
        del job  # unmap the shared buffers before answering: the training process's next pool may need the room
        try:
            conn.send(reply)
        except OSError:
            return  # the training process is gone; the checkpoint is committed (or failed) anyway


def _bare(exc: BaseException) -> BaseException:
    """``exc`` without the tracebacks of its chain (their frames hold the job's shared buffers; they
    are not sent anyway), or a :class:`CheckpointError` saying what it was if it cannot be sent."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc if _picklable(exc) else CheckpointError(f"{type(exc).__name__}: {exc}")


def _picklable(exc: BaseException) -> bool:
    """Whether ``exc`` survives the pipe: pickled, and unpickled again (an exception whose
    ``__init__`` takes other arguments than its ``args`` pickles, then fails to be rebuilt)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return False
    return True
