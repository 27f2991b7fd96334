"""Asynchronous saves are never torn by a forgotten ``wait_staged()``: an optimizer's ``step()``
waits for the capture by default, and any other in-place change before a tensor's copy finished
fails the save (nothing is committed) with an error naming the key.

To make "the change comes before the copy" certain, the saver's worker is held busy before the
save is requested, so its capture cannot start until the test lets it (after changing the state,
or from an optimizer step pre-hook that runs before the saver's own)."""

from __future__ import annotations

import threading

import pytest
import torch

import zerostall as zs


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, optimizer)  # the optimizer has state to save
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, step: bool = True) -> None:
    model(torch.randn(16, 64)).square().mean().backward()
    if step:
        optimizer.step()
        optimizer.zero_grad()


def hold_worker(saver: zs.AsyncSaver) -> threading.Event:
    """Keep the saver's one worker busy until the returned event is set (the next save's capture waits)."""
    release = threading.Event()
    saver._worker.submit(release.wait, 60)
    return release


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_an_optimizer_step_right_after_the_save_waits_for_the_capture(tmp_path):
    model, optimizer = model_and_optimizer()
    before = snapshot(model)
    saver = zs.AsyncSaver()
    release = hold_worker(saver)
    optimizer.register_step_pre_hook(lambda *_: release.set())  # runs before the saver's: the capture may start
    handle = saver.save({"model": model, "optim": optimizer}, tmp_path / "ck")
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(handle.staged.done()))  # runs after the saver's
    train_step(model, optimizer)  # the mistake: no wait_staged() before the step
    handle.result()
    saver.close()
    assert seen == [True]
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the step changed it
    loaded = zs.load({"model": model}, tmp_path / "ck", strict=False)[0]["model"]
    assert all(torch.equal(before[k], v) for k, v in loaded.state_dict().items())


def test_an_optimizer_inside_an_app_state_object_is_held_too(tmp_path):
    model, optimizer = model_and_optimizer()

    class AppState:  # the DCP-style wrapper: one stateful holding model and optimizer
        def __init__(self) -> None:
            self.model, self.optimizer = model, optimizer

        def state_dict(self) -> dict:
            return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

        def load_state_dict(self, sd: dict) -> None:
            self.model.load_state_dict(sd["model"])
            self.optimizer.load_state_dict(sd["optim"])

    before = snapshot(model)
    saver = zs.AsyncSaver()
    release = hold_worker(saver)
    optimizer.register_step_pre_hook(lambda *_: release.set())  # runs before the saver's hook
    handle = saver.save({"app": AppState()}, tmp_path / "ck")
    train_step(model, optimizer)
    handle.result()
    saver.close()
    with zs.open(tmp_path / "ck") as ck:
        assert all(torch.equal(before[k], ck.read(f"app.model.{k}")) for k in before)


def test_a_change_before_the_capture_fails_the_save_and_commits_nothing(tmp_path):
    model, optimizer = model_and_optimizer()
    zs.save({"model": model.state_dict()}, tmp_path / "ck", step=1, overwrite=True)  # the previous good checkpoint
    saver = zs.AsyncSaver()
    release = hold_worker(saver)
    # state dicts, not the optimizer itself: nothing holds the step, the version check must catch it
    handle = saver.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, tmp_path / "ck", step=2, overwrite=True)
    train_step(model, optimizer)
    release.set()
    with pytest.raises(zs.StateChangedError, match=r"(model|optim)\..* was changed in place .* wait_staged\(\)"):
        handle.result()
    saver.close()  # the failure was raised by its handle: not again
    with zs.open(tmp_path / "ck") as ck:
        assert ck.step == 1  # the previous checkpoint is untouched
    zs.verify(tmp_path / "ck")


def test_a_plain_tensor_changed_before_its_copy_names_its_key(tmp_path):
    state = {"w": torch.ones(1000), "b": torch.zeros(3)}
    saver = zs.AsyncSaver()
    release = hold_worker(saver)
    handle = saver.save(state, tmp_path / "ck")
    state["w"].mul_(2)
    release.set()
    with pytest.raises(zs.StateChangedError, match=r"^w was changed in place"):
        handle.result()
    assert not (tmp_path / "ck" / "manifest.json").exists()
    saver = zs.AsyncSaver()  # the same save, with the change after wait_staged(): committed as it was
    handle = saver.save(state, tmp_path / "ck")
    saver.wait_staged()
    state["w"].mul_(2)
    handle.result()
    saver.close()
    assert torch.equal(zs.load({"w": torch.empty(1000), "b": torch.empty(3)}, tmp_path / "ck")["w"],
                       torch.full((1000,), 2.0))


