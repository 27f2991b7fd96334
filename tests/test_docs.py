"""The user documentation stays true to the suite: every test docs/guarantees.md names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
