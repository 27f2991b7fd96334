"""The retained record: what is left of a checkpoint that was deleted while other checkpoints of
its root still refer to some of its data files (docs/format.md §11). It lists those files with
their sizes and header checksums, in the manifest's checksum envelope, so a reader can tell them
from stray files."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError
from .envelope import checked_body
from .layout import FORMAT_NAME, data_file_parts, dump_json, enveloped, load_json
from .tensor_check import HEX16

RETAINED_NAME = "retained.json"
_MEMBER = "retained"


def retained_bytes(files: dict[str, int], headers: dict[str, str]) -> bytes:
    """The record of ``files`` (name -> size) kept with their ``headers`` checksums."""
    return enveloped(dump_json({"format": FORMAT_NAME, "files": files, "headers": headers}), _MEMBER)


def parse_retained(raw: bytes, where: str) -> tuple[dict[str, int], dict[str, str]]:
    """The files (name -> size) and header checksums a retained record lists, checked; a
    :class:`CorruptCheckpointError` when it fails its checksum or is malformed."""
    try:
        d: Any = load_json(checked_body(raw, where, _MEMBER))
    except (ValueError, RecursionError):
        d = None
    if not (isinstance(d, dict) and d.get("format") == FORMAT_NAME and isinstance(d.get("files"), dict)
            and isinstance(d.get("headers"), dict)):
        raise CorruptCheckpointError(f"{where} is not a zerostall retained record")
    for name, size in d["files"].items():
        if data_file_parts(name) is None or type(size) is not int or not 0 <= size < 1 << 63:
            raise CorruptCheckpointError(f"{where} is malformed: files[{name[:80]!r}]")
    for name, digest in d["headers"].items():
        if name not in d["files"] or type(digest) is not str or not HEX16.fullmatch(digest):
            raise CorruptCheckpointError(f"{where} is malformed: headers[{name[:80]!r}]")
    return d["files"], d["headers"]
