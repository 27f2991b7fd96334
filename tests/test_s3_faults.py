"""S3 under faults: throttling, 5xx answers and dropped connections on a fraction of requests (a
proxy, tests/s3proxy.py, between the client and the real server), and the server killed in the
middle of an upload. A save either succeeds after retries or fails with a typed error, leaving no
manifest for itself, the previous checkpoint intact and, after the clean-up, no open uploads."""

from __future__ import annotations

import itertools
import tempfile
import threading
from typing import Any, Iterator

import pytest
import torch

import zerostall as zs
from faults import FaultyStorage
from s3proxy import FaultProxy
from s3server import SeaweedS3, weed_runs
from test_s3 import explicit, raw, same, state_of, uploads, zeros_like_state
from zerostall.format.layout import MANIFEST_NAME, data_file_name
from zerostall.storage import S3Storage

MIB = 1 << 20


def test_saves_loads_and_the_manager_ride_out_throttling_5xx_and_resets(s3_server, s3_url):
    with FaultProxy(s3_server.endpoint, every=5) as proxy:
        options = explicit(s3_server, part_size=5 * MIB)
        storage = S3Storage(s3_url, zs.S3Options(**{**options.__dict__, "endpoint_url": proxy.endpoint}))
        with zs.CheckpointManager(storage, keep_last=2) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, state_of(step))
            mgr.wait()
            restored = zeros_like_state()
            assert mgr.restore(restored) == 3 and same(restored, state_of(3))
            assert [tag for tag, _ in mgr.checkpoints()] == ["step_000000002", "step_000000003"]
        assert zs.verify(storage.child("step_000000003")) > 0
    assert all(proxy.fired[kind] for kind in ("slowdown", "error", "reset", "cut")), proxy.fired


def test_answers_cut_off_mid_body_are_asked_again(s3_server, s3_url):
    """Every other request's answer breaks off half-way (a listing, an error's XML, a manifest; an
    upload's connection is reset instead), including bodies botocore reads whole itself."""
    with FaultProxy(s3_server.endpoint, every=2, kinds=("cut",)) as proxy:
        storage = S3Storage(s3_url, zs.S3Options(**{**explicit(s3_server).__dict__, "endpoint_url": proxy.endpoint}))
        for name in ("a", "b", "c"):
            storage.write(name, [memoryview(name.encode() * 1000)])
        storage.child("sub").write("x", [memoryview(b"x")])
        for _ in range(3):
            assert storage.list() == ["a", "b", "c"] and storage.children() == ["sub"] and storage.exists()
            assert storage.read_bytes("b") == b"b" * 1000 and storage.read_head("c", 5) == b"ccccc"
            assert storage.stat("a").size == 1000
            with pytest.raises(FileNotFoundError):
                storage.read_bytes("missing")
    assert proxy.fired["cut"] and proxy.fired["reset"], proxy.fired


@pytest.fixture
def own_server() -> Iterator[SeaweedS3]:
    """A server of this test's own, to kill and start again."""
    pytest.importorskip("boto3")
    if (reason := weed_runs()) is not None:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="zs-s3-kill-") as tmp, SeaweedS3(tmp) as server:
        yield server


def big_state(seed: int) -> dict[str, Any]:
    return {"w": torch.randn(4 * MIB, generator=torch.Generator().manual_seed(seed)), "step": seed}


def test_a_server_killed_mid_upload_fails_the_save_and_the_restart_cleans_up(own_server):
    options = explicit(own_server, part_size=5 * MIB, max_attempts=2, connect_timeout=2, read_timeout=10)
    storage = FaultyStorage(S3Storage(f"s3://{own_server.bucket}/root", options))
    mgr = zs.CheckpointManager(storage, threads=1)
    mgr.save(1, big_state(1))
    killed = storage.call("write", lambda op, name: own_server.kill(), after_bytes=6 * MIB)
    with pytest.raises(zs.CheckpointError, match="writing a data file"):
        mgr.save(2, big_state(2))
    assert killed.count == 1
    own_server.start()
    attempt = storage.inner.child("step_000000002")
    assert MANIFEST_NAME not in attempt.list()
    out = zs.load({"w": torch.zeros(4 * MIB), "step": 0}, storage.inner.child("step_000000001"))
    assert torch.equal(out["w"], big_state(1)["w"])
    mgr.close()
    with zs.CheckpointManager(storage.inner) as again:  # the lease holder's clean-up
        assert uploads(own_server, storage.inner) == [] and not attempt.exists()
        restored = {"w": torch.zeros(4 * MIB), "step": 0}
        assert again.restore(restored) == 1 and torch.equal(restored["w"], big_state(1)["w"])


