"""``zerostall cp`` and ``zs.copy``: a checkpoint copied between local paths and S3 (the real
SeaweedFS fixture) in every direction, checked block by block as it is read, committed by its
manifest last, resumed after an interruption; progress bars and exit statuses of the command line."""

from __future__ import annotations

import errno
import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from faults import FaultyStorage

import zerostall as zs
from s3server import SeaweedS3
from test_lazy_import import run_cli
from test_s3 import explicit, raw
from zerostall.cli import cli
from zerostall.interop import copying
from zerostall.interop.copying import RUN_BYTES, _runs, _segments
from zerostall.format.layout import MANIFEST_NAME, data_file_name, generation_id
from zerostall.loading.opening import read_manifest
from zerostall.storage import LocalStorage, S3Storage, storage_for

BLOCK = 64 << 10


def state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 1000, generator=g), "b": torch.randn(70_000, generator=g).to(torch.bfloat16),
            "i": torch.arange(10, dtype=torch.int8), "e": torch.empty(0), "tied": None, "lr": 0.1 + seed}


def save(path: object, seed: int = 0, **options: object) -> dict[str, object]:
    """Save :func:`state` in two data files with small blocks; returns it."""
    s = state(seed)
    s["tied"] = s["w"]
    zs.save(s, path, zs.SaveOptions(fsync=False, threads=2, block_size=BLOCK, **options))
    return s


def assert_loads(path: object, expected: dict[str, object]) -> None:
    """The checkpoint at ``path`` verifies and loads bit-exact."""
    assert zs.verify(path) > 0
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in expected.items()}
    out = zs.load(target, path)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(out[key].view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert out[key] == value, key


def run(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def data_files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))


