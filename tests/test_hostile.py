"""Hostile checkpoints: a manifest whose checksum envelope is valid but whose contents lie, and
files swapped for symbolic links, FIFOs, devices and directories. The envelope proves that a
manifest is intact, not that its numbers are sane: every case is refused with a typed error
(``CorruptCheckpointError`` naming the field, when the manifest lies) at ``open``, by every way of
reading (load, read, state, verify) and by the CLI (an exit status and a message, no traceback),
without opening anything outside the checkpoint and without hanging.

Each case is built from a real checkpoint written by ``zs.save`` (see tests/hostile.py); the
random counterpart of these cases is the fuzz suite (tests/fuzz.py, run by tests/test_fuzz.py).
"""

from __future__ import annotations

import math
import os
import random
import shutil

import pytest
import torch
import xxhash

import zerostall as zs
from hostile import (MANIFEST, body_bytes, cli_outcome, compact, data_files, entry, opened, parse_body, read_body,
                     under, within, write_body)
from zerostall.format.layout import dump_json
from zerostall.roots.described import CORRUPT
from zerostall.roots.root import CheckpointRoot
from zerostall.storage import LocalStorage

WAIT = 20  # seconds any refusal may take: a call still running then has hung


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(1024, generator=g)
    return {"w": torch.randn(20, 15, generator=g, dtype=torch.float64), "v": v, "tied": v,
            "step": 12 + seed, "opts": {"betas": (0.9, 0.999)}}


def target() -> dict:
    return {"w": torch.zeros(20, 15, dtype=torch.float64), "v": torch.zeros(1024), "tied": torch.zeros(1024),
            "step": None, "opts": None}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    zs.save(state(0), root / "ck", step=12, metadata={"metrics": {"loss": 0.5}})
    zs.save(state(1), root / "other", step=13)
    return root


@pytest.fixture
def ck(pristine, tmp_path):
    """A fresh copy of the checkpoint (``tmp_path/ck``) beside another one (``tmp_path/other``)."""
    for name in ("ck", "other"):
        shutil.copytree(pristine / name, tmp_path / name)
    return tmp_path / "ck"


def read_one(path, fqn: str):
    with zs.open(path) as ck:
        return ck.read(fqn)


def ways(path, key: str = "w") -> dict:
    """Every way of reading a checkpoint (``read``: the entry ``key`` alone)."""
    def read():
        return read_one(path, key)

    def whole():
        with zs.open(path) as ck:
            return ck.state()

    def entries():
        with zs.open(path) as ck:
            return len(ck.entries)

    return {"open": lambda: zs.open(path).close(), "entries": entries, "load": lambda: zs.load(target(), path),
            "read": read, "state": whole, "verify": lambda: zs.verify(path)}


def assert_refused(path, *words: str, at_open: bool = True, away=(), fifos=(), read: str | None = "w") -> None:
    """Every way of reading ``path`` raises CorruptCheckpointError (whose message holds ``words``)
    within WAIT seconds, without opening anything under ``away``: the first look at the entries
    when the manifest is at fault (``at_open``; ``open`` itself checks the leading fields, and
    leaves the entries for their first use), else every read of the data. Reading one entry
    before the others are built checks that entry (and the data files it lies in) alone: ``read``
    names the entry the lie is in, whose read is refused; None when the lie is in no entry (the
    tree), and then a read of ``w`` gives its values. The CLI exits 1 with a message and no
    traceback (verify; inspect too when the manifest is at fault), and ls lists the root without
    failing (it reads only the head of a manifest)."""
    with opened() as paths:
        for how, call in ways(path, read or "w").items():
            hung, outcome = within(WAIT, call, fifos)
            assert not hung, f"{how} hung"
            if how == "read" and read is None:
                assert isinstance(outcome, torch.Tensor) and torch.equal(outcome, state(0)["w"]), f"{how}: {outcome!r}"
                continue
            if how in ("open", "entries") and not at_open or how == "open" and outcome is None:
                assert not isinstance(outcome, BaseException), f"{how}: {outcome!r}"
                continue
            assert isinstance(outcome, zs.CorruptCheckpointError), f"{how}: {outcome!r}"
            assert all(w in str(outcome) for w in words), f"{how}: {outcome}"
        for command in ("inspect", "verify"):
            hung, (code, err, escaped) = within(WAIT, lambda: cli_outcome(command, path), fifos)
            assert not hung and escaped is None, (command, code, err, escaped)
            if command == "inspect" and not at_open:
                assert code == 0, (command, code, err)
                continue
            assert code == 1 and err.strip() and "Traceback" not in err, (command, code, err)
    assert not under(paths, *away), f"opened outside the checkpoint: {under(paths, *away)}"
    hung, (code, err, escaped) = within(WAIT, lambda: cli_outcome("ls", "--json", os.path.dirname(path)), fifos)
    assert not hung and escaped is None and code == 0, (code, err, escaped)