def test_close_removes_the_step_hooks(tmp_path):
    model, optimizer = model_and_optimizer()
    hooks = len(optimizer._optimizer_step_pre_hooks)
    saver = zs.AsyncSaver()
    saver.save({"model": model, "optim": optimizer}, tmp_path / "ck", overwrite=True).result()
    saver.save({"model": model, "optim": optimizer}, tmp_path / "ck", overwrite=True).result()
    assert len(optimizer._optimizer_step_pre_hooks) == hooks + 1  # once per optimizer, not per save
    saver.close()
    assert len(optimizer._optimizer_step_pre_hooks) == hooks


def torn_on_rank_1(path: str) -> str:
    """Both ranks save asynchronously; rank 1 changes its rank-local tensor before its capture.
    Returns what each rank's save raised."""
    import torch.distributed as dist
    state = {"w": torch.ones(64), "mine": zs.rank_local(torch.full((8,), float(dist.get_rank())))}
    saver = zs.AsyncSaver()
    release = hold_worker(saver)
    handle = saver.save(state, path, commit_timeout=300.0)
    if dist.get_rank() == 1:
        state["mine"].value.add_(1)
    release.set()
    try:
        handle.result()
    except zs.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        saver.close()  # the failure was raised by the handle: not again
    return "committed"


def test_a_capture_failing_on_one_rank_fails_the_others_at_once(ranks, tmp_path):
    """A rank whose capture fails tells the others at once (a ``failed`` record), so the
    coordinator aborts instead of waiting ``commit_timeout`` for a rank that will never write."""
    rank0, rank1 = ranks(2).run(torn_on_rank_1, str(tmp_path / "ck"), timeout=60)
    assert rank1.startswith("StateChangedError") and "mine" in rank1, rank1
    assert rank0.startswith("CommitError") and "rank 1: StateChangedError" in rank0, rank0
    assert not (tmp_path / "ck" / "manifest.json").exists()


def handover_fails_on_rank_1(path: str) -> str:
    """Both ranks save asynchronously with writer processes; rank 1's handover to its writer fails
    (the writer unreachable). Returns what each rank's save raised."""
    import torch.distributed as dist

    from zerostall.saving.writer_process import WriterProcess
    submit = WriterProcess.submit
    if dist.get_rank() == 1:
        def unreachable(self, job):
            raise BrokenPipeError("the writer process is gone")
        WriterProcess.submit = unreachable
    saver = zs.AsyncSaver(writer="process")
    try:
        saver.save({"w": torch.ones(64)}, path, commit_timeout=300.0).result()
    except (zs.CheckpointError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        saver.close()
        WriterProcess.submit = submit  # the rank's process serves later tests
    return "committed"


def test_a_handover_to_the_writer_failing_on_one_rank_fails_the_others_at_once(ranks, tmp_path):
    rank0, rank1 = ranks(2).run(handover_fails_on_rank_1, str(tmp_path / "ck"), timeout=60)
    assert "the writer process is gone" in rank1, rank1
    assert rank0.startswith("CommitError") and "rank 1" in rank0, rank0
    assert not (tmp_path / "ck" / "manifest.json").exists()


def _in_place(state):
    state["w"].mul_(2)


def _through_a_view(state):  # a non-contiguous leaf: its contiguous copy is made after the save returned
    state["t"].add_(1)


def _a_parameter(state):
    with torch.no_grad():
        state["p"].add_(1)


@pytest.mark.parametrize("change", [_in_place, _through_a_view, _a_parameter], ids=lambda c: c.__name__[1:])
def test_a_later_save_collected_after_it_returned_still_catches_a_change(tmp_path, change):
    """A saver's later save of the same structure builds its collection in the worker, after
    save() returned: the versions recorded in save() still catch a change made before the copy."""
    state = {"w": torch.ones(1000), "t": torch.arange(12.0).reshape(3, 4).t(),
             "p": torch.nn.Parameter(torch.zeros(5)), "note": "first"}
    saver = zs.AsyncSaver()
    saver.save(state, tmp_path / "first").result()
    release = hold_worker(saver)
    handle = saver.save(state, tmp_path / "ck")
    change(state)
    release.set()
    with pytest.raises(zs.StateChangedError, match=r"^[wtp] was changed in place"):
        handle.result()
    assert not (tmp_path / "ck" / "manifest.json").exists()
    saver.save(state, tmp_path / "again").result()
    assert saver.collections.hits == 1  # the structure learnt by the first save serves the saves after it
    saver.close()


def test_a_python_value_is_saved_as_it_was_when_save_returned(tmp_path):
    np = pytest.importorskip("numpy")
    state = {"w": torch.ones(4), "counts": np.zeros(3)}
    saver = zs.AsyncSaver()
    saver.save(state, tmp_path / "first").result()
    release = hold_worker(saver)
    handle = saver.save(state, tmp_path / "ck")
    state["counts"][0] = 7  # after the call returned, before the worker collects
    release.set()
    handle.result()
    saver.close()
    assert saver.collections.hits == 1
    with zs.open(tmp_path / "ck") as ck:
        assert ck.read("counts").tolist() == [0.0, 0.0, 0.0]
