"""The write stage's byte streams: what a data file receives for each tensor, whatever its device."""

from __future__ import annotations

import gc
import re
import threading
from pathlib import Path

import pytest
import torch

import zerostall as zs
from zerostall.format.checksums import block_checksums, pieces
from zerostall import memory
from zerostall.memory import host_empty, owned_bytes, tensor_bytes
from zerostall.saving.write import device_pieces


@pytest.mark.parametrize("n, block, window", [(0, 64, 32), (1, 64, 32), (1000, 64, 100), (1 << 20, 4096, 3000),
                                              (3 << 20, 1 << 20, 1 << 20), (3 << 20, 1 << 21, 5 << 19)])
def test_device_pieces_stream_the_same_bytes_and_blocks_as_a_whole_copy(n, block, window):
    t = torch.randint(0, 256, (n,), dtype=torch.uint8)
    got = list(device_pieces(t, block, threading.Event(), window=window))
    assert [len(p) for p in got] == [hi - lo for lo, hi in pieces(n, block)]
    assert b"".join(bytes(p) for p in got) == bytes(tensor_bytes(t))


def test_device_pieces_of_a_wide_dtype_are_its_bytes():
    t = torch.randn(7, 33, dtype=torch.float64)
    data = b"".join(bytes(p) for p in device_pieces(t, 256, threading.Event(), window=1000))
    assert data == bytes(tensor_bytes(t)) and block_checksums(memoryview(data), 256) == block_checksums(
        tensor_bytes(t), 256)


def test_a_byte_view_of_a_temporary_owns_it():
    view = owned_bytes(torch.arange(1 << 16, dtype=torch.int32).clone())[4:12]
    gc.collect()
    noise = [torch.full((1 << 16,), -1, dtype=torch.int32) for _ in range(8)]  # would reuse freed memory
    assert bytes(view) == torch.tensor([1, 2], dtype=torch.int32).numpy().tobytes() and noise


def test_byte_views_refuse_tensors_off_the_host():
    for view in (tensor_bytes, owned_bytes):
        with pytest.raises(ValueError, match="needs a tensor in host memory, not on meta"):
            view(torch.empty(4, device="meta"))


def _huge_pages_on_advice() -> bool:
    """Linux with transparent huge pages given only where advised (so the advice is what gives them)."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return mode.exists() and "[madvise]" in mode.read_text()


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings overlapping ``t``'s memory, from /proc/self/smaps."""
    lo, hi, inside, kib = t.data_ptr(), t.data_ptr() + t.nbytes, False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) < hi and lo < int(span[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            kib += int(line.split()[1])
    return kib


@pytest.mark.skipif(not _huge_pages_on_advice(), reason="needs Linux with transparent huge pages in madvise mode")
def test_new_memory_for_a_bulk_fill_is_offered_huge_pages():
    t = host_empty((16, 1 << 20), torch.float32)
    t.fill_(1.0)
    plain = torch.empty((16, 1 << 20), dtype=torch.float32).fill_(1.0)
    assert t.shape == (16, 1 << 20) and t.dtype == torch.float32 and torch.equal(t, plain)
    assert _huge_kib(t) > 0 and _huge_kib(plain) == 0


@pytest.mark.skipif(not _huge_pages_on_advice(), reason="needs Linux with transparent huge pages in madvise mode")
def test_huge_pages_are_not_asked_for_when_turned_off(monkeypatch):
    monkeypatch.setenv("ZEROSTALL_HUGE_PAGES", "0")
    memory._advised.cache_clear()
    try:
        assert _huge_kib(host_empty(16 << 20).fill_(1)) == 0
    finally:
        memory._advised.cache_clear()


def _mapping_of(address: int) -> str | None:
    """The /proc/self/maps line of the mapping holding ``address``, or None."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line
    return None


@pytest.mark.skipif(not _huge_pages_on_advice(), reason="needs Linux with transparent huge pages in madvise mode")
def test_memory_offered_huge_pages_is_a_mapping_of_its_own_gone_with_the_tensor():
    """The advice must not outlive the tensor on memory the allocator hands out again (the heap)."""
    for size in (9 << 20, 31 << 20, 64 << 20):  # under and over glibc's largest mmap threshold
        freed = torch.empty(size + (1 << 20), dtype=torch.uint8)  # a freed large block raises the threshold
        del freed
        t = host_empty(size).fill_(7)
        ptr = t.data_ptr()
        assert ptr % (1 << 21) == 0 and "[heap]" not in _mapping_of(ptr)
        assert t.untyped_storage().nbytes() == size  # no padding: a torch.save of it writes its bytes alone
        with pytest.raises(RuntimeError):
            t.resize_(size + 1)
        view = t[5:9]
        del t
        gc.collect()
        assert _mapping_of(ptr) is not None and view.tolist() == [7] * 4  # a view keeps it
        del view
        gc.collect()
        assert _mapping_of(ptr) is None


def test_the_bytes_counted_before_a_save_are_at_least_those_it_writes(tmp_path):
    """What the free-space checks (the local tier's, DeepSpeed's) count: many small tensors, long
    key paths, large python values, a tensor of many blocks; each against the bytes written."""
    from zerostall.saving.estimate import bytes_needed
    from zerostall.state import flatten

    cases = {
        "small": {f"l{i}": torch.zeros(1) for i in range(3000)},
        "long names": {"state": {i: {"exp_avg_" + "x" * 200: torch.zeros(3, 2, 1)} for i in range(500)}},
        "values": {"config": {f"k{i}": list(range(20)) for i in range(2000)}, "t": torch.zeros(2)},
        "blocks": {"w": torch.zeros(9 << 20, dtype=torch.uint8)},
    }
    for name, state in cases.items():
        counted = bytes_needed(flatten(state).leaves, zs.SaveOptions().block_size, False, 1)
        zs.save(state, tmp_path / name)
        written = sum(max(p.stat().st_size, p.stat().st_blocks * 512) for p in (tmp_path / name).iterdir())
        assert counted >= written, (name, counted, written)


@pytest.mark.parametrize("fsync, answer", [(True, 0), (True, -1), (False, 0)])
def test_a_file_to_be_fsynced_has_its_write_back_started_as_it_is_written(tmp_path, monkeypatch, fsync, answer):
    """Every WRITEBACK_BYTES written, a file that will be fsynced asks the kernel to start writing
    those bytes out, range after range; a refusal turns the requests off for that file and the save
    goes on; without fsync none is made."""
    from zerostall.storage import vectored
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(vectored, "_SYNC_FILE_RANGE",
                        lambda fd, offset, n, flags: calls.append((offset, n)) or answer)
    state = {"w": torch.arange(9 << 20, dtype=torch.int32)}  # 36 MiB: one file, four full ranges
    zs.save(state, tmp_path / "ck", fsync=fsync, threads=1)
    assert torch.equal(zs.load({"w": torch.zeros_like(state["w"])}, tmp_path / "ck")["w"], state["w"])
    if not fsync:
        assert calls == []
    elif answer != 0:
        assert len(calls) == 1
    else:
        assert [offset for offset, _ in calls] == [sum(n for _, n in calls[:i]) for i in range(len(calls))]
        assert len(calls) == 4 and all(n >= vectored.WRITEBACK_BYTES for _, n in calls)