def conditional_put(method: str, path: str, headers: Any) -> bool:
    return method == "PUT" and ("If-Match" in headers or "If-None-Match" in headers)


def test_a_conditional_put_whose_answer_is_lost_is_no_false_conflict(s3_server, s3_url):
    with FaultProxy(s3_server.endpoint, every=2, kinds=("lost",), when=conditional_put) as proxy:
        storage = S3Storage(s3_url, zs.S3Options(**{**explicit(s3_server).__dict__, "endpoint_url": proxy.endpoint}))
        storage.publish(MANIFEST_NAME, "tmp", b"one", before_replace=lambda: None)  # If-None-Match: passes
        storage.publish(MANIFEST_NAME, "tmp", b"two", before_replace=lambda: None)  # If-Match: lost, then 412
        assert proxy.fired["lost"] == 1 and storage.read_bytes(MANIFEST_NAME) == b"two"
        other = S3Storage(s3_url, explicit(s3_server))
        with pytest.raises(zs.ConcurrentWriteError):  # lost, then 412: and the object is another writer's
            storage.publish(MANIFEST_NAME, "tmp", b"three",
                            before_replace=lambda: other.publish(MANIFEST_NAME, "tmp", b"other's"))
        assert proxy.fired["lost"] == 2 and storage.read_bytes(MANIFEST_NAME) == b"other's"


def completion(method: str, path: str, headers: Any) -> bool:
    return method == "POST" and "uploadId=" in path


def test_a_completed_upload_whose_answer_is_lost_is_no_failure(s3_server, s3_url):
    with FaultProxy(s3_server.endpoint, every=2, kinds=("lost",), when=completion) as proxy:
        options = explicit(s3_server, part_size=5 * MIB)
        storage = S3Storage(s3_url, zs.S3Options(**{**options.__dict__, "endpoint_url": proxy.endpoint}))
        data = bytes(range(256)) * (24 * 1024)  # 6 MiB: two parts
        storage.write("a.safetensors", [memoryview(data)])  # its completion passes
        storage.write("b.safetensors", [memoryview(data)])  # its completion lost, then asked again
        assert proxy.fired["lost"] == 1
        assert storage.read_bytes("b.safetensors") == data and uploads(s3_server, storage) == []


@pytest.mark.parametrize("verify", [True, False])
def test_a_server_that_ignores_byte_ranges_is_an_error_not_wrong_bytes(s3_server, s3_url, verify):
    """A server (or gateway) answering a ranged GET with the whole object: without the check a
    load would read the object's first bytes into every tensor (silently, with ``verify=False``)."""
    state = {"a": torch.randn(4096), "b": torch.randn(4096)}
    zs.save(state, s3_url, threads=1)
    storage = S3Storage(s3_url, explicit(s3_server))
    name = next(n for n in storage.list() if n != MANIFEST_NAME)
    with FaultProxy(s3_server.endpoint, every=1, kinds=("whole",)) as proxy:
        proxy.objects[f"/{storage.bucket}/{storage.prefix}{name}"] = storage.read_bytes(name)
        through = S3Storage(s3_url, zs.S3Options(**{**explicit(s3_server).__dict__, "endpoint_url": proxy.endpoint}))
        with pytest.raises(zs.CheckpointError, match=rf"{name}.*does not serve byte ranges"):
            zs.load({k: torch.zeros(4096) for k in state}, through, verify=verify)
    assert proxy.fired["whole"], proxy.fired


def manifest_requests(method: str) -> Any:
    """A ``when`` of the requests of ``method`` on a manifest."""
    return lambda m, path, headers: m == method and path.partition("?")[0].endswith(f"/{MANIFEST_NAME}")


def through(proxy: FaultProxy, s3_server: SeaweedS3, url: str, **fields: Any) -> S3Storage:
    return S3Storage(url, zs.S3Options(**{**explicit(s3_server, **fields).__dict__, "endpoint_url": proxy.endpoint}))


