"""S3 storage against a real S3 server (SeaweedFS on loopback, the ``s3_server`` fixture): the
storage contract, conditional commits, listings across pages, aborted uploads, and saves, loads,
verification, resharding over gloo, asynchronous saves, the manager and the CLI on ``s3://``."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest
import torch
from click.testing import CliRunner
from faults import FaultyStorage, wait_for
from torch.distributed.tensor import Replicate, Shard

import zerostall as zs
from s3server import SeaweedS3
from test_distributed import full_value, load_sharded, save_sharded
from zerostall.cli import cli
from zerostall.format.layout import MANIFEST_NAME, data_file_name, generation_id
from zerostall.storage import S3Options, S3Storage, storage_for

MIB = 1 << 20


def explicit(server: SeaweedS3, **fields: Any) -> S3Options:
    """Options that name the server and credentials outright (no environment needed)."""
    return S3Options(endpoint_url=server.endpoint, region=server.region, access_key_id=server.access_key,
                     secret_access_key=server.secret_key, addressing_style="path", **fields)


def raw(server: SeaweedS3) -> Any:
    """A plain boto3 client, to look at the bucket behind the storage's back."""
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint, region_name=server.region,
                        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key)


def uploads(server: SeaweedS3, storage: S3Storage) -> list[str]:
    """The keys of the unfinished multipart uploads under ``storage``."""
    found = raw(server).list_multipart_uploads(Bucket=server.bucket, Prefix=storage.prefix)
    return [u["Key"] for u in found.get("Uploads", [])]


@pytest.fixture
def small_parts(s3_server: SeaweedS3, s3_url: str) -> S3Storage:
    """A fresh location with 5 MiB parts (S3's smallest), so a few MiB make a multipart upload."""
    return S3Storage(s3_url, explicit(s3_server, part_size=5 * MIB))


def irregular(data: bytes) -> Iterator[memoryview]:
    """``data`` as views of uneven sizes, some straddling part boundaries."""
    view, at, n = memoryview(data), 0, 1
    while at < len(view):
        yield view[at:at + n]
        at += n
        n = n * 7 % (3 * MIB) + 1


# -- the storage contract ----------------------------------------------------------------------


WITHOUT_BOTO3 = """
import sys
sys.modules["boto3"] = None  # as if the s3 extra were not installed
import torch, zerostall as zs
zs.save({"w": torch.ones(3)}, sys.argv[1])
assert torch.equal(zs.load({"w": torch.zeros(3)}, sys.argv[1])["w"], torch.ones(3))
zs.S3Options(part_size=8 << 20)
try:
    zs.save({"w": torch.ones(3)}, "s3://bucket/ck")
except ImportError as exc:
    print(exc)
"""


