"""``zerostall inspect`` and ``zerostall verify``: one checkpoint's entries, and every checksum of it."""

from __future__ import annotations

import threading
import time
from typing import Any

import click
from rich.filesize import decimal as human_bytes
from rich.table import Column, Table

import zerostall as zs
from ..format import codec
from ..format.layout import Entry, Manifest
from ..loading.reader import ChunkReader
from ..loading.verification import verify_all
from ..options import default_threads
from ..storage import storage_for

from .common import (EXIT_STATUSES, FAILED, UNVERIFIED, USAGE, cli, clip, console, format_time, open_any,
                     open_checkpoint, print_json, progress_bar, reported_errors)


def entry_row(manifest: Manifest, entry: Entry) -> dict[str, Any]:
    """What ``inspect`` shows of one entry: kind, then dtype/shape/chunks/bytes, the value or the alias;
    a tensor subclass shows its class and boxes (its inner tensors are entries of their own)."""
    row: dict[str, Any] = {"fqn": entry.fqn, "kind": entry.kind}
    if entry.kind == "tensor":
        row.update(dtype=entry.dtype, shape=list(entry.shape or ()), chunks=len(entry.chunks), bytes=entry.nbytes)
        owner, entries = entry.inner_of, manifest.entries
        if owner is not None:
            row["inner_of"] = entries[owner].fqn if isinstance(owner, int) and 0 <= owner < len(entries) else owner
    elif entry.kind == "subclass":
        row.update(dtype=entry.dtype, shape=list(entry.shape or ()), chunks=len(entry.shards or ()), value=entry.cls)
    elif entry.kind == "alias":
        row["alias_of"] = manifest.entries[entry.alias_of].fqn if entry.alias_of is not None else None
    else:
        try:
            row["value"] = repr(codec.decode(entry.value, where=entry.fqn))
        except zs.CheckpointError as exc:  # a pickled value: the CLI never unpickles
            row["value"] = f"<not decoded: {exc}>"
    return row


@cli.command(epilog=EXIT_STATUSES)
@click.argument("ckpt")
@click.option("--allow-pickle", is_flag=True, help="Read a PyTorch DCP checkpoint (its .metadata is a pickle, which "
                                                   "can run code: only one you trust).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
def inspect(ckpt: str, allow_pickle: bool, as_json: bool) -> None:
    """Show the header and the entries of the checkpoint CKPT (a checkpoint, a root: its newest
    committed checkpoint, ROOT/latest or ROOT/<step>; or a PyTorch DCP or Hugging Face safetensors
    checkpoint, as zerostall reads it)."""
    with reported_errors():
        storage, m = open_any(ckpt, allow_pickle)
        header = {"path": storage.location, "format_version": m.version, "generation": m.generation, "step": m.step,
                  "created": m.created, "world_size": m.world_size, "block_size": m.block_size,
                  "total_bytes": m.total_bytes, "files": len(m.files),
                  **({"files_of_other_checkpoints": len(m.refs)} if m.refs else {})}
        if m.foreign:  # what a foreign checkpoint has: no zerostall version, generation, time or checksums
            header = {"path": storage.location, "foreign": m.foreign, "checksums": "none",
                      "total_bytes": m.total_bytes, "files": len(m.files), "left_out": ", ".join(m.left_out) or None}
        entries = [entry_row(m, e) for e in m.entries]
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
        value = f"= {row['alias_of']}" if "alias_of" in row else f"part of {row['inner_of']}" if "inner_of" in row \
            else clip(row.get("value", ""))
        size = human_bytes(row["bytes"]) if "bytes" in row else ""
        table.add_row(row["fqn"], row["kind"], row.get("dtype", ""), str(row.get("shape", "")),
                      str(row.get("chunks", "")), size, value)
    out = console()
    out.print(grid)
    out.print(table)


@cli.command(epilog=EXIT_STATUSES)
@click.argument("ckpt")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def verify(ckpt: str, as_json: bool) -> None:
    """Check every file size and checksum of the checkpoint CKPT (a checkpoint, a root: its newest
    committed checkpoint, ROOT/latest or ROOT/<step>): exit 1 if it is damaged or incomplete, 3 if
    some of it could not be read (not known to be damaged), 2 if there is none."""
    start = time.perf_counter()
    with reported_errors():
        path, checked, faults, code = run_verify(ckpt, quiet=as_json)
    seconds = time.perf_counter() - start
    rate = checked / seconds / 1e9 if seconds > 0 else 0.0
    if as_json:
        print_json({"path": path, "ok": not faults, "bytes_checked": checked,
                    "seconds": round(seconds, 6), "gb_per_s": round(rate, 3), "faults": faults})
    elif faults:
        err = console(stderr=True)
        label = {UNVERIFIED: "COULD NOT VERIFY", USAGE: "NOT VERIFIED"}.get(code, "FAILED")
        err.print(f"{label} {path}: {len(faults)} fault(s) "
                  f"({human_bytes(checked)} checked)")
        for fault in faults:
            err.print(f"  - {fault}")
    else:
        console().print(f"OK {path}: {human_bytes(checked)} checked in {seconds:.2f} s ({rate:.2f} GB/s)")
    if code:
        click.get_current_context().exit(code)


def run_verify(ckpt: str, *, quiet: bool) -> tuple[str, int, list[str], int]:
    """Verify with a progress bar; returns the checkpoint's location, the bytes checked (also when
    faults were found), the faults and the exit status."""
    path, checked, lock = storage_for(ckpt).location, 0, threading.Lock()

    def count(n: int) -> None:  # called from the verify threads
        nonlocal checked
        with lock:
            checked += n
        advance(n)

    try:
        storage, manifest = open_checkpoint(ckpt)
        path = storage.location
        total = sum(c.nbytes for e in manifest.entries if e.kind == "tensor" for c in e.chunks)
        reader = ChunkReader(storage, manifest, default_threads())
        try:
            with progress_bar(total, "verifying", quiet=quiet) as advance:
                verify_all(reader, allow_pickle=False, progress=count)
                return path, checked, [], 0
        finally:
            reader.close()
    except zs.CheckpointError as exc:
        faults = list(getattr(exc, "faults", None) or [str(exc)])
        if isinstance(exc, zs.CheckpointNotFoundError):
            return path, checked, faults, USAGE
        damaged = isinstance(exc, (zs.CorruptCheckpointError, zs.IncompleteCheckpointError))
        return path, checked, faults, FAILED if damaged else UNVERIFIED
