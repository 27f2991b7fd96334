"""The command line over incremental checkpoints (made by ``CheckpointManager(root, incremental=True)``):
``ls`` shows the bytes each step shares, ``cp`` writes a self-contained copy, ``prune`` deletes
through the root (what others refer to stays as retained data, removed once nothing does), and
``verify``, ``inspect``, ``diff``, ``export`` read them, also once older steps are pruned."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file

import zerostall as zs
from hostile import read_body
from test_incremental import blank, snapshot
from test_lazy_import import run_cli
from zerostall.cli import cli
from zerostall.format.layout import MANIFEST_NAME
from zerostall.format.retained import RETAINED_NAME
from zerostall.roots.root import step_tag
from zerostall.storage import LocalStorage

BLOCK = 64 << 10
STEPS = (1, 2, 3, 4, 5)


def make_state() -> dict:
    """A frozen base (float32 over several blocks, bfloat16, an odd-sized int8, an empty tensor)
    beside small tensors that change at every step."""
    g = torch.Generator().manual_seed(0)
    return {"model": {"base": torch.randn(1 << 16, generator=g),
                      "emb": torch.randn(3000, 7, generator=g).to(torch.bfloat16),
                      "mask": torch.arange(1001, dtype=torch.int8), "empty": torch.empty(0),
                      "lora": torch.zeros(64)},
            "opt": {"m": torch.zeros(64, dtype=torch.float64)}, "step": 0}


def train(state: dict, step: int) -> None:
    state["model"]["lora"] += step
    state["opt"]["m"].mul_(0.5).add_(step)
    state["step"] = step


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, x in a.items():
        if isinstance(x, dict):
            assert_same(x, b[k])
        elif isinstance(x, torch.Tensor):
            assert x.dtype == b[k].dtype and torch.equal(x.view(torch.uint8), b[k].view(torch.uint8)), k
        else:
            assert x == b[k], k


def assert_loads(path: object, expected: dict) -> None:
    """The checkpoint at ``path`` verifies (library and command line) and loads bit-exactly."""
    assert zs.verify(path) > 0
    assert_same(zs.load(blank(expected), path), expected)
    result = run("verify", path)
    assert result.exit_code == 0, result.output


def manager(root: object, **kw: object) -> zs.CheckpointManager:
    return zs.CheckpointManager(root, incremental=True, block_size=BLOCK, fsync=False, threads=2, **kw)


def save_steps(root: object, steps: tuple[int, ...] = STEPS, state: dict | None = None) -> dict[int, dict]:
    """Save ``steps`` incrementally under ``root``; the state each step saved."""
    state = make_state() if state is None else state
    saved = {}
    with manager(root) as mgr:
        for step in steps:
            train(state, step)
            mgr.save(step, state)
            saved[step] = snapshot(state)
    return saved


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def step_dir(root: Path, step: int) -> Path:
    return root / step_tag(step)


def data_bytes(root: Path) -> int:
    """The bytes of every data file under ``root``."""
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


@pytest.fixture
def saved(tmp_path: Path) -> dict[int, dict]:
    return save_steps(tmp_path / "root")


# -- ls -------------------------------------------------------------------------------------------
def expected_sharing(root: Path) -> dict[str, tuple[int, int, int]]:
    """(unique, shared, referenced) bytes of each committed checkpoint, from the manifests themselves."""
    bodies = {p.name: read_body(p) for p in root.iterdir() if (p / MANIFEST_NAME).exists()}
    used: dict[str, set[str]] = {}
    for body in bodies.values():
        for name, tag in body.get("refs", {}).items():
            used.setdefault(tag, set()).add(name)
    out = {}
    for tag, body in bodies.items():
        refs = body.get("refs", {})
        own = {n: s for n, s in body["files"].items() if n not in refs}
        shared = sum(s for n, s in own.items() if n in used.get(tag, set()))
        out[tag] = (sum(own.values()) - shared, shared, sum(body["files"][n] for n in refs))
    return out


def test_ls_shows_the_bytes_unique_to_each_step_those_it_shares_and_those_it_refers_to(saved, tmp_path: Path) -> None:
    root = tmp_path / "root"
    result = run("ls", root, "--json")
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.stdout)["checkpoints"]}
    expected = expected_sharing(root)
    assert set(rows) == set(expected) == {step_tag(s) for s in STEPS}
    for tag, (unique, shared, referenced) in expected.items():
        row = rows[tag]
        assert (row["unique_bytes"], row["shared_bytes"], row["referenced_bytes"]) == (unique, shared, referenced), tag
        own = sum(p.stat().st_size for p in (root / tag).glob("*.safetensors"))
        assert row["bytes"] == row["unique_bytes"] + row["shared_bytes"] == own
    first, later = rows[step_tag(1)], [rows[step_tag(s)] for s in STEPS[1:]]
    assert first["shared_bytes"] > 0 and first["referenced_bytes"] == 0  # the frozen base, written once
    assert all(r["shared_bytes"] == 0 and r["referenced_bytes"] > 0 for r in later)
    assert all(r["unique_bytes"] * 10 < first["shared_bytes"] for r in later)  # the small tensors only

    table = run("ls", root).stdout
    header = next(line for line in table.splitlines() if "name" in line)
    assert ["size", "unique", "shared", "refers to"] == [c for c in ("size", "unique", "shared", "refers to")
                                                         if c in header]
    assert header.index("size") < header.index("unique") < header.index("shared") < header.index("refers to")


def test_ls_shows_a_step_whose_referred_files_were_deleted_by_hand_as_corrupt(saved, tmp_path: Path) -> None:
    """Its manifest reads, so it was listed as committed, while a load of it fails."""
    root = tmp_path / "root"
    shutil.rmtree(step_dir(root, 1))  # by hand, not through prune (which keeps what others refer to)
    rows = {r["name"]: r for r in json.loads(run("ls", root, "--json").stdout)["checkpoints"]}
    for step in STEPS[1:]:
        row = rows[step_tag(step)]
        assert row["status"] == "corrupt" and f"of {step_tag(1)}" in row["error"], row
        with pytest.raises(zs.CorruptCheckpointError):
            zs.load(blank(saved[step]), step_dir(root, step))
    assert "refers to data files that are gone" in run("ls", root).stdout


def test_ls_of_a_root_without_incremental_checkpoints_shows_the_columns_it_always_did(tmp_path: Path) -> None:
    with zs.CheckpointManager(tmp_path, fsync=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.randn(100)})
    header = next(line for line in run("ls", tmp_path).stdout.splitlines() if "name" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == ["name", "step", "status", "size", "created", "metrics",
                                                           "kept by", "latest"]
    rows = json.loads(run("ls", tmp_path, "--json").stdout)["checkpoints"]
    assert all(r["shared_bytes"] == r["referenced_bytes"] == 0 and r["unique_bytes"] == r["bytes"] > 0 for r in rows)


# -- prune ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rules", [("--keep-last", "1"), ("--keep-last", "2"), ("--keep-every", "2")])
def test_prune_keeps_every_remaining_step_loadable_and_ls_shows_the_retained_data(saved, tmp_path: Path,
                                                                                 rules: tuple[str, str]) -> None:
    root = tmp_path / "root"
    before = data_bytes(root)
    dry = run("prune", root, *rules, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    plan = json.loads(dry.stdout)
    doomed = {r["name"] for r in plan["would_delete"]}
    assert step_tag(1) in doomed  # the step whose files every other step refers to
    first = next(r for r in plan["would_delete"] if r["name"] == step_tag(1))
    assert first["retained_bytes"] > 0 and first["referred_to_by"]

    result = run("prune", root, *rules, "--json")
    assert result.exit_code == 0, result.output  # retained data is not a failure to delete
    report = json.loads(result.stdout)
    assert {r["name"] for r in report["deleted"]} == doomed and report["leftovers"] == []
    assert report["bytes_freed"] == before - data_bytes(root) > 0  # as predicted: referred-to data stays
    kept = [s for s in STEPS if step_tag(s) not in doomed]
    for step in kept:
        assert_loads(step_dir(root, step), saved[step])

    rows = {r["name"]: r for r in json.loads(run("ls", root, "--json").stdout)["checkpoints"]}
    retained = rows[step_tag(1)]
    assert retained["status"] == "retained" and not (step_dir(root, 1) / MANIFEST_NAME).exists()
    assert retained["bytes"] == retained["shared_bytes"] == first["retained_bytes"] > 0
    assert retained["bytes"] == sum(p.stat().st_size for p in step_dir(root, 1).glob("*.safetensors"))
    assert "retained" in run("ls", root).stdout


def test_once_the_last_referrer_is_pruned_the_retained_data_is_removed(saved, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run("prune", root, "--keep-last", "1").exit_code == 0
    assert (step_dir(root, 1) / RETAINED_NAME).exists()
    more = save_steps(root, (6,), state=snapshot(saved[5]))  # a new manager's first save is a full one
    assert not read_body(step_dir(root, 6)).get("refs")

    dry = json.loads(run("prune", root, "--keep-last", "1", "--dry-run", "--json").stdout)
    assert [r["name"] for r in dry["would_delete"]] == [step_tag(5)]
    assert [(r["name"], r["action"]) for r in dry["retained"]] == [(step_tag(1), "remove")]
    before = data_bytes(root)
    result = run("prune", root, "--keep-last", "1")
    assert result.exit_code == 0, result.output
    assert "removed" in result.stdout and "nothing refers to" in result.stdout
    assert not step_dir(root, 1).exists() and not step_dir(root, 5).exists()
    assert before - data_bytes(root) == dry["retained"][0]["bytes"] + dry["would_delete"][0]["bytes"]
    assert [r["name"] for r in json.loads(run("ls", root, "--json").stdout)["checkpoints"]] == [step_tag(6)]
    assert_loads(step_dir(root, 6), more[6])


# -- cp -------------------------------------------------------------------------------------------
def check_self_contained(path: Path) -> None:
    """The checkpoint at ``path`` refers to nothing outside it; every data file is valid safetensors
    whose tensors lie back to back, each naturally aligned, up to the file's end (format.md §3)."""
    body = read_body(path)
    assert body["refs"] == {} and body["version"] == zs.FORMAT_VERSION
    assert {p.name for p in path.glob("*.safetensors")} == set(body["files"]) == set(body["headers"])
    for name, size in body["files"].items():
        assert name.startswith(body["generation"] + "-") and (path / name).stat().st_size == size
        raw = (path / name).read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        assert (8 + n) % 4096 == 0 and header["__metadata__"]["generation"] == body["generation"]
        spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
        assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert 8 + n + spans[-1][1] == size
        load_file(str(path / name))  # safetensors' own checks (alignment included)