def rewrite(path, change) -> None:
    """Rewrite the manifest of ``path`` by ``change(body)``, with a valid envelope."""
    body = read_body(path)
    change(body)
    write_body(path, body)


# -- reads outside the checkpoint -------------------------------------------------------------------

@pytest.mark.parametrize("how", ["relative", "absolute", "proc"])
def test_a_chunk_in_a_file_outside_the_checkpoint_is_refused(ck, how):
    """The chunk of ``w`` moved to the other checkpoint's file (whose bytes match its checksums:
    on the old reader every read succeeded with the other checkpoint's data)."""
    other = ck.parent / "other"
    theirs = entry(read_body(other), "w")["chunks"][0]
    name = {"relative": f"../other/{theirs['file']}", "absolute": str(other / theirs["file"]),
            "proc": "/proc/self/mem"}[how]

    def change(body):
        body["files"][name] = read_body(other)["files"][theirs["file"]] if how != "proc" else 1 << 40
        entry(body, "w")["chunks"][0] = {**theirs, "file": name}

    rewrite(ck, change)
    assert_refused(ck, "files[", away=(other, "/proc/self/mem"))


def test_a_data_file_that_is_a_symbolic_link_is_refused(ck):
    """A link to a copy of the file elsewhere: every byte matches, yet nothing is read through it."""
    elsewhere = ck.parent / "elsewhere"
    elsewhere.mkdir()
    for name in data_files(ck):
        shutil.move(ck / name, elsewhere / name)
        os.symlink(elsewhere / name, ck / name)
    assert_refused(ck, "symbolic link", at_open=False, away=(elsewhere,))


def test_a_manifest_that_is_a_symbolic_link_is_refused(ck):
    other = ck.parent / "other"
    os.remove(ck / MANIFEST)
    os.symlink(other / MANIFEST, ck / MANIFEST)
    with opened() as paths:
        with pytest.raises(zs.CorruptCheckpointError, match="symbolic link"):
            zs.open(ck)
    assert not under(paths, other)


@pytest.mark.parametrize("name", ["../other/manifest.json", "/etc/passwd", "a/b", "..", ".", "", "nul\0byte"])
def test_the_storage_opens_plain_names_only(ck, name):
    storage = LocalStorage(str(ck))
    for call in (lambda: storage.read_bytes(name), lambda: storage.read_head(name, 8), lambda: storage.size(name),
                 lambda: storage.read_into(name, 0, memoryview(bytearray(8))), lambda: storage.memory_map(name),
                 lambda: storage.delete(name)):
        with pytest.raises(zs.UnsafeFileError, match="not a plain file name"):
            call()


def test_an_object_store_reads_plain_names_only_and_caps_the_manifest(s3_url, monkeypatch):
    """On S3 too: a file name is never a path out of the prefix, a manifest over the cap is refused
    by the size its GET answers with, unread, and a manifest naming a file outside is refused."""
    from zerostall.storage import FileTooLargeError, storage_for

    path = f"{s3_url}/ck"
    zs.save(state(0), path)
    storage = storage_for(path)
    for name in ("../x", "a/b", "", ".."):
        for call in (lambda: storage.read_bytes(name), lambda: storage.size(name), lambda: storage.delete(name)):
            with pytest.raises(zs.UnsafeFileError, match="not a plain file name"):
                call()
    size = len(storage.read_bytes(MANIFEST))
    assert len(storage.read_bytes(MANIFEST, size)) == size
    with pytest.raises(FileTooLargeError):
        storage.read_bytes(MANIFEST, size - 1)
    monkeypatch.setenv("ZEROSTALL_MAX_MANIFEST_BYTES", str(size - 1))
    with pytest.raises(zs.CorruptCheckpointError, match=f"has {size} bytes, more than the {size - 1}"):
        zs.open(path)
    monkeypatch.delenv("ZEROSTALL_MAX_MANIFEST_BYTES")
    body = parse_body(storage.read_bytes(MANIFEST))
    body["files"]["../other/x"] = 1 << 20
    entry(body, "w")["chunks"][0]["file"] = "../other/x"
    storage.put(MANIFEST, body_bytes(body))
    with pytest.raises(zs.CorruptCheckpointError, match="files"):
        zs.load(target(), path)


# -- hangs ------------------------------------------------------------------------------------------

def test_a_fifo_in_place_of_a_data_file_fails_at_once(ck):
    fifos = []
    for name in data_files(ck):
        os.remove(ck / name)
        os.mkfifo(ck / name)
        fifos.append(str(ck / name))
    assert_refused(ck, "FIFO", at_open=False, fifos=tuple(fifos))


def test_a_fifo_in_place_of_the_manifest_fails_at_once(ck):
    os.remove(ck / MANIFEST)
    os.mkfifo(ck / MANIFEST)
    assert_refused(ck, "FIFO", fifos=(str(ck / MANIFEST),))
    rows = CheckpointRoot(LocalStorage(str(ck.parent))).scan()
    assert [r.status for r in rows if r.name == "ck"] == [CORRUPT]


