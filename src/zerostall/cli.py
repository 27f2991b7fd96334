"""The ``zerostall`` command line: list, inspect and verify checkpoints.

Every command prints a human table by default and one JSON object with ``--json``. Errors are a
one-line message on stderr and an exit status (1: the checkpoint is incomplete or corrupt, 2: bad
usage or nothing found), never a traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.filesize import decimal as human_bytes
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Column, Table

import zerostall as zs
from zerostall.format import MANIFEST_NAME, Entry, file_generation
from zerostall.storage import storage_for

FAILED = 1
USAGE = 2
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
    except zs.CheckpointNotFoundError as exc:
        raise Failure(str(exc), USAGE) from exc
    except (zs.CheckpointError, OSError) as exc:
        raise Failure(str(exc) or type(exc).__name__) from exc
    except ValueError as exc:  # e.g. a URL scheme with no storage backend
        raise Failure(str(exc), USAGE) from exc


def console(*, stderr: bool = False) -> Console:
    """A rich console that prints text as is; off a terminal, wide enough that tables never wrap."""
    out = Console(stderr=stderr, markup=False, emoji=False, highlight=False)
    if not out.is_terminal:
        out.width = 1000
    return out


def print_json(obj: Any) -> None:
    """Print ``obj`` as one JSON document on stdout."""
    click.echo(json.dumps(obj, indent=2))


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
    """zerostall: list, inspect and verify checkpoints."""


# -- ls ----------------------------------------------------------------------------------------
@dataclass
class Listing:
    """One row of ``zerostall ls``."""

    name: str
    path: str
    status: str
    step: int | None = None
    bytes: int = 0
    created: float | None = None
    error: str | None = None


def looks_like_checkpoint(path: Path) -> bool:
    """Whether a directory holds a manifest or zerostall data files (committed or not)."""
    return any(n == MANIFEST_NAME or file_generation(n) for n in storage_for(path).list())


def describe(path: Path) -> Listing:
    """Read a checkpoint's manifest and classify it as committed, incomplete or corrupt."""
    listing = Listing(name=path.name, path=str(path), status="committed")
    try:
        with zs.open(path, verify=False) as ck:
            manifest = ck.manifest
    except zs.IncompleteCheckpointError:
        listing.status = "incomplete"
    except zs.CheckpointError as exc:
        listing.status, listing.error = "corrupt", str(exc)
    else:
        listing.step, listing.bytes, listing.created = manifest.step, manifest.total_bytes, manifest.created
        return listing
    storage = storage_for(path)
    listing.bytes = sum(storage.size(n) for n in storage.list() if file_generation(n))
    return listing


