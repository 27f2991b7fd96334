"""A small HTTP proxy between an S3 client and a real server that fails a fraction of requests.

``FaultProxy(upstream, every=N, kinds=(...))`` listens on a free loopback port; every ``N``-th
request gets the next fault of ``kinds`` in turn, the others pass through unchanged (their bytes
and headers as sent, so signatures hold):

- ``"slowdown"``: answered ``503 SlowDown`` (throttling), not forwarded;
- ``"error"``: answered ``500 InternalError``, not forwarded;
- ``"reset"``: the connection reset (RST) once the request is read, not forwarded;
- ``"cut"``: a GET forwarded, then its answer cut off half-way through the body and the connection
  reset (another request's fault is a ``"reset"`` instead: only reads are safe to repeat blindly).
- ``"fin"``: a GET forwarded, then its answer cut off half-way through the body and the connection
  closed cleanly (FIN), as a server that goes away mid-answer or an idle timeout on the way does.
- ``"lost"``: forwarded (it takes effect), then the connection reset instead of the answer.
- ``"whole"``: a ranged GET of a key in ``objects`` answered ``200`` with that object's whole
  bytes, as a server that ignores ``Range`` does (other requests pass).

``when(method, path, headers)``, if given, picks the requests the schedule counts; the others always pass.
``script(method, path, headers)``, if given, replaces the schedule: it names each request's fault, or None.

``fired`` counts the faults of each kind that happened; the deterministic schedule makes every
retry of a failed request pass (it is not the ``N``-th).
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from collections import Counter
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

_ERRORS = {"slowdown": (503, "SlowDown", "Please reduce your request rate."),
           "error": (500, "InternalError", "We encountered an internal error. Please try again.")}
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


class FaultProxy:
    """A fault-injecting proxy in front of ``upstream`` (``http://host:port``); a context manager."""

    def __init__(self, upstream: str, every: int = 0, kinds: tuple[str, ...] = ("slowdown", "error", "reset", "cut"),
                 when: Callable[[str, str, Message], bool] | None = None,
                 script: Callable[[str, str, Message], str | None] | None = None) -> None:
        self.upstream = urlsplit(upstream).netloc
        self.every, self.kinds, self.when, self.script = every, kinds, when, script
        self.objects: dict[str, bytes] = {}  # request path -> the object's bytes, for "whole"
        self.fired: Counter[str] = Counter()
        self.requests = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="s3-fault-proxy", daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)

    def _next_fault(self, method: str, path: str, headers: Message) -> str | None:
        if self.script is not None:
            kind = self.script(method, path, headers)
            with self._lock:
                self.requests += 1
                if kind is not None:
                    self.fired[kind] += 1
            return kind
        if self.when is not None and not self.when(method, path, headers):
            return None
        with self._lock:
            self.requests += 1
            if self.requests % self.every:
                return None
            kind = self.kinds[(self.requests // self.every - 1) % len(self.kinds)]
            if kind in ("cut", "fin") and method != "GET":
                kind = "reset"
            self.fired[kind] += 1
            return kind

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        fault = self._next_fault(h.command, h.path, h.headers)
        if fault in _ERRORS:
            status, code, message = _ERRORS[fault]
            xml = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"
            _respond(h, status, [("Content-Type", "application/xml")], xml.encode())
            return
        if fault == "reset":
            _reset(h)
            return
        if fault == "whole" and h.command == "GET" and "Range" in h.headers and h.path in self.objects:
            _respond(h, 200, [("Content-Type", "binary/octet-stream")], self.objects[h.path])
            return
        conn = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            conn.putrequest(h.command, h.path, skip_host=True, skip_accept_encoding=True)
            for name, value in h.headers.items():
                if name.lower() not in _HOP:
                    conn.putheader(name, value)
            conn.endheaders(body or None)
            answer = conn.getresponse()
            data = answer.read()
            headers = [(k, v) for k, v in answer.getheaders() if k.lower() not in _HOP]
        finally:
            conn.close()
        if fault == "lost":
            _reset(h)
            return
        if fault in ("cut", "fin") and len(data) > 1:
            _respond(h, answer.status, headers, data[:len(data) // 2])  # Content-Length says all of it
            if fault == "cut":
                _reset(h)
            else:
                h.close_connection = True
            return
        _respond(h, answer.status, headers, data)


def _respond(h: BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
    """Send an answer; ``headers`` give its Content-Length when they have one (a HEAD's is the object's)."""
    h.send_response(status)
    for name, value in headers:
        h.send_header(name, value)
    if not any(name.lower() == "content-length" for name, _ in headers):
        h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)
    h.wfile.flush()


def _reset(h: BaseHTTPRequestHandler) -> None:
    """Close the client's connection with a TCP reset (linger 0), as a dropped connection looks."""
    h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    h.close_connection = True
    h.connection.close()
