"""Incremental saves: unchanged chunks referred to, changed ones written, every checkpoint loading
bit-exactly however its neighbours were deleted; references checked like any manifest field."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerostall as zs
from hostile import read_body, write_body
from zerostall.storage import storage_for
from zerostall.storage.references import referrers
from zerostall.roots.root import CheckpointRoot, step_tag
from zerostall.storage import LocalStorage

N = 1 << 16  # elements of the big tensors: 256 KiB of float32, several checksum blocks at BLOCK
BLOCK = 64 << 10


def make_state() -> dict:
    torch.manual_seed(0)
    return {"model": {"base": torch.randn(N), "frozen": torch.randn(N // 2, 2), "lora": torch.randn(64)},
            "ints": torch.arange(N // 4, dtype=torch.int32), "step": 0}


def snapshot(state: dict) -> dict:
    return {k: snapshot(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def blank(state: dict) -> dict:
    return {k: blank(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not (isinstance(y, dict) and same(x, y)):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def load(root, step: int, like: dict) -> dict:
    target = blank(like)
    return zs.load(target, os.path.join(root, step_tag(step)))


def own_files(root, step: int) -> dict[str, int]:
    body = read_body(os.path.join(root, step_tag(step)))
    return {n: s for n, s in body["files"].items() if n not in body.get("refs", {})}


def chunk_owner(root, step: int, fqn: str) -> str:
    """The checkpoint whose data file holds entry ``fqn`` of ``step``."""
    body = read_body(os.path.join(root, step_tag(step)))
    entry = next(e for e in body["entries"] if e["fqn"] == fqn)
    return body.get("refs", {}).get(entry["chunks"][0]["file"], step_tag(step))


def manager(root, **kw) -> zs.CheckpointManager:
    kw.setdefault("fsync", False)
    return zs.CheckpointManager(root, incremental=True, block_size=BLOCK, **kw)


def save_steps(mgr: zs.CheckpointManager, state: dict, steps, snaps: dict) -> zs.SaveInfo:
    """Change the small tensor and save, step by step, recording each step's state in ``snaps``;
    returns the last save's info."""
    for step in steps:
        state["model"]["lora"].add_(1)
        info = mgr.save(step, state)
        snaps[step] = snapshot(state)
    return info


def test_unchanged_chunks_are_referred_to_and_changed_ones_written(tmp_path):
    state = make_state()
    with manager(tmp_path) as mgr:
        first = mgr.save(1, state)
        state["model"]["lora"].add_(1)
        state["step"] = 2
        second = mgr.save(2, state)
    assert first.bytes_written > N * 4 > 40 * second.bytes_written
    body = read_body(tmp_path / step_tag(2))
    assert body["version"] == zs.FORMAT_VERSION and set(body["refs"].values()) == {step_tag(1)}
    assert chunk_owner(tmp_path, 2, "model.base") == step_tag(1)
    assert chunk_owner(tmp_path, 2, "model.lora") == step_tag(2)
    assert same(load(tmp_path, 2, state), state)
    assert zs.verify(tmp_path / step_tag(2)) == zs.verify(tmp_path / step_tag(1))  # every byte it reads, checked
    assert read_body(tmp_path / step_tag(1))["refs"] == {}  # the first save is full and self-contained
    # who refers to a step is found from the starts of the manifests beside it: step 2 refers to step 1
    assert referrers(storage_for(str(tmp_path / step_tag(1)))) == [step_tag(2)]
    assert referrers(storage_for(str(tmp_path / step_tag(2)))) == []


