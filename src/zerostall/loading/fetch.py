"""Fetch: move a checkpoint's bytes into target tensors, in parallel, verifying as they arrive.

A chunk that is exactly a target's box, with the target's dtype and a contiguous CPU layout, is
read straight into the target's memory; any other overlap (resharding, dtype conversion, GPU
targets) is read into a bounded per-thread staging buffer and copied from there: into a CPU
target while still in the CPU cache, into a GPU target by an asynchronous upload of the stored
bytes, converted and placed on the GPU (see :class:`_Uploads`). Reads of small tensors stored
back to back are merged into one scatter read; reader threads take the largest read left
when free, and the first failure stops the others.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

from ..devices import CallerStreams, on_stream
from ..errors import CorruptCheckpointError, StateMismatchError
from ..format.boxes import Box, BoxIndex, contiguous_strides, element_span, flat_boxes, intersect, region
from ..format.checksums import CACHE_PIECE
from ..format.layout import Chunk, Entry, Manifest
from ..memory import tensor_bytes
from ..storage import Storage
from .reader import ChunkReader

_PIECE_BYTES = 32 << 20  # the largest single read, in whole blocks
_STAGE_BYTES = 4 << 20  # a staged read: copied into its target while still in the CPU cache
MAX_ITEMSIZE = 16  # the largest element (complex128): staged reads are cut at multiples of every element size
Target = tuple[torch.Tensor, Box, Entry]  # a tensor, the box of the global tensor it holds, its entry
Piece = tuple[Entry, Chunk, int, memoryview]  # bytes [lo, lo + len(out)) of a chunk, to be read into out
Staged = tuple[torch.Tensor, Box, Entry, Chunk, Box]  # a target, its box, an entry, a chunk, their overlap
GridRequest = tuple[str, int, list[tuple[Piece, memoryview]]]  # a file, the offset of one read, the parts it fills
StageJob = tuple[torch.Tensor, Box, Entry, Chunk, Box, int, int]  # a Staged and chunk bytes [lo, hi) of it


class Fetcher(ChunkReader):
    """Reads the chunks of one checkpoint (its ``manifest`` on ``storage``) into tensors with ``threads`` threads."""

    def __init__(self, storage: Storage, manifest: Manifest, threads: int) -> None:
        super().__init__(storage, manifest, threads)
        block = manifest.block_size
        self._piece_step = max(block, _PIECE_BYTES // block * block)
        self._indexes: dict[int, tuple[Entry, BoxIndex]] = {}  # id of an entry of many chunks -> it (kept alive,
        # so that its id names no other: a deferred manifest builds an entry per read) and where its chunks lie

    def fill(self, targets: list[Target], verify: bool, staging: int,
             skip: set[tuple[int, int]] = frozenset()) -> None:
        """Copy into each target (a tensor holding ``box`` of its entry) the bytes of every chunk
        that intersects it, reading in parallel: straight into the target when a chunk is exactly
        the target's box and layouts match, through staging buffers otherwise. Chunks whose
        (target id, chunk id) pair is in ``skip`` were already delivered (by broadcast). A foreign checkpoint has no
        checksums to verify: reads then take only the bytes needed, not whole blocks."""
        verify = verify and self.manifest.foreign is None
        direct, staged = self._route(targets, skip)
        cuda = CallerStreams.of(item[0] for item in staged)  # a GPU target is never read into directly
        uploads = None if cuda is None else _Uploads(cuda)
        readers = max(self.threads, self.storage.requests_in_flight)  # waiting on requests costs no core
        try:
            with ThreadPoolExecutor(readers, thread_name_prefix="zerostall-read",
                                    initializer=None if cuda is None else cuda.enter) as pool:
                if self.storage.read_grid:
                    grid = _GridReads(self, direct, self.storage.read_grid)
                    run_largest_first(pool, readers, grid.read, grid.requests, verify)
                else:
                    run_largest_first(pool, readers, self._read_run, _runs(direct, _piece_span, CACHE_PIECE), verify)
                unit = math.lcm(self.manifest.block_size, MAX_ITEMSIZE)  # whole blocks and whole elements
                buffers = self.threads * (1 if uploads is None else _Uploads.BUFFERS)
                step = max(unit, min(_STAGE_BYTES, staging // buffers) // unit * unit)
                jobs = [job for item in staged for job in self._stage_jobs(item, step, verify)]
                stage = functools.partial(self._stage_run, uploads=uploads)
                run_largest_first(pool, self.threads, stage, _runs(jobs, _job_span, CACHE_PIECE), verify)
        finally:
            if cuda is not None:
                cuda.synchronize()  # every upload has landed (also after a failure: buffers are freed)
            self.storage.close()  # the files these threads held open: the next fill has new threads

    def _route(self, targets: list[Target], skip: set[tuple[int, int]]) -> tuple[list[Piece], list[Staged]]:
        """Split the reads for ``targets``: pieces that go straight into a target, and chunk parts
        that go through staging; raise if some part of a target has no stored bytes. Data file
        sizes are checked first where that costs no request: on an object store a read past an
        object's end fails with the same error (the targets are the caller's memory, staging is
        bounded), and a listing of every size would delay the first read."""
        direct: list[Piece] = []
        staged: list[Staged] = []
        for target, box, entry in targets:
            if not self.storage.remote:
                self.check_sizes(entry)
            covered = 0
            for chunk in self._overlapping(entry, box):
                inter = box if box == (chunk.offsets, chunk.sizes) else intersect(box, (chunk.offsets, chunk.sizes))
                if inter is None:
                    continue
                covered += math.prod(inter[1])
                if (id(target), id(chunk)) in skip:
                    continue
                if direct_read(target, box, entry, chunk):
                    direct.extend(self._pieces(entry, chunk, 0, tensor_bytes(target)))
                else:
                    staged.append((target, box, entry, chunk, inter))
            if covered < math.prod(box[1]):
                raise CorruptCheckpointError(f"entry {entry.fqn} of {self.path} has no data for part of the box "
                                             f"{[list(b) for b in box]}: its chunks do not cover the tensor")
        return direct, staged

    def _overlapping(self, entry: Entry, box: Box) -> list[Chunk]:
        """The chunks of ``entry`` that may overlap ``box`` (every one that does), in their order."""
        if len(entry.chunks) <= 2:
            return entry.chunks
        found = self._indexes.get(id(entry))
        if found is None:
            found = self._indexes[id(entry)] = (entry, BoxIndex([(c.offsets, c.sizes) for c in entry.chunks]))
        return [entry.chunks[i] for i in found[1].overlapping(box)]

    def read_bytes(self, entry: Entry, chunk: Chunk, lo: int, out: memoryview, verify: bool) -> None:
        """Read bytes ``[lo, lo+len(out))`` of ``chunk`` into ``out`` (``lo`` at a block)."""
        for piece in self._pieces(entry, chunk, lo, out):
            self.read_piece(*piece, verify)

    def _stage_jobs(self, item: Staged, step: int, verify: bool) -> list[StageJob]:
        """Split the stored bytes of ``item``'s intersection into reads of at most ``step`` bytes,
        whole blocks when verifying, each to be read, checked and copied by one thread."""
        target, box, entry, chunk, inter = item
        if math.prod(inter[1]) == 0:
            return []
        if inter == (chunk.offsets, chunk.sizes):  # the whole chunk (dtype conversion, other layouts)
            lo, hi = 0, chunk.nbytes
        else:
            itemsize = entry.torch_dtype.itemsize
            first, last = element_span((chunk.offsets, chunk.sizes), inter)
            lo, hi = first * itemsize, last * itemsize
            if verify:  # whole blocks, which also start and end at whole elements
                unit = math.lcm(self.manifest.block_size, itemsize)
                lo, hi = lo // unit * unit, min(-(-hi // unit) * unit, chunk.nbytes)
        return [(target, box, entry, chunk, inter, a, min(a + step, hi)) for a in range(lo, hi, step)]

    def _stage_run(self, run: list[StageJob], verify: bool, uploads: _Uploads | None = None) -> None:
        """Read jobs that lie back to back in one file into a staging buffer (one read for several
        small ones) and copy the part of each intersection they hold into its target: into a CPU
        target at once, while the bytes are in the CPU cache (the copies run in parallel whatever
        torch's own thread setting); into a GPU target by ``uploads``, without waiting."""
        uploading = uploads if uploads is not None and any(job[0].is_cuda for job in run) else None
        n = sum(hi - lo for *_, lo, hi in run)
        buf = self._staging(n) if uploading is None else uploading.staging(n)
        view, pieces, at = tensor_bytes(buf), [], 0
        for _, _, entry, chunk, _, lo, hi in run:
            pieces.append((entry, chunk, lo, view[at:at + hi - lo]))
            at += hi - lo
        self._read_run(pieces, verify)
        at = 0
        with torch.no_grad():
            for target, box, entry, chunk, inter, lo, hi in run:
                data = buf[at:at + hi - lo]
                dtype = entry.torch_dtype
                try:
                    if target.is_cuda:
                        assert uploading is not None
                        with uploading.on(target.device.index):
                            data = data.to(target.device, non_blocking=True)
                            copy_part(target, box, entry, chunk, inter, lo, data.view(dtype))
                    else:
                        data = data if at % dtype.itemsize == 0 else data.clone()  # elements start at elements
                        copy_part(target, box, entry, chunk, inter, lo, data.view(dtype))
                except (RuntimeError, NotImplementedError, TypeError) as exc:
                    if target.dtype == dtype or target.is_cuda and type(exc) is RuntimeError:
                        raise
                    raise StateMismatchError(f"entry {entry.fqn} of {self.path}: its {entry.dtype} values cannot be "
                                             f"converted to the target's {target.dtype}: {exc}") from exc
                at += hi - lo
        if uploading is not None:
            uploading.queued()

    def _staging(self, n: int) -> torch.Tensor:
        """This thread's reusable staging buffer of at least ``n`` bytes, for CPU targets."""
        buf = getattr(self._scratch, "staging", None)
        if buf is None or buf.numel() < n:
            buf = self._scratch.staging = torch.empty(n, dtype=torch.uint8)
        return buf

    def _pieces(self, entry: Entry, chunk: Chunk, lo: int, out: memoryview) -> list[Piece]:
        """Split a read of ``chunk`` bytes ``[lo, lo+len(out))`` into block-aligned pieces."""
        step = self._piece_step
        if len(out) <= step:
            return [(entry, chunk, lo, out)]
        return [(entry, chunk, lo + start, out[start:start + step]) for start in range(0, len(out), step)]

    def _read_run(self, run: list[Piece], verify: bool) -> None:
        """Read pieces that lie back to back in one file: one piece with the cache-sized hashing
        of :meth:`read_piece`, several with one scatter read and then their checks. If that read
        fails they are read one by one, so the error names the entry at fault."""
        if len(run) == 1:
            self.read_piece(*run[0], verify)
            return
        _, chunk, lo, _ = run[0]
        try:
            self.storage.read_into_many(chunk.file, chunk.offset + lo, [piece[3] for piece in run])
        except (OSError, EOFError):
            for piece in run:
                self.read_piece(*piece, verify)
            return
        if verify:
            for piece in run:
                self.check_blocks(*piece)

class _Uploads:
    """The GPU side of one fill. Each reader thread uploads staged bytes on a side stream per
    device (which first waits for the caller's work queued there, so a target the caller is still
    writing, zeroing say, is written after it) and does not wait for them: it reads the next run
    into the other of its two pinned staging buffers meanwhile, and reuses a buffer only once the
    uploads from it are done. The fill waits for all of them before it returns."""

    BUFFERS = 2  # staging buffers per thread

    def __init__(self, cuda: CallerStreams) -> None:
        self.cuda = cuda
        self._local = threading.local()

    def _thread(self) -> Any:
        local = self._local
        if not hasattr(local, "turn"):
            local.turn, local.streams, local.used = 0, {}, set()
            local.buffers = [None] * self.BUFFERS
            local.pending = [[] for _ in range(self.BUFFERS)]  # events after the uploads from each buffer
        return local

    def staging(self, n: int) -> torch.Tensor:
        """This thread's next pinned staging buffer, of at least ``n`` bytes, once the uploads
        queued from it are done."""
        local = self._thread()
        local.turn = (local.turn + 1) % self.BUFFERS
        for event in local.pending[local.turn]:
            event.synchronize()
        local.pending[local.turn] = []
        buf = local.buffers[local.turn]
        if buf is None or buf.numel() < n:
            buf = local.buffers[local.turn] = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return buf

    @contextlib.contextmanager
    def on(self, device: int) -> Iterator[None]:
        """Queue the block's work on this thread's side stream of ``device``."""
        local = self._thread()
        stream = local.streams.get(device)
        if stream is None:
            stream = local.streams[device] = self.cuda.side_stream(device)
        local.used.add(device)
        with on_stream(stream):
            yield

    def queued(self) -> None:
        """Mark the current staging buffer busy until the uploads queued from it are done."""
        local = self._thread()
        for device in local.used:
            event = torch.cuda.Event()
            event.record(local.streams[device])
            local.pending[local.turn].append(event)
        local.used = set()


def direct_read(target: torch.Tensor, box: Box, entry: Entry, chunk: Chunk) -> bool:
    """Whether ``chunk`` is exactly the target's ``box`` and its stored bytes can be read straight
    into the target's memory."""
    return (box == (chunk.offsets, chunk.sizes) and target.is_cpu
            and target.dtype == entry.torch_dtype and target.is_contiguous()
            and not target.is_conj() and not target.is_neg())


def copy_part(target: torch.Tensor, box: Box, entry: Entry, chunk: Chunk, inter: Box, lo: int,
               data: torch.Tensor) -> None:
    """Copy into ``target`` (holding ``box``) the elements of ``inter`` that lie in ``data``: the
    chunk's elements from byte ``lo`` on, as strided regions of the row-major chunk."""
    first = lo // data.itemsize
    if first == 0 and data.numel() == math.prod(chunk.sizes) and inter == (chunk.offsets, chunk.sizes):
        (target if inter == box else target[region(inter, box)]).copy_(data.view(chunk.sizes))
        return
    strides = contiguous_strides(chunk.sizes)
    local = (tuple(o - c for o, c in zip(inter[0], chunk.offsets)), inter[1])
    base = data.storage_offset() - first  # as_strided counts from the start of the storage
    for part in flat_boxes(chunk.sizes, first, first + data.numel()):
        sub = intersect(part, local)
        if sub is not None:
            src = data.as_strided(sub[1], strides, base + sum(o * s for o, s in zip(sub[0], strides)))
            target[region((tuple(o + c for o, c in zip(sub[0], chunk.offsets)), sub[1]), box)].copy_(src)


def run_largest_first(pool: ThreadPoolExecutor, threads: int, read: Callable[[list[Any], bool], None],
                 runs: list[tuple[list[Any], int]], verify: bool) -> None:
    """Call ``read`` on runs of work (with their byte counts) from ``threads`` threads, each taking
    the largest run left when it is free: a thread whose reads go slower (a slow request, a busy
    core) takes fewer, so all finish close together. Once one thread fails the others stop at
    their next run, so a bad block is reported without reading the rest of a large checkpoint;
    the failure is raised when they have stopped."""
    queue = collections.deque(run for run, _ in sorted(runs, key=lambda r: -r[1]))
    failed = threading.Event()

    def drain() -> None:
        try:
            while not failed.is_set():
                try:
                    run = queue.popleft()
                except IndexError:
                    return
                read(run, verify)
        except BaseException:
            failed.set()
            raise

    for fut in [pool.submit(drain) for _ in range(min(threads, len(runs)))]:
        fut.result()


def _runs(items: list[Any], span: Callable[[Any], tuple[str, int, int]], limit: int) -> list[tuple[list[Any], int]]:
    """Group items whose bytes (``span``: file, offset, length) lie back to back in one file into
    runs of at most ``limit`` bytes (with their byte counts), so many small tensors are read by one
    scatter read; larger items stay alone."""
    runs: list[tuple[list[Any], int]] = []
    run: list[Any] = []
    size = end = 0
    file = None
    for (name, start, n), item in sorted(((span(i), i) for i in items), key=lambda s: s[0][:2]):
        if run and start == end and name == file and size + n <= limit:
            run.append(item)
            size += n
        else:
            if run:
                runs.append((run, size))
            run, size, file = [item], n, name
        end = start + n
    if run:
        runs.append((run, size))
    return runs


class _GridReads:
    """Direct reads from a storage with a read grid (an object store): the pieces' bytes, file by
    file, cut into requests along the grid (one request per grid cell the pieces cover back to
    back), so every request but those at the ends of a span reads whole stored parts. A piece cut
    over several requests is checked by whichever reads its last part."""

    def __init__(self, fetcher: Fetcher, pieces: list[Piece], grid: int) -> None:
        self.fetcher = fetcher
        self.requests: list[tuple[GridRequest, int]] = []
        self._left: dict[int, int] = {}  # parts of each piece (by id) not yet read
        self._lock = threading.Lock()
        parts: list[tuple[Piece, memoryview]] = []
        file, first, end = "", 0, -1
        for (name, start, n), piece in sorted(((_piece_span(p), p) for p in pieces), key=lambda s: s[0][:2]):
            if not n:  # an empty tensor: no bytes to read, its checksum still checked
                self._left[id(piece)] = 1
                self.requests.append(((name, start, [(piece, piece[3])]), 0))
                continue
            at = 0
            while at < n:
                take = min(n - at, grid - (start + at) % grid)  # up to the file's next grid line
                if parts and (name != file or start + at != end or (start + at) % grid == 0):
                    self.requests.append(((file, first, parts), end - first))
                    parts = []
                if not parts:
                    first = start + at
                parts.append((piece, piece[3][at:at + take]))
                self._left[id(piece)] = self._left.get(id(piece), 0) + 1
                file, end, at = name, start + at + take, at + take
        if parts:
            self.requests.append(((file, first, parts), end - first))

    def read(self, request: GridRequest, verify: bool) -> None:
        """One request's bytes into its pieces; then check every piece it completed. If the read
        fails, each part is read alone, so the error names the entry at fault."""
        reader = self.fetcher
        file, start, parts = request
        try:
            reader.storage.read_into_many(file, start, [view for _, view in parts])
        except (OSError, EOFError):
            for (entry, *_), view in parts:
                reader.read_range(file, start, view, entry)
                start += len(view)
        with self._lock:
            done = []
            for piece, _ in parts:
                self._left[id(piece)] -= 1
                if not self._left[id(piece)]:
                    done.append(piece)
        if verify:
            for piece in done:
                reader.check_blocks(*piece)


def _piece_span(piece: Piece) -> tuple[str, int, int]:
    return piece[1].file, piece[1].offset + piece[2], len(piece[3])


def _job_span(job: StageJob) -> tuple[str, int, int]:
    return job[3].file, job[3].offset + job[5], job[6] - job[5]
