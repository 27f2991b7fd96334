"""``python -m zerostall``: the command line."""

from .cli import main

main()
