"""Foreign checkpoints as sources: PyTorch DCP (saved by FSDP2 ranks) and Hugging Face safetensors
(``safetensors.torch.save_file``, ``transformers`` ``save_pretrained``) load through the same
pipeline as zerostall checkpoints, resharding on any mesh, bit-exactly; ``zerostall import``
converts them (with checksums, values checked); hostile safetensors headers are refused."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from safetensors.torch import save_file

import zerostall as zs
from zerostall.cli import cli
from zerostall.storage import LocalStorage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process


def mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))


def fully_sharded(model: torch.nn.Module, layers) -> torch.nn.Module:
    """``model`` under FSDP2 over every rank, each of ``layers`` a unit of its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_mlp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = mlp(seed)
    model = fully_sharded(model, [layer for layer in model if isinstance(layer, torch.nn.Linear)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


# -- DCP saved by 2 FSDP2 ranks -------------------------------------------------------------------


def dcp_save_fsdp(path: str) -> dict:
    """FSDP2 model + AdamW after a step, saved by ``dcp.save`` from ``get_state_dict``; the full values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = fsdp_mlp(0)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "step": 7}, checkpoint_id=path)
    return {"model": {k: full(v) for k, v in msd.items()},
            "state": {n: {k: full(v) for k, v in s.items()} for n, s in osd["state"].items()},
            "param_groups": osd["param_groups"]}


def differences(model_sd: dict, optim_sd: dict, ref: dict) -> list[str]:
    """What differs between a loaded model and (index-keyed) optimizer and the saved full values."""
    bad = [k for k, v in model_sd.items() if not same_bits(full(v), ref["model"][k])]
    names = [n for g in ref["param_groups"] for n in g["params"]]
    ids = [i for g in optim_sd["param_groups"] for i in g["params"]]
    for i, name in zip(ids, names, strict=True):
        for k, v in ref["state"][name].items():
            if not same_bits(full(optim_sd["state"][i][k]), v):
                bad.append(f"optim {name}.{k}")
    for got, saved in zip(optim_sd["param_groups"], ref["param_groups"], strict=True):
        if {k: v for k, v in got.items() if k != "params"} != {k: v for k, v in saved.items() if k != "params"}:
            bad.append("param_groups")
    return bad


def dcp_load_fsdp(path: str, ref: dict) -> list[str]:
    """Into FSDP2 on this world: the model and optimizer objects, then get_state_dict's dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = fsdp_mlp(9)
    state = zs.load({"model": model, "optim": optim, "step": None}, path, allow_pickle=True)
    bad = differences(model.state_dict(), optim.state_dict(), ref) + ([] if state["step"] == 7 else ["step"])
    model, optim = fsdp_mlp(10)
    msd, osd = get_state_dict(model, optim)
    state = zs.load({"model": msd, "optim": osd, "step": None}, path, allow_pickle=True)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return bad + [f"get_state_dict: {b}" for b in differences(model.state_dict(), optim.state_dict(), ref)]


@pytest.fixture(scope="module")
def dcp_fsdp(ranks, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp") / "ck")
    return path, ranks(2).run(dcp_save_fsdp, path)[0]


def test_dcp_from_fsdp2_loads_into_one_process_bit_exactly(dcp_fsdp):
    path, ref = dcp_fsdp
    model = mlp(3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = zs.load({"model": model, "optim": optim, "step": None}, path, allow_pickle=True)
    assert differences(model.state_dict(), optim.state_dict(), ref) == []
    assert state["step"] == 7
    with zs.open(path, allow_pickle=True) as ck:  # keys as DCP names them
        assert same_bits(ck.read("model.0.weight"), ref["model"]["0.weight"])
        assert ck.read("optim.param_groups")[0]["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_dcp_from_fsdp2_loads_into_four_fsdp2_ranks_bit_exactly(dcp_fsdp, ranks):
    path, ref = dcp_fsdp
    assert ranks(4).run(dcp_load_fsdp, path, ref) == [[]] * 4


def test_optimizer_state_saved_by_name_loads_into_an_optimizer_object(tmp_path):
    """The same for a zerostall checkpoint of get_state_dict's dicts (keyed by parameter name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = mlp(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    zs.save({"model": msd, "optim": osd}, tmp_path / "ck")
    ref = {"model": msd, "state": osd["state"], "param_groups": osd["param_groups"]}
    fresh = mlp(1)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    zs.load({"model": fresh, "optim": fresh_optim}, tmp_path / "ck")
    assert differences(fresh.state_dict(), fresh_optim.state_dict(), ref) == []
    assert fresh_optim.param_groups[0]["lr"] == 1e-2 and fresh_optim.param_groups[0]["params"][0] is fresh[0].weight


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
def test_a_plain_optimizer_and_scheduler_saved_by_dcp_load_as_dcp_loads_them(tmp_path):
    """DCP stores dict keys as strings: an optimizer's state by "0", "1"... never matched the
    optimizer's int keys (strict: "missing optim.state.0.step, unexpected optim.state.0.step";
    strict=False: no optimizer state loaded, also after ``zerostall import``); a scheduler's int
    milestones came back as strings (its learning rate never decayed again); a state without
    tensors did not load at all."""
    import torch.distributed.checkpoint as dcp

    model = mlp(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, milestones=[2, 4], gamma=0.1)
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    sched.step()
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict()},
             checkpoint_id=str(tmp_path / "dcp"))
    dcp.save({"sched": sched.state_dict()}, checkpoint_id=str(tmp_path / "no-tensors"))
    assert CliRunner().invoke(cli, ["import", str(tmp_path / "dcp"), str(tmp_path / "imported"),
                                    "--allow-pickle"]).exit_code == 0
    for source, options in (("dcp", {"allow_pickle": True}), ("imported", {})):
        fresh = mlp(1)
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.5)
        fresh_sched = torch.optim.lr_scheduler.MultiStepLR(fresh_optim, milestones=[9])
        zs.load({"model": fresh, "optim": fresh_optim, "sched": fresh_sched}, tmp_path / source, **options)
        for key, value in optim.state_dict()["state"][0].items():
            assert torch.equal(fresh_optim.state_dict()["state"][0][key], value), (source, key)
        assert fresh_sched.milestones == sched.milestones and type(fresh_sched.milestones) is type(sched.milestones)
    alone = torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD(mlp(1).parameters(), lr=1.0), milestones=[9])
    zs.load({"sched": alone}, tmp_path / "no-tensors", allow_pickle=True)
    assert alone.last_epoch == 1 and alone.milestones == sched.milestones


def test_dcp_needs_allow_pickle(dcp_fsdp):
    path, _ = dcp_fsdp
    for call in (lambda: zs.open(path), lambda: zs.load({"model": mlp(1)}, path)):
        with pytest.raises(zs.UnsupportedValueError, match=r"allow_pickle=True") as err:
            call()
        assert "pickle" in str(err.value) and "run" in str(err.value)


def test_dcp_import_checks_every_value_and_adds_checksums(dcp_fsdp, tmp_path):
    path, ref = dcp_fsdp
    refused = CliRunner().invoke(cli, ["import", path, str(tmp_path / "no")])
    assert refused.exit_code == 2 and "--allow-pickle" in refused.output
    done = CliRunner().invoke(cli, ["import", path, str(tmp_path / "zs"), "--allow-pickle", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["source_kind"] == "dcp" and report["differences"] == [] and report["tensors"] == 16
    assert zs.verify(tmp_path / "zs") > 0
    model = mlp(4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    zs.load({"model": model, "optim": optim, "step": None}, tmp_path / "zs", allow_pickle=True)
    assert differences(model.state_dict(), optim.state_dict(), ref) == []


def test_dcp_reads_only_the_bytes_of_the_box(dcp_fsdp):
    path, ref = dcp_fsdp
    storage = CountingStorage(path)
    with zs.open(storage, allow_pickle=True) as ck:
        chunks = sum(len(e.chunks) for e in ck.manifest.entries)
        values = sum(e.kind == "object" for e in ck.manifest.entries)
        assert storage.calls <= 3 * chunks + values + 2  # an archive's head and tail windows, not its bytes
        entry = ck.entries["model.0.weight"]
        assert len(entry.chunks) == 2  # one per FSDP2 rank
        storage.read = 0
        part = ck.read("model.0.weight", box=((3, 0), (5, 16)))
        assert storage.read == 5 * 16 * 4
    assert same_bits(part, ref["model"]["0.weight"][3:8])


def test_dcp_items_zerostall_cannot_locate_are_named_and_left_out(tmp_path, caplog):
    """An item zerostall cannot read in place is named in a warning and left out: the rest of the
    checkpoint loads, and a load that wants that item reports it missing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

    dcp.save({"t": torch.arange(6.0).reshape(2, 3).t(), "u": torch.ones(3)}, checkpoint_id=str(tmp_path / "ck"))
    with caplog.at_level("WARNING", logger="zerostall.loading.foreign.dcp"):
        got = zs.load({"u": torch.zeros(3)}, tmp_path / "ck", allow_pickle=True)
    assert torch.equal(got["u"], torch.ones(3))
    assert "'t' is stored non-contiguous" in caplog.text and "left out" in caplog.text
    with pytest.raises(zs.StateMismatchError, match="missing.*t"):
        zs.load({"t": torch.zeros(3, 2), "u": torch.zeros(3)}, tmp_path / "ck", allow_pickle=True)
    refused = CliRunner().invoke(cli, ["import", str(tmp_path / "ck"), str(tmp_path / "zs"), "--allow-pickle"])
    assert refused.exit_code == 1 and "cannot read in place (t;" in refused.output and not (tmp_path / "zs").exists()
    with pytest.raises(zs.ExportError, match="cannot read in place under the prefix"), \
            zs.open(tmp_path / "ck", allow_pickle=True) as ck:
        zs.export(ck, tmp_path / "hf")  # an export never drops a tensor either
    assert not (tmp_path / "hf").exists()
    dcp.save({"t": torch.zeros(2, 3).t(), "u": torch.ones(3)}, checkpoint_id=str(tmp_path / "other"))
    compared = CliRunner().invoke(cli, ["diff", str(tmp_path / "ck"), str(tmp_path / "other"), "--allow-pickle"])
    assert compared.exit_code == 2 and "(t; " in compared.output and "cannot be compared" in compared.output  # not
    # "equal", as when the tensor left out was skipped
    writer = FileSystemWriter(str(tmp_path / "st"), serialization_format=SerializationFormat.SAFETENSORS)
    dcp.save({"t": torch.arange(6.0)}, storage_writer=writer)
    caplog.clear()
    with caplog.at_level("WARNING", logger="zerostall.loading.foreign.dcp"), zs.open(tmp_path / "st", allow_pickle=True) as ck:
        assert not ck.entries
    assert "'t' is not a torch.save archive" in caplog.text


# -- Hugging Face safetensors ---------------------------------------------------------------------


class CountingStorage(LocalStorage):
    """A local storage that counts the bytes read from its files' byte ranges."""

    read = calls = 0

    def read_into(self, name, offset, out):
        super().read_into(name, offset, out)
        self.read += len(out)
        self.calls += 1

    def read_into_many(self, name, offset, outs):
        super().read_into_many(name, offset, outs)
        self.read += sum(len(out) for out in outs)
        self.calls += 1


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


def llama(seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config())


def hf_load_fsdp(path: str, kind: str, ref: dict) -> list[str]:
    if kind == "llama":
        model = llama(5)
        model = fully_sharded(model, list(model.model.layers))
    else:
        model = fsdp_mlp(5)[0]
    zs.load(model, path)
    bad = [k for k, v in model.state_dict().items() if not same_bits(full(v), ref[k])]
    if kind == "mlp":  # whole on every rank: one rank reads each tensor and broadcasts it
        plain = mlp(6)
        zs.load(plain, path, broadcast=True)
        bad += [f"broadcast {k}" for k, v in plain.state_dict().items() if not same_bits(v, ref[k])]
    return bad


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """A safetensors directory sharded by hand (two files and an index) and a save_pretrained one."""
    root = tmp_path_factory.mktemp("hf")
    sd = mlp(0).state_dict()
    names = sorted(sd)
    os.makedirs(root / "mlp")
    weight_map = {}
    for n, part in enumerate((names[:2], names[2:])):
        file = f"model-{n + 1:05d}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, root / "mlp" / file)
        weight_map.update({k: file for k in part})
    (root / "mlp" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = llama(0)
    model.save_pretrained(root / "llama", max_shard_size="20KB")
    assert len([n for n in os.listdir(root / "llama") if n.endswith(".safetensors")]) > 2
    return root, {"mlp": sd, "llama": model.state_dict()}


def test_hf_directories_load_into_two_fsdp2_ranks_bit_exactly(hf_dirs, ranks):
    root, refs = hf_dirs
    for kind in ("mlp", "llama"):
        assert ranks(2).run(hf_load_fsdp, str(root / kind), kind, refs[kind]) == [[], []], kind


def test_hf_single_file_and_bare_module(hf_dirs, tmp_path):
    root, refs = hf_dirs
    save_file(refs["mlp"], tmp_path / "model.safetensors")
    for source in (tmp_path / "model.safetensors", str(tmp_path / "model.safetensors"), root / "mlp"):
        model = mlp(8)
        zs.load(model, source)
        assert all(same_bits(v, refs["mlp"][k]) for k, v in model.state_dict().items())
    os.makedirs(tmp_path / "snapshot")
    os.symlink(tmp_path / "model.safetensors", tmp_path / "snapshot" / "model.safetensors")  # a HF cache's
    model = mlp(8)
    zs.load(model, tmp_path / "snapshot" / "model.safetensors")  # the file named is followed
    assert all(same_bits(v, refs["mlp"][k]) for k, v in model.state_dict().items())
    with pytest.raises(zs.UnsafeFileError):
        zs.open(tmp_path / "snapshot")  # links inside a checkpoint are not
    with zs.open(tmp_path / "model.safetensors") as ck:
        assert sorted(ck.entries) == sorted(refs["mlp"])
        assert same_bits(ck.state()["2.bias"], refs["mlp"]["2.bias"])


def hf_cache(source, root):
    """``source``'s files laid out as the Hugging Face hub cache does (``snapshot_download``
    returns the snapshot): each file a blob, the snapshot a directory of relative links to them."""
    repo = root / "models--org--tiny-llama"
    os.makedirs(repo / "blobs")
    snapshot = repo / "snapshots" / "0123abcd"
    os.makedirs(snapshot)
    for n, name in enumerate(sorted(os.listdir(source))):
        shutil.copy(source / name, repo / "blobs" / f"{n:040x}")
        os.symlink(f"../../blobs/{n:040x}", snapshot / name)
    return snapshot


def test_a_hugging_face_cache_snapshot_loads_and_its_links_may_only_reach_its_blobs(hf_dirs, tmp_path):
    root, refs = hf_dirs
    snapshot = hf_cache(root / "llama", tmp_path)
    model = llama(5)
    zs.load(model, snapshot)
    assert all(same_bits(v, refs["llama"][k]) for k, v in model.state_dict().items())
    shard = next(n for n in sorted(os.listdir(snapshot)) if n.endswith(".safetensors"))
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(snapshot / shard, elsewhere)
    for target in (elsewhere, f"../../blobs/../../{elsewhere.name}"):  # out of blobs/, directly or by ..
        os.remove(snapshot / shard)
        os.symlink(target, snapshot / shard)
        with pytest.raises(zs.UnsafeFileError, match="symbolic link"):
            zs.load(llama(5), snapshot)


def test_hf_prefixes_are_stripped_by_load_options(hf_dirs):
    root, refs = hf_dirs
    from transformers import LlamaModel

    torch.manual_seed(1)
    bare = LlamaModel(llama_config())  # its keys lack the "model." of LlamaForCausalLM's
    _, mismatch = zs.load(bare, root / "llama", strip="model", strict=False)
    assert mismatch.unexpected == ["lm_head.weight"] and not mismatch.missing
    assert all(same_bits(v, refs["llama"]["model." + k]) for k, v in bare.state_dict().items())
    compiled = torch.compile(mlp(3))  # its keys start with "_orig_mod." (nothing is compiled before a call)
    zs.load(compiled, root / "mlp", strip="_orig_mod")
    assert all(same_bits(v, refs["mlp"][k.removeprefix("_orig_mod.")]) for k, v in compiled.state_dict().items())


def test_hf_reads_only_the_bytes_of_the_box(hf_dirs):
    root, refs = hf_dirs
    storage = CountingStorage(str(root / "llama"))
    with zs.open(storage) as ck:
        storage.read = 0
        part = ck.read("model.embed_tokens.weight", box=((10, 0), (7, 32)))
        assert storage.read == 7 * 32 * 4
    assert same_bits(part, refs["llama"]["model.embed_tokens.weight"][10:17])


def test_hf_tensors_at_unaligned_offsets_read_exactly(tmp_path):
    values = torch.arange(4, dtype=torch.float32)
    forged(tmp_path / "model.safetensors", {"a": F32, "b": {**F32, "data_offsets": [16, 32]}},
           data=values.numpy().tobytes() + (values + 4).numpy().tobytes(), length=None)
    assert (8 + len(json.dumps({"a": F32, "b": {**F32, "data_offsets": [16, 32]}}))) % 4  # misaligned
    with zs.open(tmp_path) as ck:
        assert same_bits(ck.read("a"), values) and same_bits(ck.read("b"), values + 4)
    target = {"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(4)}
    zs.load(target, tmp_path)
    assert torch.equal(target["a"], values.double()) and same_bits(target["b"], values + 4)


def test_hf_import_then_verify(hf_dirs, tmp_path):
    root, refs = hf_dirs
    done = CliRunner().invoke(cli, ["import", str(root / "llama"), str(tmp_path / "zs")])
    assert done.exit_code == 0 and done.output.startswith("OK safetensors"), done.output
    assert zs.verify(tmp_path / "zs") == sum(v.nbytes for v in refs["llama"].values())
    model = llama(3)
    zs.load(model, tmp_path / "zs")
    assert all(same_bits(v, refs["llama"][k]) for k, v in model.state_dict().items())
    again = CliRunner().invoke(cli, ["import", str(root / "llama"), str(tmp_path / "zs")])
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_foreign_checkpoints_carry_no_checksums_to_verify(hf_dirs):
    root, _ = hf_dirs
    with pytest.raises(zs.CheckpointError, match="carries no checksums") as err:
        zs.verify(root / "mlp")
    assert not isinstance(err.value, zs.CorruptCheckpointError)
    result = CliRunner().invoke(cli, ["verify", str(root / "mlp")])
    assert result.exit_code != 0 and "OK" not in result.output and "no checksums" in result.output


def test_what_is_found_is_named_when_nothing_fits(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(zs.CheckpointNotFoundError, match="notes.txt"):
        zs.open(tmp_path)
    (tmp_path / "1a2b-0000abcd-r00000-000.safetensors").write_bytes(b"")  # a zerostall save that never committed
    with pytest.raises(zs.IncompleteCheckpointError):
        zs.open(tmp_path)


# -- hostile safetensors headers ------------------------------------------------------------------


def forged(path, header: dict | bytes, data: bytes = b"\0" * 64, length: int | None = None) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


F32 = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


@pytest.mark.parametrize("header,length,words", [
    ({"a": {**F32, "data_offsets": [60, 76]}}, None, ["'a'", "outside"]),
    ({"a": {**F32, "data_offsets": [-4, 12]}}, None, ["'a'", "outside"]),
    ({"a": F32, "b": {**F32, "data_offsets": [8, 24]}}, None, ["'a'", "'b'", "overlap"]),
    ({"a": {**F32, "shape": [5]}}, None, ["'a'", "needs 20 bytes"]),
    ({"a": {**F32, "dtype": "Q7"}}, None, ["'a'", "unknown dtype 'Q7'"]),
    ({"a": {**F32, "shape": [-4]}}, None, ["'a'", "shape"]),
    ({"a": {**F32, "shape": [1 << 63, 0], "data_offsets": [0, 0]}}, None, ["'a'", "shape"]),  # no elements:
    ({"a": {**F32, "shape": [1] * 65, "data_offsets": [0, 4]}}, None, ["'a'", "shape"]),  # it was a TypeError
    ({"a": F32}, 1 << 62, ["header claims"]),
    (b'{"a": 1, "a": 2}', None, ["'a'", "twice"]),
    (b"[1, 2]", None, ["not a JSON object"]),
    (b"\xff{", None, ["not valid JSON"]),
])
def test_hostile_safetensors_headers_are_refused(tmp_path, header, length, words):
    forged(tmp_path / "model.safetensors", header, length=length)
    for call in (lambda: zs.open(tmp_path), lambda: zs.load(mlp(0), tmp_path / "model.safetensors")):
        with pytest.raises(zs.CorruptCheckpointError) as err:
            call()
        assert "model.safetensors" in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_sub_byte_dtypes_are_refused_by_name(tmp_path):
    forged(tmp_path / "model.safetensors", {"q": {"dtype": "F4", "shape": [8], "data_offsets": [0, 4]}})
    with pytest.raises(zs.UnsupportedValueError, match="'q' has the sub-byte dtype F4"):
        zs.open(tmp_path)


def test_hostile_index_and_duplicates_are_refused(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "one.safetensors")
    save_file({"a": torch.ones(2)}, tmp_path / "two.safetensors")
    with pytest.raises(zs.CorruptCheckpointError, match="'a' is in both one.safetensors and two.safetensors"):
        zs.open(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../one.safetensors"}}))
    with pytest.raises(zs.UnsafeFileError):
        zs.open(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["one.safetensors"]}))
    with pytest.raises(zs.CorruptCheckpointError, match="weight_map"):
        zs.open(tmp_path)


def test_hf_and_dcp_load_from_s3(hf_dirs, dcp_fsdp, s3_url):
    from zerostall.storage import storage_for

    root, refs = hf_dirs
    dcp_path, ref = dcp_fsdp
    for local, url in ((root / "llama", f"{s3_url}/llama"), (pathlib.Path(dcp_path), f"{s3_url}/dcp")):
        remote = storage_for(url)
        for name in os.listdir(local):
            remote.write(name, [memoryview((local / name).read_bytes())])
    model = llama(2)
    zs.load(model, f"{s3_url}/llama")
    assert all(same_bits(v, refs["llama"][k]) for k, v in model.state_dict().items())
    model = mlp(2)
    zs.load({"model": model}, f"{s3_url}/dcp", allow_pickle=True, strict=False)
    assert all(same_bits(v, ref["model"][k]) for k, v in model.state_dict().items())


def test_a_truncated_dcp_file_is_refused_naming_the_item(dcp_fsdp, tmp_path):
    import shutil

    path, _ = dcp_fsdp
    shutil.copytree(path, tmp_path / "ck")
    data = sorted(n for n in os.listdir(tmp_path / "ck") if n.endswith(".distcp"))[0]
    os.truncate(tmp_path / "ck" / data, 100)
    with pytest.raises(zs.CorruptCheckpointError, match=rf"item '[^']+'.* outside {data}"):
        zs.open(tmp_path / "ck", allow_pickle=True)
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "ck"), str(tmp_path / "out"), "--allow-pickle"])
    assert result.exit_code == 1 and "outside" in result.output and not (tmp_path / "out").exists()


def test_a_shard_missing_from_an_index_is_named(hf_dirs, tmp_path):
    import shutil

    root, _ = hf_dirs
    shutil.copytree(root / "mlp", tmp_path / "hf")
    os.remove(tmp_path / "hf" / "model-00002-of-00002.safetensors")
    with pytest.raises(zs.CorruptCheckpointError, match="model-00002-of-00002.safetensors"):
        zs.open(tmp_path / "hf")


def test_shards_without_their_index_or_not_as_it_says_are_refused(hf_dirs, tmp_path):
    """An export killed between its renames left shards of two saves and no index (or an index of the
    other save): the shards present were loaded and imported as a whole checkpoint, silently mixed."""
    import shutil

    root, _ = hf_dirs
    shutil.copytree(root / "mlp", tmp_path / "no-index")
    os.remove(tmp_path / "no-index" / "model.safetensors.index.json")
    with pytest.raises(zs.CorruptCheckpointError, match=r"shards of a sharded checkpoint.*but no "
                                                        r"model\.safetensors\.index\.json"):
        zs.open(tmp_path / "no-index")
    result = CliRunner().invoke(cli, ["import", str(tmp_path / "no-index"), str(tmp_path / "out")])
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    shutil.copytree(root / "mlp", tmp_path / "other-save")
    index = json.loads((tmp_path / "other-save" / "model.safetensors.index.json").read_text())
    moved = sorted(index["weight_map"])[0]
    index["weight_map"]["lm_head.weight"] = index["weight_map"][moved]  # a key no shard holds
    (tmp_path / "other-save" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(zs.CorruptCheckpointError, match=r"puts tensor 'lm_head\.weight' in model-0000.-of-00002"
                                                        r"\.safetensors, which does not hold it"):
        zs.open(tmp_path / "other-save")
    del index["weight_map"]["lm_head.weight"], index["weight_map"][moved]  # a tensor a shard holds, not named
    (tmp_path / "other-save" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(zs.CorruptCheckpointError, match=f"does not name tensor '{moved}'"):
        zs.open(tmp_path / "other-save")


@pytest.mark.parametrize("how", ["overlap", "gap"])
def test_dcp_chunks_that_do_not_tile_a_tensor_are_refused_naming_it(dcp_fsdp, tmp_path, how):
    """An edited .metadata listing a tensor's first chunk twice (and none for the rows after it):
    reads returned uninitialised memory, loads left old values, import wrote them under checksums;
    with a chunk left out, export wrote zeros."""
    import pickle
    import shutil

    path, _ = dcp_fsdp
    shutil.copytree(path, tmp_path / "ck")
    meta = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    item = meta.state_dict_metadata["model.0.weight"]
    assert len(item.chunks) == 2  # a shard a rank
    item.chunks = [item.chunks[0]] * 2 if how == "overlap" else item.chunks[:1]
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(zs.CorruptCheckpointError, match=r"the chunks \.metadata gives item 'model\.0\.weight' do not "
                                                        r"tile its shape \[33, 16\]"):
        zs.open(tmp_path / "ck", allow_pickle=True)
    for command in (["import", str(tmp_path / "ck"), str(tmp_path / "imported")],
                    ["export", str(tmp_path / "ck"), str(tmp_path / "exported"), "--prefix", "model."]):
        result = CliRunner().invoke(cli, [*command, "--allow-pickle"])
        assert result.exit_code == 1 and "do not tile" in result.output, result.output
