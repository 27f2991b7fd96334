"""zerostall under DeepSpeed (issue 30): the checkpoint engine and attach, tested with the real
``deepspeed`` on the CPU (gloo).

The training runs are two-rank jobs of tests/deepspeed_train.py in fresh processes: each trains,
saves at step 3, is SIGKILLed after step 6, and a new job resumes from ``latest`` and must see the
losses of steps 4-6 that the first job saw, bit for bit. The engine's own rules (tags, ``latest``,
the space check, DeepSpeed's objects, swap-file names) are tested in this process.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'zerostall[deepspeed]')")

import zerostall as zs  # noqa: E402
from zerostall.integrations.deepspeed import (DeepSpeedOptions, ZeroStallCheckpointEngine,  # noqa: E402
                                              fp32_state_dict)
from zerostall.integrations.deepspeed import values  # noqa: E402
from zerostall.saving.estimate import bytes_needed  # noqa: E402
from zerostall.state import flatten  # noqa: E402
from zerostall.options import SaveOptions  # noqa: E402
from zerostall.integrations.deepspeed.swap import SwapFolders  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402

from s3server import free_ports  # noqa: E402
from small_tmpfs import in_small_tmpfs, unavailable  # noqa: E402

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "deepspeed_train.py"
CASES = HERE / "deepspeed_cases.py"


# -- two-rank jobs ---------------------------------------------------------------------------------
def job(tmp: Path, name: str, *args: str, expect_kill: bool = False, timeout: float = 240,
        script: Path = TRAIN) -> dict[int, dict]:
    """Run tests/deepspeed_train.py (or ``script``) on two gloo ranks; each rank's losses (and what else it wrote)."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]),
               WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent / "src"),
               PYTHONFAULTHANDLER="1")  # an abort prints every thread's stack
    out = tmp / name
    procs = [subprocess.Popen([sys.executable, str(script), *args, "--losses", str(out)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for r, p in enumerate(procs):
        want = -signal.SIGKILL if expect_kill else 0
        assert p.returncode == want, f"rank {r} ended with {p.returncode}, not {want}:\n{logs[r][-6000:]}"
    return {r: json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)}


def test_an_asynchronous_save_is_loaded_back_at_once_and_destroy_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    """load_checkpoint did not wait for the save in flight: it loaded the version of ``best`` before
    and the ``latest`` before; a tag 100 in ``latest`` read as JSON, taken for no tag;
    DeepSpeed's positional arguments were a TypeError; and destroy left the save in flight running."""
    seen = job(tmp_path, "reload", "--case", "reload", "--dir", str(tmp_path / "ck"), script=CASES)
    for rank in (0, 1):
        assert seen[rank] == {"best": 2, "latest": 3, "latest_file": "100", "positional": 2,
                              "after_destroy": {"committed": True, "saver_closed": True, "threads": []}}


def test_loads_go_through_the_callers_open_session_and_a_failed_latest_never_splits_the_ranks(tmp_path: Path) -> None:
    """``load_checkpoint`` between the caller's ``open`` and ``close`` was refused ("still open"),
    so a library staging checkpoints could not hold a session across DeepSpeed's load; and after
    rank 0 failed to point ``latest`` at the asynchronous save in flight, a load raised on rank 0
    alone while rank 1 went on into the load's collectives and waited there."""
    d = tmp_path / "ck"
    seen = job(tmp_path, "bookends", "--case", "bookends", "--dir", str(d), script=CASES, timeout=180)
    for rank in (0, 1):
        assert seen[rank]["opened"] == "t1" and seen[rank]["held"] == 1 and seen[rank]["still_open"] == "t1"
        assert seen[rank]["other"] == (f"load_checkpoint('{d}', 't2') while checkpoint 't1' of {d} is open: load "
                                       "that one, or close() it first; nothing was loaded"), seen[rank]
        assert seen[rank]["loaded"] == 3, seen[rank]
    assert "committed, but" in seen[0]["next_save"] and "t3" in seen[0]["next_save"], seen[0]
    assert seen[1]["next_save"].startswith(f"checkpoint {d}/t4 was not saved on any rank"), seen[1]


def test_a_zero3_load_one_rank_finds_damaged_fails_on_every_rank_instead_of_hanging(tmp_path: Path) -> None:
    """With DeepSpeed's default persistence threshold (small parameters whole on every rank), rank 0
    went on into DeepSpeed's all-gather at the end of its load while rank 1, whose file was damaged,
    waited in zerostall's agreement: both hung until killed."""
    seen = job(tmp_path, "damaged", "--case", "damaged", "--dir", str(tmp_path / "ck"), script=CASES, timeout=150)
    assert seen[0]["persistent"] > 0
    assert seen[1]["load"].startswith("CorruptCheckpointError: ") and "zero_pp_rank_1" in seen[1]["load"], seen[1]
    assert seen[0]["load"].startswith("CheckpointError: loading checkpoint t1 from ") and \
        "failed on 1 other rank(s)" in seen[0]["load"], seen[0]
    assert all(isinstance(seen[r]["loss"], float) for r in (0, 1))  # and both stepped on together


def test_a_load_inside_an_open_session_takes_the_tag_as_open_does() -> None:
    """A tag given as a number (``save_checkpoint(d, 100)``) is opened as "100": a load of 100 inside
    that session was refused as another tag."""
    from zerostall.integrations.deepspeed.attach import _held

    for tag in (None, "latest", "100", 100):
        assert _held("/ck", "100", "/ck/", tag) == "100"
    for load_dir, tag in (("/ck", "101"), ("/other", None)):
        with pytest.raises(zs.CheckpointError, match="while checkpoint '100' of /ck is open"):
            _held("/ck", "100", load_dir, tag)


def test_a_value_that_cannot_be_encoded_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """Only rank 0 writes the model file, with client_state: it raised alone, and rank 1 waited in
    the save's collectives (a hang)."""
    seen = job(tmp_path, "unencodable", "--case", "unencodable", "--dir", str(tmp_path / "ck"), script=CASES,
               timeout=120)
    assert "UnsupportedValueError" in seen[0]["said"] and "mine" in seen[0]["said"], seen[0]
    assert seen[1]["said"].startswith(f"CheckpointError: checkpoint {tmp_path}/ck/s1 was not saved on any rank: 1 "
                                      "other rank(s) could not prepare it"), seen[1]
    assert "s1" not in seen[0]["tags"] and "latest" not in seen[0]["tags"] and seen[0]["loss"] > 0


def losses(run: dict, steps: range) -> list[list[float]]:
    return [[run[r][str(s)] for s in steps] for r in sorted(run)]


def _aio() -> str | None:
    """Why DeepSpeed's asynchronous I/O (NVMe offload) cannot run here, or None."""
    from deepspeed.ops.op_builder.cpu import AsyncIOBuilder

    return None if AsyncIOBuilder().is_compatible(verbose=False) else "NVMe offload needs libaio-dev (apt)"


NVME = pytest.mark.skipif(_aio() is not None, reason=str(_aio()))

CONFIGS = {  # name: (ZeRO stage, offload param/optimizer)
    "zero1": (1, "none/none"),
    "zero2": (2, "none/none"),
    "zero3": (3, "none/none"),
    "zero3-offload-cpu-cpu": (3, "cpu/cpu"),
    "zero3-offload-cpu-nvme": (3, "cpu/nvme"),
    "zero3-offload-nvme-nvme": (3, "nvme/nvme"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=NVME) if "nvme" in n else n for n in CONFIGS])
def test_a_killed_run_resumes_with_the_losses_of_an_uninterrupted_one(tmp_path: Path, name: str) -> None:
    stage, offload = CONFIGS[name]
    common = ["--stage", str(stage), "--offload", offload, "--nvme", str(tmp_path / "nvme"), "--dir",
              str(tmp_path / "ck"), "--save-at", "3"]
    first = job(tmp_path, "first", *common, "--kill-at", "6", expect_kill=True)
    resumed = job(tmp_path, "resumed", *common, "--resume")
    assert resumed[0]["resumed_from"] == 3
    assert losses(resumed, range(4, 7)) == losses(first, range(4, 7))
    if not offload.endswith("nvme"):  # read into the engine's own tensors (a swapped optimizer's live in files)
        assert all(run["read_in_place"][0] == run["read_in_place"][1] > 0 for run in resumed.values()), resumed
    ck = tmp_path / "ck"
    assert (ck / "latest").read_text() == "step3"  # plain text, as DeepSpeed and zero_to_fp32.py read it
    assert zs.verify(str(ck / "step3")) > 0
    with zs.open(str(ck / "step3")) as opened:
        assert opened.step == 3
        offloaded = [k for k in opened.entries if k.startswith("offloaded_tensors.")]
    swapped = {"cpu/nvme": {"optimizer"}, "nvme/nvme": {"optimizer", "float32params"}}.get(offload, set())
    assert {k.split(".")[1] for k in offloaded} == swapped
    assert not any("gradient" in k for k in offloaded)
    assert not (ck / "step3" / "offloaded_tensors").exists()  # no copy of DeepSpeed's own beside ours


@pytest.mark.parametrize("stage", [1, 3])
def test_fp32_weights_consolidate_as_deepspeeds_own_tool_gives_them(tmp_path: Path, stage: int) -> None:
    """The same run saved by zerostall and by DeepSpeed's own engine: fp32_state_dict of the one
    equals DeepSpeed's zero_to_fp32 of the other, bit for bit."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    common = ["--stage", str(stage), "--steps", "3", "--save-at", "3"]
    job(tmp_path, "ours", *common, "--dir", str(tmp_path / "ours"))
    job(tmp_path, "theirs", *common, "--dir", str(tmp_path / "theirs"), "--engine", "deepspeed")
    want = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "theirs"))
    got = fp32_state_dict(str(tmp_path / "ours"))
    assert list(got) == list(want) and len(want) == 4
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)
    assert not list((tmp_path / "ours").glob("*/*.pt"))  # read from zerostall's files, not DeepSpeed's


def test_a_run_that_switches_to_zerostall_resumes_from_deepspeeds_own_checkpoint(tmp_path: Path) -> None:
    """Saved by DeepSpeed's engine, resumed with zerostall attached: refused without allow_pickle
    (DeepSpeed's files are pickles), exact with it; the next save is a zerostall checkpoint."""
    common = ["--stage", "2", "--dir", str(tmp_path / "ck")]
    first = job(tmp_path, "first", *common, "--save-at", "3", "--kill-at", "6", "--engine", "deepspeed",
                expect_kill=True)
    refused = job(tmp_path, "refused", *common, "--save-at", "3", "--resume")
    assert all("written by DeepSpeed's own engine, whose files are pickles" in refused[r]["refused"] for r in (0, 1))
    resumed = job(tmp_path, "resumed", *common, "--save-at", "5", "--resume", "--allow-pickle")
    assert resumed[0]["resumed_from"] == 3 and losses(resumed, range(4, 7)) == losses(first, range(4, 7))
    assert (tmp_path / "ck" / "latest").read_text() == "step5" and zs.verify(str(tmp_path / "ck" / "step5")) > 0
    assert list((tmp_path / "ck" / "step3").glob("*_model_states.pt"))  # DeepSpeed's own, left as it was


def test_a_custom_load_fn_decides_what_of_the_module_is_loaded(tmp_path: Path) -> None:
    """The model file is not read into the module's own tensors when a custom_load_fn places it:
    the layer the function leaves alone keeps this run's weights."""
    common = ["--stage", "2", "--dir", str(tmp_path / "ck"), "--save-at", "3", "--steps", "3"]
    job(tmp_path, "first", *common)
    resumed = job(tmp_path, "resumed", *common, "--resume", "--first-layer-only")
    assert all(run["head_kept"] for run in resumed.values()), resumed


def test_a_zero3_load_of_the_weights_alone_consolidates_them_through_zerostall(tmp_path: Path) -> None:
    """ZeRO-3's load_checkpoint(load_optimizer_states=False) runs zero_to_fp32 on the load
    directory: the resumed run's first step sees the saved weights (its loss is the one of the
    run that saved them)."""
    common = ["--stage", "3", "--dir", str(tmp_path / "ck"), "--save-at", "3"]
    first = job(tmp_path, "first", *common, "--steps", "4")
    resumed = job(tmp_path, "resumed", *common, "--steps", "4", "--resume", "--weights-only")
    assert resumed[0]["resumed_from"] == 3 and losses(resumed, range(4, 5)) == losses(first, range(4, 5))


@NVME
def test_swap_files_come_back_under_parameter_names_when_ds_ids_moved(tmp_path: Path) -> None:
    """A process that built another ZeRO-3 model first numbers the parameters differently
    (DeepSpeed names swap files by that number): the resume still finds each parameter's state."""
    common = ["--stage", "3", "--offload", "nvme/nvme", "--nvme", str(tmp_path / "nvme"), "--dir", str(tmp_path / "ck")]
    first = job(tmp_path, "first", *common, "--kill-at", "6", expect_kill=True)
    resumed = job(tmp_path, "resumed", *common, "--resume", "--bump-ids")
    assert losses(resumed, range(4, 7)) == losses(first, range(4, 7))
    with zs.open(str(tmp_path / "ck" / "step3")) as opened:
        assert "offloaded_tensors.optimizer.exp_avg[0.weight..2.bias]@rank0" in opened.entries
    swapped = os.listdir(tmp_path / "nvme" / "zero_stage_3" / "optimizer" / "rank0")
    assert "exp_avg-0_3.tensor.swp" in swapped and "exp_avg-2_5.tensor.swp" in swapped  # the ids did move


def test_asynchronous_saves_resume_exactly_and_open_resolves_tags(tmp_path: Path) -> None:
    common = ["--stage", "2", "--dir", str(tmp_path / "ck"), "--asynchronous", "--save-at", "2", "3"]
    first = job(tmp_path, "first", *common, "--kill-at", "6", expect_kill=True)
    (tmp_path / "empty").mkdir()
    resumed = job(tmp_path, "resumed", *common, "--resume", "--check-open", str(tmp_path / "empty"))
    assert losses(resumed, range(4, 7)) == losses(first, range(4, 7))
    for r in (0, 1):
        seen = resumed[r]["open"]
        assert (seen["latest"], seen["named"], seen["empty"]) == ("step3", "step3", None)
        assert seen["latest_view"] and seen["latest_closed"] and seen["named_closed"]
        assert "step999" in seen["missing"] and "step2" in seen["missing"]


def test_zero3_keeping_small_parameters_whole_resumes_exactly_from_an_asynchronous_save(tmp_path: Path) -> None:
    """ZeRO-3's default persistence threshold keeps the biases whole on every rank; DeepSpeed
    gathers and re-partitions them around a save, between the capture and the deferred write."""
    common = ["--stage", "3", "--persist-small", "--dir", str(tmp_path / "ck"), "--asynchronous", "--save-at", "3"]
    first = job(tmp_path, "first", *common, "--kill-at", "6", expect_kill=True)
    resumed = job(tmp_path, "resumed", *common, "--resume")
    assert resumed[0]["resumed_from"] == 3
    assert losses(resumed, range(4, 7)) == losses(first, range(4, 7))


# -- the engine in this process ----------------------------------------------------------------------
def save_tag(ours: ZeroStallCheckpointEngine, save_dir: Path, tag: str, files: dict, *, step: int = 1,
             save_latest: bool = True) -> None:
    """What DeepSpeed's save_checkpoint does with an engine, through attach's begin."""
    ours.begin(str(save_dir), tag, step=step, save_latest=save_latest, swap=SwapFolders({}, {}))
    info = CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=save_latest)
    ours.create(info)
    ours.makedirs(str(save_dir), exist_ok=True)
    ours.makedirs(str(save_dir / tag), exist_ok=True)
    for name, sd in files.items():
        ours.save(state_dict=sd, path=str(save_dir / tag / name))
    ours.commit(info)


def read_tag(ours: ZeroStallCheckpointEngine, save_dir: Path, tag: str | None, name: str) -> object:
    opened = ours.open(str(save_dir), tag)
    assert opened is not None
    try:
        return ours.load(os.path.join(ours.session.directory, name), map_location="cpu")
    finally:
        ours.close()


def deepspeed_like() -> dict:
    shared = torch.arange(6.0)
    module = collections.OrderedDict([("w", torch.randn(3, 4)), ("b", torch.zeros(4))])
    module._metadata = collections.OrderedDict([("", {"version": 1}), ("0", {"version": 2})])  # as state_dict() gives
    return {
        "module": module,
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(128.0),
            "dynamic": DynamicLossScaler(init_scale=2.0**16, scale_window=7, min_scale=1, delayed_shift=2, consecutive_hysteresis=False),
            "zero_stage": ZeroStageEnum.gradients,
            "param_slice_mappings": [collections.OrderedDict([("w", fragment_address(numel=12, start=0))])],
            "single_partition_of_fp32_groups": [torch.ones(5), shared],
            "pair": (torch.full((2,), 3.0), "x"),
            "same": shared,
        },
        "global_steps": 7, "ds_version": deepspeed.__version__, "shape": torch.Size([3, 4]), "nothing": None,
        "client": {"counts": collections.Counter(a=2, b=1), "groups": collections.defaultdict(list, {"x": [1]}),
                   "none": collections.defaultdict(None, {1: 2}), "frozen": torch.nn.Parameter(torch.ones(2), False),
                   "trained": torch.nn.Parameter(torch.ones(3))},
    }


