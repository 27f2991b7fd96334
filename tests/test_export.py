"""Export (``zs.export``, ``zerostall export``): Hugging Face safetensors files (sharded as
``save_pretrained`` shards, with its index) and one ``torch.load`` file, read back by the
``safetensors`` library, ``torch.load(weights_only=True)`` and ``transformers``, bit-exact; DTensor
shards of several ranks consolidated; prefix, renames and casts; the entries skipped; errors; the
command line; and memory bounded by a few slabs, measured in a fresh process."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner, Result
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.tensor import Replicate, Shard

import zerostall as zs
from test_distributed import dtensor, full_value
from test_subclass import two
from zerostall.cli import cli
from zerostall.interop import exporting
from zerostall.interop.export_files import HF_INDEX, HF_WEIGHTS
from zerostall.interop.exporting import parse_size
from zerostall.storage import LocalStorage
from zerostall.storage import local as local_storage

SRC = Path(__file__).resolve().parent.parent / "src"
TESTS = Path(__file__).resolve().parent


def model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(32, 16, generator=g), "layers.0.w": torch.randn(16, 16, generator=g),
            "layers.0.b": torch.randn(16, generator=g).to(torch.bfloat16),
            "layers.1.w": torch.randn(16, 16, generator=g),
            "norm.scale": torch.tensor(2.5), "ids": torch.arange(10, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4)}


def saved(tmp_path: Path, extra: dict | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of {"model": model_state(), "step": 7, ...extra}, and the model state."""
    model = model_state()
    path = tmp_path / "ck"
    zs.save({"model": dict(model), "step": 7, **(extra or {})}, path)
    return path, model


