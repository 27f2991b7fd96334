"""The fault-injecting storage the crash and failure tests rely on: its faults act exactly where
and when they say, and everything else passes through to the wrapped backend."""

from __future__ import annotations

import errno
import threading

import pytest
from faults import FaultyStorage

from zerostall.storage import LocalStorage


@pytest.fixture
def storage(tmp_path) -> FaultyStorage:
    s = FaultyStorage(LocalStorage(str(tmp_path / "ck")))
    s.create()
    return s


def parts(*sizes: int) -> list[memoryview]:
    return [memoryview(bytes([i]) * n) for i, n in enumerate(sizes)]


def test_a_write_fails_after_exactly_k_bytes_and_the_inner_backend_cleans_up(storage):
    taken = []
    storage.call("write", lambda op, name: taken.append(name), after_bytes=1500)
    fault = storage.fail("write", OSError(errno.ENOSPC, "injected"), after_bytes=1500)
    with pytest.raises(OSError, match="injected"):
        storage.write("f", parts(1000, 1000, 1000))
    assert fault.count == 1 and taken == ["f"]
    assert storage.list() == []  # the backend removed its partial file
    with pytest.raises(OSError, match="injected"):
        storage.write("g", parts(1000, 500))  # exactly K bytes: it acts once they are taken
    assert storage.write("h", parts(1000)) == 1000 and fault.count == 2  # fewer: it never acts


def test_from_call_and_times_pick_the_calls(storage):
    fault = storage.fail("write", OSError(errno.EIO, "injected"), name="d*", from_call=2, times=1)
    for name in ("a", "d1", "d2", "d3"):
        try:
            storage.write(name, parts(10))
        except OSError:
            pass
    assert storage.list() == ["a", "d1", "d3"] and fault.seen == 3 and fault.count == 1
    assert storage.names("write") == ["a", "d1", "d2", "d3"]


@pytest.mark.parametrize("at, published", [("before", False), ("before_replace", False), ("after", True)])
def test_publish_faults_act_before_at_or_after_the_switch(storage, at, published):
    checked = []
    fault = storage.fail("publish", OSError(errno.EIO, "injected"), at=at)
    with pytest.raises(OSError, match="injected"):
        storage.publish("m", "m.tmp", b"new", before_replace=lambda: checked.append(True))
    assert fault.count == 1
    assert storage.list() == (["m"] if published else [])  # no temp file is left behind either way
    assert checked == ([True] if at == "after" else [])  # at the switch: before the caller's check


def test_a_gate_holds_the_call_until_it_opens(storage):
    gate = threading.Event()
    held = storage.block("delete", gate)
    storage.write("f", parts(10))
    deleting = threading.Thread(target=storage.delete, args=("f",))
    deleting.start()
    assert held.fired.wait(30)
    assert storage.list() == ["f"]
    gate.set()
    deleting.join()
    assert storage.list() == []


def test_faults_are_refused_where_they_cannot_act(storage):
    with pytest.raises(ValueError):
        storage.fail("no_such_op", OSError())
    with pytest.raises(ValueError):
        storage.fail("write", OSError(), at="before_replace")
    with pytest.raises(ValueError):
        storage.fail("read_into", OSError(), after_bytes=1)