def assert_same(a: object, b: object, where: str = "") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.requires_grad == b.requires_grad, where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), where
        assert getattr(a, "default_factory", None) is getattr(b, "default_factory", None), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif type(a).__module__.startswith("deepspeed") and hasattr(a, "__dict__"):
        assert vars(a) == vars(b), where
    else:
        assert a == b, where


def test_deepspeeds_files_round_trip_with_its_own_objects_and_no_pickle(tmp_path: Path) -> None:
    ours = ZeroStallCheckpointEngine()
    sd = deepspeed_like()
    save_tag(ours, tmp_path, "global_step7", {"mp_rank_00_model_states.pt": sd})
    back = read_tag(ours, tmp_path, None, "mp_rank_00_model_states.pt")
    assert_same(sd, back)
    shared = back["optimizer_state_dict"]
    assert shared["same"] is shared["single_partition_of_fp32_groups"][1]  # stored once, shared again
    assert (tmp_path / "latest").read_text() == "global_step7"
    with zs.open(str(tmp_path / "global_step7")) as ck:  # an ordinary zerostall checkpoint
        assert ck.step == 1 and ck.metadata["deepspeed"]["tag"] == "global_step7"
        assert torch.equal(ck.read("mp_rank_00_model_states.pt.tensors.module.w"), sd["module"]["w"])