def read_hf(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported directory, read by the safetensors library."""
    files = sorted(out.glob("*.safetensors"))
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            assert st.metadata() == {"format": "pt"}
        part = load_file(f)
        assert not set(part) & set(found)
        found.update(part)
    return found


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key


def test_one_file_when_it_fits_no_index_bit_exact(tmp_path):
    path, model = saved(tmp_path)
    info = zs.export(path, tmp_path / "hf", prefix="model.")
    assert sorted(os.listdir(tmp_path / "hf")) == [HF_WEIGHTS]
    assert info.files == [str(tmp_path / "hf" / HF_WEIGHTS)] and info.keys == list(model)
    assert info.bytes == sum(t.nbytes for t in model.values()) and info.skipped == []
    assert_same(read_hf(tmp_path / "hf"), model)



def test_a_disk_that_fills_up_is_named_in_the_error(tmp_path, monkeypatch):
    """``os.write`` raises ENOSPC without a file name: the error said only "No space left on device"."""
    path, _ = saved(tmp_path)
    write, out = os.write, str(tmp_path / "hf")

    def full(fd: int, data) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(out):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(os, "write", full)
    result = CliRunner().invoke(cli, ["export", str(path), out])
    assert result.exit_code == 1 and "No space left on device" in result.output and out in result.output, result.output

def test_an_export_into_the_checkpoint_it_exports_is_refused(tmp_path):
    """It wrote its files into the checkpoint's folder, where they are foreign files (a later save
    into that checkpoint is then refused)."""
    path, _ = saved(tmp_path)
    before = sorted(os.listdir(path))
    for out, extra in ((path / "hf", []), (path, ["--overwrite"])):
        result = CliRunner().invoke(cli, ["export", str(path), str(out), *extra])
        assert result.exit_code == 2 and "lies inside the checkpoint it exports" in result.output, result.output
    assert sorted(os.listdir(path)) == before


def test_shards_and_index_as_save_pretrained_makes_them(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards

    path, model = saved(tmp_path)
    info = zs.export(path, tmp_path / "hf", prefix="model.", max_shard_size=1100)
    split = split_torch_state_dict_into_shards(model, max_shard_size=1100)
    names = sorted(split.filename_to_tensors)
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    assert sorted(os.listdir(tmp_path / "hf")) == sorted([*names, HF_INDEX])
    index = json.loads((tmp_path / "hf" / HF_INDEX).read_text())
    assert index == {"metadata": {"total_size": sum(t.nbytes for t in model.values())},
                     "weight_map": split.tensor_to_filename}
    for name, keys in split.filename_to_tensors.items():
        assert sorted(load_file(tmp_path / "hf" / name)) == sorted(keys)
    assert info.files == [str(tmp_path / "hf" / n) for n in [*names, HF_INDEX]]
    assert_same(read_hf(tmp_path / "hf"), model)


def test_a_tensor_larger_than_a_shard_gets_a_file_of_its_own(tmp_path):
    path, model = saved(tmp_path)
    zs.export(path, tmp_path / "hf", prefix="model.", max_shard_size="1KB")
    index = json.loads((tmp_path / "hf" / HF_INDEX).read_text())
    alone = [f for f in set(index["weight_map"].values()) if list(index["weight_map"].values()).count(f) == 1]
    assert index["weight_map"]["embed.weight"] in alone  # 2048 bytes > 1000
    assert_same(read_hf(tmp_path / "hf"), model)


def test_prefix_rename_and_dtype(tmp_path):
    path, model = saved(tmp_path)
    rules = [r"^layers\.(\d+)\.=blocks.\1.", ("scale$", "weight")]
    info = zs.export(path, tmp_path / "hf", prefix="model", rename=rules, dtype="bfloat16")
    renamed = {"embed.weight": "embed.weight", "layers.0.w": "blocks.0.w", "layers.0.b": "blocks.0.b",
               "layers.1.w": "blocks.1.w", "norm.scale": "norm.weight", "ids": "ids", "mask": "mask", "empty": "empty"}
    want = {renamed[k]: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.items()}
    assert info.keys == list(want)
    assert_same(read_hf(tmp_path / "hf"), want)
    zs.export(path, tmp_path / "whole", overwrite=True)  # no prefix: every tensor under its full name
    assert_same(read_hf(tmp_path / "whole"), {f"model.{k}": v for k, v in model.items()})


def test_torch_format_loads_with_weights_only_and_mmap(tmp_path):
    path, model = saved(tmp_path)
    info = zs.export(path, tmp_path / "out" / "model.pt", format="torch", prefix="model.", dtype=torch.float16)
    assert os.listdir(tmp_path / "out") == ["model.pt"] and info.files == [str(tmp_path / "out" / "model.pt")]
    want = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in model.items()}
    for mmap in (False, True):
        got = torch.load(tmp_path / "out" / "model.pt", weights_only=True, mmap=mmap)
        assert list(got) == list(want)
        assert_same(got, want)


def test_skipped_entries_are_listed_and_named_in_a_warning(tmp_path, caplog):
    state = {"model": {"embed": torch.ones(4, 4), "flat": two((2, 3))}, "step": 3,
             "rng": zs.rank_local(torch.ones(2)), "note": "hello"}
    zs.save(state, tmp_path / "ck")
    with caplog.at_level(logging.WARNING, logger="zerostall.interop.exporting"):
        info = zs.export(tmp_path / "ck", tmp_path / "hf")
    assert info.keys == ["model.embed"] and info.tied == {}
    assert sorted(info.skipped) == ["model.flat", "note", "rng@rank0", "step"]
    assert "model.flat" in caplog.text and "rng@rank0" in caplog.text


def test_tied_weights_are_written_once_the_first_key_kept_torch_keeps_every_key_over_one_storage(tmp_path):
    """Keys that alias one tensor: hf writes it once, under the first key in save order (safetensors
    holds no aliases; save_pretrained leaves the tied keys out too); a torch file holds every key,
    the tied ones over one storage, as torch.save writes them."""
    weight = torch.randn(256, 64)  # 64 KiB: far more than a file's header
    zs.save({"model": {"embed": weight, "mid": torch.ones(3), "head": weight, "again": weight}}, tmp_path / "ck")
    info = zs.export(tmp_path / "ck", tmp_path / "hf", prefix="model.")
    assert info.keys == ["embed", "mid"] and info.tied == {"head": "embed", "again": "embed"}
    assert info.bytes == weight.nbytes + 12
    assert_same(read_hf(tmp_path / "hf"), {"embed": weight, "mid": torch.ones(3)})
    assert os.path.getsize(tmp_path / "hf" / HF_WEIGHTS) < weight.nbytes + 8192  # one copy and a header
    info = zs.export(tmp_path / "ck", tmp_path / "m.pt", format="torch", prefix="model.")
    assert info.keys == ["embed", "mid", "head", "again"] and info.tied == {"head": "embed", "again": "embed"}
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert_same(got, {"embed": weight, "mid": torch.ones(3), "head": weight, "again": weight})
    assert got["head"].data_ptr() == got["embed"].data_ptr() == got["again"].data_ptr()
    assert os.path.getsize(tmp_path / "m.pt") < weight.nbytes + 8192


def test_tied_weights_keys_choose_the_key_written_as_save_pretrained_does(tmp_path):
    """With a model's _tied_weights_keys, the keys that match are left out, whatever the save order;
    when every key of a tied set matches, the last in sorted order is written."""
    weight, other = torch.randn(8, 4), torch.randn(2)
    zs.save({"lm_head.weight": weight, "model.embed_tokens.weight": weight, "a.w": other, "b.w": other},
            tmp_path / "ck")
    default = zs.export(tmp_path / "ck", tmp_path / "first")
    assert default.tied == {"model.embed_tokens.weight": "lm_head.weight", "b.w": "a.w"}
    tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight", r"^[ab]\.w$": "x"}
    info = zs.export(tmp_path / "ck", tmp_path / "hf", tied_weights_keys=tied_weights_keys)
    assert info.tied == {"lm_head.weight": "model.embed_tokens.weight", "a.w": "b.w"}
    assert_same(read_hf(tmp_path / "hf"), {"model.embed_tokens.weight": weight, "b.w": other})


def save_dtensor_model(path: str) -> None:
    """Columns split across ranks (so every row is assembled from both), an odd-length vector, a
    replicated tensor, and a rank-local value."""
    state = {"model": {"w": dtensor(full_value((10, 6), 1), (2,), [Shard(1)]),
                       "v": dtensor(full_value((7,), 2), (2,), [Shard(0)]),
                       "r": dtensor(full_value((3, 3), 3), (2,), [Replicate()]),
                       "plain": full_value((5,), 4)},
             "seen": zs.rank_local(torch.tensor(dist.get_rank()))}
    zs.save(state, path)


def test_dtensor_shards_of_two_ranks_export_consolidated(ranks, tmp_path):
    ranks(2).run(save_dtensor_model, str(tmp_path / "ck"))
    info = zs.export(tmp_path / "ck", tmp_path / "hf", prefix="model.", max_shard_size=200)
    want = {"w": full_value((10, 6), 1), "v": full_value((7,), 2), "r": full_value((3, 3), 3),
            "plain": full_value((5,), 4)}
    assert len(info.files) > 2  # shards and the index
    assert_same(read_hf(tmp_path / "hf"), want)
    zs.export(tmp_path / "ck", tmp_path / "m.pt", format="torch")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert_same(got, {f"model.{k}": v for k, v in want.items()})
    assert sorted(zs.export(tmp_path / "ck", tmp_path / "all").skipped) == ["seen@rank0", "seen@rank1"]


class CountingStorage(LocalStorage):
    """A local checkpoint that counts the bytes read from its data files."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.data_bytes = 0
        self._count = threading.Lock()

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._add(name, len(out))
        super().read_into(name, offset, out)

    def read_into_many(self, name: str, offset: int, outs: list[memoryview]) -> None:
        self._add(name, sum(len(o) for o in outs))
        super().read_into_many(name, offset, outs)

    def _add(self, name: str, n: int) -> None:
        if name.endswith(".safetensors"):
            with self._count:
                self.data_bytes += n


