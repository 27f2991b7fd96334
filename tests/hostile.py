"""Hostile checkpoints, built from real ones: a manifest rewritten with lying contents under a
valid checksum envelope, data files swapped for links, FIFOs and directories, and the checks that
what zerostall does with them is safe (a typed error or an exact result, nothing read from outside
the checkpoint, no hang). Shared by tests/test_hostile.py and the fuzz runner tests/fuzz.py.
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import xxhash
from click.testing import CliRunner

import zerostall as zs
from zerostall.cli import cli
from zerostall.format.layout import CHUNK_FIELDS, dump_json, load_json

MANIFEST = "manifest.json"


def envelope(body: bytes) -> bytes:
    """A manifest file holding ``body`` whose checksum matches: ``{"checksum": H, "manifest": BODY}``."""
    return b'{"checksum":"%s","manifest":%s}\n' % (xxhash.xxh3_64_hexdigest(body).encode(), body)


def _tensor_entries(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    entries = body.get("entries")
    for e in entries if type(entries) is list else ():
        if type(e) is dict and e.get("kind") == "tensor" and type(e.get("chunks")) is list:
            yield e


def read_body(ckpt: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed body of the manifest of ``ckpt``, chunks as objects (see :func:`parse_body`)."""
    with open(os.path.join(ckpt, MANIFEST), "rb") as f:
        return parse_body(f.read())


def parse_body(manifest: bytes) -> dict[str, Any]:
    """The body of the manifest file ``manifest``, chunks as objects naming their file whatever
    the version (tests edit chunks by name; :func:`body_bytes` turns them back into arrays)."""
    body = load_json(manifest)["manifest"]
    if body.get("version", 0) >= 4:
        names = list(body["files"])
        for e in _tensor_entries(body):
            e["chunks"] = [dict(zip(CHUNK_FIELDS, c), file=names[c[2]]) for c in e["chunks"]]
    return body


def _as_array(c: Any, index: dict[str, int]) -> Any:
    """A chunk object as a version-4 array; a file not in ``files`` gets an index past its end,
    an object missing a field stays an object (both refused by a reader, naming the chunk)."""
    if type(c) is not dict or not set(CHUNK_FIELDS) <= c.keys():
        return c
    file = c["file"]
    return [c["offsets"], c["sizes"], index.get(file, len(index)) if type(file) is str else file,
            c["offset"], c["nbytes"], c["checksums"]]


def compact(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` (as :func:`parse_body` gives it) with its chunk objects turned into
    arrays where its version has them (4 on): the body a writer would have written."""
    if type(body.get("version")) is int and body["version"] >= 4 and type(body.get("files")) is dict:
        body = copy.deepcopy(body)
        index = {name: i for i, name in enumerate(body["files"])}
        for e in _tensor_entries(body):
            e["chunks"] = [_as_array(c, index) for c in e["chunks"]]
    return body


def body_bytes(body: dict[str, Any]) -> bytes:
    """A manifest file holding ``body`` (as :func:`parse_body` gives it) under a valid envelope."""
    return envelope(dump_json(compact(body)))


def write_body(ckpt: str | os.PathLike[str], body: dict[str, Any] | bytes) -> None:
    """Replace the manifest of ``ckpt`` by ``body`` (a dict as :func:`read_body` gives it, or raw
    JSON bytes) with a valid envelope."""
    data = envelope(body) if isinstance(body, bytes) else body_bytes(body)
    with open(os.path.join(ckpt, MANIFEST), "wb") as f:
        f.write(data)


def entry(body: dict[str, Any], fqn: str) -> dict[str, Any]:
    """The entry named ``fqn`` in a manifest body."""
    return next(e for e in body["entries"] if e["fqn"] == fqn)


def data_files(ckpt: str | os.PathLike[str]) -> list[str]:
    return sorted(n for n in os.listdir(ckpt) if n.endswith(".safetensors"))


# -- what was opened ------------------------------------------------------------------------------

_opened: list[str] | None = None
_lock = threading.Lock()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        with _lock:
            if _opened is not None:
                _opened.append(path)


sys.addaudithook(_audit)  # audit hooks stay for the process: recording is switched on by opened()


@contextmanager
def opened() -> Iterator[list[str]]:
    """Record the path of every file any thread of this process opens (``open``, ``os.open``)."""
    global _opened
    found: list[str] = []
    with _lock:
        _opened = found
    try:
        yield found
    finally:
        with _lock:
            _opened = None


def under(paths: list[str], *places: str | os.PathLike[str]) -> list[str]:
    """The ``paths`` that name ``places`` or files below them (``..`` resolved, links not followed)."""
    roots = [os.path.normpath(os.path.abspath(p)) for p in places]
    return [p for p in paths if any(os.path.normpath(os.path.abspath(p)) == r
                                    or os.path.normpath(os.path.abspath(p)).startswith(r + os.sep) for r in roots)]


# -- never a hang ---------------------------------------------------------------------------------

def within(seconds: float, call: Callable[[], Any], fifos: tuple[str, ...] = ()) -> tuple[bool, Any]:
    """Run ``call`` in a thread: ``(hung, outcome)``, where ``outcome`` is its result or the
    exception it raised. A call still running after ``seconds`` has hung: a reader blocked on one
    of the ``fifos`` is then released (a writer opens and closes it: end of file), so the suite
    goes on even when the protection is gone."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            outcome["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    hung = thread.is_alive()
    deadline = time.monotonic() + 30
    while thread.is_alive() and time.monotonic() < deadline:
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(0.05)
    return hung, outcome.get("value")


# -- the CLI --------------------------------------------------------------------------------------

def cli_outcome(*args: object) -> tuple[int, str, BaseException | None]:
    """Run ``zerostall ARGS`` in this process: (exit status, stderr, the exception that escaped
    the command if it was not a clean exit)."""
    result = CliRunner().invoke(cli, [str(a) for a in args])
    escaped = result.exception if result.exception is not None and not isinstance(result.exception, SystemExit) \
        else None
    return result.exit_code, result.stderr, escaped


def typed(value: Any) -> bool:
    """Whether ``value`` is a zerostall error (the outcome of a refused read)."""
    return isinstance(value, zs.CheckpointError)
