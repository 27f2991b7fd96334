"""``zerostall diff``: what differs between two checkpoints, entry by entry, reading tensors a slab
at a time so that checkpoints larger than memory compare too.

Exit status as for the ``diff`` tool: 0 equal within the tolerance, 1 different, 2 trouble (bad
usage, a checkpoint not found, unreadable or corrupt).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import click
from rich.table import Table

import zerostall as zs
from ..format import codec
from ..format.layout import Entry, Manifest
from ..loading.reader import resolve
from ..storage.location import few

from .common import (EXIT_STATUSES, Failure, USAGE, cli, clip, console, open_session, print_json, progress_bar,
                     reported_errors)

DIFFERENT = 1
SLAB_BYTES = 64 << 20  # of each side's tensor read and compared at a time


@dataclass
class Difference:
    """One entry that differs: how (``what``), each side's description, and for values the largest
    absolute and relative differences."""

    key: str
    what: str  # "dtype", "shape", "kind", "values", "value"
    a: str
    b: str
    max_abs: float | None = None
    max_rel: float | None = None


@dataclass
class Report:
    """The whole comparison."""

    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    compared: int = 0
    bytes_compared: int = 0

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differences)


def keyed(manifest: Manifest) -> dict[str, Entry]:
    """The user's entries by name (a rank-local one as ``name@rankN``); inner tensors of tensor
    subclasses are entries of their own, compared like any tensor. Entries whose dotted names
    coincide (the key ``"a.b"`` and ``a`` → ``b``) are named by their key paths instead, so that
    none hides another."""
    def name(entry: Entry, fqn: str) -> str:
        return fqn if entry.rank is None else f"{fqn}@rank{entry.rank}"

    names = Counter(name(entry, entry.fqn) for entry in manifest.entries)
    return {name(e, e.fqn) if names[name(e, e.fqn)] == 1 else name(e, "".join(f"[{k!r}]" for k in e.path)): e
            for e in manifest.entries}


def _common(a: zs.Checkpoint, b: zs.Checkpoint) -> Iterator[tuple[str, Entry, Entry]]:
    """The entries under a name in both checkpoints (what an alias stands for), in ``a``'s order."""
    left, right = keyed(a.manifest), keyed(b.manifest)
    for key in [k for k in left if k in right]:
        yield key, resolve(a.manifest, left[key], a.path), resolve(b.manifest, right[key], b.path)


def tensor_bytes(a: zs.Checkpoint, b: zs.Checkpoint) -> int:
    """The bytes :func:`compare` reads: both sides of every common tensor of one shape."""
    return sum(x.nbytes + y.nbytes for _, x, y in _common(a, b)
               if x.kind == y.kind == "tensor" and tuple(x.shape or ()) == tuple(y.shape or ()))


def compare(a: zs.Checkpoint, b: zs.Checkpoint, atol: float, rtol: float,
            progress: Callable[[int], None] | None = None) -> Report:
    """Compare checkpoint ``a`` with ``b``, entry by entry; ``progress(nbytes)`` as tensor bytes are read."""
    report = Report()
    left, right = keyed(a.manifest), keyed(b.manifest)
    report.only_in_a = sorted(set(left) - set(right))
    report.only_in_b = sorted(set(right) - set(left))
    for key, x, y in _common(a, b):
        report.compared += 1
        if x.kind != y.kind:
            report.differences.append(Difference(key, "kind", x.kind, y.kind))
        elif x.kind == "object":
            _compare_values(report, key, x, y)
        elif x.kind == "subclass":
            if (x.cls, x.dtype, x.shape) != (y.cls, y.dtype, y.shape):
                report.differences.append(Difference(key, "subclass", f"{x.cls} {x.dtype} {list(x.shape or ())}",
                                                     f"{y.cls} {y.dtype} {list(y.shape or ())}"))
        else:
            _compare_tensors(report, key, a, b, x, y, atol, rtol, progress)
    return report


def _compare_values(report: Report, key: str, x: Entry, y: Entry) -> None:
    """Python values are equal when their stored encodings are (the encoding is deterministic, and
    compares nested numpy arrays or tensors where ``==`` would not); decoded only to show them."""
    if x.value == y.value:
        return
    try:
        u, v = repr(codec.decode(x.value, where=key)), repr(codec.decode(y.value, where=key))
    except zs.CheckpointError:  # pickled: shown by their stored form, never unpickled
        u, v = repr(x.value), repr(y.value)
    report.differences.append(Difference(key, "value", clip(u), clip(v)))


