"""The local tier when the job around it goes wrong: two machines under one node id, and the
tier's own process group broken by a transfer that timed out. Two gloo ranks, a simulated node
and a directory each (``ZEROSTALL_NODE_ID``)."""

from __future__ import annotations

import contextlib
import shutil
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist

import zerostall as zs


def single_state(value: float) -> dict:
    return {"w": torch.full((1000,), value), "step": int(value)}


def one_node_id_two_directories(base: str) -> tuple[str, str]:
    """Both ranks say they run on node "same", but each has a directory of its own (two machines)."""
    os.environ["ZEROSTALL_NODE_ID"] = "same"
    tier = zs.LocalTier(os.path.join(base, f"machine-{dist.get_rank()}"), every=5, replicas=2, timeout_s=30)
    try:
        with zs.CheckpointManager(os.path.join(base, "root"), fsync=False, local=tier):
            pass
    except zs.CheckpointError as exc:
        refused = type(exc).__name__, str(exc)
    else:
        return "", ""
    os.environ["ZEROSTALL_NODE_ID"] = f"machine-{dist.get_rank()}"  # set right: the refused manager held nothing
    with zs.CheckpointManager(os.path.join(base, "root"), fsync=False, local=tier) as mgr:
        mgr.save(5, single_state(5.0))
    return refused


def test_two_machines_under_one_node_id_are_refused_on_every_rank(ranks, tmp_path):
    """Only the first rank's directory was listed and retired: the other machine's grew without
    bound and its copies were never restored from. The refused manager left the root's lease."""
    for kind, message in ranks(2).run(one_node_id_two_directories, str(tmp_path)):
        assert kind == "CheckpointError", message
        assert "rank(s) [1] share the node id 'same' with rank 0" in message and "ZEROSTALL_NODE_ID" in message


def a_replication_times_out_then_the_run_goes_on(base: str) -> dict:
    """Nodes a and b, a local save every 10 steps, keep=1, a persistent one every 80: rank 0's
    save of step 10 ends after node b's receive of it timed out (a slow disk), which breaks the
    tier's group. Returns what each node held at step 70 and at step 80 (the persistent save made
    the group anew), the errors and warnings logged, what a restore in the same run and one in a
    new run gave."""
    import time

    from zerostall.tiers.replication import Replicator

    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    tier = zs.LocalTier(os.path.join(base, "node-" + "ab"[rank]), every=10, keep=1, replicas=2, timeout_s=2)
    root = os.path.join(base, "root")
    real, errors = Replicator._replicate, []

    def late(self: Any, step: int) -> bool:  # rank 0's save of step 10 commits late
        if rank == 0 and step == 10:
            time.sleep(4)
        return real(self, step)

    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zerostall").addHandler(handler)
    Replicator._replicate = late
    out: dict = {}
    try:
        with zs.CheckpointManager(root, save_every=80, fsync=False, local=tier) as mgr:
            for step in range(1, 61):
                if mgr.should_save(step):
                    mgr.save(step, single_state(100.0 * rank + step))
            mgr.wait()  # every rank has said, through the store, that it saved step 60
            dist.barrier()
            assert mgr.should_save(70)  # the local tier only
            mgr.save(70, single_state(100.0 * rank + 70))
            mgr.wait()
            out["held"] = mgr.tier.directory.holdings()
            replicator = mgr.tier.replicator
            store = dist.distributed_c10d._get_process_group_store(mgr.tier.pg)
            posted = [replicator._key.format(rank), *replicator._answered]  # this rank's keys
            assert all(store.check([key]) for key in posted) and (rank == 1 or len(posted) > 1)  # answers on rank 0
            assert mgr.should_save(80)  # the root and the local tier: a collective point
            mgr.save(80, single_state(80.0))  # the root's save: the ranks hold the same values
            mgr.wait()
            out["left in the old store"] = [key for key in posted if store.check([key])]
            out["held at 80"] = mgr.tier.directory.holdings()
            state = single_state(-1.0)
            out["same run"] = mgr.restore(state), float(state["w"][0]), mgr.last_restore.sources
    finally:
        Replicator._replicate = real
        logging.getLogger("zerostall").removeHandler(handler)
    out["errors"] = errors
    state = single_state(-1.0)
    with zs.CheckpointManager(root, fsync=False, local=tier) as mgr:
        out["new run"] = mgr.restore(state), float(state["w"][0]), mgr.last_restore.sources
    return out


