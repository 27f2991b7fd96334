"""Training scripts that use ``AsyncSaver(writer="process")`` and end badly; run by
tests/test_writer_process.py as ``writer_process.py SCENARIO PATH`` in a child process (its own
session, under a timeout). Each prints what it saw as JSON lines, then ends as its scenario says.

The writer process imports this file as its main module: everything runs under ``__main__``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

import torch

import zerostall as zs
from faults import GatedLocalStorage

MIB = 1 << 20
ALIVE: list[zs.AsyncSaver] = []  # alive until the interpreter exits, like a saver made at a script's top level


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def state(mib: int, value: float = 1.0) -> dict:
    return {"w": torch.full((mib * MIB // 4,), float(value)), "step": int(value)}


def held_save(saver: zs.AsyncSaver, path: str, step: int) -> tuple[zs.SaveHandle, Connection]:
    """Start a save and return once the writer process holds it before writing its data file,
    with the pipe end that lets it go on."""
    here, there = multiprocessing.Pipe()
    handle = saver.save(state(1, step), GatedLocalStorage(path, there), step=step)
    assert here.recv() == "held"
    return handle, here


def the_writer() -> multiprocessing.Process:
    (writer,) = [p for p in multiprocessing.active_children() if p.name == "zerostall-writer"]
    return writer


def ending(path: str, how: str) -> None:
    """The script ends (``how``) while the writer process holds its save; the hold ends only once
    the interpreter exits (a threading exit hook registered after zerostall's runs before it).
    Nothing closes the saver."""
    saver = zs.AsyncSaver(writer="process")
    ALIVE.append(saver)
    _, gate = held_save(saver, path, 4)
    threading._register_atexit(lambda: gate.send("go"))  # type: ignore[attr-defined]
    report(held=True)
    if how == "exception":
        raise RuntimeError("training crashed")
    if how == "exit":
        sys.exit(3)
    if how == "interrupt":  # Ctrl-C in a terminal: SIGINT to the whole process group, the writer's too
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job ignores it)
        os.killpg(0, signal.SIGINT)
        threading.Event().wait()  # until the KeyboardInterrupt


def killed_writer(path: str, then: str) -> None:
    """The writer process is killed while it holds a save; the training process goes on."""
    saver = zs.AsyncSaver(writer="process")
    handle, _ = held_save(saver, f"{path}/a", 1)
    os.kill(the_writer().pid, signal.SIGKILL)  # not joined here: the saver reaps it and says how it ended
    try:
        if then == "save":
            saver.save(state(1, 2.0), f"{path}/b", step=2)
        else:
            saver.close()
    except zs.CheckpointError as exc:
        report(error=type(exc).__name__, message=str(exc))
    if then == "save":  # the save after that has a new writer process
        report(committed=saver.save(state(1, 3.0), f"{path}/c", step=3).result().step)
        saver.close()


def small_shm(path: str) -> None:
    """With a 16 MiB /dev/shm: a 32 MiB save is refused by the up-front check, then (statvfs made to
    report room, as when another process fills /dev/shm right after the check) by the allocation
    itself; saves that fit commit, a larger structure once the smaller one's buffers are released.
    The script ends with the refused save's error, no close."""
    saver = zs.AsyncSaver(writer="process")
    for check in ("statvfs", "allocation"):
        real = os.statvfs
        if check == "allocation":
            os.statvfs = lambda p: os.statvfs_result((4096, 4096, 1 << 18, 1 << 18, 1 << 18, 0, 0, 0, 0, 255))
        try:
            saver.save(state(32), f"{path}/big")
        except zs.CheckpointError as exc:
            cause = exc.__cause__
            report(check=check, error=type(exc).__name__, message=str(exc), shm=os.listdir("/dev/shm"),
                   cause=cause.errno if isinstance(cause, OSError) else None)
        finally:
            os.statvfs = real
    for mib, step in ((8, 1), (10, 2)):  # 8 + 10 MiB fit only if the 8 are released in both processes
        small = state(mib, step)
        small[f"w{mib}"] = small.pop("w")  # another structure: a new pool
        report(mib=mib, committed=saver.save(small, f"{path}/small{mib}", step=step).result().step)
    saver.save(state(32), f"{path}/big")


class TwoArguments(Exception):
    """An exception that pickles, and cannot be unpickled (its ``__init__`` takes two arguments)."""

    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}-{b}")


def failing_hook() -> None:
    raise TwoArguments(1, 2)


def errors(path: str) -> None:
    """What a save says when its options cannot be pickled for the writer, or its error cannot come
    back from it; then a save that works."""
    saver = zs.AsyncSaver(writer="process")
    for name, hook in (("lambda", lambda: None), ("unpicklable", failing_hook), ("none", None)):
        try:
            saver.save(state(1), os.path.join(path, name), before_commit=hook).result()
            report(**{name: "saved"})
        except zs.CheckpointError as exc:
            report(**{name: f"{type(exc).__name__}: {exc}"})
    saver.close()


if __name__ == "__main__":
    scenario, path = sys.argv[1], sys.argv[2]
    if scenario == "errors":
        errors(path)
    elif scenario.startswith("killed-writer-"):
        killed_writer(path, scenario.removeprefix("killed-writer-"))
    elif scenario == "small-shm":
        small_shm(path)
    else:
        ending(path, scenario)
