"""The user documentation stays true to the repository: every link in README.md and docs/*.md resolves (a file
inside the repository, and an #anchor that is a heading there), every python file they name exists, every
```python block compiles, every test docs/guarantees.md names exists, and bench/chart.py draws an SVG from the
benchmarks' JSON alone."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import unicodedata
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def split_fences(text: str) -> tuple[list[str], list[tuple[str, str, int]]]:
    """The lines outside fenced code blocks (a fenced line as an empty one, so numbers keep), and each block as
    ``(info string, code, line number of its opening fence)``."""
    prose, blocks = [], []
    fence, info, body, start = None, "", [], 0
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, info, body, start = m.group(1), m.group(2).strip(), [], number
            prose.append("")
        elif fence is not None and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                and not m.group(2).strip():
            blocks.append((info, "\n".join(body), start))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert fence is None, f"a code fence opened on line {start} is never closed"
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (no markup) lower-cased, punctuation dropped, spaces to hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading counts by its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, repeats numbered as GitHub numbers them (``x``, ``x-1``, ...)."""
    prose, _ = split_fences(path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for line in prose:
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of each markdown link and image outside code (fenced or inline)."""
    prose, _ = split_fences(path.read_text())
    return [(number, m.group(1)) for number, line in enumerate(prose, 1)
            for m in LINK.finditer(INLINE_CODE.sub("", line))]


def broken(path: Path, target: str, root: Path = ROOT) -> str | None:
    """Why a link from ``path`` does not resolve inside ``root``, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
        return "points outside the repository (the docs stand alone)"
    file, _, anchor = target.partition("#")
    dest = (path.parent / file).resolve() if file else path
    if not dest.is_relative_to(root):
        return "points outside the repository"
    if not dest.exists():
        return "no such file"
    if anchor:
        if dest.suffix != ".md":
            return "an anchor into a file that is not markdown"
        if anchor not in anchors(dest):
            return f"no heading with anchor #{anchor} in {dest.relative_to(root)}"
    return None


def test_the_slugs_are_github_s():
    assert slug("10. What a reader accepts") == "10-what-a-reader-accepts"
    assert slug("2.1 Tensor subclasses") == "21-tensor-subclasses"
    assert slug("On S3 (`s3://`)") == "on-s3-s3"
    assert slug("A training loop: `CheckpointManager`") == "a-training-loop-checkpointmanager"
    assert slug("Export and `torch.load`") == "export-and-torchload"


def test_the_link_checker_finds_what_is_broken(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n## Top\n\n```\n# not a heading\n[in code](gone.md)\n```\n"
                    "[ok](page.md#top-1) `[inline](gone.md)` [bad](gone.md) [no](page.md#not-a-heading) "
                    "[out](https://example.com) ![img](page.md)\n")
    assert anchors(page) == {"top", "top-1"}
    assert {t: broken(page, t, tmp_path) is None for _, t in links(page)} == {
        "page.md#top-1": True, "gone.md": False, "page.md#not-a-heading": False, "https://example.com": False,
        "page.md": True}


def test_every_link_in_the_readme_and_docs_resolves():
    assert len(PAGES) > 5
    bad = [f"{p.relative_to(ROOT)}:{line}: ({target}) {why}"
           for p in PAGES for line, target in links(p) if (why := broken(p, target))]
    assert not bad, "\n".join(bad)


def test_every_page_in_docs_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for _, t in links(ROOT / "README.md")}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages the README does not link: {orphans}"


def test_every_python_file_the_docs_name_exists():
    """A `` `folder/module.py` `` is a path from the repository or from src/zerostall/; a bare
    `` `module.py` `` is a file of that name somewhere in src/, tests/, bench/ or examples/."""
    names = {p.name for d in ("src", "tests", "bench", "examples") for p in (ROOT / d).rglob("*.py")}
    stale = []
    for page in PAGES:
        for name in re.findall(r"`([\w./-]+\.py)(?:::\w+)?`", page.read_text()):
            found = (ROOT / name).exists() or (ROOT / "src" / "zerostall" / name).exists() if "/" in name \
                else name in names
            if not found:
                stale.append(f"{page.relative_to(ROOT)}: {name}")
    assert not stale, f"the docs name files that do not exist: {stale}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_compiles(page):
    _, blocks = split_fences(page.read_text())
    for info, code, line in blocks:
        if info.split()[:1] == ["python"]:
            compile(code, f"{page.relative_to(ROOT)}:{line}", "exec")


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_chart_is_drawn_from_the_benchmarks_json_alone(monkeypatch):
    spec = importlib.util.spec_from_file_location("chart", ROOT / "bench" / "chart.py")
    chart = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "chart", chart)  # its dataclasses look their module up there
    spec.loader.exec_module(chart)
    save_load = {k: 1.0 for k in ("raw_write_gbps", "zerostall_save_gbps", "dcp_tuned_save_gbps", "dcp_save_gbps",
                                  "raw_read_gbps", "zerostall_load_gbps", "dcp_tuned_load_gbps", "dcp_load_gbps")}
    save_load |= {"state_bytes": 2**30, "n_tensors": 256, "dir": "/dev/shm", "reps": 7, "torch_version": "2.13.0"}
    async_save = {"zerostall_stall_s": 0.002, "dcp_default_stall_s": 0.5, "dcp_zero_overhead_stall_s": None,
                  "reps": 5}
    svg = chart.draw(chart.panels(save_load, async_save), chart.footnote(save_load, async_save, "2 cores"))
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "2.0 ms" in " ".join(texts) and "500.0 ms" in " ".join(texts)
    assert any(t.startswith("n/a") for t in texts)  # a contender that failed is said, not drawn as zero
    ET.parse(ROOT / "docs" / "chart.svg")  # the committed chart is well-formed


def named_tests(text: str) -> list[tuple[str, str]]:
    """``(file, test)`` for each `` `file.py::test` `` in ``text``; a bare `` `::test` `` is in the
    file named last before it."""
    found, current = [], None
    for file, test in re.findall(r"`(?:tests/)?(test_\w+\.py)?::(test_\w+)`", text):
        current = file or current
        assert current, f"{test} is named before any test file"
        found.append((current, test))
    return found


def test_every_test_the_guarantees_name_exists():
    text = (ROOT / "docs" / "guarantees.md").read_text()
    named = named_tests(text)
    assert len(named) > 20
    missing = []
    for file, test in named:
        path = ROOT / "tests" / file
        defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)} \
            if path.exists() else set()
        if test not in defined:
            missing.append(f"{file}::{test}")
    assert not missing, f"docs/guarantees.md names tests that do not exist: {missing}"
