"""CUDA paths: saving from GPU tensors, loading into them through pinned staging, capture on side
streams, the pinned pool's lifetime, and work on a GPU other than 0 (in one process, and over two
NCCL ranks). They need a GPU (some two), so they run on a GPU machine
(``./dev test tests/test_gpu.py``), not in CI.

Work the caller queues behind ``torch.cuda._sleep`` (a kernel that spins for a number of clock
cycles) is still pending when zerostall is called: a copy not ordered after it reads stale
values, and a wait that misses it lets zerostall use bytes that have not landed yet.
"""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
import weakref

import pytest
import torch

import zerostall as zs
from zerostall.devices import host_register, host_unregister
from zerostall.saving.pipeline import prepare

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
SPIN = 1 << 30  # clock cycles of queued GPU work: a good part of a second


def cuda_state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(64, 48, device="cuda", generator=g)
    return {
        "w": base,
        "wt": base.t(),  # a non-contiguous view sharing storage with w
        "b16": torch.randn(1000, device="cuda", generator=g).to(torch.bfloat16),
        "big": torch.randn(3, 1 << 20, device="cuda", generator=g),
        "ints": torch.arange(17, device="cuda", dtype=torch.int64),
        "step": 7,
    }


def test_cuda_state_round_trips_through_small_pinned_staging(tmp_path):
    state = cuda_state()
    zs.save(state, str(tmp_path / "ck"))
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    out = zs.load(target, str(tmp_path / "ck"), max_staging_bytes=64 << 10)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert out[key].is_cuda and torch.equal(out[key], value), key
    assert out["step"] == 7


def test_cuda_targets_convert_dtype_and_load_slices(tmp_path):
    state = cuda_state()
    zs.save(state, str(tmp_path / "ck"))
    with zs.open(str(tmp_path / "ck")) as ck:
        half = {"big": torch.zeros(3, 1 << 20, device="cuda", dtype=torch.bfloat16)}
        ck.load(half, keys=["big"], strict=False)
        assert torch.equal(half["big"], state["big"].to(torch.bfloat16))
        assert torch.equal(ck.read("w").cuda(), state["w"])


def test_async_capture_sees_queued_kernels_and_not_later_writes(tmp_path):
    x = torch.zeros(4096, 4096, device="cuda")
    for _ in range(20):  # queue work that writes x; save() must not read x before it finishes
        x.add_(1.0)
    with zs.AsyncSaver() as saver:
        handle = saver.save({"x": x}, str(tmp_path / "ck"))
        handle.wait_staged()
        x.fill_(-1.0)  # after capture: must not reach the checkpoint
        handle.result()
    loaded = zs.load({"x": torch.empty(4096, 4096, device="cuda")}, str(tmp_path / "ck"))
    assert torch.equal(loaded["x"], torch.full_like(x, 20.0))


def test_a_cuda_tensor_changed_before_its_capture_fails_the_save(tmp_path):
    """The version check on the CUDA path: a kernel queued after the save, before the capture
    (held back here), changes a saved tensor; the save fails, nothing is committed."""
    import threading

    state = {"w": torch.ones(1 << 20, device="cuda")}
    saver = zs.AsyncSaver()
    release = threading.Event()
    saver._worker.submit(release.wait, 60)  # the capture cannot start until the change is queued
    handle = saver.save(state, str(tmp_path / "ck"))
    state["w"].mul_(2)
    release.set()
    with pytest.raises(zs.StateChangedError, match="^w was changed in place"):
        handle.result()
    saver.close()
    assert not (tmp_path / "ck" / "manifest.json").exists()



def test_a_later_save_of_a_tensor_moved_to_cuda_after_it_returned_fails(tmp_path):
    """A saver's later save collects in its worker: a tensor whose data moved to a GPU after save()
    returned (on no stream the save recorded) fails the save with a typed error, nothing committed."""
    import threading

    state = {"w": torch.ones(1000), "b": torch.zeros(3)}
    saver = zs.AsyncSaver()
    saver.save(state, str(tmp_path / "first")).result()
    release = threading.Event()
    saver._worker.submit(release.wait, 60)
    handle = saver.save(state, str(tmp_path / "ck"))
    state["w"].data = state["w"].data.cuda()
    release.set()
    with pytest.raises(zs.StateChangedError, match="moved to cuda:0"):
        handle.result()
    saver.close()
    assert not (tmp_path / "ck" / "manifest.json").exists()

