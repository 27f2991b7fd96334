"""Multi-rank commit coordination on S3 (the ``s3_server`` fixture, real gloo ranks): the storage
requests of a save do not grow with how long the slowest rank takes (the ranks ring and wait
through the process group's store), a writer process outside the group rings too, and a rank that
cannot reach the store still commits (the coordinator finds its record in the storage)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.tensor import Shard

import zerostall as zs
import zerostall.saving.commit as commit
import zerostall.saving.pipeline as saving
from test_distributed import dtensor, full_value
from test_s3 import explicit
from zerostall.storage import S3Storage
from zerostall.storage.s3client import Connection

CONTROL = ("ListObjectsV2", "ListMultipartUploads", "GetObject", "HeadObject")


def state() -> dict[str, Any]:
    return {"w": dtensor(full_value((64, 16), 1), (dist.get_world_size(),), [Shard(0)]), "step": 7}


def slowed(rank: int, delay: float) -> Any:
    """Make ``rank`` start writing its data ``delay`` seconds late; returns the undo."""
    write_data = saving.write_data
    if dist.get_rank() == rank and delay:
        def late(*args: Any, **kwargs: Any) -> Any:
            time.sleep(delay)
            return write_data(*args, **kwargs)

        saving.write_data = late
    return lambda: setattr(saving, "write_data", write_data)


def counted_save(storage: S3Storage, slow_rank: int, delay: float) -> dict[str, int]:
    """One save with ``slow_rank`` late by ``delay`` s: the S3 operations this rank sent, by name."""
    calls: Counter[str] = Counter()

    def seen(model: Any, **_: Any) -> None:
        calls[model.name] += 1

    events = Connection.get(storage.options).client.meta.events
    events.register("before-call.s3", seen)
    undo = slowed(slow_rank, delay)
    try:
        zs.save(state(), storage)
    finally:
        undo()
        events.unregister("before-call.s3", seen)
    return dict(calls)


def control(per_rank: list[dict[str, int]]) -> int:
    return sum(c.get(op, 0) for c in per_rank for op in CONTROL)


def test_control_requests_per_save_do_not_grow_with_a_slow_rank(ranks, s3_server, s3_url):
    storage = S3Storage(s3_url, explicit(s3_server))
    pool = ranks(4)
    pool.run(counted_save, storage.child("warm"), 3, 0.0)  # connections made, first-use costs paid
    prompt = pool.run(counted_save, storage.child("prompt"), 3, 0.0)
    slow = pool.run(counted_save, storage.child("slow"), 3, 1.5)
    assert control(slow) == control(prompt), (prompt, slow)
    with zs.open(storage.child("slow")) as ck:
        assert torch.equal(ck.read("w"), full_value((64, 16), 1))


def async_save_in_a_writer_process(storage: S3Storage) -> str | None:
    """An asynchronous save whose commit runs in writer processes (outside the process group), one
    rank slow; rank 0 then reads the coordinator's verdict from the group's store."""
    undo = slowed(1, 0.5)
    try:
        with zs.AsyncSaver(writer="process") as saver:
            info = saver.save(state(), storage).result()
    finally:
        undo()
    if dist.get_rank() != 0:
        return None
    store = distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store.get(f"zerostall/{storage.location}/{info.generation}/verdict").decode()


def test_writer_processes_outside_the_group_commit_through_the_store(ranks, s3_server, s3_url):
    storage = S3Storage(s3_url, explicit(s3_server))
    assert ranks(2).run(async_save_in_a_writer_process, storage)[0] == "ok"
    with zs.open(storage) as ck:
        assert torch.equal(ck.read("w"), full_value((64, 16), 1))


def save_with_rank_1_off_the_store(storage: S3Storage) -> str:
    """Rank 1 cannot reach the store (it polls, and rings no doorbell); the coordinator's first look
    at the storage is made early, so the test does not wait the default 10 s."""
    first_check, open_doorbell = commit._FIRST_CHECK, saving.open_doorbell
    commit._FIRST_CHECK = 0.3
    if dist.get_rank() == 1:
        saving.open_doorbell = lambda *args: None
    try:
        return zs.save(state(), storage).generation
    finally:
        commit._FIRST_CHECK, saving.open_doorbell = first_check, open_doorbell


def test_a_rank_that_cannot_reach_the_store_still_commits(ranks, s3_server, s3_url):
    storage = S3Storage(s3_url, explicit(s3_server))
    generations = ranks(2).run(save_with_rank_1_off_the_store, storage)
    with zs.open(storage) as ck:
        assert ck.manifest.generation == generations[0] == generations[1]
        assert torch.equal(ck.read("w"), full_value((64, 16), 1))


def verdicts_left_after_saves(root: str) -> list[bool]:
    """Three saves into new locations (a manager's steps); then whether each one's verdict is still
    in the process group's store."""
    store = distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):  # the doorbell's keys lie in the TCPStore itself
        store = store.underlying_store
    keys = []
    for step in range(3):
        info = zs.save({"w": torch.full((64,), float(step))}, f"{root}/step_{step}", step=step)
        with zs.open(f"{root}/step_{step}") as ck:
            keys.append(f"zerostall/{ck.path}/{info.generation}/verdict")
    dist.barrier()
    return [store.check([key]) for key in keys]


def test_the_store_keeps_one_verdict_not_one_a_save(ranks, tmp_path):
    """The coordinator removes the ranks' keys of a save, and its verdict when it announces the next
    one: a job saving every few minutes for weeks does not grow the store."""
    assert ranks(3).run(verdicts_left_after_saves, str(tmp_path)) == [[False, False, True]] * 3
