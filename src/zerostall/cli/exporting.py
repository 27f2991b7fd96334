"""``zerostall export``: a checkpoint's model weights as Hugging Face safetensors files or one
``torch.load``-able file, consolidated from every rank and streamed (see ``zs.export``)."""

from __future__ import annotations

from typing import Any

import click

import zerostall as zs

from .common import (Failure, USAGE, cli, console, pickle_refusal_as_usage, print_json, progress_bar,
                     reported_errors)


@cli.command("export")
@click.argument("ckpt")
@click.argument("out")
@click.option("--format", "fmt", type=click.Choice(["hf", "torch"]), default="hf", show_default=True,
              help="hf: safetensors files in directory OUT (model.safetensors, or shards with "
                   "model.safetensors.index.json); torch: one file OUT for torch.load(OUT, weights_only=True).")
@click.option("--prefix", default=None, help="Export only the entries under this dotted prefix, with it stripped "
                                             "(model. exports the state_dict keys of a module saved as 'model').")
@click.option("--rename", multiple=True, metavar="REGEX=REPLACEMENT",
              help="Rename keys by re.sub, after the prefix; repeatable, applied in order (split at the last '=').")
@click.option("--dtype", default=None,
              help="Cast floating tensors to this dtype (bfloat16, float16, float32; bf16, fp16, fp32).")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="The most bytes of one hf file (5GB = 5*10^9, 256MiB = 256*2^20); a larger tensor gets its own.")
@click.option("--tied-weights-key", multiple=True, metavar="REGEX",
              help="hf: of keys tied to one tensor, leave out those matching (a transformers model's "
                   "_tied_weights_keys, as save_pretrained does); repeatable. Default: the first in save order "
                   "is written, the others left out (from_pretrained ties them back).")
@click.option("--overwrite", is_flag=True, help="Write into a non-empty OUT, replacing its model files (or the file).")
@click.option("--allow-pickle", is_flag=True, help="Read a PyTorch DCP checkpoint (its .metadata is a pickle, which "
                                                   "can run code: only one you trust).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a summary (and no bar or "
                                                     "start message).")
def export(ckpt: str, out: str, fmt: str, prefix: str | None, rename: tuple[str, ...], dtype: str | None,
           max_shard_size: str, tied_weights_key: tuple[str, ...], overwrite: bool, allow_pickle: bool,
           as_json: bool) -> None:
    """Export the tensors of CKPT (a checkpoint, a root: its newest, ROOT/latest or ROOT/<step>; or a
    PyTorch DCP or Hugging Face safetensors checkpoint, read as it is) to OUT, a local directory
    (--format hf) or file (--format torch). Entries that are not model weights (rank-local, python
    values, tensor subclasses) are skipped and listed. Tied weights (keys of one tensor) are written
    once, as save_pretrained writes them (--format torch: every key, over one storage). Every
    block's checksum is verified as it is read; files appear under their names only once complete.

    Exit status: 0 exported; 1 the checkpoint is incomplete, corrupt or unreadable, or writing
    failed; 2 bad usage (nothing found, a prefix that selects nothing, a rename collision, a
    non-empty OUT without --overwrite)."""
    if not as_json:  # the import below takes seconds: say the command has started (as the bar will, later)
        click.echo(f"starting the export of {ckpt} (loading torch)...", err=True)
    from ..interop import exporting  # torch: only this command needs it

    try:
        options = exporting.ExportOptions(format=fmt, prefix=prefix, rename=rename, dtype=dtype,
                                          max_shard_size=max_shard_size, tied_weights_keys=tied_weights_key,
                                          overwrite=overwrite, allow_pickle=allow_pickle)
    except ValueError as exc:
        raise Failure(str(exc), USAGE) from exc
    try:
        with reported_errors():
            target = exporting.check_target(out, options)
            with pickle_refusal_as_usage(ckpt, allow_pickle), exporting.opened(ckpt, options) as ck:
                selection = exporting.select(ck.manifest, ck.path, options)
                with progress_bar(selection.nbytes, "export", quiet=as_json) as advance:
                    info = exporting.write_selection(ck, selection, target, options, progress=advance)
                location = ck.path
    except Failure as exc:
        if isinstance(exc.__cause__, (zs.ExportError, zs.CheckpointExistsError)):
            exc.exit_code = USAGE
        raise
    _report(info, location, as_json)


def _report(info: Any, source: str, as_json: bool) -> None:
    if as_json:
        print_json({"checkpoint": source, "out": info.path, "format": info.format, "files": info.files,
                    "tensors": len(info.keys), "bytes": info.bytes, "keys": info.keys, "skipped": info.skipped,
                    "tied": info.tied})
        return
    out = console()
    out.print(f"exported {len(info.keys)} tensors ({info.bytes} bytes) from {source} to {info.path}: "
              f"{len(info.files)} file(s)")
    if info.skipped:
        out.print(f"skipped {len(info.skipped)} entries that are not model weights: {', '.join(info.skipped)}")
    if info.tied:
        how = "left out (from_pretrained ties them back)" if info.format == "hf" else "sharing its storage"
        out.print(f"tied weights, {how}: {', '.join(f'{k} -> {v}' for k, v in info.tied.items())}")
