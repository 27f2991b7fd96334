"""``zerostall import``: convert a PyTorch DCP or Hugging Face safetensors checkpoint into a zerostall
one (with checksums), then check that every value reads back bit for bit."""

from __future__ import annotations

import time
from typing import Any

import click
from rich.filesize import decimal as human_bytes

import zerostall as zs
from ..format import codec
from ..storage import storage_for
from ..storage.location import few

from .common import (FAILED, USAGE, Failure, cli, console, open_session, print_json, progress_bar, refuse_live_writer,
                     reported_errors)


@cli.command(name="import")
@click.argument("src")
@click.argument("out")
@click.option("--allow-pickle", is_flag=True,
              help="Read a DCP checkpoint: its .metadata and non-tensor items are pickles, which can run code; "
                   "only for a checkpoint you trust. Values that need pickle are saved with pickle too.")
@click.option("--overwrite", is_flag=True, help="Replace a zerostall checkpoint already at OUT.")
@click.option("--force", is_flag=True, help="Write even while a manager holds the writer lease of OUT's directory.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def import_(src: str, out: str, allow_pickle: bool, overwrite: bool, force: bool, as_json: bool) -> None:
    """Convert SRC (a PyTorch DCP checkpoint directory, a Hugging Face safetensors directory with or
    without model.safetensors.index.json, or one .safetensors file) into the zerostall checkpoint OUT,
    with checksums, then read every value back from OUT and compare it bit for bit with the value saved.

    The conversion is one zs.save of the source's state, each value read once: tensors stored whole
    in one piece of a local file are memory-mapped, others (sharded DCP tensors) are held in memory
    until every value is checked.

    Exit status: 0 converted and every value checked equal; 1 the source is damaged, cannot be
    converted, or a value read back differs; 2 bad usage (nothing at SRC, a DCP checkpoint
    without --allow-pickle, a checkpoint at OUT without --overwrite). Refused while a manager holds
    the writer lease of OUT's directory (it alone writes there), unless --force."""
    start = time.perf_counter()
    with reported_errors():
        refuse_live_writer(storage_for(out).parent(), "importing", force)
        try:
            report = convert(src, out, allow_pickle=allow_pickle, overwrite=overwrite, quiet=as_json)
        except zs.CheckpointExistsError as exc:
            raise Failure(f"{exc} (pass --overwrite to replace it)", USAGE) from exc
    report["seconds"] = round(time.perf_counter() - start, 6)
    if as_json:
        print_json(report)
    elif report["differences"]:
        err = console(stderr=True)
        err.print(f"FAILED {out}: {len(report['differences'])} value(s) read back differ from {src}")
        for name in report["differences"][:20]:
            err.print(f"  - {name}")
    else:
        console().print(f"OK {report['source_kind']} {src} -> {out}: {report['tensors']} tensor(s), "
                        f"{report['values']} value(s), {human_bytes(report['bytes'])}, every value checked "
                        f"equal in {report['seconds']:.2f} s")
    if report["differences"]:
        click.get_current_context().exit(FAILED)


def convert(src: str, out: str, *, allow_pickle: bool, overwrite: bool, quiet: bool) -> dict[str, Any]:
    """Save the state of ``src`` at ``out``, then compare every entry saved with its copy read back
    from ``out``; a report."""
    import torch

    from ..state import flatten

    with open_session(src, allow_pickle) as source:
        kind = source.manifest.foreign or "zerostall"
        if source.manifest.left_out:  # an import holds the whole source, or nothing
            raise zs.CheckpointError(f"{src} has {len(source.manifest.left_out)} tensor item(s) zerostall cannot read "
                                     f"in place ({few(source.manifest.left_out)}; the warnings above say why); nothing "
                                     "was written")
        state = source.state()
        info = zs.save(state, out, allow_pickle=allow_pickle, overwrite=overwrite)
        saved = flatten(state).leaves  # what was saved by key path, each value as read once
        entries = [e for e in source.manifest.entries if e.kind in ("tensor", "object")]
        total = sum(e.nbytes for e in entries if e.kind == "tensor")
        differences = []
        with zs.open(out, allow_pickle=allow_pickle) as copy, progress_bar(total, "checking", quiet=quiet) as advance:
            for entry in entries:
                value = saved[entry.path] if entry.path in saved else source.read(entry.path)  # a subclass's part
                again = copy.read(entry.path)
                if entry.kind == "tensor":
                    same = (isinstance(again, torch.Tensor) and again.dtype == value.dtype
                            and again.shape == value.shape and _bits(again).equal(_bits(value)))
                    advance(entry.nbytes)
                else:
                    same = codec.encode(again, allow_pickle=True) == codec.encode(value, allow_pickle=True)
                if not same:
                    differences.append(entry.fqn)
    tensors = sum(e.kind == "tensor" for e in entries)
    return {"source": src, "source_kind": kind, "out": out, "tensors": tensors, "values": len(entries) - tensors,
            "bytes": total, "bytes_written": info.bytes_written, "differences": differences}


def _bits(t: Any) -> Any:
    """A tensor's values as raw bytes (so NaNs and -0.0 compare by their bits)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)
