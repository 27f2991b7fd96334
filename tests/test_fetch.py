"""The fetch stage's scheduling of reads over reader threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from zerostall.loading.fetch import run_largest_first


def test_a_reader_free_takes_the_largest_run_left():
    """A thread held up by one slow read must not keep runs that others could take: the big run
    here only finishes once every small one is read, which (largest first onto the least-loaded
    lane, decided before reading) would have left a small run waiting behind it."""
    small_done = threading.Event()
    done: list[str] = []

    def read(run: list[str], verify: bool) -> None:
        if run == ["big"]:
            assert small_done.wait(10), "the small runs were held behind the slow one"
        done.append(run[0])
        if sum(name != "big" for name in done) == 3:
            small_done.set()

    runs = [(["big"], 100), (["s1"], 60), (["s2"], 60), (["s3"], 60)]
    with ThreadPoolExecutor(2) as pool:
        run_largest_first(pool, 2, read, runs, verify=True)
    assert sorted(done) == ["big", "s1", "s2", "s3"] and done[-1] == "big"


def test_a_failed_read_stops_the_others_and_is_raised():
    read_runs: list[int] = []
    lock = threading.Lock()

    def read(run: list[int], verify: bool) -> None:
        with lock:
            read_runs.append(run[0])
        if run[0] == 0:
            raise OSError("bad block")

    runs = [([i], 100 - i) for i in range(50)]
    with ThreadPoolExecutor(1) as pool, pytest.raises(OSError, match="bad block"):
        run_largest_first(pool, 1, read, runs, verify=True)
    assert read_runs == [0]


def test_a_backend_without_its_own_scatter_read_gets_the_bytes_in_order(tmp_path):
    """``Storage.read_into_many``'s default (a backend that only implements ``read_into``) reads
    each buffer from where the one before ended."""
    import torch

    import zerostall as zs
    from zerostall.storage import LocalStorage, Storage

    class PlainReads(LocalStorage):
        read_into_many = Storage.read_into_many

    state = {f"t{i}": torch.full((100,), float(i)) for i in range(20)}  # small, back to back: scatter reads
    zs.save(state, tmp_path / "ck", threads=1)
    out = zs.load({k: torch.zeros(100) for k in state}, PlainReads(str(tmp_path / "ck")))
    assert all(torch.equal(out[k], v) for k, v in state.items())