def test_an_optimizer_step_on_cuda_waits_for_the_capture(tmp_path):
    model = torch.nn.Linear(256, 256, device="cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 256, device="cuda")).sum().backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with zs.AsyncSaver() as saver:
        handle = saver.save({"model": model, "optim": optimizer}, str(tmp_path / "ck"))
        model(torch.randn(8, 256, device="cuda")).sum().backward()
        optimizer.step()  # no wait_staged(): the step waits for the capture by itself
        handle.result()
    with zs.open(str(tmp_path / "ck")) as ck:
        assert all(torch.equal(before[k].cpu(), ck.read(f"model.{k}")) for k in before)


SYNC_SAVE_CHILD = """
import resource, sys, torch, zerostall as zs
big = torch.randn(512, 1 << 20, device="cuda")  # 2 GiB on the GPU
zs.save({"w": big}, sys.argv[1], threads=2)  # warm up: libraries, allocator, page cache
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
zs.save({"w": big}, sys.argv[1], threads=2, overwrite=True)
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
out = zs.load({"w": torch.empty_like(big)}, sys.argv[1])
assert torch.equal(out["w"], big)
print(grown)
"""


def test_a_sync_save_of_gpu_state_streams_through_bounded_host_memory(tmp_path):
    """A 2 GiB GPU state is written through a few host windows per writer thread, not copied to
    host memory whole (which would grow the peak resident set by 2 GiB)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SYNC_SAVE_CHILD, str(tmp_path / "ck")], capture_output=True,
                         text=True, timeout=600, check=True)
    grown = int(out.stdout.split()[-1])
    assert grown < 512 << 20, f"the peak resident set grew by {grown >> 20} MiB during a sync save of 2 GiB"


def test_a_sync_save_waits_for_work_queued_on_the_callers_side_stream(tmp_path):
    """The writer threads copy on their own streams: the caller's side stream is waited for first."""
    x = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(SPIN)
        x.fill_(5.0)
        zs.save({"x": x}, str(tmp_path / "ck"))
    with zs.open(str(tmp_path / "ck")) as ck:
        assert torch.equal(ck.read("x"), torch.full((1 << 22,), 5.0))


def test_an_async_capture_waits_for_work_queued_on_the_callers_side_stream(tmp_path):
    x = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    with zs.AsyncSaver() as saver, torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(SPIN)
        x.fill_(6.0)
        handle = saver.save({"x": x}, str(tmp_path / "ck"))
    handle.result()
    with zs.open(str(tmp_path / "ck")) as ck:
        assert torch.equal(ck.read("x"), torch.full((1 << 22,), 6.0))


def test_a_gpu_load_writes_after_the_callers_work_on_its_targets_and_is_done_when_it_returns(tmp_path):
    """Uploads go on side streams that wait for the zero-fill of the targets (queued behind a spin),
    staging buffers are reused meanwhile (tiny staging, many threads: each reuse must wait for the
    uploads from the buffer), dtypes convert on the GPU, and all has landed when load returns."""
    state = cuda_state()
    zs.save(state, str(tmp_path / "ck"))
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    target["big"] = torch.zeros(3, 1 << 20, device="cuda", dtype=torch.bfloat16)
    out = zs.load(target, str(tmp_path / "ck"), max_staging_bytes=64 << 10, threads=4)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            expected = value.to(torch.bfloat16) if key == "big" else value
            assert out[key].is_cuda and torch.equal(out[key], expected), key


def peer_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(1 << 18, generator=g), "odd": torch.randn(70_001, generator=g).to(torch.bfloat16),
            "small": torch.randn(10, generator=g), "step": 3}


def _restore_into_cuda(own: str, held: str) -> dict:
    """Rank 1 sends the copy ``own`` as a restore's sender does; rank 0 receives it into zeroed
    CUDA tensors (large ones through a buffer, checked, copied to the GPU) and loads the rest."""
    import functools
    from pathlib import Path

    import torch.distributed as dist

    from zerostall.options import LoadOptions
    from zerostall.tiers.copies import load_copy, placements, view
    from zerostall.tiers.transfer import exchange

    if dist.get_rank() == 1:
        exchange(dist.group.WORLD, [(0, Path(own))], [], chunk_bytes=1 << 16, cut=True)
        return {}
    state = {k: torch.zeros_like(v, device="cuda") if isinstance(v, torch.Tensor) else 0
             for k, v in peer_state().items()}
    memory = {k: v.data_ptr() for k, v in state.items() if isinstance(v, torch.Tensor)}
    target = view(state, restoring=True)
    (landed,) = exchange(dist.group.WORLD, [], [(1, Path(held))], chunk_bytes=1 << 16,
                         place=functools.partial(placements, target))
    loaded = load_copy(state, target, landed.folder, options=LoadOptions(verify=False), placed=landed.placed,
                       manifest=landed.manifest)
    return {"placed": sorted(landed.placed), "equal": {k: torch.equal(v.cpu(), peer_state()[k])
                                                     for k, v in loaded.items() if isinstance(v, torch.Tensor)},
            "on_gpu": all(state[k].is_cuda and state[k].data_ptr() == p for k, p in memory.items()),
            "step": loaded["step"]}


