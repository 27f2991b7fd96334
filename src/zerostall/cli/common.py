"""What every ``zerostall`` command shares: the command group, exit statuses, errors as one line,
the console, JSON and formatting helpers, progress bars, and opening a checkpoint.

Every command prints a human table by default and one JSON object with ``--json``. Errors are a
one-line message on stderr and an exit status (:data:`EXIT_STATUSES`, shown in every command's
``--help``), never a traceback.
"""

from __future__ import annotations

import io
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

import zerostall as zs
from ..format.layout import Manifest
from ..loading import foreign as sources
from ..loading.opening import named_manifest, read_manifest_bytes, read_manifest_from
from ..storage.references import linked
from ..roots.lease import live_holder
from ..roots.naming import Naming, named_instead
from ..roots.root import LEASE_NAME
from ..storage import Storage, storage_for

FAILED = 1  # a checkpoint is incomplete or corrupt, an operation failed, or the root is being written
USAGE = 2  # bad usage, nothing found, or a destination that holds a checkpoint already
UNVERIFIED = 3  # verify could not read some bytes (I/O error, permissions, changed meanwhile): not known damaged
EXIT_STATUSES = """\b
Exit status (every zerostall command):
  0  success (diff: the checkpoints are equal)
  1  a checkpoint is incomplete or corrupt, or the work failed (an I/O
     error, a root being written); diff: the checkpoints differ
  2  bad usage, nothing found, or a destination that already holds a
     checkpoint (no --overwrite); diff: any trouble at all
  3  verify could not read some bytes (not known to be damaged)"""
_REPR_WIDTH = 60


class Failure(click.ClickException):
    """An error shown as one line on stderr, with its own exit status."""

    def __init__(self, message: str, exit_code: int = FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@contextmanager
def reported_errors() -> Iterator[None]:
    """Turn library and file-system errors into a :class:`Failure` (a message, not a traceback)."""
    try:
        yield
    except (zs.CheckpointNotFoundError, zs.CheckpointExistsError, zs.InvalidPathError) as exc:
        raise Failure(str(exc), USAGE) from exc
    except (zs.CheckpointError, OSError) as exc:
        raise Failure(str(exc) or type(exc).__name__) from exc
    except (ValueError, ImportError) as exc:  # ImportError: an s3:// path without the s3 extra
        raise Failure(str(exc), USAGE) from exc


def console(*, stderr: bool = False) -> Console:
    """A rich console that prints text as is; off a terminal, wide enough that tables never wrap."""
    out = Console(stderr=stderr, markup=False, emoji=False, highlight=False)
    if not out.is_terminal:
        out.width = 1000
    return out


def print_json(obj: Any) -> None:
    """Print ``obj`` as one JSON document on stdout; JSON has no infinities or NaN, so those
    numbers are the strings ``"inf"``, ``"-inf"`` and ``"nan"``."""
    click.echo(json.dumps(_finite(obj), indent=2, allow_nan=False))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


@contextmanager
def progress_bar(total: int, label: str, *, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr, shown only on a terminal and never with ``quiet`` (``--json``);
    yields ``advance(nbytes)``, safe to call from worker threads."""
    bar = Progress(TextColumn(label), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True),
                   disable=quiet or not sys.stderr.isatty(), transient=True)
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def format_time(created: float | None) -> str:
    """A manifest timestamp (seconds since the epoch) as local time, to the second."""
    if created is None:
        return "-"
    return datetime.fromtimestamp(created).astimezone().isoformat(sep=" ", timespec="seconds")


def clip(text: str, width: int = _REPR_WIDTH) -> str:
    """``text`` cut to ``width`` characters."""
    return text if len(text) <= width else text[:width - 1] + "…"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(zs.__version__, prog_name="zerostall")
def cli() -> None:
    """zerostall: list, inspect, verify, compare, copy and prune checkpoints."""
    for stream in (sys.stdout, sys.stderr):  # a key may hold any string (a lone surrogate): shown escaped
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


@contextmanager
def pickle_refusal_as_usage(ckpt: str, allow_pickle: bool) -> Iterator[None]:
    """A PyTorch DCP checkpoint CKPT refused for want of ``--allow-pickle`` is bad usage, said in
    the command's words (looked into only then: a checkpoint read as it is costs no listing)."""
    try:
        yield
    except zs.UnsupportedValueError:
        storage, file = sources.split_file(ckpt)
        if not (allow_pickle or file) and storage.exists() and sources.kind_of(storage.list()) == sources.DCP:
            raise Failure(f"{ckpt} is a PyTorch DCP checkpoint: its .metadata and non-tensor items are pickles, "
                          "which can run code when read; pass --allow-pickle if you trust it", USAGE) from None
        raise


def open_session(ckpt: str, allow_pickle: bool) -> zs.Checkpoint:
    """``zs.open`` of what CKPT names (see :func:`open_checkpoint`), or of a foreign checkpoint
    read as it is."""
    with pickle_refusal_as_usage(ckpt, allow_pickle):
        return zs.open(ckpt, allow_pickle=allow_pickle)


def open_any(ckpt: str, allow_pickle: bool) -> tuple[Storage, Manifest]:
    """:func:`open_checkpoint`, or a foreign checkpoint (a PyTorch DCP directory, Hugging Face
    safetensors) as ``zs.open`` reads it: its storage and the manifest translated from it (no checksums)."""
    storage, file = sources.split_file(ckpt)
    with pickle_refusal_as_usage(ckpt, allow_pickle):
        return named_manifest(storage, Naming(ckpt), allow_pickle=allow_pickle, file=file)


def refuse_live_writer(root: Storage, doing: str, force: bool) -> None:
    """Stop a command that writes or deletes under ``root`` while a manager holds its writer lease
    (its retention and ``latest`` assume it alone writes there); with ``force``, warn and go on."""
    try:
        holder = live_holder(root)
    except zs.StorageError as exc:  # whether a manager writes there is unknown: taken for yes
        holder = {"host": "an unknown writer", "pid": f"? ({exc})"}
    if holder is None:
        return
    who = f"{holder.get('host')} pid {holder.get('pid')}"
    if not force:
        raise Failure(f"{root.location} is being written by {who} (live {LEASE_NAME}); stop that job first, "
                      "or pass --force")
    console(stderr=True).print(f"warning: {doing} while {who} holds the writer lease (--force)")


def read_committed(ckpt: str) -> tuple[Storage, bytes]:
    """The storage and the committed manifest's bytes of what CKPT names (see :func:`open_checkpoint`)."""
    storage = storage_for(ckpt)
    try:
        return storage, read_manifest_bytes(storage)  # CKPT read as it is first: no listing
    except zs.CheckpointNotFoundError:
        instead = named_instead(ckpt)
        if instead is None:
            raise
        return instead, read_manifest_bytes(instead)


def open_checkpoint(ckpt: str) -> tuple[Storage, Manifest]:
    """The storage and the committed manifest of what CKPT names: a checkpoint, a checkpoint root
    (its newest committed checkpoint), ``ROOT/latest`` (the same) or ``ROOT/<step>`` (the newest of
    that step). What ``zs.open`` and ``zs.open_latest`` read, without importing torch. Read-only:
    it works while a manager writes the root."""
    storage, raw = read_committed(ckpt)
    manifest = read_manifest_from(storage, raw)
    return linked(storage, manifest), manifest  # an incremental checkpoint reads its references where they lie