def _inplace(s): s["model"]["base"].add_(1e-3)
def _data_write(s): s["model"]["base"].data[7] = 123.0  # noqa: E704  (bumps no version counter)
def _copy(s): s["model"]["frozen"].copy_(torch.randn_like(s["model"]["frozen"]))  # noqa: E704
def _one_element(s): s["ints"].data[-1] += 1  # noqa: E704  (the last block only)
def _view(s): s["model"]["base"][N // 2:N // 2 + 3].fill_(9.0)  # noqa: E704
def _replaced(s): s["model"]["frozen"] = torch.randn(N // 2, 2)  # noqa: E704  (same shape, a new tensor)
def _replaced_equal(s): s["model"]["frozen"] = s["model"]["frozen"].clone()  # noqa: E704  (same bytes)
def _no_grad_param(s): s["model"]["lora"].requires_grad_(False).data.mul_(2)  # noqa: E704
def _reinterpreted(s): s["ints"] = s["ints"].view(torch.float32)  # noqa: E704  (same bytes, another dtype)


def _optimizer_step(s):
    param = torch.nn.Parameter(s["model"]["base"])
    opt = torch.optim.SGD([param], lr=0.1)
    param.grad = torch.ones_like(param)
    opt.step()


@pytest.mark.parametrize("change", [_inplace, _data_write, _copy, _one_element, _view, _replaced, _optimizer_step,
                                    _no_grad_param], ids=lambda f: f.__name__.strip("_"))
def test_every_kind_of_change_is_written(tmp_path, change):
    """A wrong "unchanged" is the one bug incremental saves must never have: each way of changing a
    tensor (those that bump no version counter too) gets its new bytes saved."""
    state = make_state()
    with manager(tmp_path) as mgr:
        mgr.save(1, state)
        change(state)
        mgr.save(2, state)
        expected = snapshot(state)
        mgr.save(3, state)  # unchanged since 2: refers to 2's bytes (or 1's)
    for step in (2, 3):
        assert same(load(tmp_path, step, state), expected), step
        zs.verify(tmp_path / step_tag(step))
    assert not same(load(tmp_path, 1, state), expected)


@pytest.mark.parametrize("change", [_replaced_equal, _reinterpreted], ids=lambda f: f.__name__.strip("_"))
def test_equal_bytes_are_referred_to_whatever_the_tensor(tmp_path, change):
    state = make_state()
    with manager(tmp_path) as mgr:
        mgr.save(1, state)
        change(state)
        mgr.save(2, state)
    assert sum(own_files(tmp_path, 2).values()) < N  # the bytes are referred to, not written
    assert same(load(tmp_path, 2, state), state)


def test_a_plain_save_refuses_incremental(tmp_path):
    with pytest.raises(zs.UnsupportedValueError, match="CheckpointManager"):
        zs.save({"a": torch.ones(2)}, tmp_path / "x", incremental=True)
    with pytest.raises(zs.UnsupportedValueError, match="CheckpointManager"):
        zs.async_save({"a": torch.ones(2)}, tmp_path / "y", incremental=True)
    assert not os.path.exists(tmp_path / "x")


def test_retention_keeps_referred_data_and_frees_it_after_a_full_save(tmp_path):
    state = make_state()
    snaps = {}
    with manager(tmp_path, keep_last=2, full_save_every=4) as mgr:
        save_steps(mgr, state, range(1, 5), snaps)
        mgr.wait()
        infos = {i.name: i for i in CheckpointRoot(LocalStorage(str(tmp_path))).scan()}
        assert infos[step_tag(1)].status == "retained" and step_tag(2) not in infos
        assert not (tmp_path / step_tag(1) / "manifest.json").exists()
        for step in (3, 4):
            assert same(load(tmp_path, step, state), snaps[step])
        save_steps(mgr, state, (5, 6), snaps)  # the 5th save is full (every 4th since the first)
        mgr.wait()
    assert sorted(os.listdir(tmp_path)) == ["latest", step_tag(5), step_tag(6)]  # no retained data left
    assert read_body(tmp_path / step_tag(5))["refs"] == {}
    for step in (5, 6):
        assert same(load(tmp_path, step, state), snaps[step])


@pytest.mark.parametrize("async_save", [False, True])
def test_a_tagged_save_of_a_later_step_leaves_the_base_of_the_next_save(tmp_path, async_save):
    """keep_last=1: ``best`` at step 2 ranked above step 1, and retention deleted step 1, the base
    the save of step 3 referred to: that save failed (CorruptCheckpointError) and was lost."""
    state = make_state()
    snaps = {}
    with manager(tmp_path, keep_last=1, async_save=async_save) as mgr:
        for step, tag in ((1, None), (2, "best"), (3, None)):
            result = mgr.save(step, state, tag=tag)
            if async_save:
                result.result()
            mgr.wait()
            snaps[step] = snapshot(state)
            state["model"]["lora"].add_(1)
    assert chunk_owner(tmp_path, 3, "model.base") == step_tag(1)
    assert same(load(tmp_path, 3, state), snaps[3])


def test_asynchronous_incremental_saves(tmp_path):
    state = make_state()
    snaps = {}
    with manager(tmp_path, async_save=True) as mgr:
        for step in range(1, 4):
            mgr.save(step, state).result()
            snaps[step] = snapshot(state)
            state["model"]["lora"].add_(1)
    assert chunk_owner(tmp_path, 3, "model.base") == step_tag(1)
    for step in snaps:
        assert same(load(tmp_path, step, state), snaps[step])


def test_a_rollback_saves_in_full_and_the_set_aside_steps_keep_their_data(tmp_path):
    state = make_state()
    snaps = {}
    with manager(tmp_path, keep_last=1) as mgr:
        save_steps(mgr, state, (1, 2, 3), snaps)
        mgr.wait()
        state["model"]["lora"].add_(1)
        info = mgr.save(2, state)  # sets 3 (and 2: retention deleted it) aside
        mgr.wait()
    assert info.bytes_written > N * 4 and read_body(tmp_path / step_tag(2))["refs"] == {}
    assert same(load(tmp_path, 2, state), state)
    shutil.rmtree(tmp_path / step_tag(2))  # move step 3 back, as the warning says
    os.rename(tmp_path / ".superseded" / step_tag(3), tmp_path / step_tag(3))
    assert same(load(tmp_path, 3, state), snaps[3])  # what it refers to in step 1 was kept for it


# -- references are input like any other field ------------------------------------------------------

@pytest.fixture
def chain(tmp_path):
    state = make_state()
    with manager(tmp_path) as mgr:
        mgr.save(1, state)
        state["model"]["lora"].add_(1)
        mgr.save(2, state)
    return tmp_path, read_body(tmp_path / step_tag(2))


def test_replacing_a_checkpoint_that_others_refer_to_is_refused(chain):
    tmp_path, _ = chain
    state = make_state()
    state["model"]["lora"].add_(1)
    before = sorted(os.listdir(tmp_path / step_tag(1)))
    with pytest.raises(zs.CheckpointError, match=f"{step_tag(2)}.*refer to"):
        zs.save(make_state(), tmp_path / step_tag(1), overwrite=True)
    assert sorted(os.listdir(tmp_path / step_tag(1))) == before
    assert same(load(tmp_path, 2, state), state)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.lists(st.sets(st.sampled_from(["base", "frozen", "lora", "ints"])), min_size=2, max_size=6),
       full_every=st.sampled_from([None, 2, 3]), deleted=st.data())
def test_every_checkpoint_loads_after_any_subset_of_the_others_is_deleted(tmp_path_factory, changes, full_every,
                                                                          deleted):
    root = tmp_path_factory.mktemp("prune")
    state = make_state()
    snaps = {}
    with manager(root, full_save_every=full_every) as mgr:
        for step, changed in enumerate(changes, 1):
            for name in changed:
                leaf = state["ints"] if name == "ints" else state["model"][name]
                leaf.data[step % leaf.shape[0]] += 1
            state["step"] = step
            mgr.save(step, state)
            snaps[step] = snapshot(state)
    gone = deleted.draw(st.sets(st.sampled_from(sorted(snaps))), label="deleted steps")
    checkpoints = CheckpointRoot(LocalStorage(str(root)))
    for step in sorted(gone):
        checkpoints.delete(step_tag(step))
    checkpoints.collect_retained()
    for step in sorted(set(snaps) - gone):
        assert same(load(root, step, state), snaps[step]), (step, gone)
        zs.verify(root / step_tag(step))
    for step in sorted(set(snaps) - gone):
        checkpoints.delete(step_tag(step))
    checkpoints.collect_retained()
    assert [n for n in os.listdir(root) if n.startswith("step_")] == []  # nothing leaked


def _lie(root, body, how):
    how(body)
    write_body(root / step_tag(2), body)
    return root / step_tag(2)


@pytest.mark.parametrize("how, says", [
    (lambda b: b["refs"].update({f: "../elsewhere" for f in b["refs"]}), "not the tag of a checkpoint"),
    (lambda b: b["refs"].update({f: "/abs" for f in b["refs"]}), "not the tag of a checkpoint"),
    (lambda b: b["refs"].update({f: ".superseded" for f in b["refs"]}), "not the tag of a checkpoint"),
    (lambda b: b.update(version=2), "needs format version 3"),
    (lambda b: b["refs"].update({"0-0-r00000-000.safetensors": step_tag(1)}), "not a file of the checkpoint"),
    (lambda b: b["refs"].update({f: step_tag(3) for f in b["refs"]}), "which is gone"),
    (lambda b: b["refs"].update({f: step_tag(2) for f in b["refs"]}), "does not own that file"),
    (lambda b: b["files"].update({f: b["files"][f] + 1 for f in b["refs"]}), "another size or header"),
    (lambda b: b["headers"].update({f: "0" * 16 for f in b["refs"]}), "another size or header"),
])
def test_a_lying_reference_is_refused(chain, how, says):
    root, body = chain
    path = _lie(root, body, how)
    with pytest.raises(zs.CorruptCheckpointError, match=says):
        zs.load(blank(make_state()), path)
    with pytest.raises(zs.CorruptCheckpointError):
        zs.verify(path)


def test_a_referenced_chunk_outside_its_file_is_refused(chain):
    root, body = chain
    base = next(e for e in body["entries"] if e["fqn"] == "model.base")
    base["chunks"][0]["offset"] = body["files"][base["chunks"][0]["file"]]  # past the end of the other file
    with pytest.raises(zs.CorruptCheckpointError, match="model.base"):
        zs.load(blank(make_state()), _lie(root, body, lambda b: None))


def test_a_reference_to_a_stray_file_is_refused(chain):
    """A file with the right name and bytes in a directory that is no committed checkpoint's (and
    holds no retained record) is not read."""
    root, body = chain
    shutil.copytree(root / step_tag(1), root / "stray")
    os.remove(root / "stray" / "manifest.json")
    with pytest.raises(zs.CorruptCheckpointError, match="which is gone"):
        zs.load(blank(make_state()), _lie(root, body, lambda b: b["refs"].update({f: "stray" for f in b["refs"]})))


# -- several ranks, object storage, crashes ---------------------------------------------------------

def incremental_on_every_rank(root: str) -> tuple[list[tuple[int, bool]], bool, bool]:
    """Runs on each rank: three incremental saves of a sharded, a replicated and a changing tensor;
    returns each save's (bytes written, replanned), whether step 3 loads bit-exactly into a fresh
    state, and whether step 2 does after step 1 was deleted."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"sharded": distribute_tensor(torch.arange(N, dtype=torch.float32), mesh, [Shard(0)]),
             "replicated": torch.arange(N // 2, dtype=torch.float64), "lora": torch.zeros(32)}
    fresh = {"sharded": distribute_tensor(torch.zeros(N), mesh, [Shard(0)]),
             "replicated": torch.zeros(N // 2, dtype=torch.float64), "lora": torch.ones(32)}
    infos, snaps = [], {}
    with manager(root) as mgr:
        for step in (1, 2, 3):
            state["lora"].add_(1)
            info = mgr.save(step, state)
            infos.append((info.bytes_written, info.replanned))
            snaps[step] = state["lora"].clone()
        mgr.open(step_tag(3)).load(fresh)
        ok3 = torch.equal(fresh["sharded"].to_local(), state["sharded"].to_local()) and \
            torch.equal(fresh["replicated"], state["replicated"]) and torch.equal(fresh["lora"], snaps[3])
        if dist.get_rank() == 0:
            CheckpointRoot(LocalStorage(root)).delete(step_tag(1))
        dist.barrier()
        mgr.open(step_tag(2)).load(fresh)
        ok2 = torch.equal(fresh["sharded"].to_local(), state["sharded"].to_local()) and \
            torch.equal(fresh["lora"], snaps[2])
    return infos, ok3, ok2


def test_each_rank_refers_to_its_own_unchanged_chunks(ranks, tmp_path):
    root = str(tmp_path / "root")
    results = ranks(2).run(incremental_on_every_rank, root, timeout=120)
    for infos, ok3, ok2 in results:
        assert ok3 and ok2
        assert [replanned for _, replanned in infos] == [True, False, False]  # the plan cache is kept
        assert all(written < 8192 for written, _ in infos[1:]), infos  # a header and the small tensor, at most
    assert sum(infos[0][0] for infos, _, _ in results) > N * 4 + N * 4  # the first save wrote everything
    body = read_body(os.path.join(root, step_tag(3)))
    assert set(body["refs"].values()) == {step_tag(1)}
    assert {f.split("-r")[1][:5] for f in body["refs"]} == {"00000", "00001"}  # both ranks refer to their own
    assert zs.verify(os.path.join(root, step_tag(3))) > 0


def test_incremental_saves_and_retention_on_s3(s3_url):
    state = make_state()
    snaps = {}
    with manager(s3_url, keep_last=1) as mgr:
        info = save_steps(mgr, state, (1, 2, 3), snaps)
        mgr.wait()
        assert info.bytes_written < N
    infos = {i.name: i.status for i in CheckpointRoot(zs.storage.storage_for(s3_url)).scan()}
    assert infos == {step_tag(1): "retained", step_tag(3): "committed"}
    assert same(zs.load(blank(state), f"{s3_url}/{step_tag(3)}"), snaps[3])
    assert zs.verify(f"{s3_url}/{step_tag(3)}") > 0


def test_the_local_tier_saves_whole_copies_beside_an_incremental_root(tmp_path):
    """The node-local tier holds everything its ranks need (format: no references across tiers);
    the root's saves are incremental, and a restore takes the newest step from either."""
    state = make_state()
    root = tmp_path / "root"
    with manager(root, save_every=2, local=zs.LocalTier(tmp_path / "node", every=1, replicas=1)) as mgr:
        for step in (1, 2, 3, 4):
            state["model"]["lora"].add_(1)
            if mgr.should_save(step):
                mgr.save(step, state)
        mgr.wait()
    assert chunk_owner(root, 4, "model.base") == step_tag(2)
    copies = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "node") for f in files if f == "manifest.json"]
    assert copies and all(read_body(os.path.dirname(c))["refs"] == {} for c in copies)
    with manager(root, local=zs.LocalTier(tmp_path / "node", every=1, replicas=1)) as mgr:
        target = blank(state)
        assert mgr.restore(target) == 4 and mgr.last_restore.source == "local"
        assert torch.equal(target["model"]["lora"], state["model"]["lora"])


def test_a_tensor_written_in_place_since_is_written_without_being_compared(tmp_path, monkeypatch):
    """A version counter that moved says "written to": no hashing to compare it (writing is always
    safe). One that did not move proves nothing (``.data``), so that tensor is compared."""
    from zerostall.saving import incremental

    hashed: list[int] = []
    real = incremental._checksums
    monkeypatch.setattr(incremental, "_checksums", lambda item, block: hashed.append(item.nbytes) or real(item, block))
    state = make_state()
    with manager(tmp_path) as mgr:
        mgr.save(1, state)
        state["model"]["lora"].add_(1)  # its version moves
        state["model"]["base"].data[0] += 1  # no version moves: compared, found changed
        mgr.save(2, state)
    assert state["model"]["lora"].nbytes not in hashed and state["model"]["base"].nbytes in hashed
    assert chunk_owner(tmp_path, 2, "model.base") == step_tag(2) == chunk_owner(tmp_path, 2, "model.lora")
    assert same(load(tmp_path, 2, state), state)
