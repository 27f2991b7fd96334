"""Emergency checkpoints: the node-local tier, replicas on other nodes, restore from the fastest copy.

Four gloo ranks on two simulated nodes (``ZEROSTALL_NODE_ID``: ranks 0 and 1 on node "a", 2 and 3
on node "b"; a directory each) train a small model whose gradients are averaged over the ranks
(so the model and optimizer state are replicated) and whose data-loader state is each rank's own.
The local tier saves every 5 steps, the root every 12: a run stopped after step 23 has step 20 in
the local tier and step 12 in the root. Every restore must give back the state bit-exactly, and
the resumed losses must equal those of a run never stopped. The root is on the SeaweedFS server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zerostall as zs
from distributed import RankError
from zerostall.format.layout import MANIFEST_NAME
from zerostall.roots.root import step_tag
from zerostall.storage.s3 import S3Storage
from zerostall.storage.s3client import S3Options
from zerostall.tiers.local import LocalTier, NodeDirectory, check_space

NODES = ("a", "a", "b", "b")
EVERY, SAVE_EVERY, STOP, END = 5, 12, 23, 30


# -- what the ranks run --------------------------------------------------------------------------
def make_state() -> dict:
    torch.manual_seed(0)
    # the first weight and its AdamW state are large enough for a peer restore to receive them straight into memory
    model = torch.nn.Sequential(torch.nn.Linear(8, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = {"pos": 0, "seen": torch.zeros(64)}
    return {"model": model, "optim": optim, "dataloader": loader}


def train_step(state: dict, step: int) -> float:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    noise = torch.rand(16, 1)  # the global RNG: a resume must restore it
    loss = ((state["model"](x) - x.sum(1, keepdim=True) - noise) ** 2).mean()
    loss.backward()
    for p in state["model"].parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    state["optim"].step()
    state["optim"].zero_grad()
    state["dataloader"]["pos"] += 1
    state["dataloader"]["seen"] += x.sum() * (rank + 1)
    return float(loss.detach())


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for t in [*state["model"].state_dict().values(), state["dataloader"]["seen"],
              *(v for s in state["optim"].state.values() for v in s.values())]:
        h.update(t.detach().numpy().tobytes())
    h.update(repr(state["dataloader"]["pos"]).encode() + torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def node_dir(base: str, node: str) -> str:
    return os.path.join(base, f"node-{node}")


def train(root: Any, base: str, until: int, node: str | None = None, replicas: int = 2, keep: int = 2,
          root_down: bool = False, die_sending: int | None = None, timeout_s: float = 30, **restore) -> dict:
    """Restore (from whatever survives), train to ``until``, saving as scheduled; returns what happened.
    ``root_down``: the root (S3) answers every request with an error while restoring.
    ``die_sending``: that rank dies as it starts sending a copy to a peer during the restore."""
    node = node or NODES[dist.get_rank()]
    os.environ["ZEROSTALL_NODE_ID"] = node
    state = make_state()
    tier = zs.LocalTier(node_dir(base, node), every=EVERY, keep=keep, replicas=replicas, timeout_s=timeout_s)
    down = [False]
    if root_down:  # this rank's requests go through a proxy that fails them all while `down`
        from s3proxy import FaultProxy

        proxy = FaultProxy(root.options.endpoint_url, every=1, kinds=("error",), when=lambda *_: down[0]).__enter__()
        root = S3Storage(root.location, dataclasses.replace(root.options, endpoint_url=proxy.endpoint, max_attempts=2))
    if die_sending == dist.get_rank():
        import zerostall.tiers.sources as sources

        real = sources.exchange
        sources.exchange = lambda pg, sends, receives, **kw: os._exit(3) if sends else real(pg, sends, receives, **kw)
    with zs.CheckpointManager(root, save_every=SAVE_EVERY, local=tier, fsync=False) as mgr:
        down[0] = root_down
        try:
            start = mgr.restore(state, **restore) or 0
        except zs.CheckpointError as exc:
            return {"error": (type(exc).__name__, str(exc)), "info": mgr.last_restore}
        finally:
            down[0] = False
        info = mgr.last_restore
        resumed = digest(state)
        losses = {}
        for step in range(start + 1, until + 1):
            losses[step] = train_step(state, step)
            if mgr.should_save(step):
                mgr.save(step, state)
        mgr.wait()
        failures = mgr.tier.replicator.failures + mgr.tier.failures
    return {"start": start, "info": info, "losses": losses, "resumed": resumed, "end": digest(state),
            "replication_failures": failures}


# -- the tests -----------------------------------------------------------------------------------
@pytest.fixture
def run(ranks, tmp_path, s3_server, s3_url):
    """A 4-rank pool, the root (on S3) and the node directories' parent, after a run stopped at
    step 23; and the results of a run never stopped."""
    pool = ranks(4)
    options = S3Options(endpoint_url=s3_server.endpoint, region=s3_server.region, access_key_id=s3_server.access_key,
                        secret_access_key=s3_server.secret_key, addressing_style="path")
    root, base = S3Storage(s3_url, options), str(tmp_path / "nodes")
    whole = pool.run(train, str(tmp_path / "reference"), str(tmp_path / "reference-nodes"), END)
    first = pool.run(train, root, base, STOP)
    assert [r["replication_failures"] for r in first] == [0, 0, 0, 0]
    return pool, root, base, whole


def check_resumed(after: list[dict], whole: list[dict], step: int, sources: tuple[str, ...]) -> None:
    for rank, (got, ref) in enumerate(zip(after, whole)):
        assert "error" not in got, got
        assert got["start"] == step and got["info"].step == step
        assert got["info"].sources == sources and got["info"].source == sources[rank]
        assert got["losses"] == {s: ref["losses"][s] for s in range(step + 1, END + 1)}, f"rank {rank}"
        assert got["end"] == ref["end"], f"rank {rank}"


def test_a_restart_on_the_same_nodes_restores_the_newest_step_from_the_local_tier(run):
    pool, root, base, whole = run
    after = pool.run(train, root, base, END)
    check_resumed(after, whole, 20, ("local",) * 4)


def test_a_lost_node_restores_its_ranks_from_replicas_on_the_other_node(run):
    pool, root, base, whole = run
    shutil.rmtree(node_dir(base, "b"))
    after = pool.run_per_rank(train, [(root, base, END, node) for node in ("a", "a", "c", "c")])  # "c": a spare
    check_resumed(after, whole, 20, ("local", "local", "peer", "peer"))
    assert NodeDirectory(node_dir(base, "c"), "x").top.is_dir()


def test_two_nodes_lost_restore_from_the_persistent_tier(run):
    pool, root, base, whole = run
    shutil.rmtree(node_dir(base, "a"))
    shutil.rmtree(node_dir(base, "b"))
    after = pool.run(train, root, base, END)
    check_resumed(after, whole, 12, ("persistent",) * 4)


def copy_files(base: str, node: str, step: int, rank: int) -> list[str]:
    folder = os.path.join(node_dir(base, node), os.listdir(node_dir(base, node))[0], f"step_{step:09d}",
                          f"rank_{rank:05d}")
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def flip_a_byte(file: str) -> None:
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) - 7)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_byte_in_an_own_copy_is_found_and_the_replica_on_the_other_node_used(run, caplog):
    pool, root, base, whole = run
    flip_a_byte(copy_files(base, "a", 20, 1)[0])
    after = pool.run(train, root, base, END)
    check_resumed(after, whole, 20, ("local", "peer", "local", "local"))
    assert "rank 1's copy on node a" in after[0]["info"].fallbacks[0][0]
    assert "checksum" in after[0]["info"].fallbacks[0][1]


def test_a_flipped_byte_in_a_replica_is_found_before_it_is_used_and_an_older_step_restored(run):
    pool, root, base, whole = run
    shutil.rmtree(node_dir(base, "b"))
    flip_a_byte(copy_files(base, "a", 20, 2)[0])  # node a's replica of rank 2
    after = pool.run_per_rank(train, [(root, base, END, node) for node in ("a", "a", "c", "c")])
    check_resumed(after, whole, 15, ("local", "local", "peer", "peer"))
    assert "rank 2's copy on node a" in after[0]["info"].fallbacks[0][0]


def test_a_damaged_own_copy_on_a_rank_that_sends_to_a_peer_falls_back_after_its_sends(run):
    """Rank 0 loads its own copy while it sends rank 2's (node b is lost): its copy is damaged, its
    send completes all the same, and every rank goes to the older step (rank 0's only other copy
    was on node b)."""
    pool, root, base, whole = run
    shutil.rmtree(node_dir(base, "b"))
    flip_a_byte(copy_files(base, "a", 20, 0)[0])
    after = pool.run_per_rank(train, [(root, base, END, node) for node in ("a", "a", "c", "c")])
    check_resumed(after, whole, 15, ("local", "local", "peer", "peer"))
    assert "rank 0's copy on node a" in after[0]["info"].fallbacks[0][0]


def test_every_copy_damaged_and_an_empty_root_is_an_error_not_a_fresh_start(ranks, tmp_path):
    """Copies were tried (received into the state, loaded on other ranks) and all found damaged: the
    restore raises on every rank rather than return None, which would start training afresh from a
    state holding part of what it loaded."""
    pool, root, base = ranks(4), str(tmp_path / "root"), str(tmp_path / "nodes")
    pool.run(train, root, base, 10)  # local steps 5 and 10; the root saves at 12: none
    shutil.rmtree(node_dir(base, "b"))
    for step in (5, 10):
        flip_a_byte(copy_files(base, "a", step, 2)[0])  # node a's replicas of rank 2: its only copies
    after = pool.run_per_rank(train, [(root, base, END, node) for node in ("a", "a", "c", "c")])
    for got in after:
        assert got["error"][0] == "CorruptCheckpointError" and "holds no other checkpoint" in got["error"][1], got
        assert [what.split(",")[0] for what, _ in got["info"].fallbacks] == ["step 10", "step 5"]


def test_a_save_that_never_committed_on_one_rank_restores_the_previous_step(run):
    """As a crash in the middle of rank 3's local save of step 20 leaves it: its data, no manifest."""
    pool, root, base, whole = run
    for node in ("a", "b"):
        os.remove(os.path.join(os.path.dirname(copy_files(base, node, 20, 3)[0]), "manifest.json"))
    after = pool.run(train, root, base, END)
    check_resumed(after, whole, 15, ("local",) * 4)