def test_a_peer_copy_is_received_into_gpu_state_through_a_buffer(ranks, tmp_path):
    """A local-tier copy from a peer restores CUDA tensors of at least 256 KiB by copying each
    checked chunk from a host buffer into the target's own GPU memory; bit-exact, in place."""
    from zerostall.tiers.copies import LAYOUT_KEY, view

    own = tmp_path / "own"
    zs.save(peer_state(), str(own), metadata={LAYOUT_KEY: view(peer_state()).digest})
    got = ranks(2).run(_restore_into_cuda, str(own), str(tmp_path / "node" / "rank_00001"))[0]
    assert got["placed"] == ["big"] and all(got["equal"].values()) and got["on_gpu"] and got["step"] == 3, got


def test_the_pool_is_pinned_for_gpu_state_and_unpinned_by_close(tmp_path):
    with zs.AsyncSaver() as saver:
        saver.save({"w": torch.ones(1 << 16)}, str(tmp_path / "cpu")).result()
        assert saver.pool.pinned_bytes == 0  # nothing to copy from a GPU: no context, no pinning
        saver.save(cuda_state(), str(tmp_path / "gpu")).result()
        assert saver.pool.pinned_bytes == saver.pool.nbytes > 0
    assert saver.pool.pinned_bytes == 0


def test_a_saver_dropped_without_close_unpins_its_pool(tmp_path):
    """Pages freed while pinned come back at the same address and cannot be pinned again: the pool's
    finalizer unpins the arena before it is freed. Re-pinning the arena's memory shows it."""
    state = cuda_state()
    saver = zs.AsyncSaver()
    saver.save(state, str(tmp_path / "ck")).result()
    view = saver.pool.buffers(prepare(state, str(tmp_path / "x"), zs.SaveOptions()).items)[0]  # keeps the memory
    assert saver.pool.pinned_bytes > 0
    dropped = weakref.ref(saver)
    del saver
    gc.collect()
    assert dropped() is None
    assert host_register(view.data_ptr(), view.nbytes, torch.cuda.current_device()) == 0, "still pinned"
    assert host_unregister(view.data_ptr()) == 0


def test_a_failed_pin_is_a_warning_and_leaves_no_error_for_the_next_kernel(tmp_path, monkeypatch, caplog):
    """cudart keeps a failure as its thread's last error, which torch raises at the next kernel
    launch of that thread: the pool pins in a thread of its own and saves unpinned."""
    cudart = torch.cuda.cudart()
    real = cudart.cudaHostRegister
    monkeypatch.setattr(cudart, "cudaHostRegister", lambda ptr, size, flags: real(0, size, flags))  # fails
    state = cuda_state()
    with zs.AsyncSaver() as saver:
        saver.save(state, str(tmp_path / "ck")).result()
        assert saver.pool.pinned_bytes == 0 and saver.pool.nbytes > 0
    assert "could not pin" in caplog.text
    torch.ones(8, device="cuda").add_(1)  # a kernel launch in the thread that allocated the pool
    torch.cuda.synchronize()
    with zs.open(str(tmp_path / "ck")) as ck:
        assert torch.equal(ck.read("big").cuda(), state["big"])


@two_gpus
def test_an_async_capture_of_state_on_two_gpus_waits_for_each(tmp_path):
    """Each tensor is copied on a side stream of its own device after the work queued there, and
    capture is done once every device's copies are (not only the current device's)."""
    state = {"a": torch.zeros(1 << 22, device="cuda:0"), "b": torch.zeros(1 << 22, device="cuda:1")}
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    for n, value in enumerate(state.values()):
        with torch.cuda.device(value.device):
            torch.cuda._sleep(SPIN)
            value.fill_(float(n + 1))
    with zs.AsyncSaver() as saver:
        saver.save(state, str(tmp_path / "ck")).result()
    with zs.open(str(tmp_path / "ck")) as ck:
        assert torch.equal(ck.read("a"), torch.full((1 << 22,), 1.0))
        assert torch.equal(ck.read("b"), torch.full((1 << 22,), 2.0))


