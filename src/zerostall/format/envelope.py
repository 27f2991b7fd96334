"""A manifest's envelope, ``{"checksum": H, "manifest": BODY}``: the checksum checked byte for
byte, the body parsed whole or only its leading members (what listing and opening need)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from ..errors import CorruptCheckpointError
from .checksums import checksum
from . import layout
from .layout import FORMAT_NAME, REFS_VERSION, ManifestHead, load_json


def manifest_body(raw: bytes, where: str) -> Any:
    """The parsed body of the manifest ``raw`` (read from ``where``), once its checksum matches and
    it names this format in a version this reader knows; its fields are not checked yet."""
    try:
        d = load_json(checked_body(raw, where))
    except (ValueError, RecursionError) as exc:  # nesting deeper than any parser goes
        raise CorruptCheckpointError(f"manifest {where} is not valid JSON: {exc}") from exc
    _check_format(d, where)
    return d


def manifest_head_body(raw: bytes, where: str, *, headers: bool = False) -> dict[str, Any]:
    """The leading members of the manifest ``raw`` up to those :class:`ManifestHead` needs (the
    checksum is still checked over the whole body), as :func:`manifest_body` checks them; with
    ``headers``, the files' header checksums for sure (a manifest built from its head reads by them)."""
    wanted = {"format", *(f.name for f in dataclasses.fields(ManifestHead))} - {"headers", "refs"}  # read on the way
    try:
        text = checked_body(raw, where).decode()
        d = _leading_members(text, wanted)
        later = {"refs"} if type(d.get("version")) is int and d["version"] >= REFS_VERSION else set()
        later |= {"headers"} if headers else set()
        if not later <= d.keys():  # written after metadata (or, for headers, by a writer before they existed)
            d = _leading_members(text, wanted | later)
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"manifest {where} is not valid JSON: {exc}") from exc
    _check_format(d, where)
    return d


def checked_body(raw: bytes, where: str, member: str = "manifest") -> bytes:
    """The body inside ``{"checksum": H, MEMBER: BODY}`` (see :func:`~zerostall.format.layout.enveloped`),
    once its xxh3-64 matches H."""
    prefix, separator, suffix = b'{"checksum":"', b'","%s":' % member.encode(), b"}\n"
    head = len(prefix) + 16 + len(separator)
    body = raw[head:-len(suffix)]
    digest = raw[len(prefix):len(prefix) + 16]
    if (raw[:len(prefix)] != prefix or raw[len(prefix) + 16:head] != separator or not raw.endswith(suffix)
            or checksum(body).encode() != digest):
        raise CorruptCheckpointError(f"{member} {where} fails its checksum (damaged or not a zerostall {member})")
    return body


def _check_format(d: Any, where: str) -> None:
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where} is not a zerostall manifest")
    newest = layout.FORMAT_VERSION
    if type(d.get("version")) is not int or not 1 <= d["version"] <= newest:
        raise CorruptCheckpointError(
            f"manifest {where} has format version {d.get('version')}; this zerostall reads <= {newest}")


_SPACE = re.compile(r"[ \t\n\r]*")


def _leading_members(text: str, wanted: set[str]) -> dict[str, Any]:
    """The members of the JSON object ``text``, parsed in order until every key of ``wanted`` has
    been read (the rest is left unparsed). Raises ``ValueError`` on malformed input."""
    decode = json.JSONDecoder().raw_decode
    found: dict[str, Any] = {}
    at = _SPACE.match(text, 0).end()
    if text[at:at + 1] != "{":
        raise ValueError("the manifest body is not an object")
    at = _SPACE.match(text, at + 1).end()
    while not wanted <= found.keys() and text[at:at + 1] != "}":
        key, at = decode(text, at)
        at = _SPACE.match(text, at).end()
        if not isinstance(key, str) or text[at:at + 1] != ":":
            raise ValueError(f"expected a member name and ':' at character {at}")
        if key in found:
            raise ValueError(f"the member {key!r} appears twice")
        found[key], at = decode(text, _SPACE.match(text, at + 1).end())
        at = _SPACE.match(text, at).end()
        if text[at:at + 1] == ",":
            at = _SPACE.match(text, at + 1).end()
        elif text[at:at + 1] != "}":
            raise ValueError(f"expected ',' or '}}' at character {at}")
    return found