def test_a_transfer_that_timed_out_stops_replication_loudly_until_the_next_persistent_save_mends_it(ranks,
                                                                                                     tmp_path):
    """One timed-out transfer closed the tier's gloo pair: every later replication and every
    retention failed, with warnings only, and each node kept every step it saved; and no step was
    replicated again for the rest of the run. Retention goes on through the store meanwhile (a node
    keeps the newest step every rank saved, 60 at least once every rank said so, and the one
    newer), and the next persistent save makes the group anew: step 80 is replicated again."""
    for rank, out in enumerate(ranks(2).run(a_replication_times_out_then_the_run_goes_on, str(tmp_path))):
        assert 70 in out["held"] and set(out["held"]) <= {60, 70}, out["held"]
        failed = [m for m in out["errors"] if "its process group failed" in m]
        assert len(failed) == 1 and "No step is replicated" in failed[0], out["errors"]
        assert out["held at 80"] == {80: [0, 1]} and out["left in the old store"] == [], out
        assert sum("made anew" in m for m in out["errors"]) == (rank == 0), out["errors"]
        assert out["same run"] == out["new run"] == (80, 80.0, ("local", "local"))


def _flip_a_data_byte(folder: str) -> None:
    data = max((os.path.join(folder, f) for f in os.listdir(folder) if f != "manifest.json"), key=os.path.getsize)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))


def test_a_damaged_root_checkpoint_falls_back_to_a_newer_local_step_before_an_older_root_one(tmp_path):
    """The root's step 40 damaged (found while loading it), the local tier holding step 35: the
    restore fell back within the root, to step 30, and lost five steps (under ``fallback=False``, it
    refuses). The run goes on from 35: the damaged 40 is set aside. Then with step 35's copy damaged
    too: the root's step 30, the copy passed over said."""
    def manager() -> zs.CheckpointManager:
        return zs.CheckpointManager(str(tmp_path / "root"), save_every=10, fsync=False,
                                    local=zs.LocalTier(str(tmp_path / "node"), every=7, keep=1, replicas=1))

    with manager() as mgr:
        for step in range(1, 41):
            if mgr.should_save(step):
                mgr.save(step, single_state(float(step)))
    _flip_a_data_byte(str(tmp_path / "root" / "step_000000040"))
    state = single_state(0.0)
    with manager() as mgr, pytest.raises(zs.CorruptCheckpointError, match="newest step a faster tier holds whole"):
        mgr.restore(state, fallback=False)
    with manager() as mgr:
        assert mgr.restore(state) == 35 and float(state["w"][0]) == 35.0
        info = mgr.last_restore
        assert (info.source, info.tag, [tag for tag, _ in info.fallbacks]) == ("local", "step_000000035",
                                                                                ["step_000000040"])
    assert os.listdir(tmp_path / "root" / ".superseded") == ["step_000000040"]  # the run went on from 35
    _flip_a_data_byte(str(tmp_path / "node" / os.listdir(tmp_path / "node")[0] / "step_000000035" / "rank_00000"))
    with manager() as mgr:
        assert mgr.restore(state) == 30 and float(state["w"][0]) == 30.0
        info = mgr.last_restore
        assert info.source == "persistent" and len(info.fallbacks) == 1 and "step 35" in info.fallbacks[0][0]


def test_a_named_root_checkpoint_counts_by_its_step_against_the_local_tier(tmp_path):
    """A named checkpoint of the root (no step in its tag) was taken for newer than every local
    step: `init` (step 0) was restored over the local tier's step 30, which the restore then deleted
    as another timeline's; `best` (step 42) over the local step 45."""
    def manager(name: str, save_every: int) -> zs.CheckpointManager:
        return zs.CheckpointManager(str(tmp_path / name / "root"), save_every=save_every, fsync=False,
                                    local=zs.LocalTier(str(tmp_path / name / "node"), every=15, keep=2, replicas=1))

    with manager("init", 1000) as mgr:
        mgr.save(0, single_state(0.0), tag="init")
        for step in range(1, 31):
            if mgr.should_save(step):
                mgr.save(step, single_state(float(step)))
    with manager("best", 40) as mgr:
        for step in range(1, 46):
            if mgr.should_save(step):
                mgr.save(step, single_state(float(step)))
            if step == 42:
                mgr.save(step, single_state(float(step)), tag="best")
    for name, step in (("init", 30), ("best", 45)):
        state = single_state(-1.0)
        with manager(name, 1000) as mgr:
            assert mgr.restore(state) == step and float(state["w"][0]) == step, name
            assert mgr.last_restore.source == "local" and step in mgr.tier.directory.holdings()