def test_without_the_s3_extra_local_paths_work_and_s3_says_what_to_install(tmp_path):
    done = subprocess.run([sys.executable, "-c", WITHOUT_BOTO3, str(tmp_path / "ck")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    assert "pip install 'zerostall[s3]'" in done.stdout


def test_an_s3_url_gets_an_s3_storage_that_pickles_as_its_url(s3_url):
    storage = storage_for(s3_url)
    assert isinstance(storage, S3Storage) and storage.location == s3_url and storage.remote
    assert pickle.loads(pickle.dumps(storage)).location == s3_url
    assert storage.child("a").location == f"{s3_url}/a"
    with pytest.raises(ValueError, match="s3://bucket"):
        S3Storage("s3:///nobucket")
    with pytest.raises(ValueError, match="S3Options.part_size must be an int >= 5242880"):
        S3Options(part_size=MIB)
    assert S3Storage("s3://b/run/1/").location == "s3://b/run/1"


@pytest.mark.parametrize("url", ["s3://b/run//1", "s3://b/run/./1", "s3://b/run/../1", "s3://b/.."])
def test_an_s3_url_with_an_empty_dot_or_dot_dot_part_is_refused(url):
    """Such a key is stored as it is, but tools that resolve paths (a console, a sync) read it as
    another place: a checkpoint saved there would be found elsewhere, or not at all."""
    with pytest.raises(ValueError, match="no empty, '.' or '..' part"):
        S3Storage(url)


def test_connections_no_storage_holds_are_freed(s3_server):
    """Each set of options gets a client and a pool of threads; a program that makes new options
    again and again (fresh credentials) kept every one of them, and their threads, for good."""
    seen = []
    for n in range(10):
        storage = S3Storage(f"s3://{s3_server.bucket}", explicit(s3_server, read_timeout=10.0 + n))
        seen.append(storage._conn.pool.submit(threading.current_thread).result())
        del storage
    gc.collect()
    wait_for(lambda: sum(t.is_alive() for t in seen) <= 4, "the threads of connections no storage holds to end")


def test_files_round_trip_as_multipart_and_single_uploads(s3_server, small_parts):
    storage = small_parts
    assert not storage.exists() and storage.list() == [] and storage.children() == []
    data = os.urandom(12 * MIB + 3)  # three parts
    assert storage.write("big", irregular(data)) == len(data)
    assert storage.write("small", [memoryview(b"head"), memoryview(b"tail")]) == 8
    storage.child("sub").write("x", [memoryview(b"1")])
    assert storage.exists() and storage.list() == ["big", "small"] and storage.children() == ["sub"]
    assert storage.size("big") == len(data) and storage.stat("small").size == 8
    assert uploads(s3_server, storage) == []
    whole = bytearray(len(data))
    storage.read_into("big", 0, memoryview(whole))  # parallel ranged GETs
    assert whole == data
    part = bytearray(3 * MIB)
    storage.read_into("big", 5 * MIB - 7, memoryview(part))
    assert part == data[5 * MIB - 7:8 * MIB - 7]
    outs = [bytearray(3), bytearray(5), bytearray(1)]
    storage.read_into_many("big", 100, [memoryview(o) for o in outs])
    assert b"".join(outs) == data[100:109]
    assert storage.read_head("small", 6) == b"headta" and storage.read_head("small", 100) == b"headtail"
    assert storage.read_bytes("small") == b"headtail"
    with pytest.raises(EOFError):
        storage.read_into("small", 4, memoryview(bytearray(10)))
    for call in (lambda: storage.size("gone"), lambda: storage.read_bytes("gone"),
                 lambda: storage.read_into("gone", 0, memoryview(bytearray(1)))):
        with pytest.raises(FileNotFoundError, match="gone"):
            call()
    storage.delete("small")
    storage.delete("small")  # already gone: not an error
    assert storage.list() == ["big"]


def test_a_write_never_replaces_a_file(small_parts):
    storage = small_parts
    storage.write("one", [memoryview(b"first")])
    storage.write("many", irregular(b"a" * (6 * MIB)))
    with pytest.raises(zs.ConcurrentWriteError):
        storage.write("one", [memoryview(b"second")])
    with pytest.raises(zs.ConcurrentWriteError):
        storage.write("many", irregular(b"b" * (6 * MIB)))
    assert storage.read_bytes("one") == b"first" and storage.read_bytes("many") == b"a" * (6 * MIB)


def test_a_failed_write_leaves_no_file_and_no_upload(s3_server, small_parts):
    def parts() -> Iterator[memoryview]:
        yield from irregular(b"x" * (11 * MIB))  # two parts sent
        raise OSError("the writer failed")

    with pytest.raises(OSError, match="the writer failed"):
        small_parts.write("data", parts())
    assert small_parts.list() == [] and uploads(s3_server, small_parts) == []


def test_publish_is_conditional_on_what_the_check_saw(s3_url):
    storage = storage_for(s3_url)
    storage.publish("m", "m.tmp", b"v1", before_replace=lambda: None)  # created (none was there)
    with pytest.raises(zs.ConcurrentWriteError, match="another writer"):  # a commit between check and switch
        storage.publish("m", "m.tmp", b"mine", before_replace=lambda: storage.put("m", b"theirs"))
    assert storage.read_bytes("m") == b"theirs"
    with pytest.raises(zs.ConcurrentWriteError):  # created by another between check and switch
        storage.publish("new", "new.tmp", b"mine", before_replace=lambda: storage.put("new", b"theirs"))
    assert storage.read_bytes("new") == b"theirs"

    def refuse() -> None:
        raise zs.CheckpointError("the check failed")

    with pytest.raises(zs.CheckpointError, match="the check failed"):
        storage.publish("m", "m.tmp", b"v3", before_replace=refuse)
    assert storage.read_bytes("m") == b"theirs" and sorted(storage.list()) == ["m", "new"]  # no temp objects


def test_create_exclusive_creates_once(s3_server, s3_url):
    for storage in (storage_for(s3_url), S3Storage(f"{s3_url}-fallback", explicit(s3_server, conditional_writes=False))):
        assert storage.create_exclusive("lease", b"one")
        assert not storage.create_exclusive("lease", b"two")
        assert storage.read_bytes("lease") == b"one"
        storage.put("lease", b"three")
        assert storage.read_bytes("lease") == b"three"


def test_listings_delete_tree_and_move_span_pages(s3_server, s3_url):
    """1,300 entries: listings and batched deletes cross S3's 1,000-key pages."""
    storage = storage_for(s3_url)
    many = storage.child("many")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: many.write(f"f{i:04d}", [memoryview(b"f")]), range(650)))
        list(pool.map(lambda i: many.child(f"d{i:04d}").write("x", [memoryview(b"d")]), range(650)))
    assert many.list() == [f"f{i:04d}" for i in range(650)]
    assert many.children() == [f"d{i:04d}" for i in range(650)]
    storage.delete_tree("many")
    assert not many.exists() and many.list() == []  # (SeaweedFS lists emptied prefixes for a while: not checked)

    ck = storage.child("ck")
    ck.write("data", [memoryview(b"d" * 10)])
    ck.put(MANIFEST_NAME, b"{}")
    storage.child(".aside").create()
    storage.move("ck", ".aside/ck")
    assert not ck.exists() and storage.child(".aside").child("ck").list() == ["data", MANIFEST_NAME]
    with pytest.raises(FileNotFoundError):
        storage.move("ck", "elsewhere")