def test_local_copy_loads_bit_exact_with_the_same_files_and_manifest(tmp_path: Path) -> None:
    expected = save(tmp_path / "a")
    result = run("cp", tmp_path / "a", tmp_path / "b", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    sizes = {n: (tmp_path / "a" / n).stat().st_size for n in data_files(tmp_path / "a")}
    assert len(sizes) == 2 and report["files"] == 2 and report["bytes"] == sum(sizes.values())
    assert report["skipped_files"] == report["skipped_bytes"] == 0 and report["gb_per_s"] >= 0
    assert set(report) == {"source", "destination", "generation", "files", "bytes", "skipped_files",
                           "skipped_bytes", "moved_files", "seconds", "gb_per_s"}
    assert report["moved_files"] == 0  # self-contained already: copied as it is
    assert data_files(tmp_path / "b") == list(sizes)  # the names the manifest references
    assert (tmp_path / "b" / MANIFEST_NAME).read_bytes() == (tmp_path / "a" / MANIFEST_NAME).read_bytes()
    for name in sizes:
        assert (tmp_path / "b" / name).read_bytes() == (tmp_path / "a" / name).read_bytes()
    assert_loads(tmp_path / "b", expected)


def test_runs_tile_every_file_in_whole_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy's runs cover each data file exactly, header first, chunks split only at their
    blocks, each run within the run size unless one block is larger."""
    save(tmp_path / "a")
    manifest = read_manifest(storage_for(tmp_path / "a"))
    segments = _segments(manifest)
    for limit in (BLOCK, 3 * BLOCK + 5, RUN_BYTES):
        monkeypatch.setattr(copying, "RUN_BYTES", limit)
        for name, size in manifest.files.items():
            runs, at = list(_runs(segments[name], name, size, manifest, "here")), 0
            assert runs[0].checks[0].entry is None and runs[0].checks[0].lo == 0  # the header
            for run in runs:
                assert run.offset == at and run.length <= max(limit, BLOCK, run.checks[0].hi)
                assert run.checks[0].lo == 0 and run.checks[-1].hi == run.length
                for before, after in zip(run.checks, run.checks[1:]):
                    assert before.hi == after.lo
                assert all(c.chunk_lo % BLOCK == 0 for c in run.checks if c.entry is not None)
                at += run.length
            assert at == size


@pytest.mark.parametrize("direction", ["local-to-s3", "s3-to-local", "s3-to-s3"])
def test_copies_to_from_and_within_s3_load_bit_exact(tmp_path: Path, s3_url: str, direction: str) -> None:
    src = str(tmp_path / "a") if direction == "local-to-s3" else f"{s3_url}/a"
    dst = str(tmp_path / "b") if direction == "s3-to-local" else f"{s3_url}/b"
    expected = save(src)
    result = run("cp", src, dst, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files"] == 2
    assert storage_for(dst).read_bytes(MANIFEST_NAME) == storage_for(src).read_bytes(MANIFEST_NAME)
    assert_loads(dst, expected)
    assert run("verify", dst).exit_code == 0
    assert run("diff", src, dst).exit_code == 0


def test_a_copy_to_s3_uses_multipart_uploads_from_read_buffers(tmp_path: Path, s3_server: SeaweedS3, s3_url: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Files larger than a part go up as multipart uploads (5 MiB parts), read in runs of one block."""
    monkeypatch.setattr(copying, "RUN_BYTES", 4 << 20)
    big = {"w": torch.randn(3 << 20), "v": torch.randn(1 << 20)}  # 12 MiB and 4 MiB
    zs.save(big, tmp_path / "a", zs.SaveOptions(fsync=False, threads=2))
    dst = S3Storage(f"{s3_url}/big", explicit(s3_server, part_size=5 << 20))
    src = FaultyStorage(LocalStorage(str(tmp_path / "a")))
    info = zs.copy(src, dst)
    assert info.files == 2 and info.bytes == sum(os.path.getsize(tmp_path / "a" / n)
                                                 for n in data_files(tmp_path / "a"))
    largest = max(data_files(tmp_path / "a"), key=lambda n: os.path.getsize(tmp_path / "a" / n))
    assert src.names("read_into").count(largest) == 4  # 4 MiB blocks: 12 MiB of tensor in 3 runs, the header in 1
    etag = raw(s3_server).head_object(Bucket=s3_server.bucket, Key=dst.prefix + largest)["ETag"]
    assert etag.strip('"').endswith("-3")  # three parts
    out = zs.load({"w": torch.zeros(3 << 20), "v": torch.zeros(1 << 20)}, dst)
    assert torch.equal(out["w"], big["w"]) and torch.equal(out["v"], big["v"])


@pytest.mark.parametrize("where", ["block", "header"])
def test_a_corrupt_source_is_refused_naming_the_file_and_nothing_is_committed(tmp_path: Path, where: str) -> None:
    save(tmp_path / "a")
    manifest = read_manifest(storage_for(tmp_path / "a"))
    chunk = next(e for e in manifest.entries if e.fqn == "w").chunks[0]
    offset = chunk.offset + 3 * BLOCK + 17 if where == "block" else 40
    path = tmp_path / "a" / chunk.file
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    result = run("cp", tmp_path / "a", tmp_path / "b")
    assert result.exit_code == 1
    assert chunk.file in result.stderr
    assert ("entry w, block 3" if where == "block" else "header") in result.stderr
    assert not (tmp_path / "b" / MANIFEST_NAME).exists()
    with pytest.raises((zs.IncompleteCheckpointError, zs.CheckpointNotFoundError)):
        zs.open(tmp_path / "b")


CRASHING_COPY = """
import sys
from faults import FaultyStorage
import zerostall as zs
from zerostall.storage import LocalStorage
dst = FaultyStorage(LocalStorage(sys.argv[2], fsync=False))
dst.crash("write", from_call=2, after_bytes=int(sys.argv[3]))  # the second data file, part-way through
zs.copy(sys.argv[1], dst, threads=1)
"""


def test_an_interrupted_copy_resumes_copying_only_what_is_not_complete(tmp_path: Path) -> None:
    """A copy killed while writing its second data file leaves no checkpoint; run again, it reads
    the first file back from the destination (complete: kept), and reads and writes only the second."""
    expected = save(tmp_path / "a")
    sizes = {n: os.path.getsize(tmp_path / "a" / n) for n in data_files(tmp_path / "a")}
    first, second = sorted(sizes, key=lambda n: -sizes[n])  # copied largest first, one thread
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CRASHING_COPY, str(tmp_path / "a"), str(tmp_path / "b"),
                           str(sizes[second] // 2)], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == -9 and "SIGKILL" in done.stderr, done.stderr
    assert not (tmp_path / "b" / MANIFEST_NAME).exists()
    assert os.path.getsize(tmp_path / "b" / first) == sizes[first]
    assert os.path.getsize(tmp_path / "b" / second) < sizes[second]  # a torn file
    with pytest.raises(zs.IncompleteCheckpointError):
        zs.open(tmp_path / "b")

    src, dst = FaultyStorage(LocalStorage(str(tmp_path / "a"))), FaultyStorage(LocalStorage(str(tmp_path / "b")))
    info = zs.copy(src, dst)
    assert (info.files, info.bytes, info.skipped_files, info.skipped_bytes) == (1, sizes[second], 1, sizes[first])
    assert dst.names("write") == [second] and dst.names("delete") == [second]  # the torn one replaced
    assert set(src.names("read_into")) == {second}  # the complete file was not read from the source
    assert set(dst.names("read_into")) == {first}  # ... but checked at the destination
    assert_loads(tmp_path / "b", expected)


def test_a_complete_looking_file_with_a_bad_block_at_the_destination_is_copied_again(tmp_path: Path) -> None:
    expected = save(tmp_path / "a")
    assert run("cp", tmp_path / "a", tmp_path / "b").exit_code == 0
    (tmp_path / "b" / MANIFEST_NAME).unlink()  # as if interrupted before the commit
    damaged, intact = data_files(tmp_path / "b")
    with open(tmp_path / "b" / damaged, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff\xff")
    dst = FaultyStorage(LocalStorage(str(tmp_path / "b")))
    info = zs.copy(tmp_path / "a", dst)
    assert info.files == 1 and info.skipped_files == 1 and dst.names("write") == [damaged]
    assert_loads(tmp_path / "b", expected)



def test_a_read_error_at_the_destination_deletes_nothing_of_the_checkpoint_there(tmp_path: Path) -> None:
    """Copied again over its own committed copy (``--overwrite``, the same generation): the files
    there are that checkpoint's. A read that fails (not damage) was taken for an incomplete file,
    which was deleted to be copied again; with the writes failing too, the committed copy was
    left without it. Now the copy fails and the committed copy stays whole."""
    expected = save(tmp_path / "a")
    assert run("cp", tmp_path / "a", tmp_path / "b").exit_code == 0
    dst = FaultyStorage(LocalStorage(str(tmp_path / "b")))
    outage = OSError(errno.EIO, "Input/output error")
    failed = dst.fail("read_into", outage, name="*.safetensors")
    dst.fail("write", outage)
    with pytest.raises(zs.CheckpointError, match="Input/output error"):
        zs.copy(tmp_path / "a", dst, overwrite=True)
    assert failed.count and dst.names("delete") == []
    assert_loads(tmp_path / "b", expected)


def test_a_copy_onto_itself_never_deletes_a_file_it_cannot_check(tmp_path: Path) -> None:
    """In place (how an incremental checkpoint is made self-contained where it lies), a data file
    that failed its re-check (a read error, a bad block) was deleted to be copied again: from
    itself, which was then gone."""
    expected = save(tmp_path / "a")
    files = data_files(tmp_path / "a")
    same = FaultyStorage(LocalStorage(str(tmp_path / "a")))
    same.fail("read_into_many", OSError(errno.EIO, "Input/output error"), times=1)
    same.fail("read_into", OSError(errno.EIO, "Input/output error"), times=1)
    with pytest.raises(zs.CheckpointError, match="Input/output error"):
        zs.copy(tmp_path / "a", same, overwrite=True)
    assert data_files(tmp_path / "a") == files and not same.names("delete")
    assert_loads(tmp_path / "a", expected)  # a transient error: run again, it is whole

    with open(tmp_path / "a" / files[0], "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff\xff")
    result = run("cp", tmp_path / "a", tmp_path / "a", "--overwrite")
    assert result.exit_code == 1 and files[0] in result.stderr, result.output
    assert data_files(tmp_path / "a") == files


def test_a_copy_into_the_checkpoint_it_copies_is_refused(tmp_path: Path) -> None:
    """It committed a checkpoint inside its source, gone with the source at the next prune."""
    save(tmp_path / "a")
    result = run("cp", tmp_path / "a", tmp_path / "a" / "backup")
    assert result.exit_code == 1 and "lies inside the checkpoint it would copy" in result.stderr, result.output
    assert not (tmp_path / "a" / "backup").exists()

def test_a_destination_with_another_checkpoint_s_files_never_mixes_generations(tmp_path: Path) -> None:
    """Uncommitted files of another checkpoint at the destination are never used and are removed
    once the copy commits; so are a replaced checkpoint's (with --overwrite)."""
    expected = save(tmp_path / "a")
    save(tmp_path / "b", seed=1)
    (tmp_path / "b" / MANIFEST_NAME).unlink()  # an interrupted copy (or save) of another checkpoint
    assert run("cp", tmp_path / "a", tmp_path / "b").exit_code == 0
    assert data_files(tmp_path / "b") == data_files(tmp_path / "a")
    assert_loads(tmp_path / "b", expected)

    other = save(tmp_path / "c", seed=2)
    assert run("cp", tmp_path / "c", tmp_path / "b", "--overwrite").exit_code == 0
    assert data_files(tmp_path / "b") == data_files(tmp_path / "c")
    assert_loads(tmp_path / "b", other)


def test_a_stale_file_that_cannot_be_removed_leaves_the_others_removed(tmp_path: Path, caplog) -> None:
    """The clean-up after the commit is file by file: one delete that fails stops no other."""
    expected = save(tmp_path / "a")
    save(tmp_path / "b", seed=1)
    (tmp_path / "b" / MANIFEST_NAME).unlink()  # an interrupted copy (or save) of another checkpoint
    stuck, *others = data_files(tmp_path / "b")
    assert others
    dst = FaultyStorage(LocalStorage(str(tmp_path / "b")))
    dst.fail("delete", PermissionError(13, "injected"), name=stuck)
    zs.copy(tmp_path / "a", dst)
    assert data_files(tmp_path / "b") == sorted([*data_files(tmp_path / "a"), stuck])
    assert f"could not remove stale {stuck}" in caplog.text
    assert_loads(tmp_path / "b", expected)


def test_the_files_of_a_save_begun_after_the_copy_stay(tmp_path: Path) -> None:
    """The clean-up after the commit removes the generations begun before the copy (and the one it
    replaced), as a save's does: a save begun since, into the checkpoint the copy just committed,
    keeps the files it is writing (its commit would name them)."""
    expected = save(tmp_path / "a")
    save(tmp_path / "b", seed=1)
    (tmp_path / "b" / MANIFEST_NAME).unlink()  # an interrupted save from before the copy: removed
    older = data_files(tmp_path / "b")
    begun: list[str] = []

    def begin_a_save(op: str, name: str) -> None:  # once the copy committed: its first data file
        begun.append(data_file_name(generation_id(time.time_ns(), 7), 0, 0))
        (tmp_path / "b" / begun[0]).write_bytes(b"a save in flight")

    dst = FaultyStorage(LocalStorage(str(tmp_path / "b")))
    dst.call("publish", begin_a_save, name=MANIFEST_NAME, at="after")
    zs.copy(tmp_path / "a", dst)
    assert data_files(tmp_path / "b") == sorted([*data_files(tmp_path / "a"), *begun])
    assert not set(older) & set(data_files(tmp_path / "b"))
    assert_loads(tmp_path / "b", expected)


def test_a_checkpoint_committed_at_the_destination_meanwhile_is_kept_and_no_temp_file_is_left(tmp_path: Path) -> None:
    save(tmp_path / "a")
    dst = FaultyStorage(LocalStorage(str(tmp_path / "b")))
    other = {}
    dst.call("publish", lambda op, name: other.update(save(tmp_path / "b", seed=3)), name=MANIFEST_NAME)
    with pytest.raises(zs.CheckpointError, match="another checkpoint .* was committed there"):
        zs.copy(tmp_path / "a", dst)
    assert_loads(tmp_path / "b", other)
    assert not [n for n in os.listdir(tmp_path / "b") if n.endswith(".tmp")]  # the refused commit's manifest


def test_overwrite_is_needed_to_replace_a_committed_checkpoint(tmp_path: Path) -> None:
    save(tmp_path / "a")
    expected = save(tmp_path / "b", seed=1)
    before = (tmp_path / "b" / MANIFEST_NAME).read_bytes()
    result = run("cp", tmp_path / "a", tmp_path / "b")
    assert result.exit_code == 2 and "--overwrite" in result.stderr
    assert (tmp_path / "b" / MANIFEST_NAME).read_bytes() == before
    assert_loads(tmp_path / "b", expected)
    with pytest.raises(zs.CheckpointExistsError):
        zs.copy(tmp_path / "a", tmp_path / "b")
    assert run("cp", tmp_path / "a", tmp_path / "b", "--overwrite").exit_code == 0
    assert (tmp_path / "b" / MANIFEST_NAME).read_bytes() == (tmp_path / "a" / MANIFEST_NAME).read_bytes()


def test_a_root_its_latest_and_a_step_copy_the_checkpoint_they_name(tmp_path: Path) -> None:
    mgr = zs.CheckpointManager(tmp_path / "root", fsync=False)
    try:
        for step in (10, 20):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    finally:
        mgr.close()
    for src, step in (("root", 20), ("root/latest", 20), ("root/10", 10), ("root/step_000000010", 10)):
        dst = tmp_path / "out" / src.replace("/", "-")
        assert run("cp", tmp_path / src, dst).exit_code == 0, src
        with zs.open(dst) as ck:
            assert ck.step == step and torch.equal(ck.read("w"), torch.full((4,), float(step)))


def test_exit_statuses_and_the_help_of_every_command(tmp_path: Path) -> None:
    save(tmp_path / "a")
    assert run("cp", tmp_path / "missing", tmp_path / "b").exit_code == 2
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    result = run("cp", tmp_path / "a", tmp_path / "model")
    assert result.exit_code == 1 and "config.json" in result.stderr
    (tmp_path / "a" / MANIFEST_NAME).write_bytes(b"{}")
    assert run("cp", tmp_path / "a", tmp_path / "b").exit_code == 1
    for command in ("ls", "inspect", "verify", "prune", "diff", "cp"):
        text = run(command, "--help").stdout
        assert "Exit status (every zerostall command):" in text and "3  verify could not read" in text, command


def test_cp_imports_no_torch(tmp_path: Path) -> None:
    save(tmp_path / "a")
    done = run_cli("cp", tmp_path / "a", tmp_path / "b")
    assert done.returncode == 0 and done.stdout.startswith("copied ")
    assert run_cli("cp", tmp_path / "a", tmp_path / "b").returncode == 2


def on_a_terminal(*args: object) -> tuple[str, str]:
    """Run ``zerostall ARGS`` with stderr on a pseudo-terminal (stdout a pipe): (stdout, stderr)."""
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "100"}
    with subprocess.Popen([sys.executable, "-m", "zerostall", *map(str, args)], stdout=subprocess.PIPE,
                          stderr=slave, env=env) as proc:
        os.close(slave)
        seen = b""
        while True:
            try:
                got = os.read(master, 65536)
            except OSError:  # the terminal closed: the process ended
                break
            if not got:
                break
            seen += got
        out = proc.stdout.read().decode()  # type: ignore[union-attr]
        proc.wait(timeout=120)
    os.close(master)
    return out, seen.decode(errors="replace")


def test_progress_bars_only_on_a_terminal_and_never_with_json(tmp_path: Path) -> None:
    save(tmp_path / "a")
    save(tmp_path / "c", seed=1)
    piped = subprocess.run([sys.executable, "-m", "zerostall", "cp", str(tmp_path / "a"), str(tmp_path / "b")],
                           capture_output=True, text=True, timeout=120, check=False)
    assert piped.returncode == 0 and piped.stderr == ""
    _, err = on_a_terminal("cp", tmp_path / "a", tmp_path / "t", "--json")
    assert err == ""
    _, err = on_a_terminal("cp", tmp_path / "a", tmp_path / "u")
    assert "copying" in err
    _, err = on_a_terminal("diff", tmp_path / "a", tmp_path / "c")
    assert "comparing" in err
    out, err = on_a_terminal("diff", tmp_path / "a", tmp_path / "c", "--json")
    assert err == "" and json.loads(out)["equal"] is False
    piped = subprocess.run([sys.executable, "-m", "zerostall", "diff", str(tmp_path / "a"), str(tmp_path / "c")],
                           capture_output=True, text=True, timeout=120, check=False)
    assert piped.returncode == 1 and piped.stderr == ""


def test_an_interrupted_copy_to_s3_resumes_and_leaves_no_upload_open(tmp_path: Path, s3_server: SeaweedS3,
                                                                      s3_url: str) -> None:
    expected = save(tmp_path / "a")
    sizes = {n: os.path.getsize(tmp_path / "a" / n) for n in data_files(tmp_path / "a")}
    first, second = sorted(sizes, key=lambda n: -sizes[n])
    target = S3Storage(f"{s3_url}/b")
    dst = FaultyStorage(target)
    dst.fail("write", OSError("network gone"), name=second, after_bytes=sizes[second] // 2)
    with pytest.raises(zs.CheckpointError, match="network gone"):
        zs.copy(tmp_path / "a", dst, threads=1)
    assert target.list() == [first]  # no manifest: not a checkpoint
    client = raw(s3_server)  # what a killed copy leaves: an upload never completed
    client.create_multipart_upload(Bucket=s3_server.bucket, Key=target.prefix + second)

    dst = FaultyStorage(target)
    info = zs.copy(tmp_path / "a", dst)
    assert (info.files, info.skipped_files) == (1, 1) and dst.names("write") == [second]
    assert set(dst.names("read_into")) == {first}
    assert not client.list_multipart_uploads(Bucket=s3_server.bucket, Prefix=target.prefix).get("Uploads")
    assert_loads(target, expected)