def test_the_root_unreachable_at_restore_uses_local_and_peer_copies(run):
    pool, root, base, whole = run
    shutil.rmtree(node_dir(base, "b"))
    after = pool.run_per_rank(train, [(root, base, END, node) for node in ("a", "a", "c", "c")], root_down=True)
    check_resumed(after, whole, 20, ("local", "local", "peer", "peer"))


def test_a_flipped_byte_in_the_root_is_found_when_no_other_copy_is_left(run):
    pool, root, base, _ = run
    shutil.rmtree(node_dir(base, "a"))
    shutil.rmtree(node_dir(base, "b"))
    import boto3

    s3 = boto3.client("s3", endpoint_url=root.options.endpoint_url, region_name=root.options.region,
                      aws_access_key_id=root.options.access_key_id,
                      aws_secret_access_key=root.options.secret_access_key)
    bucket, prefix = root.location.removeprefix("s3://").split("/", 1)
    key = next(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step_000000012/")["Contents"]
               if o["Key"].endswith(".safetensors"))
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-7] ^= 0x10
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    after = pool.run(train, root, base, END)
    assert all(r["error"][0] == "CorruptCheckpointError" and "step_000000012" in r["error"][1] for r in after)


def test_a_peer_that_dies_in_the_middle_of_a_restore_fails_every_rank_and_the_next_restore_works(run, ranks):
    """Rank 0 sends rank 2 its copy (node b is lost): it dies instead. Every other rank raises a
    typed error (bounded by the tier's timeout), no hang; the restarted job restores from the peers."""
    pool, root, base, whole = run
    shutil.rmtree(node_dir(base, "b"))
    nodes = [(root, base, END, node) for node in ("a", "a", "c", "c")]
    with pytest.raises(RankError) as failed:
        pool.run_per_rank(train, nodes, die_sending=0, timeout_s=5, timeout=100, death_grace=90)
    assert failed.value.dead == [0] and sorted(failed.value.results) == [1, 2, 3]
    for got in failed.value.results.values():
        assert got["error"][0] == "CheckpointError" and got["info"].step is None
    after = ranks(4).run_per_rank(train, nodes)  # rank 3's copy went into its state, not into node c
    check_resumed(after, whole, 20, ("local", "local", "peer", "peer"))


def test_fallback_false_refuses_a_damaged_copy_and_a_damaged_manifest_is_a_damaged_copy(run):
    """A copy whose manifest is damaged was left out without a trace: a restore with
    ``fallback=False`` went to the replica all the same, and none recorded it. Damage under
    ``fallback=False`` was a plain CheckpointError, with nothing in ``last_restore``."""
    pool, root, base, whole = run
    flip_a_byte(copy_files(base, "a", 20, 0)[0])
    manifest = os.path.join(os.path.dirname(copy_files(base, "a", 20, 1)[0]), "manifest.json")
    flip_a_byte(manifest)
    for got in pool.run(train, root, base, END, fallback=False):
        assert got["error"][0] == "CorruptCheckpointError" and "fallback=True" in got["error"][1], got
        assert [what for what, _ in got["info"].fallbacks] == ["step 20, rank 0's copy on node a (local)",
                                                               "step 20, rank 1's copy on node a (local)"]
    after = pool.run(train, root, base, END)
    check_resumed(after, whole, 20, ("peer", "peer", "local", "local"))
    assert "manifest.json fails its checksum" in dict(after[1]["info"].fallbacks)["step 20, rank 1's copy on node a "
                                                                                    "(local)"]


# -- pieces ----------------------------------------------------------------------------------------
def test_local_tier_options_are_checked_when_built():
    for bad in ({"every": 0}, {"keep": -1}, {"replicas": 1.5}, {"run_id": "a/b"}, {"timeout_s": 0}, {"every": True}):
        with pytest.raises(ValueError, match=f"LocalTier.{next(iter(bad))}"):
            LocalTier("/tmp/x", **bad)
    with pytest.raises(ValueError, match="LocalTier.directory"):
        LocalTier("")


def test_start_up_removes_other_runs_and_unfinished_copies_and_keeps_committed_ones(tmp_path):
    """Removed: a copy that never committed, a replica still arriving at start-up; at the first
    save, a run no process holds any more. Kept: a run still held (another job on the node), and
    every folder that is not a run's: the whole checkpoint root once went, when it lay in the
    tier's directory."""
    ended, live = NodeDirectory(str(tmp_path), "run-0"), NodeDirectory(str(tmp_path), "run-live")
    for other in (ended, live):
        other.claim()
        os.makedirs(other.step_path(5))
    ended.release()  # run-0's job ended (or crashed); run-live's lives on
    os.makedirs(tmp_path / "ckpt" / "step_000000030")  # the root, or a dataset
    d = NodeDirectory(str(tmp_path), "run-1")
    d.claim()
    zs.save({"w": torch.ones(3)}, str(d.copy_path(10, 0)))
    os.makedirs(d.copy_path(20, 0))
    (d.copy_path(20, 0) / "data-x.safetensors").write_bytes(b"partial")
    os.makedirs(d.step_path(20) / ".incoming-rank_00001-abc")
    d.clean_at_start()
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "run-0", "run-1", "run-live"] and d.holdings() == {10: [0]}
    assert not d.copy_path(20, 0).exists() and not (d.step_path(20) / ".incoming-rank_00001-abc").exists()
    d.remove_other_runs()
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "run-1", "run-live"]
    assert os.listdir(tmp_path / "ckpt") == ["step_000000030"] and d.holdings() == {10: [0]}
    d.release()
    live.release()


