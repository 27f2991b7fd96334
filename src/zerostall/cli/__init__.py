"""The ``zerostall`` command line (also ``python -m zerostall``): ls, inspect, verify, prune, diff, cp, export,
import."""

from __future__ import annotations

from . import comparing, copying, exporting, importing, inspecting, listing  # noqa: F401  (each registers its commands)
from .common import cli

__all__ = ["cli", "main"]


def main() -> None:
    """Entry point of the ``zerostall`` console script."""
    cli(prog_name="zerostall")