@contextlib.contextmanager
def broken_at_10_then_mended_at_80(base: str, local_70: Callable[..., Any]) -> Iterator[zs.CheckpointManager]:
    """Nodes a and b, local saves every 10 steps, a persistent one every 80, the tier's group broken
    at step 10 (rank 0's worker comes to it after the timeout: the ranks' agreement on whether
    each holds its copy times out, before any transfer); rank 0's local save of step
    70 is ``local_70(persist, prepared, ...)``, while the persistent save of step 80 makes the group
    anew. Yields the manager once every save, step 80's included, is done."""
    import time

    from zerostall.saving import asynchronous
    from zerostall.tiers.replication import Replicator

    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    tier = zs.LocalTier(os.path.join(base, "node-" + "ab"[rank]), every=10, keep=1, replicas=2, timeout_s=2)
    agree, persist = Replicator._everyone_saved, asynchronous.persist

    def late(self: Any, step: int, saved: bool) -> bool:
        if rank == 0 and step == 10:
            time.sleep(4)
        return agree(self, step, saved)

    def at_70(prepared: Any, *args: Any, **kwargs: Any) -> Any:
        if rank == 0 and prepared.step == 70 and prepared.metadata.get("tier") == "local":
            return local_70(persist, prepared, *args, **kwargs)
        return persist(prepared, *args, **kwargs)

    Replicator._everyone_saved, asynchronous.persist = late, at_70
    try:
        with zs.CheckpointManager(os.path.join(base, "root"), save_every=80, fsync=False, local=tier) as mgr:
            for step in range(1, 81):
                if mgr.should_save(step):
                    mgr.save(step, single_state(float(step)))
                if step == 60:
                    mgr.wait()
                    dist.barrier()
            mgr.wait()
            yield mgr
    finally:
        Replicator._everyone_saved, asynchronous.persist = agree, persist