def test_listing_a_root_with_a_fifo_manifest_does_not_hang(tmp_path):
    root = tmp_path / "root"
    with zs.CheckpointManager(root) as manager:
        manager.save(1, state(0))
        manager.save(2, state(1))
    fifo = root / "step_000000002" / MANIFEST
    os.remove(fifo)
    os.mkfifo(fifo)

    def listing():
        with zs.CheckpointManager(root) as manager:
            return [tag for tag, _ in manager.checkpoints()], CheckpointRoot(LocalStorage(str(root))).scan()

    hung, outcome = within(WAIT, listing, (str(fifo),))
    assert not hung and not isinstance(outcome, BaseException), outcome
    tags, rows = outcome
    assert tags == ["step_000000001"]
    assert [(r.name, r.status) for r in rows] == [("step_000000001", "committed"), ("step_000000002", CORRUPT)]
    hung, (code, err, escaped) = within(WAIT, lambda: cli_outcome("ls", root), (str(fifo),))
    assert not hung and escaped is None and code == 0, (code, err)


@pytest.mark.parametrize("latest", ["deep", "huge", "fifo"])
def test_listing_a_root_whose_latest_file_lies_does_not_fail(tmp_path, latest):
    """``latest`` is only a mirror for other tools: nested deeper than a parser goes, bigger than a
    pointer can be, or a FIFO, it is ignored (it raised RecursionError, read 2 GiB, or hung)."""
    root = tmp_path / "root"
    with zs.CheckpointManager(root) as manager:
        manager.save(1, state(0))
    pointer = root / "latest"
    pointer.unlink()
    if latest == "deep":
        pointer.write_text("[" * 100_000 + "]" * 100_000)
    elif latest == "huge":
        pointer.write_bytes(b'{"tag": "step_000000001"}')
        os.truncate(pointer, 2 << 30)
    else:
        os.mkfifo(pointer)
    fifos = (str(pointer),) if latest == "fifo" else ()
    hung, outcome = within(WAIT, lambda: CheckpointRoot(LocalStorage(str(root))).read_latest(), fifos)
    assert not hung and outcome is None, outcome
    hung, (code, err, escaped) = within(WAIT, lambda: cli_outcome("ls", root), fifos)
    assert not hung and escaped is None and code == 0, (code, err, escaped)


# -- no size cap ------------------------------------------------------------------------------------

def test_a_manifest_linked_to_a_device_is_refused(ck):
    os.remove(ck / MANIFEST)
    os.symlink("/dev/zero", ck / MANIFEST)
    assert_refused(ck, "symbolic link", away=("/dev/zero",))


def test_a_device_is_not_read_as_a_file():
    with pytest.raises(zs.UnsafeFileError, match="character device"):
        LocalStorage("/dev").read_bytes("zero", 1 << 20)
    with pytest.raises(zs.UnsafeFileError, match="character device"):
        LocalStorage("/dev").read_into("zero", 0, memoryview(bytearray(8)))


def test_a_huge_manifest_is_refused_without_being_read(ck):
    """2 GiB of a sparse file: refused by its size, so neither open nor listing reads it."""
    os.truncate(ck / MANIFEST, 2 << 30)
    assert_refused(ck, "more than the 1073741824", "ZEROSTALL_MAX_MANIFEST_BYTES")
    rows = CheckpointRoot(LocalStorage(str(ck.parent))).scan()
    assert [r.status for r in rows if r.name == "ck"] == [CORRUPT]
    with zs.CheckpointManager(ck.parent) as manager:
        assert [tag for tag, _ in manager.checkpoints()] == ["other"]


def test_the_manifest_size_cap_is_an_environment_setting(ck, monkeypatch):
    size = os.path.getsize(ck / MANIFEST)
    monkeypatch.setenv("ZEROSTALL_MAX_MANIFEST_BYTES", str(size - 1))
    with pytest.raises(zs.CorruptCheckpointError, match=f"has {size} bytes, more than the {size - 1}"):
        zs.open(ck)
    monkeypatch.setenv("ZEROSTALL_MAX_MANIFEST_BYTES", str(size))
    assert zs.verify(ck) > 0
    monkeypatch.setenv("ZEROSTALL_MAX_MANIFEST_BYTES", "lots")
    with pytest.raises(ValueError, match="ZEROSTALL_MAX_MANIFEST_BYTES"):
        zs.open(ck)
    assert cli_outcome("inspect", ck)[0] == 2


@pytest.mark.parametrize("block_size", [2 ** 33, -1, 0, True, 4096.0, "4096"])
def test_a_block_size_the_format_does_not_allow_is_refused(ck, block_size):
    """-1 passed verify with garbage checksums and loaded nothing; 0 divided by zero; 2**33 made
    verify allocate that much."""
    def change(body):
        body["block_size"] = block_size
        for e in body["entries"]:
            for c in e.get("chunks", ()):
                c["checksums"] = ["0" * 16]

    rewrite(ck, change)
    assert_refused(ck, "block_size")