def test_unfinished_uploads_are_aborted_by_the_clean_up(s3_server, s3_url):
    storage = storage_for(s3_url)
    client = raw(s3_server)
    for key in ("step_000000001/a.safetensors", "step_000000002/b.safetensors"):  # what a crashed writer left
        up = client.create_multipart_upload(Bucket=s3_server.bucket, Key=storage.prefix + key)["UploadId"]
        client.upload_part(Bucket=s3_server.bucket, Key=storage.prefix + key, UploadId=up, PartNumber=1, Body=b"p")
    storage.child("step_000000002").write("c.safetensors", [memoryview(b"c")])
    assert len(uploads(s3_server, storage)) == 2
    storage.delete_tree("step_000000002")  # deleting a location aborts what is open there
    assert uploads(s3_server, storage) == [storage.prefix + "step_000000001/a.safetensors"]
    assert storage.abort_uploads() == 1 and uploads(s3_server, storage) == []


def test_a_checkpoint_set_aside_aborts_the_uploads_open_under_its_old_place(s3_server, small_parts):
    """A move (how a root sets a checkpoint aside) aborts the uploads still open under the place it
    leaves, so their writer fails instead of completing a file there once the move is done."""
    storage, gate, asked = small_parts, threading.Event(), threading.Event()
    ck = storage.child("ck")
    ck.write("a.safetensors", [memoryview(b"a")])

    def parts() -> Iterator[memoryview]:
        yield memoryview(bytes(6 * MIB))  # a first part: the upload is open
        asked.set()
        assert gate.wait(60)
        yield memoryview(bytes(MIB))

    with ThreadPoolExecutor(1) as pool:
        writing = pool.submit(ck.write, "b.safetensors", parts())
        assert asked.wait(60)
        wait_for(lambda: bool(uploads(s3_server, storage)), "the upload to open")
        storage.child(".superseded").create()
        storage.move("ck", ".superseded/ck")
        gate.set()
        with pytest.raises(zs.CheckpointError, match="b.safetensors"):
            writing.result()
    assert not ck.exists() and storage.child(".superseded").child("ck").list() == ["a.safetensors"]
    assert uploads(s3_server, storage) == []