def test_cp_of_an_incremental_checkpoint_writes_a_self_contained_copy(saved, tmp_path: Path) -> None:
    root = tmp_path / "root"
    source = step_dir(root, 3)
    assert read_body(source)["refs"]
    result = run("cp", source, tmp_path / "copy", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    copy = tmp_path / "copy"
    check_self_contained(copy)
    assert report["moved_files"] == len(set(read_body(source)["refs"])) and report["files"] == len(
        read_body(copy)["files"])
    assert report["bytes"] == data_bytes(copy) < data_bytes(root)  # only the chunks step 3 uses
    body, copied = read_body(source), read_body(copy)
    assert copied["generation"] == body["generation"] and copied["tree"] == body["tree"]
    assert [(e["fqn"], [c["checksums"] for c in e.get("chunks", [])]) for e in copied["entries"]] == \
        [(e["fqn"], [c["checksums"] for c in e.get("chunks", [])]) for e in body["entries"]]
    shutil.rmtree(root)  # the copy needs nothing of the root
    assert_loads(copy, saved[3])
    with zs.open(copy) as ck:
        assert ck.step == 3


def test_cp_of_a_step_whose_referred_data_is_retained_and_a_resumed_copy(saved, tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run("prune", root, "--keep-last", "1").exit_code == 0
    assert (step_dir(root, 1) / RETAINED_NAME).exists()
    assert run("cp", root, tmp_path / "copy").exit_code == 0  # a root: its newest
    check_self_contained(tmp_path / "copy")
    (tmp_path / "copy" / MANIFEST_NAME).unlink()  # as if interrupted before its commit
    info = zs.copy(step_dir(root, 5), tmp_path / "copy")  # run again: every file there is complete, kept
    assert info.files == 0 and info.skipped_files == len(read_body(tmp_path / "copy")["files"])
    assert info.moved_files > 0
    shutil.rmtree(root)
    assert_loads(tmp_path / "copy", saved[5])


def test_cp_checks_every_referred_chunk_as_it_copies_it(saved, tmp_path: Path) -> None:
    root = tmp_path / "root"
    body = read_body(step_dir(root, 4))
    base = next(e for e in body["entries"] if e["fqn"] == "model.base")["chunks"][0]
    assert body["refs"][base["file"]] == step_tag(1)
    path = step_dir(root, 1) / base["file"]  # the bytes lie in step 1's file
    data = bytearray(path.read_bytes())
    data[base["offset"] + 2 * BLOCK + 5] ^= 0x01
    path.write_bytes(bytes(data))
    result = run("cp", step_dir(root, 4), tmp_path / "copy")
    assert result.exit_code == 1
    assert "checksum mismatch" in result.stderr and base["file"] in result.stderr and "model.base" in result.stderr
    assert not (tmp_path / "copy" / MANIFEST_NAME).exists()


def test_cp_of_a_step_whose_referred_checkpoint_is_gone_is_refused(saved, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.rmtree(step_dir(root, 1))  # by hand, not through the root
    result = run("cp", step_dir(root, 3), tmp_path / "copy")
    assert result.exit_code == 1 and step_tag(1) in result.stderr and "gone" in result.stderr
    assert not (tmp_path / "copy").exists() or not (tmp_path / "copy" / MANIFEST_NAME).exists()


def test_cp_never_replaces_or_clears_a_checkpoint_others_refer_to(saved, tmp_path: Path) -> None:
    root = tmp_path / "root"
    zs.save({"w": torch.ones(3)}, tmp_path / "other", zs.SaveOptions(fsync=False))
    owned = sorted(p.name for p in step_dir(root, 1).glob("*.safetensors"))
    result = run("cp", tmp_path / "other", step_dir(root, 1), "--overwrite")
    assert result.exit_code == 1 and "refer to" in result.stderr and step_tag(2) in result.stderr
    assert sorted(p.name for p in step_dir(root, 1).glob("*.safetensors")) == owned
    assert_loads(step_dir(root, 2), saved[2])

    assert run("prune", root, "--keep-last", "1").exit_code == 0  # step 1: retained data
    kept = sorted(p.name for p in step_dir(root, 1).glob("*.safetensors"))
    for extra in ((), ("--overwrite",)):
        result = run("cp", tmp_path / "other", step_dir(root, 1), *extra)
        assert result.exit_code == 1 and RETAINED_NAME in result.stderr
    assert sorted(p.name for p in step_dir(root, 1).glob("*.safetensors")) == kept
    assert_loads(step_dir(root, 5), saved[5])



@pytest.mark.parametrize("unreadable", [1, 2])
def test_a_manifest_that_cannot_be_read_stops_a_replacement_that_could_delete_referenced_data(
        saved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unreadable: int) -> None:
    """A manifest that could not be read (permission denied) counted as no checkpoint (step 1's,
    the one replaced: cp skipped the check) or as one referring to nothing (step 2's, which refers
    to step 1): replacing step 1 deleted the data step 2 reads."""
    root = tmp_path / "root"
    zs.save({"w": torch.ones(3)}, tmp_path / "other", zs.SaveOptions(fsync=False))
    owned = sorted(p.name for p in step_dir(root, 1).glob("*.safetensors"))
    read_head = LocalStorage.read_head
    denied = os.path.abspath(step_dir(root, unreadable))

    def reading(self: LocalStorage, name: str, n: int) -> bytes:
        if name == MANIFEST_NAME and self.location == denied:
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(denied, name))
        return read_head(self, name, n)

    monkeypatch.setattr(LocalStorage, "read_head", reading)
    result = run("cp", tmp_path / "other", step_dir(root, 1), "--overwrite")
    assert result.exit_code == 1, result.output
    with pytest.raises(zs.CheckpointError, match="refer to" if unreadable == 1 else "cannot read the manifest"):
        zs.save({"w": torch.ones(3)}, step_dir(root, 1), overwrite=True, fsync=False)
    monkeypatch.undo()
    assert sorted(p.name for p in step_dir(root, 1).glob("*.safetensors")) == owned
    assert_loads(step_dir(root, 2), saved[2])

def test_a_reference_that_appears_while_cp_overwrites_a_checkpoint_stops_its_commit(tmp_path: Path) -> None:
    root = tmp_path / "root"
    saved = save_steps(root, (1, 2))
    zs.save({"w": torch.ones(3)}, tmp_path / "other", zs.SaveOptions(fsync=False))
    (root / step_tag(2)).rename(tmp_path / "away")  # step 1 is referred to by nothing: it may be replaced
    owned = sorted(p.name for p in step_dir(root, 1).glob("*.safetensors"))

    def meanwhile(nbytes: int) -> None:  # a save beside it commits a step that refers to it
        if not step_dir(root, 2).exists():
            (tmp_path / "away").rename(step_dir(root, 2))

    with pytest.raises(zs.CheckpointError, match="refer to"):
        zs.copy(tmp_path / "other", step_dir(root, 1), overwrite=True, progress=meanwhile)
    assert set(owned) <= {p.name for p in step_dir(root, 1).glob("*.safetensors")}  # the copy's own stay unused
    assert_loads(step_dir(root, 1), saved[1])
    assert_loads(step_dir(root, 2), saved[2])


def test_cp_of_an_incremental_checkpoint_imports_no_torch(saved, tmp_path: Path) -> None:
    done = run_cli("cp", step_dir(tmp_path / "root", 2), tmp_path / "copy")
    assert done.returncode == 0 and "self-contained" in done.stdout, done.stdout
    check_self_contained(tmp_path / "copy")


def incremental_on_ranks(root: str) -> list[str]:
    """Two incremental steps saved by every rank (each writes some tensors); the files of step 2."""
    state = {f"t{i}": torch.arange(5000 * (i + 1), dtype=torch.float32) + i for i in range(6)}
    state["moving"] = torch.zeros(100)
    with manager(root) as mgr:
        for step in (1, 2):
            state["moving"] += step
            mgr.save(step, state)
    return sorted(read_body(step_dir(Path(root), 2))["files"])


def test_cp_of_an_incremental_checkpoint_saved_by_several_ranks(ranks, tmp_path: Path) -> None:
    root = tmp_path / "root"
    files = ranks(2).run(incremental_on_ranks, str(root))[0]
    body = read_body(step_dir(root, 2))
    assert {n.rsplit("-r", 1)[1][:5] for n in body["refs"]} == {"00000", "00001"}  # both ranks' files referred to
    assert run("cp", step_dir(root, 2), tmp_path / "copy").exit_code == 0
    check_self_contained(tmp_path / "copy")
    assert {n.rsplit("-r", 1)[1][:5] for n in read_body(tmp_path / "copy")["files"]} == {"00000", "00001"}
    assert len(read_body(tmp_path / "copy")["files"]) == len(files)  # one file for each it referred to
    expected = {f"t{i}": torch.arange(5000 * (i + 1), dtype=torch.float32) + i for i in range(6)}
    expected["moving"] = torch.full((100,), 3.0)
    shutil.rmtree(root)
    assert_loads(tmp_path / "copy", expected)


@pytest.mark.parametrize("direction", ["local-to-s3", "s3-to-local"])
def test_cp_of_an_incremental_checkpoint_to_and_from_s3(tmp_path: Path, s3_url: str, direction: str) -> None:
    root = str(tmp_path / "root") if direction == "local-to-s3" else f"{s3_url}/root"
    dst = f"{s3_url}/copy" if direction == "local-to-s3" else str(tmp_path / "copy")
    saved = save_steps(root, (1, 2, 3))
    result = run("cp", f"{root}/{step_tag(3)}", dst, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["moved_files"] > 0
    raw = zs.storage.storage_for(dst).read_bytes(MANIFEST_NAME)
    assert b'"refs":{}' in raw and b'"refs":{"' not in raw and b"\"version\":%d," % zs.FORMAT_VERSION in raw
    assert_loads(dst, saved[3])


# -- verify, inspect, diff, export ----------------------------------------------------------------
@pytest.mark.parametrize("pruned", [False, True])
def test_verify_inspect_diff_and_export_read_incremental_checkpoints(saved, tmp_path: Path, pruned: bool) -> None:
    root = tmp_path / "root"
    if pruned:
        assert run("prune", root, "--keep-every", "2").exit_code == 0  # 1, 3 go; 2, 4 and 5 stay
        assert not (step_dir(root, 3) / MANIFEST_NAME).exists()
    newest, older = step_dir(root, 5), step_dir(root, 4)
    for path, step in ((newest, 5), (older, 4), (root, 5)):
        result = run("verify", path, "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        chunks = [c for e in read_body(step_dir(root, step))["entries"] for c in e.get("chunks", [])]
        assert report["ok"] and report["bytes_checked"] == sum(c["nbytes"] for c in chunks)

    shown = json.loads(run("inspect", newest, "--json").stdout)
    assert shown["format_version"] == zs.FORMAT_VERSION and shown["step"] == 5
    body = read_body(newest)  # its size is that of its own files, as `ls` says; the others' are counted apart
    assert body["refs"] and shown["files_of_other_checkpoints"] == len(body["refs"])
    assert shown["total_bytes"] == sum(size for name, size in body["files"].items() if name not in body["refs"])
    assert {e["fqn"] for e in shown["entries"]} >= {"model.base", "model.lora", "opt.m", "step"}

    result = run("diff", older, newest, "--json")
    assert result.exit_code == 1, result.output
    differ = {d["key"] for d in json.loads(result.stdout)["differences"]}
    assert differ == {"model.lora", "opt.m", "step"}
    assert run("cp", newest, tmp_path / "copy").exit_code == 0
    assert run("diff", newest, tmp_path / "copy").exit_code == 0

    result = run("export", newest, tmp_path / "hf", "--prefix", "model.")
    assert result.exit_code == 0, result.output
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert_same({k: exported[k] for k in ("base", "emb", "mask", "lora")},
                {k: saved[5]["model"][k] for k in ("base", "emb", "mask", "lora")})


def test_verify_names_the_damaged_referred_file_of_an_incremental_checkpoint(saved, tmp_path: Path) -> None:
    root = tmp_path / "root"
    body = read_body(step_dir(root, 2))
    base = next(e for e in body["entries"] if e["fqn"] == "model.base")["chunks"][0]
    assert body["refs"][base["file"]] == step_tag(1)
    with open(step_dir(root, 1) / base["file"], "r+b") as f:  # where step 2's bytes lie
        f.seek(base["offset"] + 5)
        byte = f.read(1)
        f.seek(base["offset"] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = run("verify", step_dir(root, 2))
    assert result.exit_code == 1 and "checksum mismatch" in result.stderr and base["file"] in result.stderr
