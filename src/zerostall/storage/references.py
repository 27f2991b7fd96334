"""An incremental checkpoint's references: its chunks may lie in data files of other checkpoints
of the same root (``refs``, format version 3 on). Each referenced file must be a data file that the
checkpoint beside it owns, with the size and header checksum the reference records, before any
of its bytes is read; the chunks' own checksums then cover the bytes. A reader then reads through
a :class:`RoutedStorage`, which sends each referenced file's reads where it lies."""

from __future__ import annotations

import re
from typing import Callable, Iterable

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.layout import MANIFEST_NAME, SUPERSEDED_NAME, Manifest
from ..format.manifest_check import max_manifest_bytes, parse_head
from ..format.retained import RETAINED_NAME, parse_retained
from .base import FileStat, Storage

_VERSION_3_ON = re.compile(rb'"manifest":\{"format":"zerostall","version":([3-9]|\d\d)')
_NO_REFS = re.compile(  # a manifest as zerostall writes it from version 4 on, that refers to no other checkpoint
    rb'\{"checksum":"[0-9a-f]{16}","manifest":\{"format":"zerostall","version":\d+,"generation":"[0-9a-f-]+",'
    rb'"created":[0-9.e+-]+,"step":(null|-?\d+),"world_size":\d+,"block_size":\d+,"checksum":"xxh3_64","refs":\{\}')
_HEAD = 512  # bytes that hold what both patterns look for


class RoutedStorage(Storage):
    """``base``, except that the files named in ``routes`` are read from the storage given there
    (the checkpoint beside ``base`` that holds each). Everything else, writing included, is ``base``'s."""

    def __init__(self, base: Storage, routes: dict[str, Storage]) -> None:
        self.base, self.routes = base, routes
        self.location = base.location
        self.remote, self.read_grid, self.requests_in_flight = base.remote, base.read_grid, base.requests_in_flight

    def _at(self, name: str) -> Storage:
        return self.routes.get(name, self.base)

    def __getstate__(self) -> dict[str, object]:
        return {"base": self.base, "routes": self.routes}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["base"], state["routes"])  # type: ignore[misc, arg-type]

    def create(self) -> None:
        self.base.create()

    def exists(self) -> bool:
        return self.base.exists()

    def list(self) -> list[str]:
        return self.base.list()

    def child(self, name: str) -> Storage:
        return self.base.child(name)

    def parent(self) -> Storage:
        return self.base.parent()

    def children(self) -> list[str]:
        return self.base.children()

    def size(self, name: str) -> int:
        return self._at(name).size(name)

    def sizes(self) -> dict[str, int] | None:
        own = self.base.sizes()
        if own is None:
            return None
        for holder in {id(s): s for s in self.routes.values()}.values():
            listed = holder.sizes()
            if listed is None:
                return None
            own.update((name, listed[name]) for name, at in self.routes.items() if at is holder and name in listed)
        return own

    def stat(self, name: str) -> FileStat:
        return self._at(name).stat(name)

    def write(self, name: str, parts: Iterable[memoryview]) -> int:
        return self.base.write(name, parts)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._at(name).read_into(name, offset, out)

    def read_into_many(self, name: str, offset: int, outs: list[memoryview]) -> None:
        self._at(name).read_into_many(name, offset, outs)

    def read_bytes(self, name: str, limit: int | None = None) -> bytes:
        return self._at(name).read_bytes(name, limit)

    def read_head(self, name: str, n: int) -> bytes:
        return self._at(name).read_head(name, n)

    def publish(self, name: str, tmp_name: str, data: bytes,
                before_replace: Callable[[], None] | None = None) -> None:
        self.base.publish(name, tmp_name, data, before_replace)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        return self.base.create_exclusive(name, data)

    def delete(self, name: str) -> None:
        self.base.delete(name)

    def delete_tree(self, name: str) -> None:
        self.base.delete_tree(name)

    def move(self, src: str, dst: str) -> None:
        self.base.move(src, dst)

    def abort_uploads(self, name: str = "", which: Callable[[str], bool] | None = None) -> int:
        return self.base.abort_uploads(name, which)

    def memory_map(self, name: str) -> memoryview | None:
        return self._at(name).memory_map(name)

    def close(self) -> None:
        self.base.close()
        for holder in {id(s): s for s in self.routes.values()}.values():
            holder.close()


def read_retained(checkpoint: Storage) -> tuple[dict[str, int], dict[str, str]] | None:
    """The files (sizes, header checksums) the retained record at ``checkpoint`` lists; None without one."""
    try:
        raw = checkpoint.read_bytes(RETAINED_NAME, max_manifest_bytes())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except CheckpointError:  # a storage's error (StorageError) or a refused file: typed already
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read {checkpoint.location}/{RETAINED_NAME}: {exc}") from exc
    return parse_retained(raw, f"{checkpoint.location}/{RETAINED_NAME}")