def test_a_save_aborts_the_uploads_earlier_saves_left_open(s3_server, s3_url):
    storage = S3Storage(s3_url, explicit(s3_server))
    client = raw(s3_server)
    crashed = data_file_name(generation_id(1, 0), 0, 0)  # a save that died mid-upload: an older generation
    in_flight = data_file_name(generation_id(1 << 62, 0), 1, 0)  # a newer generation: a save still writing
    nested = "step_000000001/" + crashed  # another location's
    for name in (crashed, in_flight, nested):
        client.create_multipart_upload(Bucket=s3_server.bucket, Key=storage.prefix + name)
    zs.save({"w": torch.ones(3)}, storage)
    assert sorted(uploads(s3_server, storage)) == sorted(storage.prefix + n for n in (in_flight, nested))


# -- checkpoints on s3:// ----------------------------------------------------------------------


def state_of(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(512, 1024, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
                      "ids": torch.arange(5)},
            "step": seed, "name": "run", "betas": (0.9, 0.99)}


def zeros_like_state() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(7, dtype=torch.bfloat16),
                      "ids": torch.zeros(5, dtype=torch.int64)}, "step": 0, "name": "", "betas": (0.0, 0.0)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and \
        (a["step"], a["name"], tuple(a["betas"])) == (b["step"], b["name"], tuple(b["betas"]))


def test_save_load_open_verify_on_s3(s3_server, s3_url):
    path = f"{s3_url}/ck"
    zs.save(state_of(1), path, step=1, threads=3, block_size=MIB)
    assert same(zs.load(zeros_like_state(), path), state_of(1))
    with zs.open(path) as ck:
        assert torch.equal(ck.read("model.w"), state_of(1)["model"]["w"])
        assert ck.read("name") == "run"
    assert zs.verify(path) == sum(t.nbytes for t in state_of(1)["model"].values())
    with pytest.raises(zs.CheckpointExistsError):
        zs.save(state_of(2), path)
    zs.save(state_of(2), path, step=2, overwrite=True)
    assert same(zs.load(zeros_like_state(), path), state_of(2))
    names = storage_for(path).list()
    assert MANIFEST_NAME in names and len({n.split("-r")[0] for n in names if n != MANIFEST_NAME}) == 1  # old gone

    # a damaged block is found by a load and by verify
    storage = storage_for(path)
    name = max((n for n in names if n != MANIFEST_NAME), key=storage.size)
    data = bytearray(storage.read_bytes(name))
    data[-100] ^= 0xFF
    storage.delete(name)
    storage.write(name, [memoryview(data)])
    with pytest.raises(zs.CorruptCheckpointError, match="checksum mismatch"):
        zs.load(zeros_like_state(), path)
    with pytest.raises(zs.CorruptCheckpointError):
        zs.verify(path)


def test_small_tensors_back_to_back_are_read_in_one_request(s3_url):
    state = {f"p{i:03d}": torch.full((4096,), float(i)) for i in range(300)}  # 16 KiB each, one data file
    zs.save(state, s3_url, threads=1)
    storage = FaultyStorage(storage_for(s3_url))
    out = zs.load({k: torch.zeros(4096) for k in state}, storage)
    assert [op for op, _ in storage.calls if op.startswith("read_into")] == ["read_into_many"]
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_a_load_spends_no_request_on_sizes_and_reads_one_listing(s3_url):
    zs.save(state_of(1), s3_url, threads=4)  # four data files
    storage = FaultyStorage(storage_for(s3_url))
    out = zs.load(zeros_like_state(), storage)
    ops = [op for op, _ in storage.calls]
    assert not {"exists", "list", "sizes", "size", "stat"} & set(ops), ops  # the manifest, then the data
    assert same(out, state_of(1))
    storage.calls.clear()
    with zs.open(storage) as ck:  # new tensors: sizes checked before memory is set aside, from one listing
        assert all(torch.equal(ck.read(f"model.{k}"), v) for k, v in state_of(1)["model"].items())
    ops = [op for op, _ in storage.calls]
    assert ops.count("sizes") == 1 and "size" not in ops and "stat" not in ops, ops