def a_slow_node_saves_while_the_group_is_made_anew(base: str) -> tuple:
    """Node a's local save of step 70 commits 6 s late (beyond node b's wait for its answer about
    step 70, and a timeout more). Returns the group's state after step 80 and what each node holds."""
    import time

    def slow(persist: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        time.sleep(6)
        return persist(*args, **kwargs)

    with broken_at_10_then_mended_at_80(base, slow) as mgr:
        return mgr.tier.replicator.broken, mgr.tier.directory.holdings()


def test_a_group_is_made_anew_while_one_node_saves_later_than_the_timeout(ranks, tmp_path):
    """Each rank waited for its own local save in flight, then made the new group, whose rendezvous
    waits ``timeout_s`` at most: node a's slow save made node b's wait time out, and the persistent
    save raised into training on every rank."""
    assert ranks(2).run(a_slow_node_saves_while_the_group_is_made_anew, str(tmp_path)) == [(None, {80: [0, 1]})] * 2


def a_local_save_fails_just_before_the_group_is_made_anew(base: str) -> dict:
    """Rank 0's local save of step 70 fails (a full disk), and a log handler takes 3 s over the
    error. Returns, per copy each node holds, the step its manifest names."""
    import time

    def full(*_: Any, **__: Any) -> Any:
        raise OSError(28, "No space left on device")

    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: time.sleep(3 if "step 70 failed" in record.getMessage() else 0)  # type: ignore
    logging.getLogger("zerostall").addHandler(handler)
    try:
        with broken_at_10_then_mended_at_80(base, full) as mgr:
            held = mgr.tier.directory.holdings()
            return {(step, r): zs.open(str(mgr.tier.directory.copy_path(step, r))).step
                    for step, holders in held.items() for r in holders}
    finally:
        logging.getLogger("zerostall").removeHandler(handler)


def test_a_local_save_that_failed_just_before_the_group_is_made_anew_is_handled_without_it(ranks, tmp_path):
    """Waiting for the local save in flight returned before its failure reached the replication
    thread (a slow log handler), so the group was made anew first: that step went out on the new
    group on one rank, paired with the next step on the other, and node a filed rank 1's step 80
    as its step 70, which a restore took for step 70's data."""
    for held in ranks(2).run(a_local_save_fails_just_before_the_group_is_made_anew, str(tmp_path)):
        assert held and all(step == named for (step, _), named in held.items()), held


@contextlib.contextmanager
def on_a_broken_tier(base: str, nodes: str) -> Iterator[tuple[int, zs.CheckpointManager]]:
    """This rank (on node ``nodes[rank]``) and a manager whose local tier (every 10 steps, keep=1)
    has every transfer fail as a dead link would: its group is broken from the first local save on."""
    from zerostall.tiers import replication
    from zerostall.tiers.stream import LinkError

    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = nodes[rank]

    def dead_link(*_: Any, **__: Any) -> None:
        raise LinkError("injected: the peer is gone")

    real, replication.exchange = replication.exchange, dead_link
    tier = zs.LocalTier(os.path.join(base, "node-" + nodes[rank]), every=10, keep=1, replicas=2, timeout_s=30)
    try:
        with zs.CheckpointManager(os.path.join(base, "root"), save_every=1000, fsync=False, local=tier) as mgr:
            yield rank, mgr
    finally:
        replication.exchange = real


def broken_from_the_start_then_a_rank_dies_saving(base: str) -> dict:
    """Nodes a (ranks 0, 1) and b (rank 2), a local save every 10 steps, keep=1; every transfer
    fails as a dead link would, so the tier's group is broken from step 10 on. Rank 1 dies before
    its save of step 30: what each node holds once the others' step 30 is retired."""
    with on_a_broken_tier(base, "aab") as (rank, mgr):
        for step in range(1, 31):
            if mgr.should_save(step):
                dist.barrier()  # the training step's collectives: every rank has finished the step before
                if rank == 1 and step == 30:
                    os._exit(0)
                mgr.save(step, single_state(100.0 * rank + step))
                mgr.wait()
        return mgr.tier.directory.holdings()


def restore_after_the_crash(base: str, nodes: str = "aab") -> tuple:
    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = nodes[rank]
    tier = zs.LocalTier(os.path.join(base, "node-" + nodes[rank]), every=10, keep=1, replicas=2, timeout_s=30)
    state = single_state(-1.0)
    with zs.CheckpointManager(os.path.join(base, "root"), fsync=False, local=tier) as mgr:
        return mgr.restore(state), float(state["w"][0])


def test_with_the_group_broken_a_step_is_retired_only_once_every_rank_saved_a_newer_one(ranks, tmp_path):
    """With the group broken, a node's first rank retired its steps by its own copies: it deleted
    step 20 once its own copy of step 30 was written, while rank 1 on the same node had not saved
    step 30 (and then died): no step was left whole, and the restarted job started afresh."""
    from distributed import RankError

    with pytest.raises(RankError) as caught:
        ranks(3).run(broken_from_the_start_then_a_rank_dies_saving, str(tmp_path))
    assert caught.value.dead == [1]
    assert caught.value.results[0] == {20: [0, 1], 30: [0]} and caught.value.results[2] == {20: [2], 30: [2]}
    assert ranks(3).run(restore_after_the_crash, str(tmp_path)) == [(20, 20.0), (20, 120.0), (20, 220.0)]


def a_restore_times_out_then_is_retried(base: str) -> list:
    """Nodes a and b, node b lost: rank 1 receives its copy from rank 0, which starts sending
    after the tier's timeout (a slow disk), so the restore fails; then both ranks restore again in
    the same process. Returns what each restore raised."""
    import time

    from zerostall.tiers import sources

    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    node = os.path.join(base, "node-" + "ab"[rank])
    root = os.path.join(base, "root")
    with zs.CheckpointManager(root, save_every=1000, fsync=False, local=zs.LocalTier(node, every=10, timeout_s=2)) as mgr:
        mgr.save(10, single_state(100.0 * rank + 10)) if mgr.should_save(10) else None
    dist.barrier()
    if rank == 1:
        import shutil

        shutil.rmtree(node)
    dist.barrier()
    real = sources.exchange

    slowed = []

    def slow(pg: Any, sends: Any, receives: Any, **kw: Any) -> Any:
        if sends and not slowed:
            slowed.append(time.sleep(4))
        return real(pg, sends, receives, **kw)

    sources.exchange = slow
    raised: list = []
    try:
        with zs.CheckpointManager(root, fsync=False, local=zs.LocalTier(node, every=10, timeout_s=2)) as mgr:
            for _ in range(2):
                state = single_state(-1.0)
                try:
                    raised.append((mgr.restore(state), float(state["w"][0]), mgr.last_restore.sources))
                except Exception as exc:
                    raised.append(f"{type(exc).__name__}: {exc}")
    finally:
        sources.exchange = real
    return raised


def test_a_restore_whose_transfer_timed_out_is_retried_in_the_same_process_over_a_new_group(ranks, tmp_path):
    """A restore's transfer that timed out broke the tier's group; a second restore in the same
    process used it anyway and failed on the closed connection, with no word of why. It now makes
    the group anew and restores from the peer's copy."""
    for rank, (first, second) in enumerate(ranks(2).run(a_restore_times_out_then_is_retried, str(tmp_path))):
        assert first.startswith("CheckpointError") and "restoring step 10" in first, first
        assert second == (10, 100.0 * rank + 10, ("local", "peer")), second


def broken_then_rolled_back_then_a_rank_dies_saving(base: str) -> dict:
    """Nodes a and b, the tier's group broken from step 10 on (every transfer fails as a dead link
    would), local saves 10 to 40, the root's tag `good` at step 20; then a rollback to `good`, the
    steps saved again, and rank 1 dies before its new step 40: what each node holds then."""
    with on_a_broken_tier(base, "ab") as (rank, mgr):
        return rolled_back_to_good_then_dies(rank, mgr, 1)


def rolled_back_to_good_then_dies(rank: int, mgr: zs.CheckpointManager, dies: int) -> dict:
    """Local saves 10 to 40, the root's tag `good` at step 20; then a rollback to `good`, the steps
    saved again, and rank ``dies`` dies before its new step 40: what this rank's node holds then."""
    for step in range(1, 41):
        if mgr.should_save(step):
            mgr.save(step, single_state(float(step)))
            mgr.wait()
        if step == 20:
            mgr.save(20, single_state(20.0), tag="good")
    dist.barrier()
    assert mgr.restore(single_state(-1.0), tag="good") == 20
    for step in range(21, 41):
        if mgr.should_save(step):
            dist.barrier()  # the training step's collectives
            if rank == dies and step == 40:
                os._exit(0)
            mgr.save(step, single_state(1000.0 + step))
            mgr.wait()
    return mgr.tier.directory.holdings()


def test_after_a_rollback_the_steps_of_the_abandoned_timeline_no_longer_count_as_saved(ranks, tmp_path):
    """With the group broken, the steps a rank posted as saved outlived a rollback: once saved
    again, step 40 counted as saved by every rank while rank 1 had not saved it, so node a deleted
    the new step 30, and rank 1's crash left no whole step."""
    from distributed import RankError

    with pytest.raises(RankError) as caught:
        ranks(2).run(broken_then_rolled_back_then_a_rank_dies_saving, str(tmp_path))
    assert caught.value.dead == [1] and caught.value.results[0] == {30: [0], 40: [0]}
    assert ranks(2).run(restore_after_the_crash, str(tmp_path), "ab") == [(30, 1030.0), (30, 1030.0)]


def broken_then_rolled_back_by_tag_then_a_rank_dies_saving(base: str) -> dict:
    """Nodes a (rank 0) and b (ranks 1, 2), the tier's group broken at every local save (every
    transfer fails as a dead link would), local saves 10 to 40, the root's tag `good` at step 20;
    then a rollback to `good`, the steps saved again, and rank 2 dies before its new step 40. The
    first rank answers last for step 40 both times (a slow disk). Returns what each node holds."""
    import time

    from zerostall.tiers.replication import Replicator

    real, fortieth = Replicator._saved_everywhere, []

    def late(self: Any, step: int) -> int | None:
        if self.rank == 0 and step == 40:
            fortieth.append(time.sleep(1 + len(fortieth)))
        return real(self, step)

    Replicator._saved_everywhere = late
    try:
        with on_a_broken_tier(base, "abb") as (rank, mgr):
            return rolled_back_to_good_then_dies(rank, mgr, 2)
    finally:
        Replicator._saved_everywhere = real


def test_after_a_rollback_by_tag_no_answer_about_the_abandoned_timeline_is_read(ranks, tmp_path):
    """With the group broken, a rollback by tag left the first rank's answers about the abandoned
    timeline in the store: node b's first rank read the old "step 40 saved everywhere" before the
    new one was posted, and deleted the new step 30, so rank 2's crash left it no whole step."""
    from distributed import RankError

    with pytest.raises(RankError) as caught:
        ranks(3).run(broken_then_rolled_back_by_tag_then_a_rank_dies_saving, str(tmp_path))
    assert caught.value.dead == [2] and caught.value.results[1] == {30: [1, 2], 40: [1]}, caught.value.results
    assert ranks(3).run(restore_after_the_crash, str(tmp_path), "abb") == [(30, 1030.0)] * 3


def test_a_load_that_runs_out_of_memory_does_not_take_the_tier_for_broken(tmp_path, monkeypatch):
    """An out-of-memory error loading a local copy (a RuntimeError) was taken for a broken link: the
    tier refused every later restore of the run and stopped replicating."""
    from zerostall.tiers import tier as tiers

    def manager() -> zs.CheckpointManager:
        return zs.CheckpointManager(str(tmp_path / "root"), save_every=100, fsync=False,
                                    local=zs.LocalTier(str(tmp_path / "node"), every=5, replicas=1))

    with manager() as mgr:
        mgr.save(5, single_state(5.0))
    real = tiers._load

    def out_of_memory(*args: Any) -> Any:
        monkeypatch.setattr(tiers, "_load", real)
        raise torch.OutOfMemoryError("injected: out of memory")

    monkeypatch.setattr(tiers, "_load", out_of_memory)
    state = single_state(0.0)
    with manager() as mgr:
        with pytest.raises(zs.CheckpointError, match="OutOfMemoryError"):
            mgr.restore(state)
        assert mgr.restore(state) == 5 and mgr.tier.replicator.broken is None


def test_a_step_damaged_in_the_root_and_the_local_tier_falls_back_to_the_tiers_older_step(tmp_path):
    """Step 40 damaged in both the root and the local tier (found while loading): the tier was asked
    only for steps as new as the root's 40, so the restore fell to the root's step 20 past the
    tier's whole step 35."""
    def manager() -> zs.CheckpointManager:
        return zs.CheckpointManager(str(tmp_path / "root"), save_every=20, fsync=False,
                                    local=zs.LocalTier(str(tmp_path / "node"), every=5, keep=3, replicas=1))

    with manager() as mgr:
        for step in range(1, 41):
            if mgr.should_save(step):
                mgr.save(step, single_state(float(step)))
    _flip_a_data_byte(str(tmp_path / "root" / "step_000000040"))
    _flip_a_data_byte(str(tmp_path / "node" / os.listdir(tmp_path / "node")[0] / "step_000000040" / "rank_00000"))
    state = single_state(0.0)
    with manager() as mgr:
        assert mgr.restore(state) == 35 and float(state["w"][0]) == 35.0
        assert mgr.last_restore.source == "local" and len(mgr.last_restore.fallbacks) == 2


def loader_run(base: str, phase: str) -> Any:
    """Phase "one": 1 rank saves root step 12. "two": 2 ranks (nodes a, b) resume from it (another
    world size) and save local steps 15 and 20. "restore": fresh state, restored non-strict."""
    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    state = {"w": torch.zeros(1000), "dataloader": {"pos": 0, "seen": torch.zeros(4)}}
    tier = zs.LocalTier(os.path.join(base, "node-" + "ab"[rank]), every=5, keep=2, replicas=2, timeout_s=30)
    with zs.CheckpointManager(os.path.join(base, "root"), save_every=12, local=tier, fsync=False) as mgr:
        start = 0 if phase == "one" else mgr.restore(state, strict=False)
        for step in range(start + 1, {"one": 13, "two": 21, "restore": 0}[phase]):
            mgr.wait_staged()
            state["w"] += 1
            state["dataloader"]["pos"] = 1000 * (rank + 1) + step
            state["dataloader"]["seen"] += 1
            if mgr.should_save(step):
                mgr.save(step, state)
        return start, [tag for tag, _ in mgr.last_restore.fallbacks], state["w"][0].item(), \
            state["dataloader"]["pos"], state["dataloader"]["seen"][0].item()


def test_a_fallback_from_the_tiers_to_a_root_checkpoint_of_another_world_size_leaves_per_rank_state_as_given(
        ranks, tmp_path):
    """Rank 0 loaded its per-rank state of local step 20 (then 15) in place; every copy of rank 1's was
    damaged, so both fell back to root step 12, saved by 1 rank, which leaves per-rank state as it is:
    rank 0 kept step 15's loader position beside step 12's weights."""
    base = str(tmp_path)
    ranks(1).run(loader_run, base, "one")
    pool = ranks(2)
    assert [got[0] for got in pool.run(loader_run, base, "two")] == [12, 12]
    for node in "ab":  # rank 1's copies, own and replica, of every step
        for folder, _, files in os.walk(os.path.join(base, "node-" + node)):
            if os.path.basename(folder) == "rank_00001" and "manifest.json" in files:
                _flip_a_data_byte(folder)
    for got in pool.run(loader_run, base, "restore"):
        assert got[0] == 12 and len(got[1]) == 4 and got[2:] == (12.0, 0, 0.0), got


def saved_at_5_then_restored(base: str, nodes: str, phase: str) -> Any:
    """Phase "save": step 5 on 2 ranks (nodes ``nodes``), each copy replicated to the other node.
    "restore": a fresh state restored; the step, sources and this rank's loader position."""
    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = nodes[rank]
    state = {"w": torch.full((1000,), 5.0 if phase == "save" else 0.0), "dataloader": {"pos": 0}}
    state["dataloader"]["pos"] = 100 * (rank + 1) if phase == "save" else -1
    tier = zs.LocalTier(os.path.join(base, "node-" + nodes[rank]), every=5, keep=1, replicas=2, timeout_s=30)
    with zs.CheckpointManager(os.path.join(base, "root"), save_every=1000, local=tier, fsync=False) as mgr:
        if phase == "save":
            assert mgr.should_save(5)
            mgr.save(5, state)
            return None
        return mgr.restore(state), mgr.last_restore.sources, state["dataloader"]["pos"], state["w"][0].item()


def _copy_folder(base: str, node: str, rank: int) -> str:
    run = os.path.join(base, "node-" + node)
    run = os.path.join(run, os.listdir(run)[0], "step_000000005")
    return os.path.join(run, f"rank_{rank:05d}")


def test_a_replica_killed_between_its_two_renames_is_put_back_at_start_up(ranks, tmp_path):
    """A replica arriving for a step held already moves the held copy aside, then moves itself in;
    killed in between, both lay under hidden names, which start-up removed: with node b lost, rank 1's
    only copies were gone and the restore started afresh."""
    from zerostall.tiers.local import replaced_path

    pool = ranks(2)
    pool.run(saved_at_5_then_restored, str(tmp_path), "ab", "save")
    held = Path(_copy_folder(str(tmp_path), "a", 1))  # rank 1's replica on node a
    shutil.copytree(held, held.parent / f".incoming-{held.name}-0a1b2c3d")  # the new one, whole, not yet in place
    os.rename(held, replaced_path(held))  # the old one moved aside: the process died here
    shutil.rmtree(tmp_path / "node-b")
    for rank, got in enumerate(pool.run(saved_at_5_then_restored, str(tmp_path), "ac", "restore")):
        assert got == (5, ("local", "peer"), 100 * (rank + 1), 5.0), got


def test_a_copy_moved_into_another_ranks_folder_is_not_restored_as_that_ranks(ranks, tmp_path, caplog):
    """Rank 0's and rank 1's copies on node a swapped by hand (same shapes: one layout digest): each
    rank restored the other's data-loader position, silently."""
    pool = ranks(2)
    pool.run(saved_at_5_then_restored, str(tmp_path), "ab", "save")
    zero, one = _copy_folder(str(tmp_path), "a", 0), _copy_folder(str(tmp_path), "a", 1)
    os.rename(zero, zero + ".x")
    os.rename(one, zero)
    os.rename(zero + ".x", one)
    out = pool.run(saved_at_5_then_restored, str(tmp_path), "ab", "restore")
    for rank, got in enumerate(out):  # node b's copies: rank 1's own, rank 0's replica
        assert got[0] == 5 and got[2:] == (100 * (rank + 1), 5.0), got
    assert out[0][1] == ("peer", "local")