WIDE = {"w": ((64, 48), 1), "h": ((50, 8), 2), "g": ((12, 10, 6), 3), "b": ((40, 24), 4)}


def save_wide(path: str) -> None:
    """Tensors every slab of which needs a part of a checksum block of every rank's chunk: columns
    split 4 ways (fp32 and bf16), uneven rows (chunks start inside a block) and a 2-D mesh; blocks
    of 256 bytes."""
    mesh = [(4,), (4,), (2, 2), (4,)]
    placements = [[Shard(1)], [Shard(0)], [Shard(0), Shard(2)], [Shard(1)]]
    state = {key: dtensor(full_value(shape, seed).to(torch.bfloat16 if key == "b" else torch.float32), m, p)
             for (key, (shape, seed)), m, p in zip(WIDE.items(), mesh, placements)}
    zs.save(state, path, block_size=256)


def wide_values(dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    values = {key: full_value(shape, seed).to(torch.bfloat16 if key == "b" else torch.float32)
              for key, (shape, seed) in WIDE.items()}
    return {k: v.to(dtype) if dtype is not None else v for k, v in values.items()}


@pytest.mark.parametrize("fmt, dtype", [("hf", None), ("hf", torch.bfloat16), ("torch", None),
                                        ("torch", torch.float16)])
def test_tensors_saved_by_many_ranks_are_read_once_in_small_slabs(ranks, tmp_path, monkeypatch, fmt, dtype):
    """Slabs of 1 KiB against blocks of 256 bytes: a slab needs a quarter block of each of four
    chunks, and each stored byte is still read once (a block only partly needed is held for the
    next slab), cast straight into the output."""
    ranks(4).run(save_wide, str(tmp_path / "ck"))
    monkeypatch.setattr(exporting, "SLAB_BYTES", 1024)
    storage = CountingStorage(str(tmp_path / "ck"))
    out = tmp_path / ("hf" if fmt == "hf" else "m.pt")
    zs.export(storage, out, format=fmt, dtype=dtype, threads=2)
    with zs.open(tmp_path / "ck") as ck:
        stored = sum(c.nbytes for e in ck.manifest.entries for c in e.chunks)
    assert storage.data_bytes == stored
    got = read_hf(out) if fmt == "hf" else torch.load(out, weights_only=True)
    assert_same(got, wide_values(dtype))


def test_with_no_staging_for_held_blocks_they_are_read_again_and_the_export_is_exact(ranks, tmp_path, monkeypatch):
    ranks(4).run(save_wide, str(tmp_path / "ck"))
    monkeypatch.setattr(exporting, "SLAB_BYTES", 1024)
    storage = CountingStorage(str(tmp_path / "ck"))
    with zs.open(storage, max_staging_bytes=0) as ck:
        stored = sum(c.nbytes for e in ck.manifest.entries for c in e.chunks)
        zs.export(ck, tmp_path / "hf", threads=2)
    assert storage.data_bytes > stored
    assert_same(read_hf(tmp_path / "hf"), wide_values())


def test_an_export_opens_each_data_file_once_per_reader_thread(ranks, tmp_path, monkeypatch):
    ranks(4).run(save_wide, str(tmp_path / "ck"))
    monkeypatch.setattr(exporting, "SLAB_BYTES", 1024)
    opened: list[str] = []
    real = local_storage.open_regular

    def counting(path: str) -> tuple[int, int]:
        opened.append(path)
        return real(path)

    monkeypatch.setattr(local_storage, "open_regular", counting)
    zs.export(tmp_path / "ck", tmp_path / "hf", threads=2)
    data = [p for p in opened if p.endswith(".safetensors")]
    files = {os.path.basename(p) for p in data}
    assert len(files) >= 4 and len(data) <= 2 * len(files), sorted(data)  # 2 reader threads


def export_on_rank_0(path: str, out: str) -> str:
    """A path is refused on every rank (opening it is collective); a checkpoint every rank opened
    exports on one."""
    try:
        zs.export(path, out)
    except zs.ExportError as exc:
        refused = str(exc)
    with zs.open(path) as ck:
        if dist.get_rank() == 0:
            zs.export(ck, out, prefix="model.")
    return refused


def test_in_a_distributed_job_one_rank_exports_a_checkpoint_every_rank_opened(ranks, tmp_path):
    ranks(2).run(save_dtensor_model, str(tmp_path / "ck"))
    messages = ranks(2).run(export_on_rank_0, str(tmp_path / "ck"), str(tmp_path / "hf"))
    assert all("open it with zs.open(...) on every rank" in m for m in messages)
    assert torch.equal(read_hf(tmp_path / "hf")["w"], full_value((10, 6), 1))


def test_a_root_or_its_latest_gives_its_newest_a_step_that_one_and_an_open_checkpoint_is_used_as_is(tmp_path):
    root = tmp_path / "root"
    zs.save({"model": {"w": torch.zeros(3)}}, root / "step-1", step=1)
    zs.save({"model": {"w": torch.ones(3)}}, root / "step-2", step=2)
    zs.export(root, tmp_path / "a", prefix="model.")
    assert torch.equal(read_hf(tmp_path / "a")["w"], torch.ones(3))
    zs.export(f"{root}/latest", tmp_path / "l", prefix="model.")  # as the command line names them
    zs.export(f"{root}/1", tmp_path / "s", prefix="model.")
    assert torch.equal(read_hf(tmp_path / "l")["w"], torch.ones(3)) and torch.equal(read_hf(tmp_path / "s")["w"],
                                                                                 torch.zeros(3))
    with zs.open(root / "step-1") as ck:
        zs.export(ck, tmp_path / "b", prefix="model.")
        assert torch.equal(ck.read("model.w"), torch.zeros(3))  # still open
    assert torch.equal(read_hf(tmp_path / "b")["w"], torch.zeros(3))


def test_a_checkpoint_on_s3_exports(s3_url, tmp_path):
    model = model_state()
    zs.save({"model": model}, s3_url)
    zs.export(s3_url, tmp_path / "hf", prefix="model.", max_shard_size=2000)
    assert_same(read_hf(tmp_path / "hf"), model)


# -- errors --------------------------------------------------------------------------------------


def test_a_prefix_that_selects_nothing_names_the_top_level_keys(tmp_path):
    path, _ = saved(tmp_path, {"optim": {"lr": torch.ones(1)}})
    with pytest.raises(zs.ExportError, match=r"prefix 'modle\.' selects no entry .*: model, optim, step"):
        zs.export(path, tmp_path / "hf", prefix="modle.")
    assert not (tmp_path / "hf").exists()


def test_a_key_that_is_not_utf8_is_refused_naming_the_entry(tmp_path):
    """A lone surrogate was written into the header, which safetensors then refused to open."""
    zs.save({"model": {"tok\udcff": torch.ones(2)}}, tmp_path / "ck")
    with pytest.raises(zs.ExportError, match=r"entry model.tok.* a name no file may hold"):
        zs.export(tmp_path / "ck", tmp_path / "hf", prefix="model.")
    assert not (tmp_path / "hf").exists()


def test_two_keys_renamed_onto_one_name_are_named(tmp_path):
    path, _ = saved(tmp_path)
    with pytest.raises(zs.ExportError, match=r"model\.layers\.0\.w and model\.layers\.1\.w .* both exported as "
                                             r"'layers\.w'"):
        zs.export(path, tmp_path / "hf", prefix="model.", rename=[(r"\.\d+\.", ".")])
    assert not (tmp_path / "hf").exists()


def test_a_non_empty_out_is_refused_unless_overwrite_which_replaces_the_model_files(tmp_path):
    path, model = saved(tmp_path)
    out = tmp_path / "hf"
    zs.export(path, out, prefix="model.", max_shard_size=1100)
    (out / "config.json").write_text("{}")
    before = sorted(os.listdir(out))
    with pytest.raises(zs.CheckpointExistsError, match="is not empty"):
        zs.export(path, out, prefix="model.")
    assert sorted(os.listdir(out)) == before
    zs.export(path, out, prefix="model.", overwrite=True)  # one file now: the old shards and index go
    assert sorted(os.listdir(out)) == ["config.json", HF_WEIGHTS]
    assert_same(read_hf(out), model)
    (tmp_path / "m.pt").write_bytes(b"x")
    with pytest.raises(zs.CheckpointExistsError):
        zs.export(path, tmp_path / "m.pt", format="torch")
    with pytest.raises(zs.ExportError, match="is a directory"):
        zs.export(path, out, format="torch", overwrite=True)


def test_a_read_error_is_reported_as_the_sources_not_the_destinations(tmp_path):
    """An OSError from reading (a refused data file) was given the temporary model file's name:
    "[Errno None] None: '<out>/.model.safetensors….tmp'"."""
    path, _ = saved(tmp_path)
    data = next(path.glob("*.safetensors"))
    data.rename(tmp_path / "moved")
    data.symlink_to(tmp_path / "moved")
    with pytest.raises(zs.CheckpointError) as exc:
        zs.export(path, tmp_path / "hf")
    assert str(data) in str(exc.value) and ".tmp" not in str(exc.value)


def test_a_corrupt_block_fails_the_export_and_leaves_no_model_files(tmp_path):
    path, _ = saved(tmp_path)
    data = next(path.glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF  # the last tensor's bytes
    data.write_bytes(bytes(raw))
    for fmt, out in (("hf", tmp_path / "hf"), ("torch", tmp_path / "t" / "m.pt")):
        with pytest.raises(zs.CorruptCheckpointError, match="checksum mismatch"):
            zs.export(path, out, format=fmt, max_shard_size=1100)
        assert not (out if fmt == "hf" else out.parent).exists()  # the folder it made is gone too
    (tmp_path / "kept").mkdir()  # a folder that was there is left there
    with pytest.raises(zs.CorruptCheckpointError, match="checksum mismatch"):
        zs.export(path, tmp_path / "kept", max_shard_size=1100)
    assert os.listdir(tmp_path / "kept") == []


def test_an_export_killed_midway_leaves_no_model_file_and_a_rerun_completes(tmp_path):
    state = {f"w{i}": torch.full((64 << 10,), float(i)) for i in range(8)}  # 256 KiB each: 2 a file
    zs.save(state, tmp_path / "ck")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        import zerostall as zs
        from faults import FaultyStorage
        from zerostall.storage import LocalStorage

        storage = FaultyStorage(LocalStorage({str(tmp_path / "ck")!r}))
        storage.crash("read_into", name="*.safetensors", from_call=6)  # the third file's tensors
        zs.export(storage, {str(tmp_path / "hf")!r}, max_shard_size=600_000)
    """)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == -9 and "SIGKILL" in done.stderr, done.stderr
    left = os.listdir(tmp_path / "hf")
    assert left and all(name.startswith(".model-") and name.endswith(".tmp") for name in left)  # hidden, never named
    info = zs.export(tmp_path / "ck", tmp_path / "hf", max_shard_size=600_000)  # the same command again: what
    # the killed one left is no reason to refuse it (it was), no overwrite needed
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(os.path.basename(f) for f in info.files)  # temps gone
    assert len(info.files) == 5
    assert_same(read_hf(tmp_path / "hf"), state)


def test_safetensors_cannot_hold_complex128_but_torch_can(tmp_path):
    zs.save({"z": torch.randn(3, dtype=torch.complex128)}, tmp_path / "ck")
    with pytest.raises(zs.ExportError, match=r"safetensors cannot hold the dtype of z \(torch.complex128\)"):
        zs.export(tmp_path / "ck", tmp_path / "hf")
    zs.export(tmp_path / "ck", tmp_path / "z.pt", format="torch")
    assert torch.load(tmp_path / "z.pt", weights_only=True)["z"].dtype == torch.complex128


def test_every_dtype_safetensors_names_exports_to_it(tmp_path):
    """Those a zerostall data file does not name (e8m0 scales, the fnuz float8s, complex64) were
    refused: "safetensors cannot hold the dtype"."""
    state = {name: torch.randn(4).to(getattr(torch, name)) for name in
             ("float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz", "complex64", "bfloat16")}
    zs.save(state, tmp_path / "ck")
    zs.export(tmp_path / "ck", tmp_path / "hf")
    back = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(back) == set(state)
    for name, value in state.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name].view(torch.uint8), value.view(torch.uint8))


@pytest.mark.parametrize("field, value", [("format", "gguf"), ("dtype", "int8"), ("dtype", torch.int32),
                                          ("dtype", "bfloat"),  # a name torch does not know was taken for None
                                          ("max_shard_size", 0), ("rename", ["no-equals-sign"]),
                                          ("overwrite", "yes"), ("threads", 0), ("prefix", 3),
                                          ("allow_pickle", 1), ("tied_weights_keys", "lm_head"),
                                          ("tied_weights_keys", [3])])
def test_bad_options_fail_when_built_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ExportOptions\.{field} must be"):
        zs.ExportOptions(**{field: value})


def test_a_rule_or_tied_key_that_is_no_regular_expression_is_named():
    with pytest.raises(ValueError, match=r"ExportOptions\.tied_weights_keys: '\(' is not a regular expression"):
        zs.ExportOptions(tied_weights_keys=("(",))
    with pytest.raises(ValueError, match=r"ExportOptions\.rename: the replacement 'blocks\.\\\\2' .* not valid"):
        zs.ExportOptions(rename=[r"^layers\.(\d+)=blocks.\2"])  # failed in the export, with a traceback


def test_dtypes_are_named_as_torch_or_as_commonly_abbreviated():
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("torch.float32", torch.float32)):
        assert zs.ExportOptions(dtype=name).dtype == dtype


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process
def test_a_dcp_checkpoint_exports_with_allow_pickle_and_is_refused_without(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = model_state()
    dcp.save({"model": model, "step": 7}, checkpoint_id=str(tmp_path / "dcp"))
    with pytest.raises(zs.UnsupportedValueError, match="allow_pickle=True"):
        zs.export(tmp_path / "dcp", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    info = zs.export(tmp_path / "dcp", tmp_path / "hf", prefix="model.", allow_pickle=True)
    assert info.skipped == [] and sorted(info.keys) == sorted(model)
    assert_same(read_hf(tmp_path / "hf"), model)


def test_a_safetensors_file_exports_by_its_path(tmp_path):
    path, model = saved(tmp_path)
    zs.export(path, tmp_path / "hf", prefix="model.")
    info = zs.export(tmp_path / "hf" / HF_WEIGHTS, tmp_path / "m.pt", format="torch")
    assert sorted(info.keys) == sorted(model)
    assert_same(torch.load(tmp_path / "m.pt", weights_only=True), model)


def test_sizes_read_as_save_pretrained_reads_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("256MiB") == 256 << 20 and parse_size("10kb") == 10_000
    assert parse_size(123) == 123 and zs.ExportOptions().max_shard_size == 5 * 10**9
    with pytest.raises(ValueError, match="not a size"):
        parse_size("5 parsecs")
    with pytest.raises(ValueError, match=r"^ExportOptions\.max_shard_size: '5 parsecs' is not a size"):
        zs.ExportOptions(max_shard_size="5 parsecs")


# -- the command line ----------------------------------------------------------------------------


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_cli_json_and_exit_codes(tmp_path):
    path, model = saved(tmp_path)
    result = run("export", path, tmp_path / "hf", "--prefix", "model.", "--max-shard-size", "1100", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["format"] == "hf" and report["keys"] == list(model) and report["skipped"] == []
    assert report["files"][-1].endswith(HF_INDEX) and report["bytes"] == sum(t.nbytes for t in model.values())
    assert_same(read_hf(tmp_path / "hf"), model)
    text = run("export", path, tmp_path / "m.pt", "--format", "torch", "--rename", "^model\\.=", "--dtype", "bfloat16")
    assert text.exit_code == 0 and "skipped 1 entries that are not model weights: step" in text.output
    assert torch.load(tmp_path / "m.pt", weights_only=True)["embed.weight"].dtype == torch.bfloat16
    assert run("export", path, tmp_path / "hf").exit_code == 2  # not empty
    assert "selects no entry" in (bad := run("export", path, tmp_path / "x", "--prefix", "nope")).output
    assert bad.exit_code == 2
    assert run("export", tmp_path / "missing", tmp_path / "y").exit_code == 2
    assert run("export", path, tmp_path / "z", "--max-shard-size", "big").exit_code == 2
    data = next(path.glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    corrupt = run("export", path, tmp_path / "w")
    assert corrupt.exit_code == 1 and "checksum mismatch" in corrupt.output


# Runs the command line as the console script does, saying on stderr when torch is first imported.
RUN_CLI = """
import importlib.abc, sys

class Announce(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("<torch is imported>", file=sys.stderr, flush=True)
        return None

sys.meta_path.insert(0, Announce())
from zerostall.cli import main
main()
"""


def test_the_command_says_it_is_starting_before_torch_is_imported(tmp_path):
    path, _ = saved(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", RUN_CLI, "export", str(path), str(tmp_path / "hf")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines.index(f"starting the export of {path} (loading torch)...") < lines.index("<torch is imported>")
    assert done.stdout.startswith("exported 8 tensors")
    quiet = CliRunner().invoke(cli, ["export", str(path), str(tmp_path / "again"), "--json"])
    assert quiet.exit_code == 0 and quiet.stderr == ""  # --json: one JSON object, nothing else


def test_the_command_reads_the_manifest_once_and_reports_skipped_entries_without_touching_a_logger(
        tmp_path, monkeypatch, caplog):
    path, _ = saved(tmp_path)
    opened: list[str] = []
    real = local_storage.open_regular

    def counting(name: str) -> tuple[int, int]:
        opened.append(name)
        return real(name)

    levels: list[tuple[str, object]] = []
    real_set_level = logging.Logger.setLevel
    monkeypatch.setattr(local_storage, "open_regular", counting)
    monkeypatch.setattr(logging.Logger, "setLevel", lambda self, level: (levels.append((self.name, level)),
                                                                          real_set_level(self, level)))
    with caplog.at_level(logging.WARNING):
        result = run("export", path, tmp_path / "hf")
    assert result.exit_code == 0, result.output
    assert [n for n in opened if n.endswith("manifest.json")] == [str(path / "manifest.json")]
    assert not [lv for lv in levels if lv[0].startswith("zerostall")], levels
    assert "skipped 1 entries that are not model weights: step" in result.stdout
    assert not [r for r in caplog.records if r.name.startswith("zerostall")]  # shown once: in the summary


def test_the_command_writes_tied_weights_once_and_reports_them(tmp_path):
    weight = torch.randn(8, 4)
    zs.save({"lm_head.weight": weight, "model.embed_tokens.weight": weight}, tmp_path / "ck")
    result = run("export", tmp_path / "ck", tmp_path / "hf", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["tied"] == {
        "model.embed_tokens.weight": "lm_head.weight"}
    text = run("export", tmp_path / "ck", tmp_path / "hf2", "--tied-weights-key", "^lm_head")
    assert "tied weights, left out (from_pretrained ties them back): lm_head.weight -> model.embed_tokens.weight" \
        in text.stdout
    assert list(read_hf(tmp_path / "hf2")) == ["model.embed_tokens.weight"]


def test_export_help_documents_the_exit_statuses():
    assert "Exit status: 0 exported; 1" in run("export", "--help").output


# -- acceptance: a transformers model ------------------------------------------------------------


@pytest.mark.parametrize("tied, keys", [(False, False), (True, False), (True, True)], ids=["untied", "tied",
                                                                                           "tied-by-model-keys"])
def test_a_llama_model_exported_loads_in_transformers_with_the_same_logits(tmp_path, tied, keys):
    """A tied model's embeddings are written once (not again as lm_head.weight), as save_pretrained
    writes them, by default or guided by the model's _tied_weights_keys; from_pretrained ties them
    back and gives the same logits."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    zs.save({"model": model, "step": 1}, tmp_path / "ck")
    options = {"tied_weights_keys": model._tied_weights_keys} if keys else {}
    info = zs.export(tmp_path / "ck", tmp_path / "hf", prefix="model.", max_shard_size="100KB", **options)
    config.save_pretrained(tmp_path / "hf")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    unique = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}
    weight_map = json.loads((tmp_path / "hf" / HF_INDEX).read_text())["weight_map"]
    assert ("lm_head.weight" in weight_map) == (not tied) and "model.embed_tokens.weight" in weight_map
    assert info.tied == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    files = list((tmp_path / "hf").glob("*.safetensors"))
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    assert info.bytes == sum(unique.values()) == sum(f.stat().st_size for f in files) - headers  # one copy
    if tied:  # what save_pretrained writes
        model.save_pretrained(tmp_path / "pretrained", max_shard_size="100KB")
        assert sorted(weight_map) == sorted(json.loads((tmp_path / "pretrained" / HF_INDEX).read_text())["weight_map"])


# -- memory ----------------------------------------------------------------------------------------


MEASURE = """
import sys
import torch, zerostall as zs, zerostall.interop.exporting, safetensors  # imports first: the baseline

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

base = status("VmRSS")
zs.export(sys.argv[1], sys.argv[2], max_shard_size=int(sys.argv[3]))
print(status("VmHWM") - base)
"""


def test_peak_memory_stays_under_two_shards(tmp_path):
    """A checkpoint of ~290 MB (one tensor larger than a shard) exported with 64 MB shards: the
    peak resident memory of a fresh process grows by less than two shards."""
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}": torch.randn(1024, 4096, generator=g) for i in range(12)}  # 16 MiB each
    state["big"] = torch.randn(24 << 20, generator=g)  # 96 MiB: more than a shard
    zs.save(state, tmp_path / "ck")
    shard = 64 << 20
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "ck"), str(tmp_path / "hf"), str(shard)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    growth = int(done.stdout.split()[-1])
    assert growth < 2 * shard, f"peak RSS grew by {growth >> 20} MiB"
    index = json.loads((tmp_path / "hf" / HF_INDEX).read_text())
    assert len(set(index["weight_map"].values())) == 4  # 4 layers a shard, then the big one alone
    assert torch.equal(load_file(tmp_path / "hf" / index["weight_map"]["big"])["big"], state["big"])