GPU1_CHILD = """
import sys, torch, zerostall as zs
path = sys.argv[1]
torch.cuda.set_device(1)
x = torch.zeros(1 << 22, device="cuda")
w = torch.randn(1024, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
torch.cuda.synchronize()
torch.cuda._sleep(1 << 30)
x.fill_(3.0)
assert not torch._C._cuda_hasPrimaryContext(0), "torch itself made a context on GPU 0"
state = {"x": x, "w": w}
with zs.AsyncSaver() as saver:
    saver.save(state, path + "/async").result()
zs.save(state, path + "/sync")
for name in ("async", "sync"):
    target = {"x": torch.empty_like(x), "w": torch.empty(1024, 1024, device="cuda", dtype=torch.bfloat16)}
    out = zs.load(target, f"{path}/{name}", max_staging_bytes=1 << 16)
    assert torch.equal(out["x"], torch.full_like(x, 3.0)), name
    assert torch.equal(out["w"], w.to(torch.bfloat16)), name
assert not torch._C._cuda_hasPrimaryContext(0), "zerostall made a context on GPU 0"
print("ok")
"""


@two_gpus
def test_saving_and_loading_on_gpu_1_makes_no_context_on_gpu_0_and_waits_for_gpu_1(tmp_path):
    """A torchrun rank with local rank 1, as a fresh process: its async save copies on GPU 1 after
    the work queued there, and neither its capture, writer, pin or reader threads make a
    context on GPU 0 (checked with the driver's per-device primary context state)."""
    out = subprocess.run([sys.executable, "-c", GPU1_CHILD, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout.splitlines(), out.stderr[-3000:]


NCCL_CHILD = """
import sys, torch, torch.distributed as dist, zerostall as zs
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.cuda.set_device(rank)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        device_id=torch.device("cuda", rank))
mesh = init_device_mesh("cuda", (2,))
g = torch.Generator().manual_seed(0)  # the same values on both ranks
full = torch.randn(512, 256, generator=g).cuda()
replicated = torch.randn(1 << 20, generator=g).cuda()
sharded = distribute_tensor(full, mesh, [Shard(0)])
own = torch.zeros(1 << 20, device="cuda")
dist.barrier()
torch.cuda.synchronize()
before = torch._C._cuda_hasPrimaryContext(1 - rank)
torch.cuda._sleep(1 << 30)
own.fill_(rank + 1.0)
state = {"sharded": sharded, "replicated": replicated, "own": zs.rank_local(own), "step": 3}
with zs.AsyncSaver() as saver:
    saver.save(state, path + "/async").result()
zs.save(state, path + "/sync")
for name in ("async", "sync"):
    target = {"sharded": distribute_tensor(torch.zeros(512, 256, device="cuda"), mesh, [Shard(0)]),
              "replicated": torch.zeros(1 << 20, device="cuda", dtype=torch.bfloat16),
              "own": zs.rank_local(torch.zeros(1 << 20, device="cuda")), "step": 0}
    with zs.open(f"{path}/{name}") as ck:
        out = ck.load(target)
    assert torch.equal(out["sharded"].to_local(), sharded.to_local()), name
    assert torch.equal(out["replicated"], replicated.to(torch.bfloat16)), name
    assert torch.equal(out["own"].value, torch.full((1 << 20,), rank + 1.0, device="cuda")), name
    assert out["step"] == 3, name
after = torch._C._cuda_hasPrimaryContext(1 - rank)
dist.destroy_process_group()
print("contexts on the other GPU, before and after:", int(before), int(after))
"""


@two_gpus
def test_two_nccl_ranks_save_open_and_load_on_their_own_gpus(tmp_path):
    """torchrun-like: rank r on cuda:r with set_device(r) and a bound NCCL group. Async and sync
    saves of a sharded DTensor, a replicated tensor and a rank-local one written behind queued
    work, opened and loaded collectively, equal the sources; zerostall adds no context on the
    other rank's GPU (whatever NCCL itself did before is the baseline)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", NCCL_CHILD, str(rank), str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    for rank, (proc, (stdout, stderr)) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, f"rank {rank}: {stderr[-3000:]}"
        [line] = [line for line in stdout.splitlines() if line.startswith("contexts on the other GPU")]
        before, after = line.split()[-2:]
        assert after == before, f"rank {rank}: zerostall made a context on the other rank's GPU"
