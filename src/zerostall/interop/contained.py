"""A self-contained manifest for the copy of an incremental checkpoint: the chunks it reads from
data files of other checkpoints of its root move into new data files of its own, so the copy
refers to nothing outside it (``zerostall cp``). Manifests and headers only: no I/O, no torch."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..format.checksums import checksum
from ..format.layout import FORMAT_NAME, Chunk, Entry, Manifest, data_file_name
from ..format.safetensors_file import FileItem, safetensors_header
from ..format.tensor_check import dtype_itemsize


@dataclass(frozen=True)
class Moved:
    """A data file of the copy holding chunks that the source reads from other checkpoints' files:
    its header (built here) and, by each chunk's offset in it, the source's chunk (where it is read
    from, and checked as)."""

    header: bytes
    origins: dict[int, Chunk]


def self_contained(manifest: Manifest) -> tuple[Manifest, dict[str, Moved]]:
    """``manifest`` without references: the chunks it reads from each file of another checkpoint
    go into a new data file of its generation (of that file's rank, numbered after the rank's own
    files), packed back to back in the order the format writes (descending element size, then as
    they lay), with their checksums, which cover the same bytes; and the new files' headers."""
    numbers: dict[int, int] = {}
    for name in manifest.files:
        if name not in manifest.refs:
            rank, index = _rank_index(name)
            numbers[rank] = max(numbers.get(rank, 0), index + 1)
    by_file: dict[str, list[tuple[int, int, int]]] = {}  # referenced file -> (entry index, chunk index, sort key)
    for i, entry in enumerate(manifest.entries):
        for j, chunk in enumerate(entry.chunks):
            if chunk.file in manifest.refs:
                by_file.setdefault(chunk.file, []).append((i, j, -(dtype_itemsize(entry.dtype) or 1)))
    chunks = {i: list(e.chunks) for i, e in enumerate(manifest.entries) if e.kind == "tensor"}
    files = {n: size for n, size in manifest.files.items() if n not in manifest.refs}
    headers = {n: digest for n, digest in manifest.headers.items() if n not in manifest.refs}
    moved: dict[str, Moved] = {}
    for old in sorted(by_file):
        placed = sorted(by_file[old], key=lambda p: (p[2], manifest.entries[p[0]].chunks[p[1]].offset))
        rank = _rank_index(old)[0]
        rank = rank if rank < manifest.world_size else 0
        name = data_file_name(manifest.generation, rank, numbers.get(rank, 0))
        numbers[rank] = numbers.get(rank, 0) + 1
        taken = {"__metadata__"}
        items = []
        for i, j, _ in placed:
            entry, chunk = manifest.entries[i], manifest.entries[i].chunks[j]
            items.append(FileItem(_unique(_item_name(entry, chunk), taken), str(entry.dtype), chunk.sizes,
                                  chunk.nbytes))
        header, offsets = safetensors_header(items, {"format": FORMAT_NAME, "generation": manifest.generation})
        origins = {}
        for (i, j, _), offset in zip(placed, offsets):
            chunk = chunks[i][j]
            chunks[i][j] = Chunk(chunk.offsets, chunk.sizes, name, offset, chunk.nbytes, list(chunk.checksums))
            if chunk.nbytes:  # an empty chunk is read from nowhere (another may start where it lies)
                origins[offset] = chunk
        files[name], headers[name] = len(header) + sum(i.nbytes for i in items), checksum(header)
        moved[name] = Moved(header, origins)
    entries = [replace(e, chunks=chunks[i]) if i in chunks else e for i, e in enumerate(manifest.entries)]
    return replace(manifest, entries=entries, files=files, headers=headers, refs={}, version=1), moved


def _rank_index(name: str) -> tuple[int, int]:
    """The rank and index of data file ``name`` (``<generation>-r<rank>-<index>.safetensors``, checked)."""
    rank, index = name.rsplit("-r", 1)[1].removesuffix(".safetensors").split("-")
    return int(rank), int(index)


def _item_name(entry: Entry, chunk: Chunk) -> str:
    """A chunk's name in a data file's header, as a save names it (format.md §3)."""
    name = entry.fqn if chunk.sizes == entry.shape else f"{entry.fqn}@{','.join(map(str, chunk.offsets))}"
    return name.encode("utf-8", "backslashreplace").decode()


def _unique(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "#"
    taken.add(name)
    return name
