"""The README's chart: zerostall's save, load and asynchronous stall against PyTorch DCP and the raw rate, as an SVG.

    python bench/chart.py [--out docs/chart.svg] [--save-load FILE --async-save FILE] [--size-mb N]

Without FILE arguments it runs ``bench/save_load.py --json`` and ``bench/async_save.py --json`` (each at its
defaults: a 1 GiB state in /dev/shm; ``--size-mb`` is passed on to both) and reads the last line of each one's
output, the JSON object; with them it reads such output saved from earlier runs. It draws three panels from those
numbers and nothing else: save GB/s and load GB/s (raw rate, zerostall, DCP tuned, DCP default) and the time an
asynchronous save blocks the caller (zerostall, DCP default, DCP zero-overhead). The SVG is written by hand (no
plotting library); the footnote says what was measured where.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path

HERE = Path(__file__).resolve().parent
WIDTH = 760
LABEL_W = 210  # room for the bar labels left of the bars
VALUE_W = 90  # room for the value right of the longest bar
BAR_H, BAR_GAP, TITLE_H, PANEL_GAP = 20, 6, 30, 18
COLORS = {"zerostall": "#1f6fd1", "dcp": "#e0843a", "raw": "#9a9a9a"}


@dataclass
class Bar:
    label: str
    value: float | None  # None: the contender did not run (drawn as "n/a")
    kind: str  # a COLORS key


@dataclass
class Panel:
    title: str
    unit: str
    bars: list[Bar]
    digits: int = 2


def last_json_line(text: str, source: str) -> dict:
    """The JSON object a benchmark prints as its last stdout line."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{source}: no output")
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{source}: its last line is not a JSON object ({exc}); run it with --json") from exc


def run_benchmark(script: str, size_mb: int | None) -> dict:
    """Run ``bench/<script> --json`` (progress on this stderr) and return its JSON object."""
    cmd = [sys.executable, str(HERE / script), "--json"] + ([] if size_mb is None else ["--size-mb", str(size_mb)])
    print(f"running {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, cwd=HERE, stdout=subprocess.PIPE, text=True, check=True).stdout
    return last_json_line(out, script)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def panels(save_load: dict, async_save: dict) -> list[Panel]:
    """The three panels, from the two benchmarks' JSON objects."""
    s, a = save_load, async_save
    return [
        Panel("Save (GB/s, higher is better)", "GB/s", [
            Bar("raw write (the limit)", s["raw_write_gbps"], "raw"),
            Bar("zerostall zs.save", s["zerostall_save_gbps"], "zerostall"),
            Bar("DCP tuned", s["dcp_tuned_save_gbps"], "dcp"),
            Bar("DCP default", s["dcp_save_gbps"], "dcp"),
        ]),
        Panel("Load (GB/s, higher is better)", "GB/s", [
            Bar("raw read (the limit)", s["raw_read_gbps"], "raw"),
            Bar("zerostall zs.load, verified", s["zerostall_load_gbps"], "zerostall"),
            Bar("DCP tuned, unverified", s["dcp_tuned_load_gbps"], "dcp"),
            Bar("DCP default, unverified", s["dcp_load_gbps"], "dcp"),
        ]),
        Panel("Asynchronous save: caller blocked (ms, lower is better)", "ms", [
            Bar("zerostall AsyncSaver", ms(a["zerostall_stall_s"]), "zerostall"),
            Bar("DCP async_save default", ms(a["dcp_default_stall_s"]), "dcp"),
            Bar("DCP zero-overhead", ms(a["dcp_zero_overhead_stall_s"]), "dcp"),
        ], digits=1),
    ]


def footnote(save_load: dict, async_save: dict, machine: str) -> list[str]:
    gib = save_load["state_bytes"] / 2**30
    return [
        f"{machine}; torch {save_load['torch_version']}; a {gib:.0f} GiB state of {save_load['n_tensors']} CPU tensors "
        f"in {save_load['dir']}, fsync on;",
        f"medians of {save_load['reps']} interleaved reps (async: {async_save['reps']}); verified: every checksum "
        "block checked as it is read.",
        "Drawn by bench/chart.py from the JSON of bench/save_load.py and bench/async_save.py.",
    ]


def draw(ps: list[Panel], notes: list[str]) -> str:
    """The SVG text: one panel under the other, each bar scaled to its panel's largest value."""
    out: list[str] = []
    y = 10
    bar_area = WIDTH - LABEL_W - VALUE_W
    for p in ps:
        out.append(f'<text x="10" y="{y + 18}" class="title">{escape(p.title)}</text>')
        y += TITLE_H
        top = max((b.value for b in p.bars if b.value is not None), default=1.0) or 1.0
        for b in p.bars:
            out.append(f'<text x="{LABEL_W - 8}" y="{y + 15}" class="label">{escape(b.label)}</text>')
            if b.value is None:
                out.append(f'<text x="{LABEL_W + 4}" y="{y + 15}" class="value">n/a (failed; see its JSON)</text>')
            else:
                w = max(1.0, bar_area * b.value / top)
                out.append(f'<rect x="{LABEL_W}" y="{y}" width="{w:.1f}" height="{BAR_H}" fill="{COLORS[b.kind]}"/>')
                out.append(f'<text x="{LABEL_W + w + 6:.1f}" y="{y + 15}" class="value">'
                           f'{b.value:.{p.digits}f} {escape(p.unit)}</text>')
            y += BAR_H + BAR_GAP
        y += PANEL_GAP
    for note in notes:
        out.append(f'<text x="10" y="{y + 4}" class="note">{escape(note)}</text>')
        y += 16
    height = y + 6
    style = ("text{font-family:Helvetica,Arial,sans-serif;fill:#222}.title{font-size:15px;font-weight:bold}"
             ".label{font-size:13px;text-anchor:end}.value{font-size:13px}.note{font-size:11px;fill:#555}")
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img">',
        "<title>zerostall against PyTorch DCP and the raw rate: save, load, asynchronous stall</title>",
        f"<style>{style}</style>",
        f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        *out,
        "</svg>",
        "",
    ])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE.parent / "docs" / "chart.svg"), help="the SVG to write")
    parser.add_argument("--save-load", help="output of bench/save_load.py --json (else it is run)")
    parser.add_argument("--async-save", help="output of bench/async_save.py --json (else it is run)")
    parser.add_argument("--size-mb", type=int, help="state size passed on to the benchmarks it runs")
    parser.add_argument("--machine", default=f"{os.cpu_count()} cores, {platform.machine()}",
                        help="the machine, as the footnote names it")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    save_load = (last_json_line(Path(args.save_load).read_text(), args.save_load) if args.save_load
                 else run_benchmark("save_load.py", args.size_mb))
    async_save = (last_json_line(Path(args.async_save).read_text(), args.async_save) if args.async_save
                  else run_benchmark("async_save.py", args.size_mb))
    Path(args.out).write_text(draw(panels(save_load, async_save), footnote(save_load, async_save, args.machine)))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