def test_a_data_file_cut_short_or_gone_is_named_by_a_load(s3_url):
    zs.save(state_of(1), s3_url, threads=1)
    storage = storage_for(s3_url)
    name = next(n for n in storage.list() if n != MANIFEST_NAME)
    data = storage.read_bytes(name)
    storage.delete(name)
    storage.write(name, [memoryview(data[:len(data) // 2])])
    with pytest.raises(zs.CorruptCheckpointError, match=rf"data file {name} of .* is truncated: .*\(entry model\."):
        zs.load(zeros_like_state(), s3_url)
    storage.delete(name)
    with pytest.raises(zs.CorruptCheckpointError, match=rf"data file {name} of .* is missing \(entry model\."):
        zs.load(zeros_like_state(), s3_url)


def test_reads_are_cut_along_the_upload_parts(s3_server, s3_url):
    """A ranged GET that starts or ends inside a stored part costs the server that whole part:
    every GET of a load starts and ends on a part boundary, but where the tensors' bytes begin and end."""
    part = 5 * MIB
    storage = S3Storage(s3_url, explicit(s3_server, part_size=part))
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate((333_333, 1_234_567, 777_777, 2_000_003,
                                                                            55_555, 1_500_001))}
    zs.save(state, storage, threads=1)  # one data file of ~23 MiB, in 5 MiB parts
    with zs.open(storage) as ck:
        chunks = [c for e in ck.manifest.entries if e.kind == "tensor" for c in e.chunks]
    first, end = min(c.offset for c in chunks), max(c.offset + c.nbytes for c in chunks)
    ranges: list[tuple[int, int]] = []

    def record(params: dict[str, Any], **_: Any) -> None:
        if params.get("Key", "").endswith(chunks[0].file) and "Range" in params:
            lo, hi = map(int, params["Range"].removeprefix("bytes=").split("-"))
            ranges.append((lo, hi + 1))

    storage._client.meta.events.register("provide-client-params.s3.GetObject", record)
    try:
        out = zs.load({k: torch.zeros_like(v) for k, v in state.items()}, storage)
    finally:
        storage._client.meta.events.unregister("provide-client-params.s3.GetObject", record)
    assert all(torch.equal(out[k], v) for k, v in state.items())
    ranges.sort()
    assert ranges[0][0] == first and ranges[-1][1] == end and len(ranges) == -(-end // part), ranges
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges  # back to back, each byte once
    assert all(lo % part == 0 for lo, _ in ranges[1:]) and all(hi % part == 0 for _, hi in ranges[:-1]), ranges


def test_explicit_options_need_no_environment(s3_server, s3_url, monkeypatch):
    for name in s3_server.env():
        monkeypatch.delenv(name)
    storage = S3Storage(s3_url, explicit(s3_server))
    zs.save(state_of(3), storage)
    assert same(zs.load(zeros_like_state(), storage), state_of(3))


def test_settings_come_from_an_aws_profile(s3_server, s3_url, tmp_path, monkeypatch):
    """Endpoint, region, addressing style and credentials from ~/.aws/config and credentials files."""
    for name in s3_server.env():
        monkeypatch.delenv(name)
    config, credentials = tmp_path / "config", tmp_path / "credentials"
    config.write_text(f"[profile zs-test]\nendpoint_url = {s3_server.endpoint}\nregion = {s3_server.region}\n"
                      "s3 =\n    addressing_style = path\n")
    credentials.write_text(f"[zs-test]\naws_access_key_id = {s3_server.access_key}\n"
                           f"aws_secret_access_key = {s3_server.secret_key}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    storage = S3Storage(s3_url, S3Options(profile="zs-test"))
    zs.save(state_of(7), storage)
    assert same(zs.load(zeros_like_state(), storage), state_of(7))


@pytest.mark.parametrize("load_world, load_mesh, load_pl", [(1, (1,), [Replicate()]), (2, (2,), [Shard(1)])])
def test_two_ranks_save_and_load_resharded(ranks, s3_server, s3_url, load_world, load_mesh, load_pl):
    storage = S3Storage(s3_url, explicit(s3_server))  # pickled to the ranks with its options
    ranks(2).run(save_sharded, storage, (2,), [Shard(0)])
    assert all(ranks(load_world).run(load_sharded, storage, load_mesh, load_pl))
    with zs.open(storage) as ck:
        assert torch.equal(ck.read("w"), full_value((10, 6), 1))


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_asynchronous_saves_commit_on_s3(s3_server, s3_url, writer):
    storage = S3Storage(s3_url, explicit(s3_server))
    with zs.AsyncSaver(writer=writer) as saver:
        state = state_of(4)
        handle = saver.save(state, storage.child("a"), step=4)
        handle.wait_staged()
        state["model"]["w"].add_(1)  # after staging: not in the checkpoint
        assert handle.result(timeout=120).step == 4
    assert same(zs.load(zeros_like_state(), storage.child("a")), state_of(4))


def test_the_manager_keeps_retains_restores_and_cleans_up_on_s3(s3_server, s3_url):
    storage = storage_for(s3_url)
    dead = storage.child("step_000000009")  # a dead writer's attempt: data, an open upload, no manifest
    dead.write("0a1b2c3d-4e5f6a7b-r00000-000.safetensors", [memoryview(b"x")])  # named as a save names them
    raw(s3_server).create_multipart_upload(Bucket=s3_server.bucket,
                                           Key=dead.prefix + "0a1b2c3d-4e5f6a7b-r00001-000.safetensors")
    with zs.CheckpointManager(s3_url, keep_last=2) as mgr:
        assert not dead.exists() and uploads(s3_server, storage) == []
        for step in (1, 2, 3, 4):
            mgr.save(step, state_of(step), metrics={"loss": 1 / step})
        mgr.wait()
        assert [tag for tag, _ in mgr.checkpoints()] == ["step_000000003", "step_000000004"]
        assert mgr.checkpoint_root.read_latest() == "step_000000004"
        restored = zeros_like_state()
        assert mgr.restore(restored) == 4 and same(restored, state_of(4))
        mgr.save(3, state_of(30))  # a rollback: step 3 and 4 are set aside, by copy
        mgr.wait()
        assert [tag for tag, _ in mgr.checkpoints()] == ["step_000000003"]
        assert sorted(storage.child(".superseded").children()) == ["step_000000003", "step_000000004"]
        mgr.save(3, state_of(31))  # saved again, and a tag twice: each replaces the one before once committed
        mgr.save(3, state_of(31), tag="best")
        mgr.save(3, state_of(32), tag="best")
    aside = storage.child(".superseded")  # a server may list a prefix emptied as a folder still
    assert [name for name in sorted(aside.children()) if aside.child(name).exists()] == ["step_000000003",
                                                                                       "step_000000004"]
    assert ".writer-lease" not in storage.list() and ".resaving" not in storage.list()
    with zs.CheckpointManager(s3_url) as mgr:
        restored = zeros_like_state()
        assert mgr.restore(restored, "best") == 3 and same(restored, state_of(32))


def test_every_command_works_on_s3(s3_url):
    with zs.CheckpointManager(s3_url) as mgr:
        mgr.save(5, state_of(5))
        mgr.save(6, state_of(6))
    runner = CliRunner()
    listing = runner.invoke(cli, ["ls", s3_url, "--json"])
    assert listing.exit_code == 0, listing.output
    assert "step_000000005" in listing.output and "step_000000006" in listing.output
    zs.save(state_of(5), f"{s3_url}-plain/a")
    zs.save(state_of(5), f"{s3_url}-plain/b")
    for args in (["inspect", f"{s3_url}/latest"], ["verify", s3_url], ["verify", f"{s3_url}/5"],
                 ["diff", f"{s3_url}-plain/a", f"{s3_url}-plain/b"]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 0, (args, result.output)
    assert runner.invoke(cli, ["diff", f"{s3_url}/5", f"{s3_url}/6"]).exit_code == 1  # they differ
    pruned = runner.invoke(cli, ["prune", s3_url, "--keep-last", "1"])
    assert pruned.exit_code == 0, pruned.output
    root = storage_for(s3_url)
    assert not root.child("step_000000005").exists() and root.child("step_000000006").exists()


def test_two_committers_on_one_manifest_one_wins(s3_url):
    """Two saves into one path, both past their checks at once: the conditional switch lets one commit."""
    path = f"{s3_url}/race"
    zs.save(state_of(1), path)
    gate, arrived = threading.Barrier(2, timeout=60), []

    def together() -> None:
        arrived.append(1)
        gate.wait()

    results: dict[int, Any] = {}

    def save(seed: int) -> None:
        try:
            results[seed] = zs.save(state_of(seed), path, overwrite=True, before_commit=together)
        except zs.CheckpointError as exc:
            results[seed] = exc

    threads = [threading.Thread(target=save, args=(seed,)) for seed in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    failed = [s for s, r in results.items() if isinstance(r, BaseException)]
    assert len(failed) == 1 and isinstance(results[failed[0]], zs.ConcurrentWriteError), results
    won = 5 - failed[0]
    assert same(zs.load(zeros_like_state(), path), state_of(won))


def test_a_lease_taken_over_is_never_renewed_over(s3_url):
    from zerostall.roots.lease import WriterLease, read_lease

    storage = storage_for(s3_url)
    lease = WriterLease(storage, ttl=0.3)  # renewed every 0.1 s
    lease.acquire()
    assert not storage.create_exclusive(".writer-lease", b"{}")  # a second manager cannot create it
    storage.put(".writer-lease", b'{"token": "theirs", "host": "elsewhere", "pid": 1}')  # taken over
    lease._thread.join(60)
    assert not lease._thread.is_alive()  # it stopped renewing
    assert read_lease(storage)["token"] == "theirs"
    lease.release()
    assert read_lease(storage)["token"] == "theirs"  # not ours: not removed


def test_a_stale_lease_is_taken_over_by_one_of_two_takers(s3_url):
    from zerostall.roots.lease import WriterLease, read_lease

    storage = storage_for(s3_url)
    storage.put(".writer-lease", b'{"token": "dead", "host": "gone", "pid": 1, "ttl": 1, "renewed": 0}')
    faulty = FaultyStorage(storage)
    first, second = WriterLease(faulty, ttl=60), WriterLease(storage, ttl=60)
    faulty.call("publish", lambda op, name: second.acquire(), name=".writer-lease", times=1, at="before_replace")
    with pytest.raises(zs.CheckpointError, match="another manager took"):
        first.acquire()  # the second took it between the first one's look and its switch
    assert read_lease(storage)["token"] == second.me["token"]
    second.release()
    assert read_lease(storage) is None


def test_reads_received_straight_into_tensors_give_their_connections_back(s3_server, s3_url):
    storage = S3Storage(s3_url, explicit(s3_server, part_size=5 * MIB))
    state = {"w": torch.randn(6 * MIB // 4 * 5), "b": torch.randn(3)}  # 30 MiB: six parts
    zs.save(state, storage, threads=1)
    pool = storage._client._endpoint.http_session._manager.connection_from_url(s3_server.endpoint)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    zs.load(out, storage)
    opened = pool.num_connections
    for _ in range(3):
        zs.load(out, storage)
    assert pool.num_connections == opened  # each GET read to its end went back to the pool
    assert all(torch.equal(out[k], v) for k, v in state.items())


def test_a_flip_in_a_block_a_part_boundary_cuts_or_not_is_caught(s3_server, s3_url):
    """A block whole inside one request, and one that a part boundary cuts over two (checked once
    both halves are in): a flipped byte in either is caught, naming entry and block."""
    part, block = 5 * MIB, MIB
    storage = S3Storage(s3_url, explicit(s3_server, part_size=part))
    state = {"big": torch.randn(5 * MIB), "small": torch.randn(1000)}  # 20 MiB: cut by three part boundaries
    zs.save(state, storage, threads=1, block_size=block)
    with zs.open(storage) as ck:
        chunk = next(e for e in ck.manifest.entries if e.fqn == "big").chunks[0]
    blocks = -(-chunk.nbytes // block)
    cut = [k for k in range(blocks) if (chunk.offset + k * block) // part != (chunk.offset + (k + 1) * block - 1) // part]
    assert 0 < len(cut) < blocks
    data = bytearray(storage.read_bytes(chunk.file))
    for bad in (cut[0], next(k for k in range(blocks) if k not in cut)):
        flipped = bytearray(data)
        flipped[chunk.offset + bad * block + 777] ^= 0x40
        storage.delete(chunk.file)
        storage.write(chunk.file, [memoryview(flipped)])
        with pytest.raises(zs.CorruptCheckpointError, match=rf"entry big, block {bad} "):
            zs.load({k: torch.zeros_like(v) for k, v in state.items()}, storage)
