"""Open: read a checkpoint's committed manifest from storage, checked, the same one on every rank.

A checkpoint exists only once its manifest is published; data files without one are an
incomplete save. Listing reads only the manifest's head (step, time, metadata), never its entries.
A path that holds no checkpoint may name one instead (a root's newest: see
:class:`~zerostall.roots.naming.Naming`); which one is decided once, with the manifest. An
incremental checkpoint's referenced files are read where they lie, once each is checked to be a
data file that the checkpoint beside it owns, with the size and header checksum recorded.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from ..format.envelope import manifest_body
from ..format.layout import MANIFEST_NAME, Manifest, ManifestHead, dump_json, file_generation, load_json
from ..format.manifest_check import MANIFEST_BYTES_ENV, max_manifest_bytes, parse_deferred, parse_head, parse_manifest
from ..gcpause import gc_paused
from ..storage import FileTooLargeError, Storage
from ..storage.references import linked
from . import foreign

if TYPE_CHECKING:  # only passed through: reading a manifest needs no torch (the command line)
    from ..collectives import Group

_STORED = b'{"checksum":'  # how a stored manifest begins; one sent with marks (its tag, foreign kind) does not


class Instead(Protocol):
    """What a path holding no checkpoint names instead (implemented by :class:`~zerostall.roots.naming.Naming`)."""

    def tag(self) -> str | None:
        """The checkpoint named (a listing), or None when the path names none."""

    def child(self, tag: str) -> Storage:
        """The storage of checkpoint ``tag``."""


def read_manifest_bytes(storage: Storage) -> bytes:
    """The committed manifest's raw bytes at ``storage`` (at most :func:`max_manifest_bytes`), or
    the precise error for why there is none (the location is looked up only then: on an object
    store, each lookup is a request)."""
    limit = max_manifest_bytes()
    try:
        return storage.read_bytes(MANIFEST_NAME, limit)
    except FileTooLargeError as exc:
        raise CorruptCheckpointError(
            f"the manifest of {storage.location} has {exc.size} bytes, more than the {limit} zerostall reads "
            f"(if it is genuine, set {MANIFEST_BYTES_ENV} to read it)") from None
    except CorruptCheckpointError:  # a symbolic link, FIFO, device or directory in its place
        raise
    except (FileNotFoundError, NotADirectoryError):
        if not storage.exists():
            raise CheckpointNotFoundError(f"no checkpoint at {storage.location}") from None
        names = storage.list()
        data = [n for n in names if file_generation(n)]
        if not data:
            kind = foreign.kind_of(names)
            if kind is not None:
                raise CheckpointNotFoundError(
                    f"{storage.location} is {foreign.describe(kind)}, not a zerostall checkpoint: open it with "
                    "zs.open / zs.load (it carries no checksums), or convert it with `zerostall import`") from None
            found = f"; it holds {', '.join(names[:5])}" + (", …" if len(names) > 5 else "") if names else ""
            raise CheckpointNotFoundError(
                f"no checkpoint at {storage.location} (no manifest, no data files: neither a zerostall manifest.json, "
                f"a DCP .metadata nor *.safetensors files{found})") from None
        raise IncompleteCheckpointError(
            f"{storage.location} has no manifest: its save never committed "
            f"({len(data)} uncommitted data file(s) present)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read the manifest of {storage.location}: {exc}") from exc


def read_manifest_from(storage: Storage, raw: bytes, *, deferred: bool = False) -> Manifest:
    """The manifest ``raw`` read from ``storage``, checked (see
    :func:`~zerostall.format.manifest_check.parse_manifest`); ``deferred``: its entries and tree
    parsed and checked when first used (:func:`~zerostall.format.manifest_check.parse_deferred`)."""
    where = os.path.join(storage.location, MANIFEST_NAME)
    if deferred:
        return parse_deferred(raw, where)
    with gc_paused():
        return parse_manifest(raw, where)


def read_manifest(storage: Storage) -> Manifest:
    """The committed manifest at ``storage``."""
    return read_manifest_from(storage, read_manifest_bytes(storage))


def read_manifest_head(storage: Storage) -> ManifestHead:
    """The committed manifest at ``storage`` without its entries (checksum still checked)."""
    return parse_head(read_manifest_bytes(storage), os.path.join(storage.location, MANIFEST_NAME))


def source(storage: Storage, *, allow_pickle: bool = False, file: str | None = None) -> bytes | Manifest:
    """What the checkpoint at ``storage`` holds: its committed zerostall manifest's bytes as stored
    (parsed by whoever reads them), else the manifest translated from the foreign checkpoint found
    there (``file``: a single safetensors file)."""
    if file is None:
        try:
            return read_manifest_bytes(storage)
        except CheckpointNotFoundError:
            kind = foreign.kind_of(storage.list()) if storage.exists() else None
            if kind is None:
                raise
    else:
        kind = foreign.SAFETENSORS
        try:
            storage.size(file)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint at {storage.location}/{file}: no such file") from None
    try:
        return foreign.foreign_manifest(storage, kind, allow_pickle=allow_pickle, file=file)
    except FileNotFoundError as exc:  # one its index names
        raise CorruptCheckpointError(f"{storage.location} is {foreign.describe(kind)} with a file missing: "
                                     f"{exc}") from None
    except OSError as exc:  # a CheckpointError, which every rank then raises (a rank that saw none would hang)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"cannot read {foreign.describe(kind)} at {storage.location}: {exc}") from exc


def named_source(storage: Storage, instead: Instead | None, *, allow_pickle: bool = False,
                 file: str | None = None) -> tuple[str | None, bytes | Manifest]:
    """:func:`source` of ``storage``; where it holds no checkpoint, that of the one ``instead``
    names, with its tag (None: ``storage``'s own)."""
    try:
        return None, source(storage, allow_pickle=allow_pickle, file=file)
    except CheckpointNotFoundError:
        tag = instead.tag() if instead is not None and file is None else None
        if tag is None:
            raise
    return tag, source(instead.child(tag), allow_pickle=allow_pickle)


def named_manifest(storage: Storage, instead: Instead | None, *, allow_pickle: bool = False,
                   file: str | None = None, deferred: bool = False) -> tuple[Storage, Manifest]:
    """The checkpoint at ``storage`` (or the one ``instead`` names) and its manifest (``deferred``:
    see :func:`read_manifest_from`), in this process alone (no torch: the command line reads this way)."""
    tag, data = named_source(storage, instead, allow_pickle=allow_pickle, file=file)
    where = _where(storage, instead, tag)
    manifest = data if isinstance(data, Manifest) else read_manifest_from(where, data, deferred=deferred)
    return linked(where, manifest), manifest


def agreed_source(storage: Storage, group: Group, *, allow_pickle: bool = False, file: str | None = None,
                  instead: Instead | None = None, deferred: bool = False) -> tuple[Storage, Manifest]:
    """The checkpoint at ``storage`` (or the one ``instead`` names, see :func:`named_source`) and
    its manifest, the same on every rank: rank 0 decides which and reads the bytes (an error
    there is raised on every rank), every rank parses them, rank 0 too once they are sent, so no
    rank waits on its parse. A foreign checkpoint is translated once, by rank 0, and sent as a
    manifest of ours with what marks it foreign (its kind, the items left out). Ranks reading for
    themselves could see different manifests, or checkpoints (a save committing in between).
    ``deferred``: see :func:`read_manifest_from`."""
    if group.size == 1:
        return named_manifest(storage, instead, allow_pickle=allow_pickle, file=file, deferred=deferred)
    found: tuple[str | None, bytes | Manifest] | None = None

    def read() -> bytes:
        nonlocal found
        tag, data = found = named_source(storage, instead, allow_pickle=allow_pickle, file=file)
        if isinstance(data, bytes):
            if not data.startswith(_STORED):  # damaged: its parse error (here, every rank's), not taken for marks
                read_manifest_from(_where(storage, instead, tag), data)
            return data if tag is None else dump_json({"tag": tag}) + b"\n" + data
        return dump_json({"tag": tag, "foreign": data.foreign, "left_out": data.left_out}) + b"\n" + data.to_bytes()

    raw = group.agree(read)
    if found is not None:  # rank 0: what it read
        tag, data = found
    elif raw.startswith(_STORED):
        tag, data = None, raw
    else:
        head, _, data = raw.partition(b"\n")
        marks = load_json(head)
        tag = marks["tag"]
        if "foreign" in marks:
            where = _where(storage, instead, tag)
            manifest = Manifest.from_json(manifest_body(data, where.location))
            manifest.foreign, manifest.left_out = marks["foreign"], marks["left_out"]
            return where, manifest
    where = _where(storage, instead, tag)
    manifest = data if isinstance(data, Manifest) else read_manifest_from(where, data, deferred=deferred)
    return linked(where, manifest), manifest


def _where(storage: Storage, instead: Instead | None, tag: str | None) -> Storage:
    """The storage of the checkpoint opened: ``storage`` itself, or checkpoint ``tag`` that ``instead`` names."""
    if tag is None:
        return storage
    assert instead is not None  # a tag comes only from instead, on every rank alike
    return instead.child(tag)