def _no_items() -> list:
    return []


def test_an_object_our_encoding_cannot_hold_is_named_or_pickled_on_request(tmp_path: Path) -> None:
    class Custom:
        pass

    with pytest.raises(zs.UnsupportedValueError, match=r"client\.obj.*allow_pickle"):
        save_tag(ZeroStallCheckpointEngine(), tmp_path, "t1", {"f.pt": {"client": {"obj": Custom()}}})
    with pytest.raises(zs.UnsupportedValueError, match=r"f\.pt\.client\.d\.default_factory.*allow_pickle"):
        save_tag(ZeroStallCheckpointEngine(), tmp_path, "t1",
                 {"f.pt": {"client": {"d": collections.defaultdict(_no_items)}}})
    assert not (tmp_path / "t1").exists() and not (tmp_path / "latest").exists()
    ours = ZeroStallCheckpointEngine(allow_pickle=True)
    save_tag(ours, tmp_path, "t1", {"f.pt": {"client": {"n": 3, "d": collections.defaultdict(_no_items, a=[1])}}})
    back = read_tag(ours, tmp_path, "t1", "f.pt")
    assert back["client"]["d"].default_factory is _no_items and back == {"client": {"n": 3, "d": {"a": [1]}}}
    with pytest.raises(zs.CheckpointError, match="allow_pickle"):  # the pickled factory is refused without it
        read_tag(ZeroStallCheckpointEngine(), tmp_path, "t1", "f.pt")


