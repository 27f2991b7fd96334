"""Read a checkpoint's stored bytes and check them: chunk pieces block by block against the
manifest's checksums, memory maps, missing files; and the entry an alias stands for.

No tensors here, and so no torch: verifying a checkpoint (``zerostall verify``) reads through a
:class:`ChunkReader` alone; :class:`zerostall.loading.fetch.Fetcher` builds on it to fill tensors.
"""

from __future__ import annotations

import threading

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksums import BlockHasher, block_checksums, checksum, pieces
from ..format.layout import Chunk, Entry, Manifest
from ..storage import Storage
from ..storage.location import manifest_generation


def resolve(manifest: Manifest, entry: Entry, where: str) -> Entry:
    """The entry that ``entry`` stands for: itself, or the tensor (or tensor subclass) entry it aliases."""
    if entry.kind == "alias":
        entries = manifest.entries
        index = entry.alias_of
        if not isinstance(index, int) or not 0 <= index < len(entries) or entries[index].kind not in ("tensor",
                                                                                                       "subclass"):
            raise CorruptCheckpointError(f"entry {entry.fqn} aliases entry #{index}, which is not a tensor "
                                         f"entry of {where}")
        return entries[index]
    return entry


class ChunkReader:
    """Reads and checks the chunks of one checkpoint (its ``manifest`` on ``storage``); ``threads``:
    how many threads read it at once."""

    def __init__(self, storage: Storage, manifest: Manifest, threads: int) -> None:
        self.storage = storage
        self.manifest = manifest
        self.path = storage.location
        self.threads = threads
        self._maps: dict[str, memoryview | None] = {}
        self._scratch = threading.local()
        self._sizes: dict[str, int] = {}  # the actual sizes of the data files looked at
        self._listed = False  # whether _sizes holds the storage's listing (where a listing gives sizes)

    def where(self, name: str) -> str:
        """The checkpoint data file ``name`` lies in: this one, or (an incremental checkpoint's
        reference) the one beside it that holds the file."""
        tag = self.manifest.refs.get(name)
        return self.path if tag is None else f"{self.path} (it lies in {tag} beside it)"

    def close(self) -> None:
        """Release file handles and maps; what was read from a map stays valid."""
        self.storage.close()
        self._maps.clear()

    def map(self, name: str) -> memoryview | None:
        """A memory map of data file ``name`` where the storage offers one (kept for the session), else None."""
        if name not in self._maps:
            try:
                self._maps[name] = self.storage.memory_map(name)
            except FileNotFoundError:
                raise self.missing(name) from None
            except CheckpointError:  # not a regular file (UnsafeFileError)
                raise
            except OSError as exc:
                raise CheckpointError(f"reading {name} of {self.where(name)} failed: {exc}") from exc
        return self._maps[name]

    def check_sizes(self, entry: Entry) -> None:
        """Check that the chunks of ``entry`` lie inside their data files as they are (a file's
        size is looked up once per session), before memory is set aside for what the manifest
        claims they hold: a manifest may list any size."""
        for chunk in entry.chunks:
            size = self._sizes.get(chunk.file)
            if size is None:
                try:
                    if not self._listed:  # an object store lists every size in one request: no HEAD per file
                        self._listed = True
                        self._sizes.update(self.storage.sizes() or {})
                    size = self._sizes.get(chunk.file)
                    if size is None:
                        size = self._sizes[chunk.file] = self.storage.size(chunk.file)
                except FileNotFoundError:
                    raise self.missing(chunk.file, entry) from None
                except CheckpointError:
                    raise
                except OSError as exc:
                    raise CheckpointError(f"reading {chunk.file} of {self.where(chunk.file)} failed: {exc}") from exc
            if chunk.offset + chunk.nbytes > size:
                raise CorruptCheckpointError(f"data file {chunk.file} of {self.where(chunk.file)} is truncated: entry "
                                             f"{entry.fqn} lies past its end")

    def read_piece(self, entry: Entry, chunk: Chunk, lo: int, out: memoryview, verify: bool) -> None:
        """Read chunk bytes ``[lo, lo+len(out))``; when verifying (``lo`` is then block-aligned),
        hash each cache-sized piece right after reading it and check every block's checksum (from
        a remote storage: read all of ``out`` in one call, then check it). A foreign checkpoint's
        bytes carry no checksums: they are read unchecked."""
        verify = verify and self.manifest.foreign is None
        if not verify or self.storage.remote:
            self._read_raw(entry, chunk, lo, out)
            if verify:
                self.check_blocks(entry, chunk, lo, out)
            return
        self._check_count(entry, chunk)
        hasher = BlockHasher(self.manifest.block_size)
        for a, b in pieces(len(out), self.manifest.block_size):
            piece = out[a:b]
            self._read_raw(entry, chunk, lo + a, piece)
            hasher.update(piece)
        self.check_digests(entry, chunk, lo, len(out), hasher.finish())

    def _read_raw(self, entry: Entry, chunk: Chunk, lo: int, out: memoryview) -> None:
        self.read_range(chunk.file, chunk.offset + lo, out, entry)

    def read_range(self, name: str, offset: int, out: memoryview, entry: Entry | None = None) -> None:
        """Read bytes ``[offset, offset+len(out))`` of data file ``name`` (holding ``entry``, if
        given), unchecked; a failure is the error that names the file (and entry) at fault."""
        of = f" (entry {entry.fqn})" if entry is not None else ""
        try:
            self.storage.read_into(name, offset, out)
        except FileNotFoundError:
            raise self.missing(name, entry) from None
        except EOFError:
            raise CorruptCheckpointError(f"data file {name} of {self.where(name)} is truncated: it ends before byte "
                                         f"{offset + len(out)}{of}") from None
        except CheckpointError:  # not a regular file (UnsafeFileError)
            raise
        except OSError as exc:
            raise CheckpointError(f"reading {name} of {self.where(name)}{of} failed: {exc}") from exc

    def check_header(self, name: str, data: bytes | memoryview) -> None:
        """Check the safetensors header of data file ``name`` (its first bytes, ``data``) against the
        manifest's checksum (manifests before it had none)."""
        self.check_header_digest(name, checksum(data))

    def check_header_digest(self, name: str, digest: str) -> None:
        """Check the checksum of data file ``name``'s header, hashed as it arrived, against the manifest's."""
        expected = self.manifest.headers.get(name)
        if expected is not None and digest != expected:
            raise CorruptCheckpointError(f"the safetensors header of data file {name} is damaged (fails its "
                                         f"checksum) in {self.where(name)}")

    def missing(self, name: str, entry: Entry | None = None) -> CheckpointError:
        """The error for a data file that is gone: damage, unless the checkpoint changed under this
        session (a save into the same path replaced it, or it was deleted) - then it is not corrupt,
        and a script that deletes corrupt checkpoints must not delete the new one."""
        of = f" (entry {entry.fqn})" if entry is not None else ""
        foreign = self.manifest.foreign is not None  # no manifest of ours in place to compare with
        try:
            current = self.manifest.generation if foreign else manifest_generation(self.storage)
        except OSError as exc:
            return CheckpointError(f"data file {name}{of} of {self.path} is gone, and its manifest cannot be read "
                                   f"({exc}): the checkpoint may have changed, or the storage is failing; open it again")
        if current != self.manifest.generation:
            now = f"another save ({current}) replaced it" if current else "it was deleted: pruned by retention, or by hand"
            return CheckpointError(f"{self.path} changed while this read session was open ({now}): data file "
                                   f"{name}{of} is gone; open the checkpoint again")
        return CorruptCheckpointError(f"data file {name} of {self.where(name)} is missing{of}")

    def _check_count(self, entry: Entry, chunk: Chunk) -> None:
        expected = max(1, -(-chunk.nbytes // self.manifest.block_size))
        if len(chunk.checksums) != expected:
            raise CorruptCheckpointError(f"entry {entry.fqn} in {chunk.file}: {len(chunk.checksums)} checksums for "
                                         f"{expected} blocks")

    def check_digests(self, entry: Entry, chunk: Chunk, lo: int, length: int, digests: list[str]) -> None:
        """Compare the checksums of the blocks of chunk bytes ``[lo, lo+length)`` (``lo`` block-aligned)
        with the manifest's."""
        self._check_count(entry, chunk)
        block = self.manifest.block_size
        for n, digest in enumerate(digests):
            index = lo // block + n
            if digest != chunk.checksums[index]:
                first = chunk.offset + index * block
                raise CorruptCheckpointError(
                    f"checksum mismatch in {chunk.file} of {self.where(chunk.file)}: entry {entry.fqn}, block {index} "
                    f"(file bytes {first}-{first + min(block, lo + length - index * block)})")

    def check_blocks(self, entry: Entry, chunk: Chunk, lo: int, data: memoryview) -> None:
        """Check chunk bytes ``[lo, lo+len(data))`` already in memory (a memory map) against their
        checksums (none for a foreign checkpoint)."""
        if self.manifest.foreign:
            return
        self.check_digests(entry, chunk, lo, len(data), block_checksums(data, self.manifest.block_size))

    def scratch_view(self, n: int) -> memoryview:
        """This thread's reusable scratch bytes, ``n`` of them (reads that are only checked, not kept)."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._scratch.buf = bytearray(max(n, 1))
        return memoryview(buf)[:n]