def test_two_managers_sharing_a_node_directory_each_restore_their_own_steps_after_a_requeue(tmp_path):
    """Two managers of one job (two roots) with their local tiers in one directory: at the
    requeued job's start, the first manager built removed the second's run folder, which no process
    held yet, and the second started afresh beside its lost steps. Other runs go at the first save."""
    node = str(tmp_path / "node")

    def job(*steps: int) -> tuple[int | None, int | None]:
        a, b = {"w": torch.full((100,), 1.0)}, {"ema": torch.full((100,), 2.0)}
        ma = zs.CheckpointManager(str(tmp_path / "a"), save_every=100, local=LocalTier(node, every=5))
        mb = zs.CheckpointManager(str(tmp_path / "b"), save_every=100, local=LocalTier(node, every=5))
        try:
            got = ma.restore(a), mb.restore(b)
            for step in steps:  # the local tier only (save() without should_save() writes the root too)
                assert ma.should_save(step) and mb.should_save(step)
                ma.save(step, a)
                mb.save(step, b)
            return got
        finally:
            ma.close()
            mb.close()

    assert job(5, 10) == (None, None)
    finished = NodeDirectory(node, "run-finished")  # a finished job's, held by no process
    finished.claim()
    finished.release()
    assert job() == (10, 10) and len(os.listdir(node)) == 3
    assert job(15) == (10, 10) and len(os.listdir(node)) == 2  # the finished one went at the first save


def test_a_copy_dropped_before_replication_is_gone_at_once_and_its_step_can_be_written_anew(tmp_path):
    """A dropped copy was deleted where it lay, in a thread of its own: a save of the same step
    made meanwhile (a run that went back) wrote into the folder being deleted, and lost files."""
    d = NodeDirectory(str(tmp_path), "run-1")
    d.claim()
    zs.save({"w": torch.ones(3)}, str(d.copy_path(10, 0)))
    aside = d.set_aside(10, 0)
    assert aside is not None and aside.parent == d.step_path(10) and (aside / MANIFEST_NAME).is_file()
    assert d.holdings() == {} and not d.copy_path(10, 0).exists() and d.set_aside(10, 0) is None
    zs.save({"w": torch.full((3,), 2.0)}, str(d.copy_path(10, 0)))  # written anew beside the one set aside
    shutil.rmtree(aside)
    assert d.holdings() == {10: [0]} and float(zs.open(str(d.copy_path(10, 0))).read("w")[0]) == 2.0
    d.set_aside(10, 0)
    d.clean_at_start()  # one left by a crash is removed at start-up
    assert d.holdings() == {} and not d.step_path(10).exists()
    d.release()


def test_a_step_saved_twice_while_replication_lags_keeps_its_new_copy(tmp_path, monkeypatch):
    """Step 2 saved twice (a final save of the last step) while the worker was still on step 1:
    the first save of step 2 was dropped, taken for a step some rank lacks, and retention deleted
    the step's folder, with the second save's copy in it: a restore took step 1."""
    from zerostall.tiers.replication import Replicator

    retire = Replicator._retire

    def busy_on_step_1(self, step, *args):
        if step == 1:
            time.sleep(1.0)
        return retire(self, step, *args)

    monkeypatch.setattr(Replicator, "_retire", busy_on_step_1)
    tier = zs.LocalTier(str(tmp_path / "node"), every=1, keep=2, replicas=1)
    with zs.CheckpointManager(str(tmp_path / "root"), save_every=10_000, fsync=False, local=tier) as mgr:
        for step, value in ((1, 1.0), (2, 2.0), (2, 22.0)):
            mgr.save(step, single_state(value))
        mgr.wait()
        assert mgr.tier.directory.holdings() == {1: [0], 2: [0]} and mgr.tier.replicator.dropped == 0
    state = single_state(-1.0)
    with zs.CheckpointManager(str(tmp_path / "root"), local=tier) as mgr:
        assert mgr.restore(state) == 2 and float(state["w"][0]) == 22.0 and mgr.last_restore.source == "local"


def test_a_step_saved_again_after_its_replication_began_is_not_dropped_by_the_next_save(tmp_path, monkeypatch):
    """Step 2 saved again while the worker retired its first save, then step 3 saved: the second
    save of step 2 was dropped, which set aside step 2's one copy (the one just replicated, the
    step kept for a lost node), and its folder was deleted as a step some rank lacks: while step 3
    was written, no step was left to restore."""
    from zerostall.tiers.replication import Replicator

    retire, held = Replicator._retire, {}

    def busy_retiring_step_2(self, step, *args):
        held[step] = self.directory.holdings()
        if step == 2 and len(held) == 2:
            time.sleep(1.0)
        return retire(self, step, *args)

    monkeypatch.setattr(Replicator, "_retire", busy_retiring_step_2)
    tier = zs.LocalTier(str(tmp_path / "node"), every=1, keep=1, replicas=1)
    with zs.CheckpointManager(str(tmp_path / "root"), save_every=10_000, fsync=False, local=tier) as mgr:
        for step in (1, 2, 2, 3):
            mgr.save(step, single_state(float(step)))
        mgr.wait()
        assert mgr.tier.replicator.dropped == 0 and 2 in held[3], held


def test_every_spelling_of_a_root_directory_names_one_run(tmp_path):
    """The run id hashed the root as spelled: through a symbolic link the restarted job was another
    run, and its start-up removed the run's own local steps."""
    from zerostall.tiers.local import run_id_for

    (tmp_path / "root").mkdir()
    os.symlink(tmp_path / "root", tmp_path / "link")
    ids = {run_id_for(str(p)) for p in (tmp_path / "root", tmp_path / "link", f"{tmp_path}/./root/", f"/{tmp_path}/root")}
    assert len(ids) == 1