@cli.command()
@click.argument("root", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def ls(root: Path, as_json: bool) -> None:
    """List the checkpoints in ROOT (ROOT itself and its immediate subdirectories)."""
    if not root.is_dir():
        raise Failure(f"no such directory: {root}", USAGE)
    root = root.absolute()
    with reported_errors():
        candidates = [root] + sorted(p for p in root.iterdir() if p.is_dir())
        rows = [describe(p) for p in candidates if looks_like_checkpoint(p)]
    rows.sort(key=lambda r: (r.step is None, r.step or 0, r.name))
    if as_json:
        print_json({"root": str(root), "checkpoints": [asdict(r) for r in rows]})
        return
    if not rows:
        console(stderr=True).print(f"no checkpoints in {root}")
        return
    table = Table("name", Column("step", justify="right"), "status", Column("size", justify="right"), "created")
    for r in rows:
        status = r.status if r.error is None else f"{r.status}: {r.error}"
        step = "-" if r.step is None else str(r.step)
        table.add_row(r.name, step, status, human_bytes(r.bytes), format_time(r.created))
    console().print(table)


# -- inspect -----------------------------------------------------------------------------------
def entry_row(ck: zs.Checkpoint, entry: Entry) -> dict[str, Any]:
    """What ``inspect`` shows of one entry: kind, then dtype/shape/chunks/bytes, the value or the alias."""
    row: dict[str, Any] = {"fqn": entry.fqn, "kind": entry.kind}
    if entry.kind == "tensor":
        row.update(dtype=entry.dtype, shape=list(entry.shape or ()), chunks=len(entry.chunks), bytes=entry.nbytes)
    elif entry.kind == "alias":
        row["alias_of"] = ck.manifest.entries[entry.alias_of].fqn if entry.alias_of is not None else None
    else:
        try:
            row["value"] = repr(ck.read(entry.path))
        except zs.CheckpointError as exc:  # a pickled value: the CLI never unpickles
            row["value"] = f"<not decoded: {exc}>"
    return row


@cli.command()
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def inspect(ckpt: str, as_json: bool) -> None:
    """Show the header and the entries of the checkpoint CKPT."""
    with reported_errors(), zs.open(ckpt, verify=False) as ck:
        m = ck.manifest
        header = {"path": ck.path, "format_version": m.version, "generation": m.generation, "step": m.step,
                  "created": m.created, "world_size": m.world_size, "block_size": m.block_size,
                  "total_bytes": m.total_bytes, "files": len(m.files)}
        entries = [entry_row(ck, e) for e in m.entries]
    if as_json:
        print_json({**header, "entries": entries})
        return
    grid = Table.grid(padding=(0, 2))
    for key, value in header.items():
        if key == "created":
            value = format_time(value)
        elif key in ("total_bytes", "block_size"):
            value = f"{human_bytes(value)} ({value:,} bytes)"
        grid.add_row(key.replace("_", " "), "-" if value is None else str(value))
    table = Table("fqn", "kind", "dtype", "shape", Column("chunks", justify="right"),
                  Column("bytes", justify="right"), "value")
    for row in entries:
        value = f"= {row['alias_of']}" if "alias_of" in row else clip(row.get("value", ""))
        size = human_bytes(row["bytes"]) if "bytes" in row else ""
        table.add_row(row["fqn"], row["kind"], row.get("dtype", ""), str(row.get("shape", "")),
                      str(row.get("chunks", "")), size, value)
    out = console()
    out.print(grid)
    out.print(table)


# -- verify ------------------------------------------------------------------------------------
@cli.command()
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def verify(ckpt: str, as_json: bool) -> None:
    """Check every file size and block checksum of the checkpoint CKPT (exit 1 on any fault)."""
    start = time.perf_counter()
    with reported_errors():
        checked, faults, code = run_verify(ckpt, quiet=as_json)
    seconds = time.perf_counter() - start
    rate = checked / seconds / 1e9 if seconds > 0 else 0.0
    if as_json:
        print_json({"path": os.path.abspath(ckpt), "ok": not faults, "bytes_checked": checked,
                    "seconds": round(seconds, 6), "gb_per_s": round(rate, 3), "faults": faults})
    elif faults:
        err = console(stderr=True)
        err.print(f"FAILED {ckpt}: {len(faults)} fault(s)")
        for fault in faults:
            err.print(f"  - {fault}")
    else:
        console().print(f"OK {ckpt}: {human_bytes(checked)} checked in {seconds:.2f} s ({rate:.2f} GB/s)")
    if code:
        click.get_current_context().exit(code)


def run_verify(ckpt: str, *, quiet: bool) -> tuple[int, list[str], int]:
    """Verify with a progress bar; returns bytes checked, the faults found and the exit status."""
    try:
        with zs.open(ckpt) as ck:
            total = sum(c.nbytes for e in ck.manifest.entries if e.kind == "tensor" for c in e.chunks)
            with progress_bar(total, quiet=quiet) as advance:
                return ck.verify(progress=advance), [], 0
    except zs.CheckpointError as exc:
        faults = list(getattr(exc, "faults", None) or [str(exc)])
        return 0, faults, USAGE if isinstance(exc, zs.CheckpointNotFoundError) else FAILED


@contextmanager
def progress_bar(total: int, *, quiet: bool) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr (off with ``quiet`` or off a terminal); yields ``advance(n)``."""
    bar = Progress(TextColumn("verifying"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=Console(stderr=True),
                   disable=quiet or not sys.stderr.isatty(), transient=True)
    with bar:
        task = bar.add_task("verify", total=total)
        yield lambda n: bar.advance(task, n)


def main() -> None:
    """Entry point of the ``zerostall`` console script."""
    cli(prog_name="zerostall")
