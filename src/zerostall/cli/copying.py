"""``zerostall cp``: copy one checkpoint between local paths and ``s3://`` (any direction), every
block checked as it is read, the manifest written last; run again, it resumes."""

from __future__ import annotations

import click
from rich.filesize import decimal as human_bytes

from ..interop.copying import Source, copy
from ..storage import storage_for

from .common import (EXIT_STATUSES, cli, console, print_json, progress_bar, read_committed, refuse_live_writer,
                     reported_errors)


@cli.command(epilog=EXIT_STATUSES)
@click.argument("src")
@click.argument("dst")
@click.option("--overwrite", is_flag=True,
              help="Replace a committed checkpoint at DST (it stays readable until the copy commits).")
@click.option("--threads", type=click.IntRange(1, 64), default=None,
              help="Data files copied at once (default: one per core, 2 to 8).")
@click.option("--force", is_flag=True, help="Copy even while a manager holds the writer lease of DST's directory.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def cp(src: str, dst: str, overwrite: bool, threads: int | None, force: bool, as_json: bool) -> None:
    """Copy the checkpoint SRC (a checkpoint, a root: its newest committed checkpoint, ROOT/latest
    or ROOT/<step>) to the checkpoint path DST; either may be local or s3://bucket/prefix.

    Every block is checked against the manifest's checksums as it is read, before it is written,
    and the manifest is written last: a copy stopped at any point leaves no checkpoint at DST.
    Run the same command again to resume: a data file already at DST is kept when its size, its
    header's checksum and every block's checksum verify (read back from DST); any other file is
    copied again, and files of other checkpoints there are removed once the copy commits. A
    committed checkpoint at DST is refused unless --overwrite (and while other checkpoints beside
    it refer to its data). One checkpoint at a time: copy the steps of a root one by one
    (ROOT/<step> to DST_ROOT/<name>). The copy is self-contained: the data an incremental
    checkpoint refers to in other checkpoints of its root is copied into files of its own. A
    progress bar shows the bytes copied (on a terminal, without --json). Refused while a manager
    holds the writer lease of DST's directory (it alone writes there), unless --force."""
    with reported_errors():
        refuse_live_writer(storage_for(dst).parent(), "copying", force)
        source = Source.read(*read_committed(src))
        with progress_bar(sum(source.manifest.files.values()), "copying", quiet=as_json) as advance:
            info = copy(source, dst, overwrite=overwrite, threads=threads, progress=advance)
    if as_json:
        print_json({"source": info.source, "destination": info.destination, "generation": info.generation,
                    "files": info.files, "bytes": info.bytes, "skipped_files": info.skipped_files,
                    "skipped_bytes": info.skipped_bytes, "moved_files": info.moved_files,
                    "seconds": round(info.seconds, 6), "gb_per_s": round(info.gb_per_s, 3)})
        return
    kept = f"; {info.skipped_files} file(s), {human_bytes(info.skipped_bytes)}, already complete at the " \
        "destination, kept" if info.skipped_files else ""
    moved = f"; self-contained: {info.moved_files} of its file(s) hold the chunks it read from other " \
        "checkpoints" if info.moved_files else ""
    console().print(f"copied {info.source} -> {info.destination}: {info.files} file(s), "
                    f"{human_bytes(info.bytes)} in {info.seconds:.2f} s ({info.gb_per_s:.2f} GB/s){kept}{moved}")