def _compare_tensors(report: Report, key: str, a: zs.Checkpoint, b: zs.Checkpoint, x: Entry, y: Entry,
                     atol: float, rtol: float, progress: Callable[[int], None] | None) -> None:
    shape_x, shape_y = tuple(x.shape or ()), tuple(y.shape or ())
    if shape_x != shape_y:
        report.differences.append(Difference(key, "shape", f"{x.dtype} {list(shape_x)}", f"{y.dtype} {list(shape_y)}"))
        return
    import torch  # here: the other commands start without torch

    from ..format.boxes import flat_boxes

    numel = math.prod(shape_x)
    itemsize = max(x.torch_dtype.itemsize, y.torch_dtype.itemsize)
    step = max(1, SLAB_BYTES // max(1, itemsize))
    worst_abs = worst_rel = 0.0
    close = True
    for first in range(0, numel, step):
        for box in flat_boxes(shape_x, first, min(numel, first + step)):
            u, v = a.read(x.path if x.rank is None else key, box=box), b.read(y.path if y.rank is None else key, box=box)
            report.bytes_compared += u.nbytes + v.nbytes
            if progress is not None:
                progress(u.nbytes + v.nbytes)
            same, d_abs, d_rel = _slab_difference(torch, u, v, atol, rtol)
            close &= same
            worst_abs, worst_rel = max(worst_abs, d_abs), max(worst_rel, d_rel)
    if x.dtype != y.dtype:
        report.differences.append(Difference(key, "dtype", x.dtype or "", y.dtype or "", worst_abs, worst_rel))
    elif not close:
        report.differences.append(Difference(key, "values", f"{x.dtype} {list(shape_x)}", f"{y.dtype} {list(shape_y)}",
                                             worst_abs, worst_rel))


def _slab_difference(torch: Any, u: Any, v: Any, atol: float, rtol: float) -> tuple[bool, float, float]:
    """Whether two parts are equal within ``atol + rtol * |v|`` (NaNs equal where both are), and
    their largest absolute and relative differences."""
    if u.dtype == v.dtype and not (u.dtype.is_floating_point or u.dtype.is_complex):
        if torch.equal(u, v):
            return True, 0.0, 0.0
        p, q = u.to(torch.int64), v.to(torch.int64)  # subtracted exactly (float64 rounds ints past 2**53 alike)
        diff, scale = (p - q).abs().to(torch.float64), q.abs().to(torch.float64)
        same = (atol > 0 or rtol > 0) and bool((diff <= atol + rtol * scale).all())
        return same, float(diff.max()), float(torch.where(scale > 0, diff / scale, diff).max())
    else:
        wide = (u.to(torch.complex128), v.to(torch.complex128)) if u.dtype.is_complex or v.dtype.is_complex \
            else (u.to(torch.float64), v.to(torch.float64))
    p, q = wide
    equal = (p == q) | (torch.isnan(p) & torch.isnan(q))  # equal infinities, NaN on both sides
    diff = torch.where(equal, torch.zeros_like(p), p - q).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)  # NaN or inf on one side only
    scale = torch.nan_to_num(q.abs(), nan=0.0)
    rel = torch.where(scale > 0, diff / scale, torch.where(diff > 0, torch.full_like(diff, math.inf), diff))
    same = bool(((diff <= atol + rtol * scale) | equal).all())
    d_abs = float(diff.max()) if diff.numel() else 0.0
    d_rel = float(rel.max()) if rel.numel() else 0.0
    return same, d_abs, d_rel


@cli.command(epilog=EXIT_STATUSES)
@click.argument("a")
@click.argument("b")
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance of tensor values.")
@click.option("--rtol", type=float, default=0.0, show_default=True,
              help="Relative tolerance: values differ where |a - b| > atol + rtol * |b|.")
@click.option("--allow-pickle", is_flag=True, help="Read a PyTorch DCP checkpoint (its .metadata is a pickle, which "
                                                   "can run code: only one you trust).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def diff(a: str, b: str, atol: float, rtol: float, allow_pickle: bool, as_json: bool) -> None:
    """Compare checkpoints A and B (each a checkpoint, a root, ROOT/latest or ROOT/<step>, or a PyTorch
    DCP or Hugging Face safetensors checkpoint, read as it is): entries
    only in one, kind, dtype and shape changes, python values, and tensor values (largest absolute
    and relative difference), reading a slab at a time. A progress bar shows the bytes read (on a
    terminal, without --json).

    Exit status as for diff(1): 0 equal within the tolerance, 1 different, 2 trouble (a checkpoint
    not found, unreadable or corrupt)."""
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise Failure("--atol and --rtol must be numbers >= 0", USAGE)
    try:
        with reported_errors():
            with open_session(a, allow_pickle) as ck_a, open_session(b, allow_pickle) as ck_b, \
                    progress_bar(tensor_bytes(ck_a, ck_b), "comparing", quiet=as_json) as advance:
                for ck in (ck_a, ck_b):
                    if ck.manifest.left_out:  # a tensor not read would be compared as equal
                        raise zs.CheckpointError(f"{ck.path} has tensor item(s) zerostall cannot read in place "
                                                 f"({few(ck.manifest.left_out)}; the warnings above say why): "
                                                 "they cannot be compared")
                report = compare(ck_a, ck_b, atol, rtol, advance)
    except Failure as exc:
        exc.exit_code = USAGE  # trouble, as for diff(1): never mistaken for "different"
        raise
    if as_json:
        print_json({"a": ck_a.path, "b": ck_b.path, "equal": report.equal, "atol": atol, "rtol": rtol,
                    "compared": report.compared, "bytes_compared": report.bytes_compared,
                    "only_in_a": report.only_in_a, "only_in_b": report.only_in_b,
                    "differences": [vars(d) for d in report.differences]})
    else:
        _print(report, ck_a.path, ck_b.path)
    if not report.equal:
        sys.exit(DIFFERENT)


def _print(report: Report, a: str, b: str) -> None:
    out = console()
    if report.equal:
        out.print(f"equal: {report.compared} entries, {report.bytes_compared} bytes compared")
        return
    table = Table("entry", "difference", f"A ({a})", f"B ({b})", "max abs", "max rel", box=None)
    for key in report.only_in_a:
        table.add_row(key, "only in A", "", "", "", "")
    for key in report.only_in_b:
        table.add_row(key, "only in B", "", "", "", "")
    for d in report.differences:
        table.add_row(d.key, d.what, d.a, d.b, "" if d.max_abs is None else f"{d.max_abs:.4g}",
                      "" if d.max_rel is None else f"{d.max_rel:.4g}")
    out.print(table)
    out.print(f"different: {len(report.differences)} of {report.compared} common entries, "
              f"{len(report.only_in_a)} only in A, {len(report.only_in_b)} only in B")