def owned_files(holder: Storage) -> dict[str, tuple[int, str | None]] | None:
    """The data files checkpoint ``holder`` owns (name -> size, header checksum): its manifest's own
    files, or, once it was deleted while others still referred to some, those its retained record
    keeps; None when it holds neither (gone)."""
    try:
        head = parse_head(holder.read_bytes(MANIFEST_NAME, max_manifest_bytes()), f"{holder.location}/{MANIFEST_NAME}")
    except (FileNotFoundError, NotADirectoryError):
        pass
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(f"cannot read {holder.location}/{MANIFEST_NAME}: {exc}") from exc
    else:
        return {n: (size, head.headers.get(n)) for n, size in head.files.items() if n not in head.refs}
    kept = read_retained(holder)
    if kept is None:
        return None
    files, headers = kept
    return {n: (size, headers.get(n)) for n, size in files.items()}


def linked(storage: Storage, manifest: Manifest) -> Storage:
    """``storage``, reading the files ``manifest`` refers to from the checkpoints that own them,
    once each is checked to be theirs; ``storage`` itself when it refers to none."""
    if not manifest.refs:
        return storage
    by_tag: dict[str, list[str]] = {}
    for name, tag in manifest.refs.items():
        by_tag.setdefault(tag, []).append(name)
    routes: dict[str, Storage] = {}
    links = set(storage.parent().links())
    for tag, names in sorted(by_tag.items()):
        holder = storage.sibling(tag)
        owned = None if tag in links else owned_files(holder)
        for name in sorted(names):
            if tag in links:
                why = "which is a link to a directory elsewhere (not followed)"
            elif owned is None:
                why = "which is gone"
            elif name not in owned:
                why = "which does not own that file"
            elif owned[name] != (manifest.files[name], manifest.headers.get(name)):
                why = "which lists it with another size or header checksum"
            else:
                routes[name] = holder
                continue
            raise CorruptCheckpointError(
                f"{storage.location} refers to data file {name} of checkpoint {tag} beside it, {why}: this incremental "
                "checkpoint cannot be read (restore another one; `zerostall ls` shows what each step shares)")
    return RoutedStorage(storage, routes)


def referrers(checkpoint: Storage) -> list[str]:
    """The committed checkpoints beside ``checkpoint`` (in its root), and those a manager set
    aside there (they may be moved back), that refer to its data files. One whose manifest cannot
    be read now (not a damaged one) raises: what it refers to is unknown."""
    tag = checkpoint.location.rstrip("/").rsplit("/", 1)[-1]
    root = checkpoint.parent()
    aside = root.child(SUPERSEDED_NAME)
    found = []
    for name, holder in [*((n, root.child(n)) for n in root.children()),
                         *((f"{SUPERSEDED_NAME}/{n}", aside.child(n)) for n in aside.children())]:
        if name == tag or name.startswith(".") and not name.startswith(f"{SUPERSEDED_NAME}/"):
            continue
        try:
            start = holder.read_head(MANIFEST_NAME, _HEAD)
            if _VERSION_3_ON.search(start) is None or _NO_REFS.match(start):
                continue  # only format versions 3 on refer, and from version 4 each says so at its start
            raw = holder.read_bytes(MANIFEST_NAME, max_manifest_bytes())
            head = parse_head(raw, f"{holder.location}/{MANIFEST_NAME}")
        except (FileNotFoundError, NotADirectoryError, CorruptCheckpointError):  # none, damaged
            continue
        except OSError as exc:  # denied, or an I/O error: it may refer to the checkpoint
            raise CheckpointError(f"cannot read the manifest of {holder.location} ({exc}), so whether it refers to "
                                  f"data of {checkpoint.location} is unknown; nothing was replaced") from exc
        if tag in head.refs.values():
            found.append(name)
    return found


def check_unreferenced(checkpoint: Storage, committed: bool | None = None) -> None:
    """Refuse to replace the committed checkpoint at ``checkpoint`` while other checkpoints of its
    root refer to its data files: the replacement would delete them. ``committed``: whether a
    manifest is there, where the caller knows (None: looked up)."""
    if committed is None:
        try:
            checkpoint.size(MANIFEST_NAME)
            committed = True
        except (FileNotFoundError, NotADirectoryError):
            committed = False
    if not committed:
        return
    users = referrers(checkpoint)
    if users:
        raise CheckpointError(f"{checkpoint.location} holds data that {', '.join(users[:5])} (incremental checkpoints "
                              "beside it) refer to; nothing was written: replacing it would delete that data, so "
                              "save under another name, or delete those checkpoints first")