def test_a_commit_whose_outcome_cannot_be_learned_keeps_its_files(s3_server, s3_url):
    """The manifest's PUT takes effect but its answer is lost, the retry finds the object there
    (412), and the store then fails every read of the manifest. The save cannot know whether it
    committed: it says so, and deletes nothing (the committed manifest would name deleted files)."""
    lost, put = threading.Event(), manifest_requests("PUT")

    def script(method: str, path: str, headers: Any) -> str | None:
        if put(method, path, headers) and not lost.is_set():
            lost.set()
            return "lost"
        return "error" if lost.is_set() and manifest_requests("GET")(method, path, headers) else None

    state = state_of(1)
    with FaultProxy(s3_server.endpoint, script=script) as proxy:
        storage = through(proxy, s3_server, s3_url, max_attempts=2)
        with pytest.raises(zs.CheckpointError, match="outcome is unknown"):
            zs.save(state, storage, threads=1)
    assert proxy.fired["lost"] == 1 and proxy.fired["error"] >= 2, proxy.fired
    restored = zeros_like_state()
    zs.load(restored, s3_url)  # committed after all, every data file there
    assert same(restored, state)


def test_a_body_closed_early_is_asked_again_not_taken_for_a_short_file(s3_server, s3_url):
    """A ranged GET's answer stops half-way with a clean close (FIN, no reset): the rest is asked
    for again. Before, the reader took the missing bytes for the end of the file: a load said the
    checkpoint was corrupt and a restore fell back to an older one."""
    state = {"w": torch.randn(1 << 18, generator=torch.Generator().manual_seed(3))}
    zs.save(state, s3_url, threads=1)
    gets = itertools.count()

    def script(method: str, path: str, headers: Any) -> str | None:  # the first two GETs of data (one retried)
        data = method == "GET" and "Range" in headers and path.partition("?")[0].endswith(".safetensors")
        return "fin" if data and next(gets) < 2 else None

    with FaultProxy(s3_server.endpoint, script=script) as proxy:
        out = zs.load({"w": torch.zeros(1 << 18)}, through(proxy, s3_server, s3_url))
    assert proxy.fired["fin"] == 2 and torch.equal(out["w"], state["w"]), proxy.fired


def test_a_whole_object_for_a_range_from_byte_0_is_refused_unless_it_is_the_range(s3_server, s3_url):
    """A server ignoring ``Range`` answers ``200`` with the whole object. From byte 0 that is the
    right first bytes, but a read of a small head would take the whole object: refused, as from
    any other byte; an object no longer than the range asked is what was asked."""
    storage = S3Storage(s3_url, explicit(s3_server))
    storage.write("big", [memoryview(b"x" * 5000)])
    storage.write("small", [memoryview(b"y" * 10)])
    with FaultProxy(s3_server.endpoint, every=1, kinds=("whole",)) as proxy:
        for name in ("big", "small"):
            proxy.objects[f"/{storage.bucket}/{storage.prefix}{name}"] = storage.read_bytes(name)
        faulty = through(proxy, s3_server, s3_url)
        with pytest.raises(zs.StorageError, match="does not serve byte ranges"):
            faulty.read_head("big", 256)
        assert faulty.read_head("small", 256) == b"y" * 10
    assert proxy.fired["whole"] == 2, proxy.fired


def test_a_request_is_tried_max_attempts_times_in_all(s3_server, s3_url):
    with FaultProxy(s3_server.endpoint, every=1, kinds=("error",)) as proxy:
        with pytest.raises(zs.StorageError):
            through(proxy, s3_server, s3_url, max_attempts=3).read_bytes("anything")
    assert proxy.requests == 3


def test_a_managers_clean_up_leaves_other_programs_uploads_under_its_root(s3_server, s3_url):
    """A root shared with other programs (the top of a bucket, say): the lease holder's clean-up
    aborts the uploads its dead writers left, never another program's."""
    root = S3Storage(s3_url, explicit(s3_server))
    client, bucket = raw(s3_server), s3_server.bucket
    theirs, ours = f"{root.prefix}other-app/big.bin", f"{root.prefix}step_000000007/{data_file_name('1-2', 0, 0)}"
    for key in (theirs, ours):
        client.create_multipart_upload(Bucket=bucket, Key=key)
    zs.CheckpointManager(root).close()
    assert uploads(s3_server, root) == [theirs]
    root.abort_uploads()
