"""Damaged checkpoints are detected and reported precisely: flipped bytes, truncated or missing
files, a missing or damaged manifest, and pickle as an explicit opt-in on save and on load.

Everything here works on real files written by ``zs.save``; the damage is done with plain file
operations, never by mocking the library (a failed read is injected through the storage interface).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading

import pytest
import torch
import xxhash

import zerostall as zs
from faults import FaultyStorage
from zerostall.format.layout import Chunk, load_json
from zerostall.storage import LocalStorage

WEIGHT = "layer.weight"  # fqn of the tensor the byte-level tests damage


class Thing:
    """A module-level class (importable, so pickle can store it) that the codec does not know."""

    def __init__(self, x: int = 0) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Thing) and other.x == self.x


def make_state() -> dict:
    return {
        "layer": {"weight": torch.arange(4096, dtype=torch.float32) / 7, "bias": torch.arange(16, dtype=torch.int64)},
        "head": torch.linspace(-1, 1, 300, dtype=torch.float64).reshape(20, 15),
        "step": 12,
    }


def empty_like_state() -> dict:
    return {
        "layer": {"weight": torch.zeros(4096), "bias": torch.zeros(16, dtype=torch.int64)},
        "head": torch.zeros(20, 15, dtype=torch.float64),
        "step": 0,
    }


def assert_state_equal(got: dict, want: dict) -> None:
    assert torch.equal(got["layer"]["weight"], want["layer"]["weight"])
    assert torch.equal(got["layer"]["bias"], want["layer"]["bias"])
    assert torch.equal(got["head"], want["head"])
    assert got["step"] == want["step"]


def assert_load_verify_and_read_fail(path, *names: str) -> None:
    """Loading, verifying and reading WEIGHT each raise CorruptCheckpointError naming every one of ``names``."""
    with pytest.raises(zs.CorruptCheckpointError) as exc:
        zs.load(empty_like_state(), path)
    assert all(name in str(exc.value) for name in names)

    with pytest.raises(zs.CorruptCheckpointError) as exc:
        zs.verify(path)
    assert all(name in str(exc.value) for name in names)

    with zs.open(path) as ck, pytest.raises(zs.CorruptCheckpointError) as exc:
        ck.read(WEIGHT)
    assert all(name in str(exc.value) for name in names)


def chunk_of(path, fqn: str) -> Chunk:
    with zs.open(path) as ck:
        entry = ck.entries[fqn]
        assert entry.kind == "tensor" and len(entry.chunks) == 1
        return entry.chunks[0]


def flip_byte(file: str, offset: int, mask: int = 0x01) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        (b,) = f.read(1)
        f.seek(offset)
        f.write(bytes([b ^ mask]))


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    state = make_state()
    zs.save(state, path)
    return path, state


# -- (a) a flipped byte inside a tensor's data --------------------------------------------------

def test_flipped_byte_is_caught_by_load_verify_and_read(saved):
    path, state = saved
    chunk = chunk_of(path, WEIGHT)
    data_file = os.path.join(path, chunk.file)
    flip_byte(data_file, chunk.offset + chunk.nbytes // 2 + 1)

    assert_load_verify_and_read_fail(path, WEIGHT, chunk.file)

    # the undamaged entries still read fine one by one
    with zs.open(path) as ck:
        assert torch.equal(ck.read("head"), state["head"])
        assert torch.equal(ck.read("layer.bias"), state["layer"]["bias"])


def test_flipped_byte_loads_with_verify_off(saved):
    """verify=False is an explicit opt-out: the damaged value is loaded as stored."""
    path, state = saved
    chunk = chunk_of(path, WEIGHT)
    pos = chunk.nbytes // 2 + 1
    flip_byte(os.path.join(path, chunk.file), chunk.offset + pos)

    expected = state["layer"]["weight"].clone()
    expected.view(torch.uint8)[pos] ^= 0x01
    assert not torch.equal(expected, state["layer"]["weight"])

    target = empty_like_state()
    out = zs.load(target, path, verify=False)
    assert torch.equal(target["layer"]["weight"], expected)
    assert torch.equal(out["layer"]["weight"], expected)
    assert torch.equal(target["head"], state["head"])

    with zs.open(path, verify=False) as ck:
        assert torch.equal(ck.read(WEIGHT), expected)
    with zs.open(path) as ck:
        assert torch.equal(ck.read(WEIGHT, verify=False), expected)


def test_flipped_byte_in_a_converted_load_is_caught(saved):
    """The staged path (dtype conversion) verifies too."""
    path, _ = saved
    chunk = chunk_of(path, WEIGHT)
    flip_byte(os.path.join(path, chunk.file), chunk.offset + 3)
    target = empty_like_state()
    target["layer"]["weight"] = torch.zeros(4096, dtype=torch.float64)
    with pytest.raises(zs.CorruptCheckpointError) as exc:
        zs.load(target, path)
    assert WEIGHT in str(exc.value) and chunk.file in str(exc.value)


# -- (b) a truncated data file --------------------------------------------------------------------

@pytest.mark.parametrize("keep", ["half", "header_only", "one_byte_short"])
def test_truncated_data_file(saved, keep):
    path, _ = saved
    chunk = chunk_of(path, WEIGHT)
    data_file = os.path.join(path, chunk.file)
    end = chunk.offset + chunk.nbytes
    assert os.path.getsize(data_file) >= end
    size = {"half": chunk.offset + chunk.nbytes // 2, "header_only": chunk.offset, "one_byte_short": end - 1}[keep]
    os.truncate(data_file, size)

    assert_load_verify_and_read_fail(path, chunk.file)


def test_data_file_with_extra_bytes_fails_verify(saved):
    """A file longer than the manifest says is not what was saved either."""
    path, _ = saved
    chunk = chunk_of(path, WEIGHT)
    with open(os.path.join(path, chunk.file), "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(zs.CorruptCheckpointError) as exc:
        zs.verify(path)
    assert chunk.file in str(exc.value)


def test_damaged_data_file_header_fails_verify_and_loads_stay_exact(saved):
    """Loads never read a data file's safetensors header (the manifest has the offsets), but the
    file is no longer a valid safetensors file for other tools: verify names it."""
    path, state = saved
    chunk = chunk_of(path, WEIGHT)
    flip_byte(os.path.join(path, chunk.file), 20)
    with pytest.raises(zs.CorruptCheckpointError, match=f"header of data file {chunk.file} is damaged"):
        zs.verify(path)
    out = zs.load(empty_like_state(), path)
    assert torch.equal(out["layer"]["weight"], state["layer"]["weight"])


@pytest.mark.parametrize("drop", ["all", "one"])
def test_a_manifest_of_a_current_version_without_a_header_checksum_is_refused(saved, drop):
    """Only manifests of format version 1, written before data-file headers were checksummed, may
    lack ``headers``: without one, a damaged header would pass verify."""
    path, _ = saved
    manifest_path = os.path.join(path, "manifest.json")
    body = load_json(open(manifest_path, "rb").read())["manifest"]
    if drop == "all":
        del body["headers"]
    else:
        body["headers"].popitem()
    raw = json.dumps(body, separators=(",", ":")).encode()
    with open(manifest_path, "wb") as f:
        f.write(b'{"checksum":"%s","manifest":%s}\n' % (xxhash.xxh3_64_hexdigest(raw).encode(), raw))
    with pytest.raises(zs.CorruptCheckpointError, match="headers.*missing"):
        zs.verify(path)


# -- (c) no manifest, no checkpoint ----------------------------------------------------------------

def test_missing_manifest_is_incomplete(saved):
    path, _ = saved
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(zs.IncompleteCheckpointError):
        zs.load(empty_like_state(), path)
    with pytest.raises(zs.IncompleteCheckpointError):
        zs.open(path)
    with pytest.raises(zs.IncompleteCheckpointError) as exc:
        zs.verify(path)
    assert isinstance(exc.value, zs.CheckpointError)
    assert str(path) in str(exc.value)


def test_empty_directory_is_not_a_checkpoint(tmp_path):
    with pytest.raises(zs.CheckpointNotFoundError, match="no manifest, no data files"):
        zs.open(tmp_path)


def test_nonexistent_path_is_not_found(tmp_path):
    missing = tmp_path / "never-saved"
    for call in (lambda: zs.load(empty_like_state(), missing), lambda: zs.open(missing),
                 lambda: zs.verify(missing)):
        with pytest.raises(zs.CheckpointNotFoundError) as exc:
            call()
        assert isinstance(exc.value, zs.CheckpointError)
        assert isinstance(exc.value, FileNotFoundError)
        assert "never-saved" in str(exc.value)
    assert not missing.exists(), "reading must not create the directory"


# -- (d) a damaged manifest ------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["start", "checksum", "middle", "near_end"])
def test_flipped_byte_in_manifest(saved, where):
    path, _ = saved
    manifest = os.path.join(path, "manifest.json")
    raw = open(manifest, "rb").read()
    pos = {"start": 0, "checksum": 15, "middle": len(raw) // 2, "near_end": len(raw) - 3}[where]
    flip_byte(manifest, pos)
    with pytest.raises(zs.CorruptCheckpointError) as exc:
        zs.open(path)
    assert "manifest" in str(exc.value)
    with pytest.raises(zs.CorruptCheckpointError):
        zs.load(empty_like_state(), path)
    with pytest.raises(zs.CorruptCheckpointError):
        zs.verify(path)


def test_every_single_byte_flip_in_manifest_is_caught(saved):
    """No position in manifest.json may be damaged without the reader noticing: every byte of the
    framing (the first and last 64 bytes) and a sample of the body."""
    path, _ = saved
    manifest = os.path.join(path, "manifest.json")
    raw = open(manifest, "rb").read()
    undetected = []
    positions = sorted(set(range(64)) | set(range(len(raw) - 64, len(raw))) | set(range(64, len(raw), 37)))
    for pos in positions:
        damaged = bytearray(raw)
        damaged[pos] ^= 0x01
        with open(manifest, "wb") as f:
            f.write(damaged)
        try:
            zs.open(path).close()
        except zs.CorruptCheckpointError:
            continue
        undetected.append((pos, chr(raw[pos])))
    assert not undetected, f"byte flips in manifest.json ({len(raw)} bytes) not detected at {undetected}"


def test_a_forged_manifest_nested_too_deep_is_refused_with_a_typed_error(tmp_path):
    """A manifest whose checksum matches (forged, not damaged) but whose metadata nests deeper than
    any JSON parser goes: a CorruptCheckpointError, not a RecursionError, from open and from listing."""
    import xxhash

    from zerostall.loading.opening import read_manifest_head
    from zerostall.storage import LocalStorage

    path = tmp_path / "ck"
    zs.save({"w": torch.ones(2)}, path)
    raw = (path / "manifest.json").read_bytes()
    body = raw[len(b'{"checksum":"') + 16 + len(b'","manifest":'):-2]
    assert b'"metadata":{}' in body
    body = body.replace(b'"metadata":{}', b'"metadata":' + b"[" * 100_000 + b"]" * 100_000)
    digest = xxhash.xxh3_64_hexdigest(body).encode()
    (path / "manifest.json").write_bytes(b'{"checksum":"%s","manifest":%s}\n' % (digest, body))
    with pytest.raises(zs.CorruptCheckpointError, match="not valid JSON"):
        zs.open(path)
    with pytest.raises(zs.CorruptCheckpointError, match="not valid JSON"):
        read_manifest_head(LocalStorage(str(path)))


def test_truncated_manifest(saved):
    path, _ = saved
    manifest = os.path.join(path, "manifest.json")
    size = os.path.getsize(manifest)
    for keep in (0, 10, size // 2, size - 2):
        os.truncate(manifest, keep)
        with pytest.raises(zs.CorruptCheckpointError):
            zs.open(path)


# -- (e) a missing data file -----------------------------------------------------------------------

def test_missing_data_file(saved):
    path, _ = saved
    chunk = chunk_of(path, WEIGHT)
    os.remove(os.path.join(path, chunk.file))

    assert_load_verify_and_read_fail(path, chunk.file)


@pytest.mark.parametrize("change", ["resaved", "deleted"])
def test_a_checkpoint_changed_under_an_open_session_is_not_called_corrupt(saved, change):
    """A read session holds the manifest it opened; a save into the same path (or retention)
    removes that manifest's data files. What the session then fails to read is gone, not damaged:
    a plain CheckpointError that says so, never CorruptCheckpointError (a script deleting corrupt
    checkpoints would delete the new, healthy one)."""
    path, state = saved
    ck = zs.open(path)
    if change == "resaved":
        zs.save({"other": torch.ones(3)}, path, overwrite=True)
    else:
        shutil.rmtree(path)
    for read in (lambda: ck.load(empty_like_state()), lambda: ck.read(WEIGHT), ck.verify):
        with pytest.raises(zs.CheckpointError, match="changed while this read session was open") as exc:
            read()
        assert not isinstance(exc.value, zs.CorruptCheckpointError)
    ck.close()
    if change == "resaved":
        assert zs.verify(path) > 0


# -- (f) the damaged block is named ------------------------------------------------------------------

BLOCK = 4096
N_FLOATS = 16 * BLOCK // 4 + 100  # 16 full 4 KiB blocks and a short 17th


@pytest.mark.parametrize("block", [0, 7, 16])
def test_flip_names_the_right_block(tmp_path, block):
    path = tmp_path / "ckpt"
    weight = torch.arange(N_FLOATS, dtype=torch.float32)
    zs.save({"big": weight, "other": torch.ones(10)}, path, block_size=BLOCK)
    chunk = chunk_of(path, "big")
    assert len(chunk.checksums) == 17
    pos = block * BLOCK + 5
    assert pos < chunk.nbytes
    flip_byte(os.path.join(path, chunk.file), chunk.offset + pos)
    first = chunk.offset + block * BLOCK

    def check(message: str) -> None:
        assert "big" in message and chunk.file in message
        assert re.search(rf"\bblock {block}\b", message), message
        assert f"file bytes {first}-" in message

    with pytest.raises(zs.CorruptCheckpointError) as exc:
        zs.load({"big": torch.zeros(N_FLOATS), "other": torch.zeros(10)}, path)
    check(str(exc.value))
    with pytest.raises(zs.CorruptCheckpointError) as exc:
        zs.verify(path)
    check(str(exc.value))
    with zs.open(path) as ck, pytest.raises(zs.CorruptCheckpointError) as exc:
        ck.read("big")
    check(str(exc.value))

    # the undamaged entry beside it still loads on its own
    with zs.open(path) as ck:
        other = torch.zeros(10)
        ck.load({"other": other}, keys=["other"])
        assert torch.equal(other, torch.ones(10))


# -- (h) many small tensors are read back to back in scatter reads, and still checked one by one ----

N_SMALL = 1200  # over 512 per file with 2 threads: several scatter reads per file


def small_state() -> dict:
    """Tensors of 0..6 floats (empty ones included), stored back to back in the data files."""
    return {f"t{i}": torch.full((i % 7,), float(i)) for i in range(N_SMALL)}


def zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def test_many_small_tensors_round_trip(tmp_path):
    state = small_state()
    zs.save(state, tmp_path / "ck", threads=2)
    for verify in (True, False):
        target = zs.load(zeros_like(state), tmp_path / "ck", verify=verify)
        assert all(torch.equal(target[k], state[k]) for k in state)


def test_flip_among_many_small_tensors_names_the_entry(tmp_path):
    state = small_state()
    path = tmp_path / "ck"
    zs.save(state, path, threads=2)
    chunk = chunk_of(path, "t600")
    flip_byte(os.path.join(path, chunk.file), chunk.offset + 3)
    with pytest.raises(zs.CorruptCheckpointError, match=r"entry t600, block 0") as exc:
        zs.load(zeros_like(state), path)
    assert chunk.file in str(exc.value)

    loaded = zs.load(zeros_like(state), path, verify=False)  # the opt-out reads the damaged bytes as they are
    assert not torch.equal(loaded["t600"], state["t600"])
    assert all(torch.equal(loaded[k], state[k]) for k in state if k != "t600")


def test_truncation_among_many_small_tensors_names_an_entry_past_the_end(tmp_path):
    state = small_state()
    path = tmp_path / "ck"
    zs.save(state, path, threads=2)
    chunk = chunk_of(path, "t601")
    cut = chunk.offset + 5
    os.truncate(os.path.join(path, chunk.file), cut)
    with pytest.raises(zs.CorruptCheckpointError) as exc:
        zs.load(zeros_like(state), path)
    found = re.search(r"data file (\S+) of .* is truncated: entry (\S+) lies past its end", str(exc.value))
    assert found and found.group(1) == chunk.file, str(exc.value)
    named = chunk_of(path, found.group(2))
    assert named.file == chunk.file and named.offset + named.nbytes > cut


# -- (g) pickle is an opt-in on save and on load ------------------------------------------------------

def test_unknown_object_is_refused_without_pickle(tmp_path):
    path = tmp_path / "ckpt"
    state = {"w": torch.ones(3), "opts": {"thing": Thing(5)}}
    with pytest.raises(zs.UnsupportedValueError) as exc:
        zs.save(state, path)
    assert "opts.thing" in str(exc.value)
    assert "Thing" in str(exc.value)
    assert isinstance(exc.value, zs.CheckpointError)
    assert not (path / "manifest.json").exists()
    with pytest.raises((zs.CheckpointNotFoundError, zs.IncompleteCheckpointError)):
        zs.open(path)


def test_refused_value_deep_inside_metadata_is_located(tmp_path):
    path = tmp_path / "ckpt"
    metadata = {"run": {"tags": ["a", {"owner": ("me", Thing(1))}]}}
    with pytest.raises(zs.UnsupportedValueError, match=r"Thing at metadata\.run\.tags\[1\]\.owner\[1\]"):
        zs.save({"w": torch.ones(3)}, path, metadata=metadata)
    assert not (path / "manifest.json").exists()


@pytest.mark.parametrize("where,named", [("state", "x.0.0.0"), ("metadata", "metadata")])
def test_values_nested_too_deeply_are_refused_with_a_typed_error(tmp_path, where, named):
    """Not a RecursionError from deep inside the walk: a typed error naming where, and the
    checkpoint already at the path untouched."""
    zs.save({"t": torch.ones(2)}, tmp_path / "ck", overwrite=True)
    deep = 1
    for _ in range(5000):
        deep = [deep]
    state, metadata = {"t": torch.zeros(2)}, {}
    (state if where == "state" else metadata)["x"] = deep
    with pytest.raises(zs.UnsupportedValueError, match="deep") as exc:
        zs.save(state, tmp_path / "ck", metadata=metadata, overwrite=True)
    assert named in str(exc.value)
    assert torch.equal(zs.load({"t": torch.zeros(2)}, tmp_path / "ck")["t"], torch.ones(2))


def test_an_object_pickle_cannot_store_is_refused_naming_its_key(tmp_path):
    """With allow_pickle, a lock or a lambda made pickle raise its own error (PicklingError,
    TypeError), naming neither the key nor zerostall; the checkpoint in place stays."""
    zs.save({"w": torch.ones(3)}, tmp_path / "ck")
    for bad in (threading.Lock(), lambda: 1):
        with pytest.raises(zs.UnsupportedValueError, match=r"at opts\.bad: pickle cannot store it"):
            zs.save({"w": torch.zeros(3), "opts": {"bad": bad}}, tmp_path / "ck", allow_pickle=True, overwrite=True)
    assert torch.equal(zs.load({"w": torch.zeros(3)}, tmp_path / "ck")["w"], torch.ones(3))


def test_pickle_opt_in_on_save_and_on_load(tmp_path):
    path = tmp_path / "ckpt"
    state = {"w": torch.ones(3), "opts": {"thing": Thing(5)}}
    zs.save(state, path, allow_pickle=True)

    with pytest.raises(zs.UnsupportedValueError) as exc:
        zs.load({"w": torch.zeros(3), "opts": {"thing": None}}, path)
    assert isinstance(exc.value, zs.CheckpointError)
    assert "opts" in str(exc.value) and "pickle" in str(exc.value)

    with zs.open(path) as ck, pytest.raises(zs.UnsupportedValueError):
        ck.read("opts")

    # verify checks the bytes without unpickling anything
    assert zs.verify(path) > 0

    target = {"w": torch.zeros(3), "opts": {"thing": None}}
    out = zs.load(target, path, allow_pickle=True)
    assert torch.equal(target["w"], torch.ones(3))
    assert out["opts"]["thing"] == Thing(5)
    with zs.open(path, allow_pickle=True) as ck:
        assert ck.read("opts") == {"thing": Thing(5)}


# -- (h) verify on a clean checkpoint ----------------------------------------------------------------

def test_verify_clean_returns_bytes_checked(saved):
    path, state = saved
    n = zs.verify(path)
    tensor_bytes = sum(t.numel() * t.element_size()
                       for t in (state["layer"]["weight"], state["layer"]["bias"], state["head"]))
    assert n == tensor_bytes > 0
    seen = []
    assert zs.verify(path, progress=seen.append) == n
    assert sum(seen) == n
    target = empty_like_state()
    zs.load(target, path)
    assert_state_equal(target, state)


def test_a_failed_read_stops_the_other_reader_threads(tmp_path):
    """Without the stop, a load whose first read fails (a bad block, an I/O error) reads all the
    rest of a large checkpoint before raising. Through a FaultyStorage: the first read fails once
    the other thread waits at its own first read, which then goes on; its reads after the failure
    are counted (the one it had begun, not the other 7 runs of its lane)."""
    state = {f"t{i:02d}": torch.randn(1 << 18) for i in range(16)}  # 1 MiB each: one read each, 8 per thread
    path = tmp_path / "ck"
    zs.save(state, path)
    storage = FaultyStorage(LocalStorage(str(path)))
    other_waits, reads_after = threading.Event(), []
    storage.block("read_into", other_waits, times=1)
    failure = storage.fail("read_into", OSError(errno.EIO, "read failed (injected)"), times=1)

    def after_the_failure(op, name):
        other_waits.set()
        failure.fired.wait()
        reads_after.append(name)

    storage.call("read_into", after_the_failure, from_call=2)
    with pytest.raises(zs.CheckpointError, match=r"read failed \(injected\)"):
        zs.load({k: torch.empty(1 << 18) for k in state}, storage, threads=2, verify=False)
    assert failure.count == 1
    assert len(reads_after) == 1


def test_the_manifest_head_matches_the_whole_manifest_and_is_checked_whole(tmp_path):
    """Listing reads only a manifest's leading fields, but still checks its checksum over every byte."""
    from zerostall.format.layout import MANIFEST_NAME, ManifestHead
    from zerostall.loading.opening import read_manifest, read_manifest_head
    from zerostall.storage import LocalStorage

    path = tmp_path / "ck"
    tricky = '"files": {"x": 1}}, "entries": [ \\" {'  # JSON syntax inside a string value
    zs.save({"w": torch.randn(8), "n": {"k": 1}}, path, step=12, metadata={"metrics": {"loss": 0.5}, "note": tricky})
    storage = LocalStorage(str(path))
    head, whole = read_manifest_head(storage), read_manifest(storage)
    assert isinstance(head, ManifestHead)
    assert (head.generation, head.files, head.world_size, head.block_size, head.step, head.metadata, head.created,
            head.version) == (whole.generation, whole.files, whole.world_size, whole.block_size, whole.step,
                              whole.metadata, whole.created, whole.version)
    raw = (path / MANIFEST_NAME).read_bytes()
    at = raw.rindex(b'"entries"') + 20  # a byte the head itself never parses
    (path / MANIFEST_NAME).write_bytes(raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1:])
    with pytest.raises(zs.CorruptCheckpointError, match="checksum"):
        read_manifest_head(storage)
