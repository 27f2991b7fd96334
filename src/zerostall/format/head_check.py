"""A manifest's head: the fields before ``tree`` and ``entries``, which listing reads alone
(generation, time, step, world, block size, the data files with their sizes, header checksums and
references, the metadata), checked against what the format allows (docs/format.md §10)."""

from __future__ import annotations

import re
from typing import Any

from .layout import HEADERS_VERSION, REFS_VERSION, data_file_parts
from .tensor_check import HEX16, MAX_INT, FieldError, clip, field, int_field
from .value_check import check_value

MAX_BLOCK_SIZE = 1 << 30  # bytes per checksum block: a reader holds a block (per thread) to check it

_GENERATION = re.compile(r"[0-9a-f]{1,32}-[0-9a-f]{1,32}")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")  # a checkpoint's tag under its root (see roots.root)
_YEAR_10000 = 253402300800  # seconds since the epoch


def check_head(d: dict[str, Any]) -> None:
    """The fields before ``tree`` and ``entries``: what a listing reads."""
    generation = field(d, "generation", str)
    if not _GENERATION.fullmatch(generation):
        raise FieldError("generation", f"{clip(generation)} is not a generation id")
    created = field(d, "created", (int, float))
    if not 0 <= created < _YEAR_10000:  # NaN too
        raise FieldError("created", f"{created!r} is not a time (seconds since 1970, before the year 10000)")
    step = field(d, "step", (int, type(None)))
    if step is not None:
        int_field(step, "step", -MAX_INT)
    world = int_field(field(d, "world_size", int), "world_size", 1)
    int_field(field(d, "block_size", int), "block_size", 1, MAX_BLOCK_SIZE)
    if d.get("checksum", "xxh3_64") != "xxh3_64":
        raise FieldError("checksum", f"{clip(d['checksum'])} is not the checksum algorithm this zerostall knows "
                                     "(xxh3_64)")
    files = field(d, "files", dict)
    refs = _checked_refs(d, files)
    for name, size in files.items():
        if name in refs:
            _check_referenced_name(name, generation)
        else:
            _check_file_name(name, generation, world)
        int_field(size, f"files[{name!r}]")
    metadata = field(d, "metadata", dict)
    check_value(metadata, "metadata")
    if len(metadata) == 1 and next(iter(metadata)).startswith("$") and "$dict" not in metadata:
        raise FieldError("metadata", f"{clip(metadata)} is not an encoded dict")
    if "headers" in d or d["version"] >= HEADERS_VERSION:
        headers = field(d, "headers", dict)
        for name, digest in headers.items():
            if name not in files:
                raise FieldError(f"headers[{clip(name)}]", "not a file of the checkpoint (a key of files)")
            if type(digest) is not str or not HEX16.fullmatch(digest):
                raise FieldError(f"headers[{name!r}]", f"{clip(digest)} is not an xxh3-64 checksum (16 hex digits)")
        unchecked = [name for name in files if name not in headers] if d["version"] >= HEADERS_VERSION else []
        if unchecked:  # its header bytes would be under no checksum
            raise FieldError(f"headers[{clip(unchecked[0])}]", "missing: every data file's header has a checksum "
                                                               f"from format version {HEADERS_VERSION}")


def _checked_refs(d: dict[str, Any], files: dict[str, Any]) -> dict[str, str]:
    """``refs`` (format version 3 on): files of other checkpoints of the same root, each named with
    the plain tag of the checkpoint directory beside this one that holds it (never a path)."""
    if "refs" not in d:
        return {}
    if d["version"] < REFS_VERSION:
        raise FieldError("refs", f"needs format version {REFS_VERSION}, the manifest says {d['version']}")
    refs = field(d, "refs", dict)
    for name, tag in refs.items():
        if name not in files:
            raise FieldError(f"refs[{clip(name)}]", "not a file of the checkpoint (a key of files)")
        if type(tag) is not str or not _TAG.fullmatch(tag) or tag == "latest" or len(tag) > 255:
            raise FieldError(f"refs[{clip(name)}]", f"{clip(tag)} is not the tag of a checkpoint beside this one "
                                                    "(one plain name, not starting with '.')")
    return refs


def _check_referenced_name(name: str, generation: str) -> None:
    """A file of another checkpoint: a data file's name, of another generation."""
    parts = data_file_parts(name)
    if parts is None or parts[0] == generation:
        raise FieldError(f"files[{clip(name)}]", "not the name of a data file of another generation "
                                                 "(<generation>-r<rank>-<index>.safetensors)")


def _check_file_name(name: str, generation: str, world: int) -> None:
    """A data file's name: a plain name, ``<generation>-r<rank>-<index>.safetensors`` of this
    generation and of a rank of the world that wrote it (so nothing outside the checkpoint, and
    nothing of it but its data files, is ever read as data)."""
    parts = data_file_parts(name)
    if parts is None or parts[0] != generation or parts[1] >= world:
        raise FieldError(f"files[{clip(name)}]", f"not the name of a data file of generation {generation} written "
                                                 f"by one of {world} rank(s) (<generation>-r<rank>-<index>"
                                                 ".safetensors)")