def test_deepspeeds_own_checkpoint_is_found_through_its_latest_and_a_bad_latest_is_none(tmp_path: Path) -> None:
    """``deepspeeds_own`` reads ``latest`` as the root does: DeepSpeed's plain tag names its
    checkpoint; a ``latest`` that names no valid tag (a path, or far too large) is no checkpoint."""
    ours = ZeroStallCheckpointEngine()
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "latest").write_text("global_step4\n")
    assert ours.deepspeeds_own(str(tmp_path)) == "global_step4"
    assert ours.deepspeeds_own(str(tmp_path), "global_step4") == "global_step4"
    for bad in ("../global_step4", "global_step4" * 100_000):
        (tmp_path / "latest").write_text(bad)
        assert ours.deepspeeds_own(str(tmp_path)) is None
    save_tag(ours, tmp_path, "global_step5", {"f.pt": {"x": torch.ones(2)}})  # ours: not DeepSpeed's
    assert ours.deepspeeds_own(str(tmp_path)) is None and ours.deepspeeds_own(str(tmp_path), "global_step5") is None
    (tmp_path / "epoch 1").mkdir()  # any tag a save takes: DeepSpeed writes and reads latest as the bare name
    (tmp_path / "epoch 1" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (tmp_path / "latest").write_text("epoch 1")
    assert ours.deepspeeds_own(str(tmp_path)) == "epoch 1"


def test_latest_naming_a_tag_with_spaces_or_signs_opens_that_tag(tmp_path: Path) -> None:
    """``latest`` held "best loss 0.12", a tag every save takes, and was read as missing: the load
    opened the newest checkpoint instead (an evaluation snapshot saved with save_latest=False)."""
    ours = ZeroStallCheckpointEngine()
    for tag in ("best loss 0.12", "val:0.3@5", "-1"):
        save_tag(ours, tmp_path, tag, {"f.pt": {"x": torch.zeros(3)}}, step=3)
        save_tag(ours, tmp_path, "global_step6", {"f.pt": {"x": torch.ones(3)}}, step=6, save_latest=False)
        assert ours.open(str(tmp_path)) == tag
        ours.close()


def test_zero_to_fp32_reads_through_an_engine_in_the_calling_thread_only_and_may_nest(tmp_path: Path) -> None:
    """While one thread consolidates through zerostall, another thread's zero_to_fp32 (on DeepSpeed's
    own files) still reads with torch; a nested use reads through the inner engine, then the outer
    one again; afterwards zero_to_fp32 has torch back."""
    import threading

    from deepspeed.utils import zero_to_fp32

    from zerostall.integrations.deepspeed.consolidate import reading_through

    class Reads:
        def __init__(self, name: str) -> None:
            self.name = name

        def load(self, path: str, map_location: object = None) -> str:
            return self.name

    theirs = tmp_path / "theirs.pt"
    torch.save({"x": torch.ones(2)}, theirs)
    inside, outside = threading.Event(), threading.Event()
    seen: list[object] = []

    def other_thread() -> None:
        inside.wait(30)
        seen.append(zero_to_fp32.torch.load(theirs, map_location="cpu", weights_only=False))
        outside.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with reading_through(Reads("outer")):  # type: ignore[arg-type]
        inside.set()
        assert outside.wait(30)
        assert zero_to_fp32.torch.load("a.pt") == "outer"
        with reading_through(Reads("inner")):  # type: ignore[arg-type]
            assert zero_to_fp32.torch.load("a.pt") == "inner"
        assert zero_to_fp32.torch.load("a.pt") == "outer"
    worker.join(30)
    assert torch.equal(seen[0]["x"], torch.ones(2))  # type: ignore[index]
    assert zero_to_fp32.torch is torch


def test_saving_a_tag_again_replaces_it_and_latest_follows_the_commit(tmp_path: Path) -> None:
    ours = ZeroStallCheckpointEngine()
    save_tag(ours, tmp_path, "best", {"f.pt": {"x": torch.zeros(3)}}, step=1)
    save_tag(ours, tmp_path, "other", {"f.pt": {"x": torch.ones(3)}}, step=2, save_latest=False)
    assert (tmp_path / "latest").read_text() == "best"
    save_tag(ours, tmp_path, "best", {"f.pt": {"x": torch.full((3,), 5.0)}}, step=3)
    assert torch.equal(read_tag(ours, tmp_path, "best", "f.pt")["x"], torch.full((3,), 5.0))
    assert torch.equal(read_tag(ours, tmp_path, "latest", "f.pt")["x"], torch.full((3,), 5.0))
    (tmp_path / "latest").unlink()  # lost (a crash between the commit and its update): the newest by step
    assert ours.open(str(tmp_path)) == "best"
    ours.close()


def test_a_save_under_the_tag_of_deepspeeds_own_checkpoint_is_refused_and_leaves_it(tmp_path: Path) -> None:
    """The refusal named files "not part of a zerostall checkpoint", and no way out."""
    own = tmp_path / "global_step3"
    own.mkdir()
    (own / "mp_rank_00_model_states.pt").write_bytes(b"DeepSpeed's")
    with pytest.raises(zs.CheckpointError, match=f"{own} is a checkpoint of DeepSpeed's own engine: .* another tag"):
        save_tag(ZeroStallCheckpointEngine(), tmp_path, "global_step3", {"f.pt": {"x": torch.zeros(3)}})
    assert sorted(os.listdir(own)) == ["mp_rank_00_model_states.pt"] and not (tmp_path / "latest").exists()


def open_with_rank_1_unable_to_lay_out_its_view(directory: str) -> str:
    """Save t1 on two ranks; open it with rank 1's temporary folder of names impossible to make."""
    import torch.distributed as dist

    ours = ZeroStallCheckpointEngine()
    save_tag(ours, Path(directory), "t1", {"f.pt": {"x": torch.zeros(3)}})
    real = tempfile.mkdtemp
    if dist.get_rank() == 1:
        tempfile.mkdtemp = lambda **kw: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    try:
        ours.open(directory)
        return "opened"
    except zs.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        tempfile.mkdtemp = real


def test_an_open_that_fails_on_one_rank_fails_on_every_rank(ranks, tmp_path: Path) -> None:
    """Rank 1 raised alone and rank 0 waited for it in the load's next collective."""
    said = ranks(2).run(open_with_rank_1_unable_to_lay_out_its_view, str(tmp_path / "ck"), timeout=120)
    assert said == [f"CheckpointError: checkpoint t1 of {tmp_path}/ck could not be opened on 1 other rank(s) (their "
                    "errors say why)", f"CheckpointError: cannot show checkpoint t1 of {tmp_path}/ck to DeepSpeed (a "
                    f"folder of its file names under {tempfile.gettempdir()}, TMPDIR): [Errno 28] No space left on device"]


def save_with_latest_blocked(directory: str, asynchronous: bool) -> list[str]:
    """On each of two ranks: save t1, make ``latest`` impossible to replace (on rank 0, the one that
    writes it), then save t2 and t3; what each save said."""
    import torch.distributed as dist

    d = Path(directory)
    ours = ZeroStallCheckpointEngine(asynchronous=asynchronous)
    save_tag(ours, d, "t1", {"f.pt": {"x": torch.zeros(3)}})
    ours.wait()
    dist.barrier()
    if dist.get_rank() == 0:
        (d / "latest").unlink()
        (d / "latest" / "in the way").mkdir(parents=True)  # as a full or read-only disk would fail it
    dist.barrier()
    said = []
    for tag in ("t2", "t3"):
        try:
            save_tag(ours, d, tag, {"f.pt": {"x": torch.ones(3)}})
            if ours.saver is not None:
                ours.saver.wait()  # committed: latest is updated right after, in the background
            said.append("saved")
        except zs.CheckpointError as exc:
            said.append(str(exc))
    ours.cleanup()
    return said


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_failed_update_of_latest_fails_the_save_on_every_rank(ranks, tmp_path: Path, asynchronous: bool) -> None:
    """Rank 0 alone writes ``latest``: its failure was raised on rank 0 alone (a bare OSError), and
    rank 1 went on into the next collective and waited for good; asynchronously, rank 0 raised it
    at the next save alone. Now every rank raises: at that save (synchronous), or at the next."""
    said = ranks(2).run(save_with_latest_blocked, str(tmp_path / "ck"), asynchronous, timeout=120)
    refused = said[0][1:] if asynchronous else said[0]
    for message in refused:
        assert "committed, but" in message and "could not be made to name it" in message and "its tag" in message
    assert said[0][0] == "saved" if asynchronous else True
    assert said[1] == (["saved", f"checkpoint {tmp_path}/ck/t3 was not saved on any rank: 1 other rank(s) could not "
                                 "prepare it (their errors say why: a value they cannot encode, or rank 0's failure to "
                                 "point latest at the checkpoint saved before)"] if asynchronous else
                       [f"checkpoint {tmp_path}/ck/{t} committed, but rank 0 could not point {tmp_path}/ck/latest at "
                        "it (its error says why)" for t in ("t2", "t3")])


FULL_DISK = """
import os, sys, torch
sys.path[:0] = [sys.argv[2], sys.argv[3]]
import zerostall as zs
from test_deepspeed import ZeroStallCheckpointEngine, read_tag, save_tag
from pathlib import Path
d = Path(sys.argv[1])
ours = ZeroStallCheckpointEngine()
save_tag(ours, d, "t1", {"f.pt": {"x": torch.zeros(1000)}})
big = {"f.pt": {"x": torch.zeros(2**20)}}
many = {"f.pt": {f"layers.{i}.bias": torch.zeros(1) for i in range(8000)}}  # 32 KB of tensors
try:
    save_tag(ours, d, "t2", big if sys.argv[4] == "big" else many)
except zs.InsufficientSpaceError as exc:
    print("REFUSED", exc)
print("LEFT", sorted(os.listdir(d)), (d / "latest").read_text(), read_tag(ours, d, None, "f.pt")["x"].shape)
"""


@pytest.mark.parametrize("files", ["big", "many"])
def test_a_save_the_target_cannot_hold_fails_before_any_write_with_the_sizes(tmp_path: Path, files: str) -> None:
    """On a real 2 MiB file system: the save of one 4 MiB tensor, or of 8000 tensors of 4 bytes
    (which with what describes them write more than 2 MiB), is refused with the numbers, nothing
    of it written, ``latest`` and the previous checkpoint as they were. The many small tensors were
    counted by their bytes alone, and the save failed part way with ENOSPC."""
    directory = str(tmp_path / "small")
    os.makedirs(directory)
    why = unavailable(directory)
    if why:
        pytest.skip(why)
    done = subprocess.run(in_small_tmpfs(directory, "2m", sys.executable, "-c", FULL_DISK, directory,
                                         str(HERE.parent / "src"), str(HERE), files),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    needed = re.search(rf"REFUSED checkpoint {re.escape(directory)}/t2 needs (\d+) bytes", done.stdout)
    assert needed is not None, done.stdout + done.stderr
    assert int(needed[1]) > (4 << 20 if files == "big" else 2 << 20)
    assert "bytes free: free space there or save elsewhere; nothing was written" in done.stdout
    assert "LEFT ['latest', 't1'] t1 torch.Size([1000])" in done.stdout


def test_the_bytes_counted_before_a_save_are_at_least_those_it_writes(tmp_path: Path) -> None:
    """The free-space check's count against what the save then wrote: many small tensors, long key
    paths, large python values, a tensor of many blocks, DeepSpeed's own files."""
    cases = {
        "small": {"f.pt": {f"l{i}": torch.zeros(1) for i in range(3000)}},
        "long names": {"optim.pt": {"state": {i: {"exp_avg_" + "x" * 200: torch.zeros(3, 2, 1)} for i in range(500)}}},
        "values": {"f.pt": {"config": {f"k{i}": list(range(20)) for i in range(2000)}, "t": torch.zeros(2)}},
        "blocks": {"f.pt": {"w": torch.zeros(9 << 20, dtype=torch.uint8)}},
        "deepspeed": deepspeed_like(),
    }
    for name, files in cases.items():
        state = {file: values.split(sd) for file, sd in files.items()}
        counted = bytes_needed(flatten(state).leaves, SaveOptions().block_size, False, 1)
        save_tag(ZeroStallCheckpointEngine(), tmp_path, name, files)
        written = sum(max(p.stat().st_size, p.stat().st_blocks * 512) for p in (tmp_path / name).iterdir())
        assert counted >= written, (name, counted, written)


def test_a_damaged_checkpoint_is_named_on_load_and_reads_need_an_open_session(tmp_path: Path) -> None:
    ours = ZeroStallCheckpointEngine()
    save_tag(ours, tmp_path, "t1", {"f.pt": {"x": torch.arange(1000.0)}})
    with pytest.raises(zs.CheckpointError, match="no checkpoint open"):
        ours.load(str(tmp_path / "t1" / "f.pt"))
    data = next(p for p in (tmp_path / "t1").iterdir() if p.name != "manifest.json")
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # inside the tensor's bytes (the file's end)
    data.write_bytes(bytes(raw))
    with pytest.raises(zs.CorruptCheckpointError, match=data.name):
        read_tag(ours, tmp_path, "t1", "f.pt")


def test_a_load_reads_into_the_engines_own_tensors_where_they_match(tmp_path: Path) -> None:
    ours = ZeroStallCheckpointEngine()
    saved = {"opt": {"flat": [torch.arange(1000.0)], "exp_avg": torch.full((4, 5), 2.0), "step": torch.tensor(7.0)}}
    save_tag(ours, tmp_path, "t1", {"f.pt": saved})
    live = {"opt": {"flat": [torch.zeros(1000)], "exp_avg": torch.zeros(5, 4), "step": torch.tensor(0.0)}}
    ours.open(str(tmp_path), "t1")
    try:
        ours.session.into["f.pt"] = lambda: live
        back = ours.load(os.path.join(ours.session.directory, "f.pt"), map_location="cpu")
    finally:
        ours.close()
    assert_same(saved, back)
    assert back["opt"]["flat"][0] is live["opt"]["flat"][0] and back["opt"]["step"] is live["opt"]["step"]
    assert back["opt"]["exp_avg"] is not live["opt"]["exp_avg"]  # another shape: new memory, the live one untouched
    assert not live["opt"]["exp_avg"].any()


def test_a_damaged_load_into_the_engines_tensors_says_they_are_overwritten(tmp_path: Path) -> None:
    ours = ZeroStallCheckpointEngine()
    save_tag(ours, tmp_path, "t1", {"f.pt": {"x": torch.arange(1000.0)}})
    data = next(p for p in (tmp_path / "t1").iterdir() if p.name != "manifest.json")
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    ours.open(str(tmp_path), "t1")
    try:
        ours.session.into["f.pt"] = lambda: {"x": torch.zeros(1000)}
        with pytest.raises(zs.CorruptCheckpointError, match=f"{data.name}.*partly overwritten: load another"):
            ours.load(os.path.join(ours.session.directory, "f.pt"))
    finally:
        ours.close()


def test_outside_save_checkpoint_files_are_plain_torch_files(tmp_path: Path) -> None:
    """save_16bit_model writes pytorch_model.bin through the engine: the torch file it promises."""
    ours = ZeroStallCheckpointEngine()
    info = CheckpointCommitInfo(tag="global_step1", save_dir=str(tmp_path), save_latest=False)
    ours.create(info)
    ours.save({"w": torch.ones(2)}, str(tmp_path / "pytorch_model.bin"))
    assert ours.commit(info)
    assert torch.equal(torch.load(tmp_path / "pytorch_model.bin")["w"], torch.ones(2))


def test_stored_objects_are_rebuilt_only_from_deepspeeds_own_classes() -> None:
    value = values.split({"s": LossScaler(4.0)})[values.VALUE]
    value["objects"][0][1:3] = ["os", "system"]
    with pytest.raises(zs.CorruptCheckpointError, match="only DeepSpeed's own classes"):
        values.join(value, lambda names: [torch.zeros(1) for _ in names], "f.pt")
    value["objects"][0][1:3] = ["deepspeed.not_imported_module", "X"]
    with pytest.raises(zs.CorruptCheckpointError, match="not imported"):
        values.join(value, lambda names: [torch.zeros(1) for _ in names], "f.pt")


def test_options_are_checked_when_built() -> None:
    with pytest.raises(ValueError, match="asynchronous"):
        DeepSpeedOptions(asynchronous="yes")
    with pytest.raises(TypeError, match="did you mean 'allow_pickle'"):
        ZeroStallCheckpointEngine(allow_pickles=True)


# -- swap files -------------------------------------------------------------------------------------
def swap_folder(folder: Path, first: int, last: int) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    files = {f"{first}_{last}.tensor.swp": os.urandom(3000), f"exp_avg-{first}_{last}.tensor.swp": os.urandom(3000),
             f"{first}_{last}_gradient_0_10.tensor.swp": os.urandom(40)}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def test_swap_files_are_saved_by_parameter_name_and_restored_in_place(tmp_path: Path) -> None:
    saved = swap_folder(tmp_path / "a", 0, 3)
    names = {0: "layer.0.weight", 1: "layer.0.bias", 3: "head.weight"}
    tensors = SwapFolders({"optimizer": str(tmp_path / "a")}, names).tensors()
    assert sorted(tensors["optimizer"]) == ["exp_avg[layer.0.weight..head.weight]", "fp32[layer.0.weight..head.weight]"]
    zs.save({"offloaded_tensors": zs.rank_local(tensors)}, str(tmp_path / "ck"))
    # a new process: the same parameters, numbered 10.. by DeepSpeed; its files hold other bytes
    target = tmp_path / "b"
    stale = swap_folder(target, 10, 13)
    moved = SwapFolders({"optimizer": str(target)}, {10: "layer.0.weight", 11: "layer.0.bias", 13: "head.weight"})
    with zs.open(str(tmp_path / "ck")) as ck:
        assert moved.restore(ck, 0) == 6000
    assert (target / "10_13.tensor.swp").read_bytes() == saved["0_3.tensor.swp"]
    assert (target / "exp_avg-10_13.tensor.swp").read_bytes() == saved["exp_avg-0_3.tensor.swp"]
    assert (target / "10_13_gradient_0_10.tensor.swp").read_bytes() == stale["10_13_gradient_0_10.tensor.swp"]
    assert sorted(os.listdir(target)) == sorted(stale)


def test_a_damaged_swap_file_leaves_the_one_in_place_untouched(tmp_path: Path) -> None:
    swap_folder(tmp_path / "a", 0, 3)
    folders = SwapFolders({"optimizer": str(tmp_path / "a")}, {0: "a", 3: "b"})
    zs.save({"offloaded_tensors": zs.rank_local(folders.tensors())}, str(tmp_path / "ck"))
    for data in (tmp_path / "ck").iterdir():
        if data.name != "manifest.json":
            raw = bytearray(data.read_bytes())
            raw[-100] ^= 1
            data.write_bytes(bytes(raw))
    target = tmp_path / "b"
    before = swap_folder(target, 0, 3)
    with zs.open(str(tmp_path / "ck")) as ck, pytest.raises(zs.CorruptCheckpointError):
        SwapFolders({"optimizer": str(target)}, {0: "a", 3: "b"}).restore(ck, 0)
    assert {n: (target / n).read_bytes() for n in os.listdir(target)} == before  # no .incoming file left either


def test_restoring_swap_files_checks_the_space_first(tmp_path: Path, monkeypatch) -> None:
    swap_folder(tmp_path / "a", 0, 3)
    folders = SwapFolders({"optimizer": str(tmp_path / "a")}, {0: "a", 3: "b"})
    zs.save({"offloaded_tensors": zs.rank_local(folders.tensors())}, str(tmp_path / "ck"))
    (tmp_path / "b").mkdir()
    from zerostall.integrations.deepspeed import swap as swap_module

    real = os.statvfs

    class Tiny:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize, self.f_blocks, self.f_bavail = 1, st.f_blocks, 5999

    monkeypatch.setattr(swap_module.os, "statvfs", lambda p: Tiny(real(p)))
    with zs.open(str(tmp_path / "ck")) as ck, pytest.raises(zs.InsufficientSpaceError, match="needs 6000 bytes"):
        folders_b = SwapFolders({"optimizer": str(tmp_path / "b")}, {0: "a", 3: "b"})
        folders_b.restore(ck, 0)
    assert os.listdir(tmp_path / "b") == []


def test_a_lock_left_by_a_killed_op_build_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A just-in-time build killed mid-way leaves its ``lock``, on which every later build waits
    for ever: tests/deepspeed_ops.py removes one older than any build takes, never a fresh one."""
    import time

    from deepspeed_ops import STALE_LOCK_S, remove_stale_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "async_io" / "lock", tmp_path / "pin_memory" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.write_text("")
    now = time.time()
    os.utime(stale, (now - STALE_LOCK_S - 60,) * 2)
    assert remove_stale_locks(now) == [str(stale)]
    assert not stale.exists() and fresh.exists()


@NVME
def test_a_load_of_weights_alone_leaves_the_optimizers_swap_files_as_they_were(tmp_path: Path) -> None:
    """The optimizer's swap files were restored before DeepSpeed's load, which then failed (ZeRO-3
    rebuilds weights alone from the optimizer's fp32 partitions, which lie in those files): the
    engine was left with the checkpoint's Adam moments, and a bare ValueError."""
    common = ["--stage", "3", "--offload", "none/nvme", "--nvme", str(tmp_path / "nvme"), "--dir", str(tmp_path / "ck")]
    job(tmp_path, "first", *common, "--steps", "4")
    with pytest.raises(zs.CheckpointError, match="offloaded to NVMe"):  # was a bare ValueError too
        fp32_state_dict(str(tmp_path / "ck"))
    resumed = job(tmp_path, "resumed", *common, "--resume", "--weights-only")
    for r in (0, 1):
        assert "CheckpointError" in resumed[r]["refused"] and "weights alone" in resumed[r]["refused"], resumed[r]
        assert resumed[r]["swap_kept"]


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    """A damaged block in rank 1's own optimizer file: rank 1 raised alone while rank 0 loaded
    and trained on, so the ranks went on from different checkpoints, or hung in the next collective."""
    common = ["--stage", "1", "--width", "64", "--dir", str(tmp_path / "ck")]
    job(tmp_path, "first", *common, "--steps", "3")
    with zs.open(str(tmp_path / "ck" / "step3")) as ck:
        entry = next(e for e in ck.manifest.entries if e.kind == "tensor" and "exp_avg" in e.fqn
                     and str(e.path[0]).startswith("zero_pp_rank_1"))
        chunk = entry.chunks[0]
    with open(tmp_path / "ck" / "step3" / chunk.file, "r+b") as f:
        f.seek(chunk.offset)
        byte = f.read(1)
        f.seek(chunk.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = job(tmp_path, "resumed", *common, "--resume")
    assert resumed[1]["refused"].startswith("CorruptCheckpointError"), resumed[1]
    assert "failed on 1 other rank" in resumed[0].get("refused", ""), resumed[0]


@NVME
def test_nvme_offload_with_nothing_large_enough_to_swap_resumes(tmp_path: Path) -> None:
    """Optimizer partitions under DeepSpeed's 1 MiB swap minimum leave the swap folder empty: the
    checkpoint held no offloaded state, and every load was refused as saved with other offload settings."""
    common = ["--stage", "3", "--width", "64", "--offload", "none/nvme", "--nvme", str(tmp_path / "nvme"),
              "--dir", str(tmp_path / "ck")]
    job(tmp_path, "first", *common, "--kill-at", "6", expect_kill=True)
    resumed = job(tmp_path, "resumed", *common, "--resume")
    # resumed, not bit-exactly: DeepSpeed's own engine does not resume this setting exactly either
    assert all("refused" not in resumed[r] and resumed[r]["resumed_from"] == 3 for r in (0, 1)), resumed


@NVME
def test_a_rollback_in_the_same_process_with_the_optimizer_on_nvme_trains_on_exactly(tmp_path: Path) -> None:
    """A load of an earlier checkpoint into an engine that had trained on: the optimizer's state
    was given new tensors its NVMe swapper did not know, and the next step failed on a size
    mismatch. Now the steps after the checkpoint are trained again with the losses they had."""
    run = job(tmp_path, "run", "--stage", "3", "--width", "512", "--offload", "none/nvme",
              "--nvme", str(tmp_path / "nvme"), "--dir", str(tmp_path / "ck"), "--tag", "step3", "--rollback")
    for r in (0, 1):
        assert [run[r][f"again{s}"] for s in (4, 5, 6)] == [run[r][str(s)] for s in (4, 5, 6)], run[r]


def consolidate_on_rank_0(directory: str) -> int:
    import torch.distributed as dist

    count = len(fp32_state_dict(directory)) if dist.get_rank() == 0 else 0
    dist.barrier()
    return count


def test_fp32_state_dict_on_one_rank_of_a_job_does_not_wait_for_the_others(ranks, tmp_path: Path) -> None:
    """It opened the checkpoint collectively on the default group: rank 0 alone hung in a broadcast."""
    job(tmp_path, "saved", "--stage", "2", "--width", "64", "--dir", str(tmp_path / "ck"), "--steps", "3")
    assert ranks(2).run(consolidate_on_rank_0, str(tmp_path / "ck"), timeout=120)[0] == 4  # two Linear layers