def test_too_little_space_is_a_typed_error_with_the_numbers(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(zs.InsufficientSpaceError, match=rf"needs {free * 2} bytes .* has \d+ bytes free"):
        check_space(str(tmp_path), free * 2, 0)
    check_space(str(tmp_path), free // 2, 0)


def one_node_save_and_restore(root: str, base: str) -> tuple:
    os.environ["ZEROSTALL_NODE_ID"] = "only"
    handler = logging.Handler()
    seen: list[str] = []
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zerostall").addHandler(handler)
    logging.getLogger("zerostall").setLevel(logging.INFO)
    try:
        state = make_state()
        with zs.CheckpointManager(root, local=zs.LocalTier(base, every=1, replicas=2), fsync=False) as mgr:
            train_step(state, 1)
            mgr.save(1, state) if mgr.should_save(1) else None
            mgr.wait()
        after = make_state()
        with zs.CheckpointManager(root, local=zs.LocalTier(base, every=1, replicas=2), fsync=False) as mgr:
            step = mgr.restore(after)
        return step, mgr.last_restore.sources, digest(after) == digest(state), seen
    finally:
        logging.getLogger("zerostall").removeHandler(handler)


def test_one_node_keeps_its_own_copies_and_says_there_is_no_replica(ranks, tmp_path):
    out = ranks(2).run(one_node_save_and_restore, str(tmp_path / "root"), str(tmp_path / "node"))
    for step, sources, same, seen in out:
        assert step == 1 and sources == ("local", "local") and same
    assert any("one node, so no replicas" in m for m in out[0][3])


def single_state(value: float) -> dict:
    return {"w": torch.full((1000,), value), "b": torch.arange(10.0) * value, "step": int(value)}


@pytest.mark.parametrize("async_save", [False, True])
def test_a_step_due_in_both_tiers_copies_the_state_once(tmp_path, monkeypatch, async_save):
    """The root's save of a step the local tier saves too takes every tensor from the local capture."""
    from zerostall.saving.capture import Captured

    taken: list[int] = []
    take = Captured.take
    monkeypatch.setattr(Captured, "take", lambda self, items, recorded: taken.append(take(self, items, recorded))
                        or taken[-1])
    state = single_state(3.0)
    with zs.CheckpointManager(tmp_path / "root", save_every=2, async_save=async_save, fsync=False,
                              local=zs.LocalTier(str(tmp_path / "node"), every=2)) as mgr:
        assert mgr.should_save(2)
        mgr.save(2, state)
        mgr.wait()
    assert taken == [3]  # every tensor of the root's save was found in the local capture: w, b, the torch RNG state
    for path in (tmp_path / "root", tmp_path / "node"):
        got = zs.load(single_state(0.0), str(path / "step_000000002") if path.name == "root" else
                      str(next((path).glob("run-*/step_000000002/rank_00000"))))
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"]) and got["step"] == 3


def test_one_process_restores_from_the_local_tier_before_the_older_root(tmp_path):
    state = single_state(1.0)
    with zs.CheckpointManager(tmp_path / "root", save_every=4, fsync=False,
                              local=zs.LocalTier(str(tmp_path / "node"), every=1, keep=1)) as mgr:
        for step in range(1, 7):
            state = single_state(float(step))
            if mgr.should_save(step):
                mgr.save(step, state)
    target = single_state(0.0)
    with zs.CheckpointManager(tmp_path / "root", local=zs.LocalTier(str(tmp_path / "node"), every=1)) as mgr:
        assert mgr.restore(target) == 6
        assert mgr.last_restore.sources == ("local",) and mgr.last_restore.tag == "step_000000006"
    assert torch.equal(target["w"], state["w"]) and target["step"] == 6
    steps = sorted(p.name for p in (tmp_path / "node").glob("run-*/step_*"))
    assert steps == ["step_000000006"]  # keep=1: retention after the last save's commit keeps the newest


def test_retention_never_deletes_the_local_save_still_being_written(tmp_path, monkeypatch):
    """The next save's retention ran while the last one was still writing (slower than `every` steps):
    it saw no committed copy of that step and deleted its folder: that save failed, or its copy was lost."""
    from zerostall.saving import pipeline

    reached, release, publish = threading.Event(), threading.Event(), pipeline.publish_manifest

    def held_back(*args, **kwargs):  # the first save stops before its commit until retention has run
        reached.set()
        release.wait(2)  # fixed code retires only after the commit: it goes on after 2 s
        return publish(*args, **kwargs)

    monkeypatch.setattr(pipeline, "publish_manifest", held_back)
    state = {"w": torch.arange(1000.0)}
    tier = zs.LocalTier(str(tmp_path / "node"), every=1, keep=2, replicas=1)
    with zs.CheckpointManager(str(tmp_path / "root"), local=tier, fsync=False) as mgr:
        directory = mgr.tier.directory
        remove_steps = directory.remove_steps
        directory.remove_steps = lambda steps: (remove_steps(steps), release.set())  # type: ignore[method-assign]
        assert mgr.should_save(1)
        first = mgr.save(1, state)
        assert reached.wait(60)
        assert mgr.should_save(2)
        mgr.save(2, state)
        first.result()
        mgr.wait()
        assert sorted(directory.holdings()) == [1, 2]
        zs.verify(str(directory.copy_path(1, 0)))


def test_retention_never_deletes_a_step_that_appeared_after_it_listed_the_steps(tmp_path):
    """The next save created its folder between retention's listing of the steps and its deletions
    (seen in CI: a failed step's retention deleted the next step's folder while it was written)."""
    state = {"w": torch.arange(1000.0)}
    tier = zs.LocalTier(str(tmp_path / "node"), every=1, keep=1, replicas=1)
    with zs.CheckpointManager(str(tmp_path / "root"), local=tier, fsync=False) as mgr:
        directory = mgr.tier.directory
        steps = directory.steps

        def next_save_starts():  # the listing, then the next step's folder, as the next save makes it
            listed = steps()
            directory.copy_path(99, 0).mkdir(parents=True, exist_ok=True)
            return listed

        directory.steps = next_save_starts  # type: ignore[method-assign]
        for step in (1, 2):
            mgr.save(step, state)
        mgr.wait()
        assert directory.copy_path(99, 0).is_dir() and 2 in directory.steps() and 1 not in directory.steps()


def test_a_failed_local_save_is_counted_and_training_goes_on(tmp_path, monkeypatch):
    from zerostall.saving import pipeline

    publish, calls = pipeline.publish_manifest, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return publish(*args, **kwargs)

    monkeypatch.setattr(pipeline, "publish_manifest", fails_once)
    tier = zs.LocalTier(str(tmp_path / "node"), every=1, keep=1, replicas=1)
    with zs.CheckpointManager(str(tmp_path / "root"), local=tier, fsync=False) as mgr:
        for step in (1, 2):
            assert mgr.should_save(step)
            mgr.save(step, single_state(float(step)))
        mgr.wait()
        assert mgr.tier.failures == 1 and sorted(mgr.tier.directory.holdings()) == [2]
    target = single_state(0.0)
    with zs.CheckpointManager(str(tmp_path / "root"), local=tier) as mgr:
        assert mgr.restore(target) == 2 and target["step"] == 2


def restore_elsewhere(root: Any, base: str) -> tuple:
    os.environ["ZEROSTALL_NODE_ID"] = "a"
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zerostall").addHandler(handler)
    try:
        state = make_state()
        with zs.CheckpointManager(root, local=zs.LocalTier(node_dir(base, "a"), every=EVERY)) as mgr:
            step = mgr.restore(state, strict=False)
        return step, mgr.last_restore.sources, seen
    finally:
        logging.getLogger("zerostall").removeHandler(handler)


def test_another_world_size_with_an_empty_root_is_refused_and_deletes_nothing(ranks, tmp_path):
    """The root held no checkpoint yet: the restore on 2 ranks returned None (a fresh start), and the
    manager then deleted every step of the local tier, the run's only checkpoints."""
    root, base = str(tmp_path / "root"), str(tmp_path / "nodes")
    ranks(4).run(train, root, base, 10)  # local steps 5 and 10; the root saves at 12: none
    held = sorted(p for p, _, files in os.walk(base) if "manifest.json" in files)
    for got in ranks(2).run(refused_elsewhere, root, base):
        assert got[0] == "StateMismatchError" and "holds steps [10, 5]" in got[1] and "nothing deleted" in got[1], got
    assert sorted(p for p, _, files in os.walk(base) if "manifest.json" in files) == held and len(held) == 16


def refused_elsewhere(root: Any, base: str) -> tuple[str, str]:
    try:
        return ("returned", repr(restore_elsewhere(root, base)))
    except zs.CheckpointError as exc:
        return (type(exc).__name__, str(exc))


def test_another_world_size_restores_from_the_root_and_says_why(run, ranks):
    _, root, base, _ = run
    out = ranks(2).run(restore_elsewhere, root, base)
    assert [(step, sources) for step, sources, _ in out] == [(12, ("persistent", "persistent"))] * 2
    assert any("holds a good copy of every rank's state saved from the layout the ranks have now (another world "
               "size or mesh" in m for m in out[0][2])


def replication_of_step_10_held_back(root: str, base: str) -> dict:
    """Step 5's replication waits until step 10 is saved on this rank; step 10's waits until the
    node's holdings were read. Returns this node's holdings while step 10 is not replicated yet."""
    import threading

    import zerostall.tiers.replication as replication

    os.environ["ZEROSTALL_NODE_ID"] = NODES[dist.get_rank()]
    real, saved_10, at_10, looked = replication.exchange, threading.Event(), threading.Event(), threading.Event()

    def held(pg, sends, receives, **kw):
        step = kw["step"]
        if step == 5:
            saved_10.wait(60)
        if step == 10:
            at_10.set()
            looked.wait(60)
        return real(pg, sends, receives, **kw)

    replication.exchange = held
    try:
        state = make_state()
        tier = zs.LocalTier(node_dir(base, NODES[dist.get_rank()]), every=5, keep=1, replicas=2, timeout_s=60)
        with zs.CheckpointManager(root, local=tier, fsync=False) as mgr:
            for step in range(1, 11):
                train_step(state, step)
                if mgr.should_save(step):
                    mgr.save(step, state)
            mgr.tier.saver.wait()
            saved_10.set()
            assert at_10.wait(60)  # step 5 was replicated and retention ran after it
            dist.barrier()
            holdings = mgr.tier.directory.holdings()
            dist.barrier()
            looked.set()
            mgr.wait()
        return holdings
    finally:
        replication.exchange = real


def test_a_step_is_kept_until_the_newer_one_is_replicated_everywhere(ranks, tmp_path):
    """Retention ran after step 5's replication while step 10 was saved but not yet replicated: it
    deleted step 5, so losing a node then lost both steps."""
    out = ranks(4).run(replication_of_step_10_held_back, str(tmp_path / "root"), str(tmp_path / "nodes"))
    for holdings in out:
        assert holdings[5] == [0, 1, 2, 3]


def test_a_local_tier_inside_the_root_is_refused_before_anything_is_written(tmp_path):
    """The tier's folder inside the root worked once, then the restarted manager refused the root
    (files that are not checkpoints): refused up front now, naming both."""
    root = tmp_path / "root"
    with pytest.raises(zs.InvalidPathError, match="inside the checkpoint root"):
        zs.CheckpointManager(str(root), local=zs.LocalTier(str(root / "local"), every=1, replicas=1))
    assert not root.exists() or not any(root.iterdir())
    with zs.CheckpointManager(str(root), local=zs.LocalTier(str(tmp_path / "node"), every=1, replicas=1)) as mgr:
        mgr.save(1, single_state(1.0))  # beside the root: fine


def manager_with_a_tier_over_a_subgroup(root: str, base: str) -> tuple[str | None, float]:
    """Ranks 0 and 1 of 3 start a manager with a local tier over their own group; then every rank
    makes a group together and all-reduces on it: what the manager raised, and the sum."""
    from datetime import timedelta

    os.environ["ZEROSTALL_NODE_ID"] = "abc"[dist.get_rank()]
    sub = dist.new_group([0, 1])
    refused = None
    if dist.get_rank() < 2:
        try:
            with zs.CheckpointManager(root, process_group=sub, local=zs.LocalTier(node_dir(base, "ab"[dist.get_rank()]),
                                                                                   every=1, replicas=2, timeout_s=5)):
                pass
        except zs.CheckpointError as exc:
            refused = str(exc)
        with zs.CheckpointManager(root, process_group=sub) as mgr:  # the refused one let go of the root
            mgr.save(1, single_state(1.0))
    everyone = dist.new_group([0, 1, 2], timeout=timedelta(seconds=10))
    total = torch.ones(1)
    dist.all_reduce(total, group=everyone)
    dist.destroy_process_group(everyone)
    dist.destroy_process_group(sub)
    return refused, total.item()


def test_a_local_tier_over_part_of_the_job_is_refused_and_the_jobs_next_group_still_forms(ranks, tmp_path):
    """Its own group made by two of three ranks put torch's count of groups out of step on the
    third, so the job's next group hung until its timeout: refused up front, saying why."""
    out = ranks(3).run(manager_with_a_tier_over_a_subgroup, str(tmp_path / "root"), str(tmp_path / "nodes"))
    assert [total for _, total in out] == [3.0] * 3
    assert out[2][0] is None
    for refused, _ in out[:2]:
        assert refused is not None and "every rank of the job" in refused and "2 of its 3 ranks" in refused


def replication_of_step_20_fails_then_node_a_is_lost(base: str) -> tuple[dict, Any]:
    """Two ranks on nodes a and b, a local save every 10 steps; node b cannot take rank 0's copy of
    step 20 (its disk full); then node a is lost: what node b held, and what a restore gives."""
    from zerostall.tiers import transfer

    rank = dist.get_rank()
    real = transfer._publish

    def publish(incoming: Any, final: Any) -> None:
        if rank == 1 and final.parent.name == "step_000000020":
            raise OSError(28, "No space left on device")
        real(incoming, final)

    os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    node = os.path.join(base, "node-" + "ab"[rank])
    tier = zs.LocalTier(node, every=10, keep=1, replicas=2, timeout_s=60)
    transfer._publish = publish
    try:
        with zs.CheckpointManager(os.path.join(base, "root"), save_every=1000, fsync=False, local=tier) as mgr:
            for step in range(1, 21):
                if mgr.should_save(step):  # the local tier's steps 10 and 20
                    mgr.save(step, single_state(100.0 * rank + step))
            mgr.wait()
            held = mgr.tier.directory.holdings()
    finally:
        transfer._publish = real
    dist.barrier()
    if rank == 0:
        shutil.rmtree(node)
    dist.barrier()
    state = single_state(-1.0)
    with zs.CheckpointManager(os.path.join(base, "root"), fsync=False, local=tier) as mgr:
        return held, (mgr.restore(state), float(state["w"][0]), mgr.last_restore.sources)


def test_a_step_whose_replication_failed_does_not_retire_the_last_replicated_one(ranks, tmp_path):
    """Step 20 could not be replicated (node b's disk was full), yet counted as replicated, so
    retention deleted step 10: losing node a then left nothing to restore."""
    (held_a, _), (held_b, restored_b) = ranks(2).run(replication_of_step_20_fails_then_node_a_is_lost, str(tmp_path))
    assert held_b == {10: [0, 1], 20: [1]}
    assert restored_b == (10, 110.0, ("peer", "local"))


def test_an_io_error_listing_a_local_copy_is_raised_not_taken_for_damage(tmp_path, monkeypatch):
    """An I/O error reading step 35's manifest left the copy out: the restore quietly took step 30."""
    import errno

    from zerostall.tiers import sources

    def manager() -> zs.CheckpointManager:
        return zs.CheckpointManager(str(tmp_path / "root"), save_every=100, fsync=False,
                                    local=zs.LocalTier(str(tmp_path / "node"), every=5, keep=2, replicas=1))

    with manager() as mgr:
        for step in (30, 35):
            mgr.save(step, single_state(float(step)))
    real = sources.read_manifest_head

    def flaky(storage: Any) -> Any:
        if "step_000000035" in storage.location:
            raise OSError(errno.EIO, "Input/output error")
        return real(storage)

    monkeypatch.setattr(sources, "read_manifest_head", flaky)
    state = single_state(0.0)
    with manager() as mgr, pytest.raises(zs.CheckpointError, match="cannot list the local tier .*Input/output error"):
        mgr.restore(state)
    monkeypatch.setattr(sources, "read_manifest_head", real)
    with manager() as mgr:
        assert mgr.restore(state) == 35 and state["step"] == 35


def test_a_rollback_leaves_no_newer_local_step_for_a_later_restore(tmp_path):
    """After a restore of root step 20, the local tier still held step 50 of the abandoned run:
    the next restore took it over the new run's step 30."""
    def manager() -> zs.CheckpointManager:
        return zs.CheckpointManager(str(tmp_path / "root"), save_every=10, fsync=False,
                                    local=zs.LocalTier(str(tmp_path / "node"), every=5, keep=1, replicas=1))

    with manager() as mgr:
        for step in range(1, 51):
            if mgr.should_save(step):
                mgr.save(step, single_state(1000.0 + step))
    state = single_state(0.0)
    with manager() as mgr:
        assert mgr.restore(state, tag="step_000000020") == 20 and state["step"] == 1020
        assert mgr.tier.directory.steps() == []
        for step in range(21, 31):
            if mgr.should_save(step):
                mgr.save(step, single_state(2000.0 + step))
    with manager() as mgr:
        assert mgr.restore(state) == 30 and state["step"] == 2030 and mgr.last_restore.source == "local"


FAILS_AT = {0: 30, 1: 20}  # the step whose local save fails on each rank


def saves_failing_on_other_steps(root: str, base: str) -> tuple:
    """Steps 10, 20, 30 with keep=1: rank 0's save of 30 fails, rank 1's of 20; only 10 is whole."""
    from zerostall.saving import pipeline

    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    publish = pipeline.publish_manifest

    def full_disk(storage: Any, *args: Any, **kwargs: Any) -> Any:
        if step_tag(FAILS_AT[rank]) in storage.location:
            raise OSError(28, "No space left on device")
        return publish(storage, *args, **kwargs)

    tier = zs.LocalTier(node_dir(base, "ab"[rank]), every=10, keep=1, replicas=2, timeout_s=20)
    pipeline.publish_manifest = full_disk
    try:
        with zs.CheckpointManager(root, save_every=1000, local=tier, fsync=False) as mgr:
            for step in (10, 20, 30):
                assert mgr.should_save(step)
                mgr.save(step, single_state(float(step)))
                mgr.wait()
            held = sorted(mgr.tier.directory.holdings())
    finally:
        pipeline.publish_manifest = publish
    target = single_state(0.0)
    with zs.CheckpointManager(root, save_every=1000, local=tier, fsync=False) as mgr:
        return held, mgr.restore(target), target["step"]


def test_retention_keeps_the_newest_step_every_rank_saved_not_the_newest_of_each(ranks, tmp_path):
    """The ranks agreed on the minimum of each rank's newest saved step (20 here), which no rank
    had whole: step 10, the only whole one, was deleted, and the restore started from scratch."""
    out = ranks(2).run(saves_failing_on_other_steps, str(tmp_path / "root"), str(tmp_path / "nodes"), timeout=240)
    assert out == [([10], 10, 10)] * 2  # the steps missing a rank's copy are gone; 10 restores


def runs_on_one_root(root: str, base: str, run: int, last: int, restore: bool | str, nodes: str = "ab") -> tuple:
    """Run ``run`` on ``nodes`` (one a rank): restore (a tag of the root's, when ``restore`` is
    one) or not, then save steps 10 to ``last``, each of value 1000 * run + step; returns the step
    restored, its value and where each rank's state came from."""
    node = os.environ["ZEROSTALL_NODE_ID"] = nodes[dist.get_rank()]
    tier = zs.LocalTier(node_dir(base, node), every=10, keep=1, replicas=2, timeout_s=20)
    target = single_state(-1.0)
    with zs.CheckpointManager(root, save_every=20, local=tier, fsync=False) as mgr:
        restored = mgr.restore(target, **({"tag": restore} if isinstance(restore, str) else {})) if restore else None
        for step in range(10, last + 1, 10):
            assert mgr.should_save(step)
            mgr.save(step, single_state(float(1000 * run + step)))
        mgr.wait()
    return restored, target["step"], mgr.last_restore.sources if restore else None


def test_a_run_that_starts_anew_drops_the_local_steps_of_the_run_before(ranks, tmp_path):
    """A run that restored nothing and saved up to step 20 left the earlier run's local step 40 on
    the nodes (the root set its own step 40 aside): the next restore loaded that abandoned step."""
    root, base = str(tmp_path / "root"), str(tmp_path / "nodes")
    ranks(2).run(runs_on_one_root, root, base, 1, 40, False, timeout=240)
    ranks(2).run(runs_on_one_root, root, base, 2, 20, False, timeout=240)  # starts anew: no restore
    assert ranks(2).run(runs_on_one_root, root, base, 3, 0, True, timeout=240) == [(20, 2020, ("local",) * 2)] * 2


def test_a_node_that_missed_a_job_brings_back_none_of_its_abandoned_steps(ranks, tmp_path):
    """Run 1 on nodes a, b saved step 10; run 2 on a, c started anew and saved its own step 10;
    run 3 on a, b took rank 1's step 10 from b, run 1's (1010), beside rank 0's from run 2 (2010)."""
    root, base = str(tmp_path / "root"), str(tmp_path / "nodes")
    ranks(2).run(runs_on_one_root, root, base, 1, 10, False, "ab", timeout=240)
    ranks(2).run(runs_on_one_root, root, base, 2, 10, False, "ac", timeout=240)  # starts anew, without b
    got = ranks(2).run(runs_on_one_root, root, base, 3, 0, True, "ab", timeout=240)
    assert got == [(10, 2010, ("local", "peer"))] * 2
    assert NodeDirectory(node_dir(base, "b"), os.listdir(node_dir(base, "b"))[0]).steps() == []  # deleted by run 3


def test_a_node_that_missed_a_job_keeps_the_steps_the_run_went_through_and_drops_those_after(ranks, tmp_path):
    """Node b missed run 2 (on a, c: it went on from step 30) and run 5 (on a, c: a rollback to the
    root's step 20). Run 4 on a, b took its rank 1 from the peer: b's own step 30, which run 2 went on
    from, was dropped as an abandoned timeline's. Run 6 must take none of b's step 30, which the
    rollback left."""
    root, base = str(tmp_path / "root"), str(tmp_path / "nodes")
    ranks(2).run(runs_on_one_root, root, base, 1, 30, False, "ab", timeout=240)
    got = ranks(2).run(runs_on_one_root, root, base, 2, 0, True, "ac", timeout=240)
    assert got == [(30, 1030, ("local", "peer"))] * 2
    assert ranks(2).run(runs_on_one_root, root, base, 4, 0, True, "ab", timeout=240) == [(30, 1030, ("local",) * 2)] * 2
    ranks(2).run(runs_on_one_root, root, base, 5, 0, "step_000000020", "ac", timeout=240)  # a rollback without b
    b = NodeDirectory(node_dir(base, "b"), os.listdir(node_dir(base, "b"))[0])
    assert 30 in b.steps()
    got = ranks(2).run(runs_on_one_root, root, base, 6, 0, True, "ab", timeout=240)
    assert got == [(20, 1020, ("persistent",) * 2)] * 2
    assert b.steps() == []  # its step 30 was of the timeline the rollback left


def test_a_tier_directory_that_cannot_be_made_is_a_typed_error(tmp_path):
    """A bare NotADirectoryError came out of the manager (the root's own start-up wraps its errors)."""
    (tmp_path / "a-file").write_text("")
    tier = zs.LocalTier(str(tmp_path / "a-file" / "zs"), every=1)
    with pytest.raises(zs.CheckpointError, match="cannot prepare the local tier in .*a-file"):
        zs.CheckpointManager(str(tmp_path / "root"), local=tier)


def restore_with_a_peer_copy_missing_a_file(root: str, base: str) -> tuple:
    """Steps 10 and 20 on nodes a and b; then node b is lost, and node a's replica of rank 1 at
    step 20 lost a data file: rank 1's only copy of step 20 is incomplete."""
    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    tier = zs.LocalTier(node_dir(base, "ab"[rank]), every=10, keep=2, replicas=2, timeout_s=30)
    with zs.CheckpointManager(root, fsync=False, local=tier) as mgr:
        for step in (10, 20):
            assert mgr.should_save(step)
            mgr.save(step, single_state(float(100 * rank + step)))
        mgr.wait()
        directory = mgr.tier.directory
    dist.barrier()
    if rank == 1:
        shutil.rmtree(node_dir(base, "b"))
    else:
        copy = directory.copy_path(20, 1)
        os.unlink(copy / next(n for n in sorted(os.listdir(copy)) if n.endswith(".safetensors")))
    dist.barrier()
    target = single_state(-1.0)
    with zs.CheckpointManager(root, fsync=False, local=tier) as mgr:
        step = mgr.restore(target)
        return step, mgr.last_restore.sources, target["step"], [why for why, _ in mgr.last_restore.fallbacks]


def test_a_peer_copy_missing_a_file_falls_back_like_a_damaged_one(ranks, tmp_path):
    """The sender's failure to open the copy reached the receiver as a plain error: the restore
    raised on every rank, where a damaged copy makes them fall back together (here to step 10)."""
    out = ranks(2).run(restore_with_a_peer_copy_missing_a_file, str(tmp_path / "root"), str(tmp_path / "nodes"),
                       timeout=240)
    for rank, (step, sources, value, fallbacks) in enumerate(out):
        assert (step, sources, value) == (10, ("local", "peer"), 100 * rank + 10)
        assert fallbacks == ["step 20, rank 1's copy on node a (peer)"]


def restart_then_a_replication_fails(root: str, base: str) -> dict:
    """keep=1: steps 10, 20 saved and replicated; a restart restores 20; step 30's replication fails."""
    from zerostall.tiers import replication

    rank = dist.get_rank()
    os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    tier = zs.LocalTier(node_dir(base, "ab"[rank]), every=10, keep=1, replicas=2, timeout_s=30)
    with zs.CheckpointManager(root, save_every=1000, fsync=False, local=tier) as mgr:
        for step in (10, 20):
            assert mgr.should_save(step)
            mgr.save(step, single_state(float(step)))
        mgr.wait()
    exchange = replication.exchange

    def fails_at_30(pg: Any, sends: Any, receives: Any, *, step: int, **kwargs: Any) -> Any:
        if step == 30:
            raise OSError(28, "No space left on device")  # a node's RAM disk full: the replica does not fit
        return exchange(pg, sends, receives, step=step, **kwargs)

    target = single_state(-1.0)
    replication.exchange = fails_at_30
    try:
        with zs.CheckpointManager(root, save_every=1000, fsync=False, local=tier) as mgr:
            assert mgr.restore(target) == 20
            assert mgr.should_save(30)
            mgr.save(30, single_state(30.0))
            mgr.wait()
            return mgr.tier.directory.holdings()
    finally:
        replication.exchange = exchange


def test_after_a_restart_the_restored_step_is_kept_until_a_newer_one_is_replicated(ranks, tmp_path):
    """A restarted process knew no step as replicated: the first failed replication deleted the
    restored step, the only one with copies on two nodes (a node lost then restored nothing)."""
    out = ranks(2).run(restart_then_a_replication_fails, str(tmp_path / "root"), str(tmp_path / "nodes"), timeout=240)
    assert all(20 in held and 30 in held for held in out), out


def timeline_not_recorded_on_b(root: str, base: str, fail: bool) -> tuple:
    """Restore (nodes a and b); with ``fail``, node b cannot record the job's timeline (a full disk)."""
    node = os.environ["ZEROSTALL_NODE_ID"] = "ab"[dist.get_rank()]
    real = NodeDirectory.set_timeline
    if fail and node == "b":
        def full(self, timeline):
            raise OSError(28, "No space left on device")
        NodeDirectory.set_timeline = full
    tier = zs.LocalTier(node_dir(base, node), every=10, keep=1, replicas=1, timeout_s=20)
    target = single_state(-1.0)
    try:
        with zs.CheckpointManager(root, save_every=1000, local=tier, fsync=False) as mgr:
            return mgr.restore(target), target["step"], mgr.last_restore.sources
    except zs.CheckpointError as exc:
        return type(exc).__name__, str(exc)[:200]
    finally:
        NodeDirectory.set_timeline = real


def test_a_node_that_took_part_in_a_job_but_could_not_record_its_timeline_is_not_taken_for_absent(ranks, tmp_path):
    """Node a recorded job 2's timeline, node b's disk was full: job 3 took b for a node that missed
    job 2 and used none of its copies (with one replica: rank 1's only ones), and refused or went
    back to the root's older step."""
    root, base = str(tmp_path / "root"), str(tmp_path / "nodes")
    ranks(2).run(runs_on_one_root, root, base, 1, 10, False, "ab", timeout=240)
    failed = ranks(2).run(timeline_not_recorded_on_b, root, base, True)
    assert all(kind == "CheckpointError" and "timeline could not be recorded" in message for kind, message in failed), \
        failed
    assert ranks(2).run(timeline_not_recorded_on_b, root, base, False) == [(10, 1010.0, ("local", "local"))] * 2


def test_a_first_local_save_that_never_committed_everywhere_is_a_fresh_start(ranks, tmp_path):
    """Killed during the first local save: rank 0's copy of step 10 committed, rank 1's did not. The
    restore refused (the tier held a step it could not use) at every restart, though nothing could
    ever make that step whole."""
    root, base = str(tmp_path / "root"), str(tmp_path / "nodes")
    ranks(2).run(runs_on_one_root, root, base, 1, 10, False, "ab", timeout=240)
    for node in "ab":
        run = os.path.join(node_dir(base, node), os.listdir(node_dir(base, node))[0])
        os.unlink(os.path.join(run, step_tag(10), "rank_00001", "manifest.json"))
    assert ranks(2).run(runs_on_one_root, root, base, 2, 10, True, "ab", timeout=240) == [(None, -1, ())] * 2


def restore_with_node_b_unlistable(root: str, base: str) -> tuple:
    """Step 10 saved on nodes a and b; at the restart, node b's directory cannot be listed."""
    rank = dist.get_rank()
    node = os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    tier = zs.LocalTier(node_dir(base, node), every=10, keep=1, replicas=2, timeout_s=20)
    with zs.CheckpointManager(root, save_every=1000, local=tier, fsync=False) as mgr:
        mgr.save(10, single_state(10.0))
    real = NodeDirectory.holdings
    if node == "b":
        NodeDirectory.holdings = lambda self: (_ for _ in ()).throw(PermissionError(13, "Permission denied", "node-b"))
    try:
        with zs.CheckpointManager(root, save_every=1000, local=tier, fsync=False) as mgr:
            mgr.restore(single_state(-1.0))
    except zs.CheckpointError as exc:
        return type(exc).__name__, str(exc)
    finally:
        NodeDirectory.holdings = real
    return "restored", ""


def test_a_node_whose_tier_cannot_be_listed_fails_the_restore_on_every_rank(ranks, tmp_path):
    """Each rank raises a typed error, node b's naming its directory and the cause, none waits."""
    out = ranks(2).run(restore_with_node_b_unlistable, str(tmp_path / "root"), str(tmp_path / "nodes"), timeout=120)
    assert out[0] == ("CheckpointError", "the local tier could not be listed on 1 other rank(s) (their errors say why)")
    assert out[1][0] == "CheckpointError" and "node-b" in out[1][1] and "Permission denied" in out[1][1], out[1]


def test_a_new_run_whose_first_saves_are_local_is_not_undone_by_an_older_runs_checkpoints(ranks, tmp_path):
    """Run 1 saved up to step 40 (the root: 20 and 40); run 2 started anew and saved steps 10 and 30
    in the local tier only (save_every=20: 10 and 30 are not the root's). Run 3 restored run 1's step 40."""
    root, base = str(tmp_path / "root"), str(tmp_path / "nodes")
    ranks(2).run(runs_on_one_root, root, base, 1, 40, False, "ab", timeout=240)
    ranks(2).run(local_saves_only, root, base, 2, (10, 30), timeout=240)
    assert ranks(2).run(runs_on_one_root, root, base, 3, 0, True, "ab", timeout=240) == [(30, 2030, ("local",) * 2)] * 2


def local_saves_only(root: str, base: str, run: int, steps: tuple[int, ...]) -> None:
    node = os.environ["ZEROSTALL_NODE_ID"] = "ab"[dist.get_rank()]
    tier = zs.LocalTier(node_dir(base, node), every=10, keep=1, replicas=2, timeout_s=20)
    with zs.CheckpointManager(root, save_every=20, local=tier, fsync=False) as mgr:
        for step in steps:
            assert mgr.should_save(step)
            mgr.save(step, single_state(float(1000 * run + step)))


def rollback_then_a_local_save(root: str, base: str) -> tuple:
    """Run 2 on nodes a, b: roll back to the root's step 20, then save step 30 (the local tier alone)."""
    node = os.environ["ZEROSTALL_NODE_ID"] = "ab"[dist.get_rank()]
    tier = zs.LocalTier(node_dir(base, node), every=10, keep=1, replicas=2, timeout_s=20)
    with zs.CheckpointManager(root, save_every=20, local=tier, fsync=False) as mgr:
        assert mgr.restore(single_state(-1.0), step_tag(20)) == 20
        assert mgr.should_save(30)
        mgr.save(30, single_state(2030.0))
    return sorted(os.listdir(root))


def test_a_rollback_then_local_saves_is_not_undone_by_the_roots_later_checkpoints(ranks, tmp_path):
    """Run 1 saved up to step 40 (the root: 20 and 40); run 2 rolled back to 20 and saved step 30 in
    the local tier only. Run 3 restored the root's step 40, of the timeline run 2 left: the root's
    later checkpoints are now set aside as soon as the run goes on from 20."""
    root, base = str(tmp_path / "root"), str(tmp_path / "nodes")
    ranks(2).run(runs_on_one_root, root, base, 1, 40, False, "ab", timeout=240)
    listed = ranks(2).run(rollback_then_a_local_save, root, base, timeout=240)[0]
    assert listed == [".superseded", "latest", step_tag(20)]
    assert json.loads((tmp_path / "root" / "latest").read_text())["tag"] == step_tag(20)
    assert ranks(2).run(runs_on_one_root, root, base, 3, 0, True, "ab", timeout=240) == [(30, 2030, ("local",) * 2)] * 2


def first_local_save_with_a_value_rank_1_cannot_encode(root: str, base: str) -> tuple:
    """Nodes a and b; rank 1's loader state holds an object of no known kind; then close twice."""
    rank = dist.get_rank()
    node = os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    tier = zs.LocalTier(node_dir(base, node), every=10, keep=1, replicas=2, timeout_s=20)
    mgr = zs.CheckpointManager(root, save_every=1000, local=tier, fsync=False)
    with mgr:
        loader = {"epoch": 1} if rank == 0 else {"epoch": 1, "sampler": object()}
        try:
            assert mgr.should_save(10)
            mgr.save(10, {"w": torch.ones(10), "dataloader": loader})
            said = "saved"
        except zs.CheckpointError as exc:
            said = f"{type(exc).__name__}: {exc}"
        mgr.close()  # and again on leaving the block
    return said


def test_a_first_local_save_that_one_rank_cannot_encode_fails_on_every_rank_and_close_may_repeat(ranks, tmp_path):
    """Rank 1 raised alone and rank 0 waited in the space check's all-gather for the group's whole
    timeout; a second close() of a manager with a local tier raised ValueError (its group destroyed twice)."""
    said = ranks(2).run(first_local_save_with_a_value_rank_1_cannot_encode, str(tmp_path / "root"),
                        str(tmp_path / "nodes"), timeout=120)
    assert said[0] == ("CheckpointError: the first local-tier save could not be prepared on 1 other rank(s) (their "
                       "errors say why); nothing was saved")
    assert said[1].startswith("UnsupportedValueError") and "sampler" in said[1], said[1]


def saves_whose_replication_fails(root: str, base: str, steps: tuple[int, ...], failing: int, restore: bool) -> tuple:
    """Nodes a and b: restore or not, then save ``steps``; the replication of step ``failing`` fails
    (a receiver's full disk: an error, not a broken link). Returns what restore gave, and the holdings."""
    from zerostall.tiers import replication

    rank = dist.get_rank()
    node = os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    real = replication.exchange

    def exchange(pg, sends, receives, *, step=None, **kw):
        if step == failing:
            raise zs.CheckpointError(f"cannot write the copy of step {step}: No space left on device")
        return real(pg, sends, receives, step=step, **kw)

    replication.exchange = exchange
    tier = zs.LocalTier(node_dir(base, node), every=10, keep=1, replicas=2, timeout_s=20)
    try:
        with zs.CheckpointManager(root, save_every=1000, local=tier, fsync=False) as mgr:
            got = mgr.restore(single_state(-1.0)) if restore else None
            for step in steps:
                assert mgr.should_save(step)
                mgr.save(step, single_state(float(100 * rank + step)))
                mgr.wait()
            return got, mgr.tier.directory.holdings()
    finally:
        replication.exchange = real


def test_after_a_restart_retention_keeps_the_newest_step_every_replica_of_which_arrived(ranks, tmp_path):
    """Step 10 replicated, 20 and 30 not. A restart restored 20, taken for replicated: step 30's
    round deleted step 10, and once node b was lost nothing could be restored."""
    root, base = str(tmp_path / "root"), str(tmp_path / "nodes")
    ranks(2).run(saves_whose_replication_fails, root, base, (10, 20), 20, False, timeout=240)
    got = ranks(2).run(saves_whose_replication_fails, root, base, (30,), 30, True, timeout=240)
    assert got == [(20, {10: [0, 1], 30: [0]}), (20, {10: [0, 1], 30: [1]})]  # as a run without the restart keeps


def saves_faster_than_a_slow_link(root: str, base: str) -> dict:
    """Nodes a and b, a local save every step of 50 ms, each replication 0.5 s: the most steps the
    node directory held, and what replication did."""
    from zerostall.tiers import replication

    rank = dist.get_rank()
    node = os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    real = replication.exchange

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    replication.exchange = slow
    tier = zs.LocalTier(node_dir(base, node), every=1, keep=1, replicas=2, timeout_s=30)
    most = 0
    try:
        with zs.CheckpointManager(root, save_every=10_000, local=tier, fsync=False) as mgr:
            for step in range(1, 13):
                time.sleep(0.05)
                assert mgr.should_save(step)
                mgr.save(step, single_state(float(step)))
                dist.barrier()
                most = max(most, len(mgr.tier.directory.holdings()))
            mgr.wait()
            kept = mgr.tier.directory.steps()
            state = single_state(-1.0)
            return {"most": most, "replicated": [s for s, _ in mgr.tier.replicator.replicated],
                    "dropped": mgr.tier.replicator.dropped, "failures": mgr.tier.replicator.failures,
                    "save_failures": mgr.tier.failures, "kept": kept, "holders": mgr.tier.directory.holdings()[12],
                    "restored": (mgr.restore(state), float(state["w"][0]), mgr.last_restore.source)}
    finally:
        replication.exchange = real


def test_replication_slower_than_the_saves_drops_the_steps_waiting_instead_of_piling_them_up(ranks, tmp_path):
    """Each step waited for its replication in a queue, kept on the node until then: 10 of 12 steps
    at once on the node (a RAM disk fills up), where the space check counted 2. Then a save waited
    for the step before the last to be replicated: every step replicated, but the training step
    held back by replication. Now a save drops the steps waiting for replication: keep + 2 steps
    at most on the node, only some steps replicated (every one when a save waits), the newest one
    always, and it restores."""
    got = ranks(2).run(saves_faster_than_a_slow_link, str(tmp_path / "root"), str(tmp_path / "nodes"), timeout=240)
    for seen in got:
        assert seen["most"] <= 3 and seen["failures"] == seen["save_failures"] == 0, seen
        assert seen["dropped"] > 0 and 12 in seen["replicated"] and len(seen["replicated"]) < 12, seen
        assert len(seen["replicated"]) + seen["dropped"] == 12, seen
        assert seen["kept"] == [12] and seen["holders"] == [0, 1], seen
        assert seen["restored"] == (12, 12.0, "local"), seen


def one_rank_fails_to_save_step_2(root: str, base: str) -> dict:
    """Nodes a and b, local saves of steps 1 to 3; rank 1's of step 2 fails (a full disk). Returns
    the steps replicated, and the copies each node holds."""
    from zerostall.saving import pipeline

    rank = dist.get_rank()
    node = os.environ["ZEROSTALL_NODE_ID"] = "ab"[rank]
    publish = pipeline.publish_manifest

    def full_at_step_2(*args, **kwargs):
        if rank == 1 and mgr.tier._last == 2:
            raise OSError(28, "No space left on device")
        return publish(*args, **kwargs)

    pipeline.publish_manifest = full_at_step_2
    tier = zs.LocalTier(node_dir(base, node), every=1, keep=3, replicas=2, timeout_s=30)
    try:
        with zs.CheckpointManager(root, save_every=10_000, local=tier, fsync=False) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, single_state(float(step)))
                mgr.wait()
            return {"replicated": [s for s, _ in mgr.tier.replicator.replicated], "held": mgr.tier.directory.holdings(),
                    "failures": (mgr.tier.failures, mgr.tier.replicator.failures)}
    finally:
        pipeline.publish_manifest = publish


def test_a_step_one_rank_failed_to_save_is_not_replicated_by_the_others(ranks, tmp_path):
    """Rank 0 sent its copy of step 2 to node b, though rank 1's save of it failed: a step no
    restore can use (some rank lacks its copy), sent over the link for nothing. Now the ranks
    agree first whether every rank holds its copy."""
    got = ranks(2).run(one_rank_fails_to_save_step_2, str(tmp_path / "root"), str(tmp_path / "nodes"), timeout=240)
    assert got[0]["replicated"] == got[1]["replicated"] == [1, 3], got
    assert got[0]["held"] == got[1]["held"] == {1: [0, 1], 3: [0, 1]}, got
    assert got[0]["failures"] == (0, 0) and got[1]["failures"] == (1, 0), got


def test_a_run_that_goes_back_without_a_restore_leaves_no_later_local_step(tmp_path):
    """Saves 5 to 20; the run went back to step 10 by itself (no restore) and saved 15 anew: the
    root set its step 20 aside, the local tier kept its own, and the next restore took that
    abandoned step 20 (20.0, where 1015.0 was saved last)."""
    def manager() -> zs.CheckpointManager:
        return zs.CheckpointManager(str(tmp_path / "root"), save_every=10, fsync=False,
                                    local=zs.LocalTier(str(tmp_path / "node"), every=5, keep=1, replicas=1))

    with manager() as mgr:
        for step in (5, 10, 15, 20):
            assert mgr.should_save(step)
            mgr.save(step, single_state(float(step)))
        assert mgr.should_save(15)  # local only: the root keeps its step 20 until its own next save
        mgr.save(15, single_state(1015.0))
    state = single_state(-1.0)
    with manager() as mgr:
        assert mgr.restore(state) == 15 and float(state["w"][0]) == 1015.0
        assert mgr.last_restore.source == "local"
