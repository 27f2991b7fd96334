"""The reads of :class:`~zerostall.storage.s3.S3Storage`: ranged GETs straight into the caller's
buffers, a large read split over parallel requests, a body that breaks off asked again for the rest."""

from __future__ import annotations

import http.client
from typing import Any, Callable

from ..errors import StorageError
from .base import FileTooLargeError
from .s3client import Connection, S3Options, error_code, runs_of


class S3Reads:
    """The read side of ``S3Storage`` (a mixin: the requests are its ``_call``, ``_key`` and
    ``_again_or_fail``)."""

    options: S3Options
    location: str
    read_grid: int
    _conn: Connection
    _call: Callable[..., Any]
    _key: Callable[[str], str]
    _again_or_fail: Callable[[str, int, BaseException], None]

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        """The whole object; with ``limit``, one GET of at most ``limit + 1`` bytes whose answer
        says the object's size, refused (``FileTooLargeError``) before its body is read."""
        if limit is None:
            return self._fetch(name, None)
        try:
            return self._fetch(name, f"bytes=0-{limit}", limit)
        except EOFError:
            return b""  # an empty object has no byte 0

    def read_head(self, name: str, n: int) -> bytes:
        try:
            return self._fetch(name, f"bytes=0-{n - 1}") if n > 0 else b""
        except EOFError:
            return b""  # an empty object has no byte 0

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.read_into_many(name, offset, [out])

    def read_into_many(self, name: str, offset: int, outs: list[memoryview]) -> None:
        """Parallel ranged GETs straight into ``outs``, which lie back to back from ``offset``: cut
        along the grid of whole parts (``read_grid``), at most ``concurrency`` requests' worth."""
        n = sum(len(o) for o in outs)
        part = self.read_grid
        step = part * max(1, -(-n // (part * self.options.concurrency)))  # each request costs client CPU
        runs = runs_of(outs, offset, step)
        if len(runs) == 1:
            self._get_into(name, offset, outs)
            return
        futures = [self._conn.pool.submit(self._get_into, name, offset + lo, views) for lo, views in runs]
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
            for f in futures:
                if not f.cancelled():
                    f.exception()  # no GET may write into ``outs`` after this returns

    def _open(self, name: str, byte_range: str | None, limit: int | None = None) -> dict[str, Any]:
        """The answer to a GET of ``name`` (of ``byte_range``), its body unread; EOFError if the
        range starts past its end, ``FileTooLargeError`` (unread) if the object is larger than ``limit``."""
        extra = {"Range": byte_range} if byte_range else {}
        try:
            answer = self._call(self._key(name), "reading", self._client.get_object, Key=self._key(name), **extra)
        except StorageError as exc:
            if error_code(exc.__cause__) in ("InvalidRange", "416"):
                raise EOFError(f"{self.location}/{name} ends before {byte_range}") from None
            raise
        if byte_range and not _answers(byte_range, answer):
            answer["Body"].close()
            raise StorageError(f"{self.location}/{name}: the server answered a GET of {byte_range} with "
                               f"{answer.get('ContentRange') or 'the whole object'}: it does not serve byte ranges, "
                               "which zerostall reads by; use a server (or gateway) that does")
        if limit is not None:
            size = int(str(answer.get("ContentRange", "")).rpartition("/")[2] or answer.get("ContentLength", 0))
            if size > limit:
                answer["Body"].close()
                raise FileTooLargeError(f"{self.location}/{name}", size, limit)
        return answer

    def _fetch(self, name: str, byte_range: str | None, limit: int | None = None) -> bytes:
        """A whole (small) body, asked again if the connection breaks in the middle."""
        from botocore.exceptions import BotoCoreError

        attempt = 0
        while True:
            body = self._open(name, byte_range, limit)["Body"]
            try:
                return body.read()
            except (BotoCoreError, ConnectionError, TimeoutError) as exc:
                attempt += 1
                self._again_or_fail(f"reading {self.location}/{name}", attempt, exc)
            finally:
                body.close()

    def _get_into(self, name: str, offset: int, outs: list[memoryview]) -> None:
        """One ranged GET read into ``outs`` in order; a connection that breaks mid-body (reset, or
        closed before the bytes its answer promised) is asked again for the rest."""
        from botocore.exceptions import BotoCoreError

        total = sum(len(o) for o in outs)
        pending = [o for o in outs if len(o)]
        done = attempt = 0
        while pending:
            answer = self._open(name, f"bytes={offset + done}-{offset + total - 1}")
            body, promised = answer["Body"], done + int(answer.get("ContentLength") or 0)
            readinto = socket_readinto(body)
            try:
                while pending:
                    got = readinto(pending[0])
                    if not got and done < promised:
                        raise ConnectionError(f"the connection closed {promised - done} bytes before the end "
                                              "of the answer")
                    if not got:
                        raise EOFError(f"{self.location}/{name} ends at byte {offset + done}, "
                                       f"expected {offset + total}")
                    done += got
                    pending[0] = pending[0][got:]
                    if not len(pending[0]):
                        pending.pop(0)
            except (BotoCoreError, ConnectionError, TimeoutError, http.client.HTTPException) as exc:
                attempt += 1
                self._again_or_fail(f"reading {self.location}/{name}", attempt, exc)
            finally:
                release(body)


def _answers(byte_range: str, answer: dict[str, Any]) -> bool:
    """Whether a GET's ``answer`` is what ``byte_range`` (``bytes=a-b``) asked: its Content-Range
    starts at ``a``; or it has none (a whole object) and ``a`` is 0 and the object no longer than asked."""
    start, _, end = byte_range.removeprefix("bytes=").partition("-")
    served = str(answer.get("ContentRange") or "")
    if served:
        return served.removeprefix("bytes ").partition("-")[0] == start
    length = answer.get("ContentLength")
    return start == "0" and length is not None and int(length) <= int(end) + 1


def socket_readinto(body: Any) -> Callable[[memoryview], int]:
    """The fastest ``readinto`` of a GET's body: http.client's own, which receives straight into
    the buffer (urllib3's reads into a new bytes object and copies it), where the body is plain
    bytes; else the body's."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if fp is None or not hasattr(fp, "readinto") or getattr(raw, "_decoder", None) is not None or \
            raw.headers.get("content-encoding", "identity") != "identity":
        return body.readinto
    return fp.readinto


def release(body: Any) -> None:
    """Close a GET's body; a connection whose answer was read to its end goes back to the pool."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if fp is not None and fp.isclosed():
        raw.release_conn()
    body.close()
