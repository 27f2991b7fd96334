"""The retained record: what is left of a checkpoint that was deleted while other checkpoints of
its root still refer to some of its data files (docs/format.md §11). It lists those files with
their sizes and header checksums, under a checksum, so a reader can tell them from stray files."""

from __future__ import annotations

import re
from typing import Any

from ..errors import CorruptCheckpointError
from .checksums import checksum
from .layout import FORMAT_NAME, data_file_name, dump_json, load_json

RETAINED_NAME = "retained.json"

_PREFIX, _SEPARATOR, _SUFFIX = b'{"checksum":"', b'","retained":', b"}\n"
_DATA_FILE = re.compile(r"(?P<gen>[0-9a-f]{1,32}-[0-9a-f]{1,32})-r(?P<rank>\d{5,})-(?P<n>\d{3,})\.safetensors")
_HEX16 = re.compile(r"[0-9a-f]{16}")


def retained_bytes(files: dict[str, int], headers: dict[str, str]) -> bytes:
    """The record of ``files`` (name -> size) kept with their ``headers`` checksums."""
    body = dump_json({"format": FORMAT_NAME, "files": files, "headers": headers})
    return b"%s%s%s%s%s" % (_PREFIX, checksum(body).encode(), _SEPARATOR, body, _SUFFIX)


def parse_retained(raw: bytes, where: str) -> tuple[dict[str, int], dict[str, str]]:
    """The files (name -> size) and header checksums a retained record lists, checked; a
    :class:`CorruptCheckpointError` when it fails its checksum or is malformed."""
    head = len(_PREFIX) + 16 + len(_SEPARATOR)
    body = raw[head:-len(_SUFFIX)]
    if (raw[:len(_PREFIX)] != _PREFIX or raw[len(_PREFIX) + 16:head] != _SEPARATOR or not raw.endswith(_SUFFIX)
            or checksum(body).encode() != raw[len(_PREFIX):len(_PREFIX) + 16]):
        raise CorruptCheckpointError(f"{where} fails its checksum (damaged or not a zerostall retained record)")
    try:
        d: Any = load_json(body)
    except (ValueError, RecursionError):
        d = None
    if not (isinstance(d, dict) and d.get("format") == FORMAT_NAME and isinstance(d.get("files"), dict)
            and isinstance(d.get("headers"), dict)):
        raise CorruptCheckpointError(f"{where} is not a zerostall retained record")
    for name, size in d["files"].items():
        match = _DATA_FILE.fullmatch(name)
        if (not match or data_file_name(match["gen"], int(match["rank"]), int(match["n"])) != name
                or type(size) is not int or not 0 <= size < 1 << 63):
            raise CorruptCheckpointError(f"{where} is malformed: files[{name[:80]!r}]")
    for name, digest in d["headers"].items():
        if name not in d["files"] or type(digest) is not str or not _HEX16.fullmatch(digest):
            raise CorruptCheckpointError(f"{where} is malformed: headers[{name[:80]!r}]")
    return d["files"], d["headers"]