# -- silently wrong tensors from trusted integers ---------------------------------------------------

def carve(path, fqn: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> torch.Tensor:
    """Store entry ``fqn`` anew as the chunks ``boxes`` (offsets, sizes), each holding the saved
    values of its box in a new data file of the checkpoint, with true checksums; returns the tensor."""
    with zs.open(path) as ck:
        value = ck.read(fqn).clone()
    body = read_body(path)
    name = data_files(path)[0].replace("-000.safetensors", "-009.safetensors")
    blob, chunks = bytearray(), []
    for offsets, sizes in boxes:
        part = value[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].contiguous()
        raw = part.numpy().tobytes()
        chunks.append({"offsets": list(offsets), "sizes": list(sizes), "file": name, "offset": len(blob),
                       "nbytes": len(raw), "checksums": [xxhash.xxh3_64_hexdigest(raw)]})
        blob += raw
    (path / name).write_bytes(bytes(blob))
    body["files"][name] = len(blob)
    body["headers"][name] = xxhash.xxh3_64_hexdigest(b"")  # no header: its data starts at 0
    entry(body, fqn)["chunks"] = chunks
    write_body(path, body)
    return value


def test_chunks_that_tile_a_tensor_load_exactly(ck):
    """The control: a tensor stored as a grid of chunks (as a sharded save writes it) loads."""
    value = carve(ck, "w", [((r, c), (s, t)) for r, s in ((0, 8), (8, 12)) for c, t in ((0, 5), (5, 10))])
    assert torch.equal(zs.load(target(), ck)["w"], value)
    assert zs.verify(ck) > 0


@pytest.mark.parametrize("layout", ["overlap and gap", "gap", "overlap", "twice"])
def test_chunks_that_overlap_or_leave_a_gap_are_refused(ck, layout):
    """Rows 0-10 and 5-15 of 20: as many elements as the tensor, so the old coverage check passed
    and rows 15-20 of the target were left as they were."""
    boxes = {"overlap and gap": [((0, 0), (10, 15)), ((5, 0), (10, 15))],
             "gap": [((0, 0), (10, 15)), ((11, 0), (9, 15))],
             "overlap": [((0, 0), (10, 15)), ((5, 0), (15, 15))],
             "twice": [((0, 0), (20, 15)), ((0, 0), (20, 15))]}[layout]
    carve(ck, "w", boxes)
    assert_refused(ck, "do not tile the shape [20, 15]")


def test_a_dtype_that_does_not_match_nbytes_is_refused(ck):
    """float32 → float64 with the same bytes: the old reader filled half the target."""
    rewrite(ck, lambda body: entry(body, "v").update(dtype="float64"))
    assert_refused(ck, "nbytes", "float64", read="v")


def test_a_tensor_cut_short_with_true_checksums_is_refused(ck):
    """``v`` said to hold its first 1000 elements, with the checksums of those: every check of the
    tensor passes, but its last 24 values are bytes of the file that no chunk holds."""
    def change(body):
        chunk = entry(body, "v")["chunks"][0]
        with open(ck / chunk["file"], "rb") as f:
            f.seek(chunk["offset"])
            data = f.read(4000)
        entry(body, "v")["shape"] = [1000]
        chunk.update(sizes=[1000], nbytes=4000, checksums=[xxhash.xxh3_64_hexdigest(data)])

    rewrite(ck, change)
    assert_refused(ck, "files[", "its chunks end at byte", read="v")  # v is stored last in its file


def test_a_chunk_that_lies_past_its_file_is_refused_before_memory_is_set_aside(ck):
    """The manifest says ``v`` holds 256 GiB, the last bytes of its file: nothing is allocated for it."""
    def change(body):
        e = entry(body, "v")
        body["files"][e["chunks"][0]["file"]] = e["chunks"][0]["offset"] + (1 << 38)
        body["block_size"] = 1 << 30
        e["shape"] = [1 << 36]
        e["chunks"][0].update(sizes=[1 << 36], nbytes=1 << 38, checksums=["0" * 16] * 256)

    rewrite(ck, change)
    partial = {"v": None, "w": torch.zeros(20, 15, dtype=torch.float64)}  # v: a tensor made as the manifest says
    calls = {**ways(ck), "read": lambda: read_one(ck, "v"), "load": lambda: zs.load(partial, ck, strict=False)}
    for how, call in calls.items():
        hung, outcome = within(WAIT, call)
        assert not hung, how
        if how in ("open", "entries"):  # the manifest holds together: only its numbers of the data lie
            assert not isinstance(outcome, BaseException), (how, outcome)
        else:
            assert isinstance(outcome, zs.CorruptCheckpointError), (how, outcome)
            assert "lies past its end" in str(outcome), (how, outcome)


# -- untyped exceptions -----------------------------------------------------------------------------

def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def set_value(body, value):
    entry(body, "opts")["value"] = value


HOSTILE = {  # what the old reader raised, or did, in brackets
    "a value nested 300 deep [RecursionError]": (lambda b: set_value(b, nested(300)), "deep"),
    "metadata nested 300 deep [RecursionError]": (lambda b: b.update(metadata={"x": nested(300)}), "metadata"),
    "$complex without parts [IndexError]": (lambda b: set_value(b, {"$complex": []}), "$complex"),
    "$float of no number [ValueError]": (lambda b: set_value(b, {"$float": "abc"}), "$float"),
    "$set of lists [TypeError]": (lambda b: set_value(b, {"$set": [[1]]}), "$set"),
    "$device of nothing [RuntimeError]": (lambda b: set_value(b, {"$device": "warp:9"}), "warp"),
    "$dtype of a function [torch.load returned]": (lambda b: set_value(b, {"$dtype": "load"}), "load"),
    "$ndarray of objects [ValueError]": (lambda b: set_value(b, {"$ndarray": ["|O", [1], "AAAAAAAAAAA="]}), "|O"),
    "$bytes of no base64 [binascii.Error]": (lambda b: set_value(b, {"$bytes": "!"}), "$bytes"),
    "$size beyond 64 bits [a torch.Size whose repr raised ValueError: inspect exited 2]":
        (lambda b: set_value(b, {"$size": [10**30]}), "$size"),
    "$size below 64 bits": (lambda b: set_value(b, {"$size": [-(2**63) - 1]}), "$size"),
    "$complex of an int beyond floats [OverflowError]": (lambda b: set_value(b, {"$complex": [10**400, 0.0]}),
                                                         "$complex"),
    "$ndarray of absurd dimensions [ValueError]": (lambda b: set_value(b, {"$ndarray": ["<f4", [0, 10**30], ""]}),
                                                   "$ndarray"),
    "$ndarray of 65 dimensions [ValueError]": (lambda b: set_value(b, {"$ndarray": ["<f4", [1] * 65, "AAAAAA=="]}),
                                               "65 dimensions"),
    "an unknown tag [UnsupportedValueError]": (lambda b: set_value(b, {"$lambda": "x"}), "$lambda"),
    "a tag among keys": (lambda b: set_value(b, {"$tuple": [], "x": 1}), "$tuple"),
    "no dtype [AssertionError]": (lambda b: entry(b, "w").update(dtype=None), "dtype"),
    "an unknown dtype": (lambda b: entry(b, "w").update(dtype="float33"), "float33"),
    "a dtype alias": (lambda b: entry(b, "w").update(dtype="double"), "double"),
    "an unknown kind [AssertionError]": (lambda b: entry(b, "w").update(kind="blob"), "blob"),
    "a shape of text [TypeError]": (lambda b: entry(b, "w").update(shape="20x15"), "shape"),
    "a negative dimension": (lambda b: entry(b, "w").update(shape=[-20, -15]), "shape"),
    "an empty tensor of absurd dimensions [RuntimeError]": (lambda b: entry(b, "w").update(shape=[0, 1 << 40, 1 << 40]),
                                                            "spans more than"),
    "offsets of text": (lambda b: entry(b, "w")["chunks"][0].update(offsets="00"), "chunks[0]"),
    "a negative offset": (lambda b: entry(b, "w")["chunks"][0].update(offset=-8), "offset"),
    "an odd offset": (lambda b: entry(b, "w")["chunks"][0].update(offset=entry(b, "w")["chunks"][0]["offset"] + 1),
                      "offset"),
    "a float nbytes": (lambda b: entry(b, "w")["chunks"][0].update(nbytes=2400.0), "nbytes"),
    "a boolean offset": (lambda b: entry(b, "v")["chunks"][0].update(offsets=[False]), "chunks[0]"),
    "too few checksums [IndexError]": (lambda b: entry(b, "w")["chunks"][0].update(checksums=[]), "checksums"),
    "a checksum of no hex": (lambda b: entry(b, "w")["chunks"][0].update(checksums=["xyz"]), "checksums"),
    "a file not listed": (lambda b: entry(b, "w")["chunks"][0].update(file="nowhere"), "is not the index of a file"),
    "a file index below zero": (lambda b: entry(b, "w")["chunks"][0].update(file=-1), "is not the index of a file"),
    "a file index that is a boolean": (lambda b: entry(b, "w")["chunks"][0].update(file=True),
                                       "is not the index of a file"),
    "a chunk object in version 4": (lambda b: entry(b, "w")["chunks"][0].pop("checksums"), "is not an array"),
    "chunk arrays in version 3": (lambda b: b.update(version=3, entries=compact(b)["entries"]), "is not an object"),
    "an alias of nothing [IndexError]": (lambda b: entry(b, "tied").update(alias_of=99), "alias_of"),
    "an alias of a value": (lambda b: entry(b, "tied").update(alias_of=b["entries"].index(entry(b, "opts"))),
                            "alias_of"),
    "a reference to nothing [IndexError]": (lambda b: b["tree"].update(w={"$ref": 99}), "tree"),
    "a reference elsewhere": (lambda b: b["tree"].update(w=b["tree"]["v"]), "tree"),
    "a key path of a set [TypeError]": (lambda b: entry(b, "w").update(path=[{"$set": []}]), "path"),
    "two entries at one path": (lambda b: entry(b, "v").update(path=["w"]), "same key path"),
    "a rank outside the world": (lambda b: entry(b, "w").update(rank=7), "rank"),
    "no entries [TypeError]": (lambda b: b.update(entries={}), "entries"),
    "a world of nobody": (lambda b: b.update(world_size=0), "world_size"),
    "a file of negative size": (lambda b: b["files"].update({next(iter(b["files"])): -1}), "files["),
    "a file of another generation": (lambda b: b.update(generation="abc-def"), "files["),
    "a version that is a boolean": (lambda b: b.update(version=True), "version"),
    "a time that is not a number": (lambda b: b.update(created="noon"), "created"),
    "a time after the year 9999 [ValueError in ls and inspect]": (lambda b: b.update(created=1e16), "created"),
    "a header checksum of no file": (lambda b: b["headers"].update(nowhere="0" * 16), "headers"),
    "an unknown checksum algorithm": (lambda b: b.update(checksum="crc32"), "checksum"),
}


# the entry each lie is in, where it is not w (None: in no entry, so a read of one entry goes through)
LIE_IN = {case: "opts" for case, (change, _) in HOSTILE.items() if "set_value" in change.__code__.co_names}
LIE_IN.update({"a boolean offset": "v", "an alias of nothing [IndexError]": "tied", "an alias of a value": "tied",
               "a reference to nothing [IndexError]": None, "a reference elsewhere": None})


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_malformed_manifest_is_refused_at_open_naming_the_field(ck, case):
    change, named = HOSTILE[case]
    rewrite(ck, change)
    assert_refused(ck, named, read=LIE_IN.get(case, "w"))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_manifest_of_an_older_version_reads_as_it_always_did(ck, version):
    """Before version 4 a chunk was an object naming its data file: such checkpoints still
    open, read one entry, load, verify and inspect exactly."""
    def older(body):
        body["version"] = version  # the chunks stay objects (see hostile.write_body)
        if version < 3:
            del body["refs"]  # no "refs" before version 3

    rewrite(ck, older)
    assert b'"file":' in (ck / MANIFEST).read_bytes()
    assert torch.equal(read_one(ck, "w"), state(0)["w"])
    out = zs.load(target(), ck)
    assert all(torch.equal(out[k], v) for k, v in state(0).items() if isinstance(v, torch.Tensor))
    assert zs.verify(ck) > 0 and cli_outcome("inspect", str(ck))[0] == 0


def test_a_tensor_subclass_whose_inner_tensor_is_another_attributes_is_refused(tmp_path):
    """A TwoTensor whose ``a`` refers to the entry stored for ``b``: every checksum holds, and a
    load filled ``a`` with ``b``'s values (found by the fuzzer)."""
    from torch.testing._internal.two_tensor import TwoTensor

    two = TwoTensor(torch.arange(6.0).reshape(2, 3), -torch.arange(6.0).reshape(2, 3))
    zs.save({"two": two}, tmp_path / "ck")

    def change(body):
        b = next(i for i, e in enumerate(body["entries"]) if e["fqn"] == "two.b")
        entry(body, "two")["shards"][0]["inner"]["a"]["entry"] = b

    rewrite(tmp_path / "ck", change)
    with zs.open(tmp_path / "ck") as ck, pytest.raises(zs.CorruptCheckpointError, match="stored for another attribute"):
        ck.entries  # the entries are checked when first used


@pytest.mark.parametrize("box,fault", [
    ({"sizes": [1 << 40, 3]}, "is not inside the tensor's shape"),  # allocated before anything was checked
    ({"sizes": [-1, 3]}, "is not inside the tensor's shape"),  # a RuntimeError (negative dimension)
    ({"offsets": [1, 0]}, "is not inside the tensor's shape"),
    ({"offsets": [float("inf"), 0]}, "are not all integers"),  # an OverflowError
    ({"sizes": [2.0, 3]}, "are not all integers")])
def test_a_tensor_subclass_shard_outside_its_tensor_is_refused_when_opened_and_by_verify(tmp_path, box, fault):
    """A subclass shard's box was never checked against the entry's shape: a load allocated the
    forged box (or failed untyped), and verify said the checkpoint was sound."""
    from torch.testing._internal.two_tensor import TwoTensor

    zs.save({"two": TwoTensor(torch.zeros(2, 3), torch.ones(2, 3))}, tmp_path / "ck")
    rewrite(tmp_path / "ck", lambda body: entry(body, "two")["shards"][0].update(box))
    with zs.open(tmp_path / "ck") as ck, pytest.raises(zs.CorruptCheckpointError, match=fault):
        ck.entries
    assert cli_outcome("verify", str(tmp_path / "ck"))[0] == 1


def test_reading_a_directory_in_place_of_a_data_file_is_refused(ck):
    """``Checkpoint.read`` let IsADirectoryError through."""
    for name in data_files(ck):
        os.remove(ck / name)
        os.mkdir(ck / name)
    assert_refused(ck, "directory", at_open=False)


def test_values_nested_as_deep_as_allowed_round_trip(tmp_path):
    """The depth limit refuses nothing a save accepts: a value and a state nested to the limit."""
    from zerostall.format.codec import MAX_DEPTH

    deep = nested(MAX_DEPTH - 1)  # inside the state's own dict: MAX_DEPTH containers
    zs.save({"t": torch.ones(2), "x": deep}, tmp_path / "ck", metadata={"m": nested(MAX_DEPTH - 1)})
    out = zs.load({"t": torch.zeros(2), "x": None}, tmp_path / "ck")
    assert out["x"] == deep
    with zs.open(tmp_path / "ck") as ck:
        assert ck.metadata["m"] == nested(MAX_DEPTH - 1)
    with pytest.raises(zs.UnsupportedValueError, match=f"more than {MAX_DEPTH}"):
        zs.save({"t": torch.ones(2)}, tmp_path / "ck2", metadata={"m": nested(MAX_DEPTH)})
    with pytest.raises(zs.UnsupportedValueError, match=f"more than {MAX_DEPTH}"):  # scalars at the bottom too
        zs.save({"t": torch.ones(2), "x": nested(MAX_DEPTH)}, tmp_path / "ck3")
    assert math.isfinite(zs.verify(tmp_path / "ck"))


def test_the_dtype_table_knows_every_torch_dtype():
    """The schema knows dtypes without importing torch (the CLI never does): its table must hold
    every dtype of this torch, with its item size."""
    from zerostall.format.tensor_check import ITEMSIZES

    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and not str(value).startswith("torch.q"):
            assert ITEMSIZES.get(str(value).removeprefix("torch.")) == value.itemsize, value


def test_the_cli_shows_a_key_that_is_no_valid_text(tmp_path):
    """A key may be any string, a lone surrogate too (it cannot be written as UTF-8): the CLI shows
    it escaped instead of failing on its own output (found by the fuzzer, with a manifest's fqn)."""
    zs.save({"\ud800": torch.ones(2), "w": torch.zeros(3)}, tmp_path / "ck")
    code, err, escaped = cli_outcome("inspect", tmp_path / "ck")
    assert code == 0 and escaped is None, (code, err, escaped)



def test_a_path_with_a_nul_byte_is_a_typed_error_naming_it(ck, tmp_path):
    """Every call raised a bare ValueError ("embedded null byte") naming no path, and the CLI said
    only that; no file name can hold a NUL byte, so it is a usage error: InvalidPathError (a
    ValueError still), the CLI's exit status 2."""
    bad = str(tmp_path / "new\0ck")
    calls = {"save": lambda: zs.save(state(), bad), "async_save": lambda: zs.async_save(state(), bad).result(),
             "load": lambda: zs.load(target(), bad), "open": lambda: zs.open(bad), "verify": lambda: zs.verify(bad),
             "manager": lambda: zs.CheckpointManager(bad), "export": lambda: zs.export(ck, bad)}
    for how, call in calls.items():
        with pytest.raises(zs.InvalidPathError, match="NUL byte") as refused:
            call()
        assert repr(bad) in str(refused.value) and isinstance(refused.value, ValueError), how
    for args in (("inspect", bad), ("verify", bad), ("ls", bad), ("cp", ck, bad), ("export", ck, bad),
                 ("diff", ck, bad)):
        code, err, escaped = cli_outcome(*args)
        assert code == 2 and escaped is None and repr(bad) in err, (args[0], code, err, escaped)
    assert sorted(os.listdir(tmp_path)) == ["ck", "other"]  # nothing written anywhere
    with pytest.raises(zs.InvalidPathError, match="no storage backend for gs://"):
        zs.open("gs://bucket/ck")


def test_an_entry_read_alone_that_holds_another_s_bytes_is_refused(tmp_path):
    """``a``'s chunk pointed at ``b``'s bytes in the same file, with ``b``'s checksums: every field
    of ``a`` is sane, so reading ``a`` alone also checks every chunk of the files it lies in (found
    by the fuzzer when reads first checked the entry alone)."""
    g = torch.Generator().manual_seed(0)
    zs.save({"a": torch.randn(64, generator=g), "b": torch.randn(64, generator=g)}, tmp_path / "ck", threads=1)

    def change(body):
        entry(body, "a")["chunks"][0] = dict(entry(body, "b")["chunks"][0])

    rewrite(tmp_path / "ck", change)
    with zs.open(tmp_path / "ck") as ck, pytest.raises(zs.CorruptCheckpointError, match="in two chunks"):
        ck.read("a")


def test_the_first_reads_check_their_entry_alone_and_then_every_entry_is_built(tmp_path):
    """A lie in one entry: the other entries read alone give their values; the lying one is
    refused, as are the entries, state and load; after the reads served alone, every entry is
    built (each read alone looks through all of them)."""
    saved = {f"t{n}": torch.full((4,), float(n)) for n in range(8)}
    zs.save(saved, tmp_path / "ck")
    rewrite(tmp_path / "ck", lambda body: entry(body, "t7").update(dtype="float33"))
    with zs.open(tmp_path / "ck") as ck:
        for n in range(4):
            assert torch.equal(ck.read(f"t{n}"), saved[f"t{n}"])
        assert "entries" not in ck.manifest.__dict__
        with pytest.raises(zs.CorruptCheckpointError, match="float33"):
            ck.read("t4")  # the fifth read builds every entry, and refuses the lie in t7
    with zs.open(tmp_path / "ck") as ck, pytest.raises(zs.CorruptCheckpointError, match="float33"):
        ck.read("t7")


def _guillotine(lo: list[int], hi: list[int], rng: random.Random, depth: int) -> list[tuple[list[int], list[int]]]:
    """A random tiling of the box [lo, hi): cut it along a random dimension, then each part again."""
    k = rng.randrange(len(lo))
    if depth == 0 or hi[k] - lo[k] < 2:
        return [(list(lo), [b - a for a, b in zip(lo, hi)])]
    at = rng.randrange(lo[k] + 1, hi[k])
    return (_guillotine(lo, [*hi[:k], at, *hi[k + 1:]], rng, depth - 1)
            + _guillotine([*lo[:k], at, *lo[k + 1:]], hi, rng, depth - 1))


def test_the_chunk_overlap_check_is_exact_and_linear_on_any_layout():
    """Chunks that are no grid were checked by a sweep that took quadratic time: a manifest of a
    few MB held open, verify and inspect for minutes. The check by corners must agree with painting
    every element, on tilings that are no grid and on layouts with as many elements that overlap."""
    from zerostall.format.tensor_check import _disjoint

    rng = random.Random(7)
    for case in range(300):
        shape = [rng.randrange(2, 7) for _ in range(rng.randrange(2, 4))]
        boxes = _guillotine([0] * len(shape), shape, rng, rng.randrange(1, 6))
        if case % 2 and len(boxes) > 1:  # move one box: the same number of elements, now overlapping or not
            o, s = boxes[rng.randrange(len(boxes))]
            k = rng.randrange(len(shape))
            o[k] = rng.randrange(0, shape[k] - s[k] + 1)
        painted = torch.zeros(shape, dtype=torch.int32)
        for o, s in boxes:
            painted[tuple(slice(a, a + n) for a, n in zip(o, s))] += 1
        if len(boxes) > 1:
            assert _disjoint(boxes, shape) == bool((painted == 1).all()), (shape, boxes)
    n = 20_000  # rows, and one row cut into strips: every row stays in view of the old sweep (hours of it)
    bricks = [([r, 0], [1, n]) for r in range(n)] + [([n, i], [1, 1]) for i in range(n)]
    assert _disjoint(bricks, [n + 1, n]) and not _disjoint([*bricks[:-1], ([n, 0], [1, 1])], [n + 1, n])


def test_a_manifest_member_given_twice_is_refused(tmp_path):
    """The head of a manifest kept a member's first value, the checked whole parse its last: with
    ``files`` and ``headers`` given twice, ``zs.verify`` checked other data files than the entries used."""
    zs.save({"a": torch.arange(1000.0), "b": torch.arange(1000.0) * 2}, tmp_path / "ck", threads=2)
    body = compact(read_body(tmp_path / "ck"))
    kept = list(body["files"])[:1]
    first = {**body, "files": {n: body["files"][n] for n in kept}, "headers": {n: body["headers"][n] for n in kept}}
    again = b"".join(b',"%s":%s' % (k.encode(), dump_json(body[k])) for k in ("files", "headers"))
    write_body(tmp_path / "ck", dump_json(first)[:-1] + again + b"}")  # the first one data file, then both
    with pytest.raises(zs.CorruptCheckpointError, match="gives files, headers twice"):
        with zs.open(tmp_path / "ck") as ck:
            ck.verify()
    with pytest.raises(zs.CorruptCheckpointError, match="twice"):
        zs.verify(tmp_path / "ck")
    text = dump_json(body)
    write_body(tmp_path / "ck", b'{"format":"zerostall",' + text[1:])  # twice among the leading members
    with pytest.raises(zs.CorruptCheckpointError, match="'format' appears twice"):
        zs.open(tmp_path / "ck").close()
