"""The one block-checksum routine: xxh3-64 of every fixed-size block of a chunk's bytes.

The writer, the reader and ``verify`` all hash through here, so they cannot disagree on what a
block is. Bytes that stream (a write, a read) are hashed in cache-sized pieces right next to the
copy that moves them, so memory is read once for both; bytes already in memory are hashed whole.
"""

from __future__ import annotations

from typing import Iterator

import xxhash

CACHE_PIECE = 512 << 10  # hashed and then copied (or read and then hashed) while still in the CPU cache


def checksum(data: bytes | memoryview) -> str:
    """The checksum of ``data`` in one piece (a block, a data file's header)."""
    return xxhash.xxh3_64_hexdigest(data)


def block_checksums(data: memoryview, block_size: int) -> list[str]:
    """The checksum of each ``block_size`` block of ``data`` (the last may be short; empty data has one)."""
    if len(data) <= block_size:
        return [checksum(data)]
    return [checksum(data[start:start + block_size]) for start in range(0, len(data), block_size)]


def pieces(n: int, block_size: int) -> Iterator[tuple[int, int]]:
    """Byte ranges ``[lo, hi)`` tiling ``[0, n)`` in cache-sized pieces that never straddle a block."""
    for start in range(0, n, block_size):
        end = min(start + block_size, n)
        for lo in range(start, end, CACHE_PIECE):
            yield lo, min(lo + CACHE_PIECE, end)


class BlockHasher:
    """Block checksums of bytes fed in order, in pieces of any size (those from :func:`pieces`
    never straddle a block; bytes that arrive as they come, over a network, may)."""

    __slots__ = ("block_size", "digests", "_hasher", "_filled")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.digests: list[str] = []
        self._hasher = xxhash.xxh3_64()
        self._filled = 0

    def update(self, piece: memoryview) -> None:
        """Hash the next piece of the stream, completing every block it reaches the end of."""
        while len(piece):
            take = min(len(piece), self.block_size - self._filled)
            self._hasher.update(piece[:take])
            self._filled += take
            piece = piece[take:]
            if self._filled == self.block_size:
                self.digests.append(self._hasher.hexdigest())
                self._hasher.reset()
                self._filled = 0

    def finish(self) -> list[str]:
        """The checksums of every block, the last short one included."""
        if self._filled or not self.digests:
            self.digests.append(self._hasher.hexdigest())
            self._filled = 0
        return self.digests
