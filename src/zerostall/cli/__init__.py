"""The ``zerostall`` command line (also ``python -m zerostall``): ls, inspect, verify, prune, diff, import."""

from __future__ import annotations

from . import comparing, importing, inspecting, listing  # noqa: F401  (each registers its commands on the group)
from .common import cli

__all__ = ["cli", "main"]


def main() -> None:
    """Entry point of the ``zerostall`` console script."""
    cli(prog_name="zerostall")
