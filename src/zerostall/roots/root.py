"""A checkpoint root: checkpoints by step (or tag) on one :class:`Storage`, and the ``latest`` pointer.

Layout: one sub-location per checkpoint (``step_000000100``, or any tag); ``latest``, JSON naming
the newest committed tag (replaced atomically, written only after a commit); the writer lease
``.writer-lease`` (see :mod:`zerostall.roots.lease`); ``.superseded/``, checkpoints that a rollback set
aside; ``.resaving``, the saves to undo should they never commit (see :mod:`zerostall.roots.resaving`);
and, briefly, ``.deleting-*``, uncommitted attempts being removed. A checkpoint is committed
once its manifest exists, and is deleted manifest first, so a half-deleted one never looks valid.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Iterable

from ..errors import CheckpointError, CheckpointNotFoundError, InvalidPathError
from ..format.layout import MANIFEST_NAME, SUPERSEDED_NAME, file_generation
from ..loading.opening import read_manifest_head
from ..storage import SMALL_FILE_BYTES, Storage
from ..storage.location import few
from .described import COMMITTED, DAMAGE, CheckpointInfo, committed_info, describe
from .retention import RetentionPolicy, kept
from .sharing import collect_retained, delete_checkpoint, referenced, refs_set_aside, set_aside
from . import resaving
from .stale import remove_attempts

log = logging.getLogger(__name__)

LATEST_NAME = "latest"
LEASE_NAME = ".writer-lease"

FRAMEWORK_FILES = frozenset({"zero_to_fp32.py"})
"""Files a training framework keeps beside its checkpoints in its save directory (DeepSpeed's
conversion script; DeepSpeed's ``latest`` shares our pointer's name): not unrelated to a root."""



def step_tag(step: int) -> str:
    """The tag of the checkpoint of ``step``: ``step_000000100``."""
    return f"step_{step:09d}"


def tag_step(tag: str) -> int | None:
    """The step a tag of :func:`step_tag`'s form names, else None."""
    match = re.fullmatch(r"step_(\d{9,})", tag)
    return int(match.group(1)) if match else None


def validate_tag(tag: str) -> str:
    """``tag``, refused unless a plain name of its own (not a path, ``latest``, the lease, a hidden name, nor one
    with a backslash, which some object stores take for '/', or a control character, which some cannot name)."""
    if (not isinstance(tag, str) or "/" in tag or "\\" in tag or tag in (LATEST_NAME, LEASE_NAME) or tag.startswith(".")
            or any(ord(c) < 32 or ord(c) == 127 for c in tag)):
        raise InvalidPathError(f"invalid checkpoint tag {tag!r}: a tag is one plain name of a folder under the root "
                               f"(no '/', '\\' or control character; not {LATEST_NAME!r} nor starting with '.')")
    return tag


def checkpoint_name(tag: str | int | None) -> str | None:
    """The name of the checkpoint ``tag`` asks for: None and ``"latest"`` as they are, a step (an
    int, as Orbax takes it) its checkpoint's, a tag checked (see :func:`validate_tag`)."""
    if tag is None or tag == LATEST_NAME:
        return tag
    if type(tag) is int and tag >= 0:
        return step_tag(tag)
    return validate_tag(tag)


def retained(infos: list[CheckpointInfo], policy: RetentionPolicy, pinned: Iterable[int] = ()) -> dict[str, list[str]]:
    """For each committed checkpoint with a step, the rules that keep it (see
    :func:`zerostall.roots.retention.kept`); an empty list: retention may delete it. Checkpoints that share
    a step share its fate; others (incomplete, corrupt, step-less) are not for retention to judge."""
    ranked = [i for i in infos if i.status == COMMITTED and i.step is not None]
    records = [i.record() for i in ranked]
    reasons = kept(records, policy, pinned=sorted(set(pinned)))
    return {i.name: list(reasons.get(i.step, [])) for i in ranked}


def checkpoint_files(names: Iterable[str]) -> bool:
    """Whether ``names`` (a listing) hold a manifest or zerostall data files (committed or not)."""
    return any(n == MANIFEST_NAME or file_generation(n) for n in names)


def looks_like_checkpoint(storage: Storage) -> bool:
    """Whether ``storage`` holds a checkpoint (see :func:`checkpoint_files`)."""
    return checkpoint_files(storage.list())


def _update_temp(name: str) -> bool:
    """Whether ``name`` is a temp file of a ``latest``, lease or re-save journal update (see :meth:`Storage.put`)."""
    return name.endswith(".tmp") and name.rsplit(".", 2)[0] in (LATEST_NAME, LEASE_NAME, resaving.RESAVING_NAME)


def _holds_nothing_foreign(storage: Storage) -> bool:
    """Whether a directory under a root is a checkpoint (committed or not) or empty."""
    names = storage.list()
    return checkpoint_files(names) or not (names or storage.children())


def typed_error(exc: OSError, what: str) -> CheckpointError:
    """``exc`` where it is a zerostall error already (a storage's, a refused file), else a
    :class:`CheckpointError` saying ``what`` could not be done, caused by it."""
    if isinstance(exc, CheckpointError):
        return exc
    typed = CheckpointError(f"{what}: {exc}")
    typed.__cause__ = exc
    return typed


class CheckpointRoot:
    """The checkpoints under one location: listing (each manifest parsed once while it stays the
    same), ``latest``, deletion, setting aside, and removing what a dead writer left."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.location = storage.location
        self._seen: dict[str, tuple[str, CheckpointInfo]] = {}  # name -> (manifest version, info)
        self.unreadable: dict[str, CheckpointError] = {}
        """The checkpoints of the last listing whose manifest is there but could not be read, and why."""
        self.bare: set[str] = set()
        """Folders with no manifest at the last listing (attempts, retained data)."""
        self.journaled = False  # whether this writer noted a save in the re-save journal since it was last settled

    def where(self, name: str) -> str:
        """The location of ``name`` under the root, for messages."""
        return f"{self.location.rstrip('/')}/{name}"

    def child(self, tag: str) -> Storage:
        """The storage of checkpoint ``tag``."""
        return self.storage.child(tag)

    # -- listing -------------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """The committed checkpoints, oldest step first (step-less ones first), hidden names and
        unreadable manifests skipped. Only the head of each manifest is parsed, once while it stays
        the same file: a manager lists after every save. Unreadable ones are kept in :attr:`unreadable`."""
        found = []
        seen: dict[str, tuple[str, CheckpointInfo]] = {}
        unreadable: dict[str, CheckpointError] = {}
        bare: set[str] = set()
        try:
            names = self.storage.children()
        except OSError as exc:
            raise typed_error(exc, f"cannot list the checkpoints under {self.location}")
        for name in names:
            if name.startswith("."):
                continue
            storage = self.storage.child(name)
            try:
                version = storage.stat(MANIFEST_NAME).version
            except (FileNotFoundError, NotADirectoryError):
                bare.add(name)
                continue
            except OSError as exc:  # as a failed read of it is (a symbolic link in its place: damage)
                unreadable[name] = typed_error(exc, f"cannot read the manifest of {storage.location}")
                continue
            cached = self._seen.get(name)
            if cached is not None and cached[0] == version:
                info = cached[1]
            else:
                try:
                    info = committed_info(name, storage, read_manifest_head(storage))
                except CheckpointError as exc:
                    unreadable[name] = exc
                    continue
            seen[name] = (version, info)
            found.append(info)
        self._seen, self.unreadable, self.bare = seen, unreadable, bare
        return sorted(found, key=lambda info: (-1 if info.step is None else info.step, info.name))

    def latest(self) -> str | None:
        """The newest committed checkpoint's tag (None when there is none), found by listing, which
        cannot lag behind a commit; unreadable manifests count as :meth:`newest` says."""
        return self._past_unreadable(self.checkpoints(), None)

    def newest(self, step: int | None = None) -> str:
        """The tag of the newest committed checkpoint (of ``step``, when given), or a
        :class:`CheckpointNotFoundError` saying what there is. A manifest that may be the newer one
        but could not be read is raised when the reason was not damage (an I/O error must not
        resolve to an older checkpoint), and is named in a warning when it was."""
        found = self.checkpoints()
        tag = self._past_unreadable(found, step)
        if tag is not None:
            return tag
        steps = ", ".join(str(i.step) for i in found if i.step is not None)
        raise CheckpointNotFoundError(f"no committed checkpoint{f' of step {step}' if step is not None else ''} under "
                                      f"{self.location}" + (f" (steps there: {steps})" if steps else ""))

    def _past_unreadable(self, found: list[CheckpointInfo], step: int | None) -> str | None:
        """The newest of ``found`` (of ``step``), once no unreadable manifest of the last listing that
        may be newer (of that step; a tag without one may be) failed for a reason other than damage."""
        match = [i for i in found if step is None or i.step == step]
        newest = match[-1] if match else None
        below = -1 if newest is None else newest.record().step
        for tag, exc in sorted(self.unreadable.items()):
            at = tag_step(tag)  # None: a tag of any step, which may be the one asked for
            asked = at is None or (at == step if step is not None else at >= below)
            if isinstance(exc, CheckpointNotFoundError) or not asked:
                continue  # deleted since it was listed, or not the one asked for
            if not isinstance(exc, DAMAGE):
                raise exc
            log.warning("%s is damaged (%s): passed over%s", self.where(tag), exc,
                        f" for {newest.name}" if newest is not None else "")
        return newest.name if newest is not None else None

    def scan(self, *, include_self: bool = False) -> list[CheckpointInfo]:
        """Every checkpoint directly under the root, committed or not (see :func:`describe`), and the
        root itself when ``include_self`` and it is one; by step, step-less last."""
        candidates = [(name, self.storage.child(name)) for name in self.storage.children()]
        if include_self:
            candidates.insert(0, (self.location.rstrip("/").rsplit("/", 1)[-1], self.storage))
        return sorted((describe(storage, name) for name, storage in candidates if looks_like_checkpoint(storage)),
                      key=lambda r: (r.step is None, r.step or 0, r.name))

    def check_only_ours(self) -> None:
        """Refuse a root holding what is neither a checkpoint (committed or not, or an empty
        directory; one named by :func:`step_tag` is taken for one unlooked) nor a manager's own
        (``latest``, the lease, ``.superseded/``, temp files of their updates; hidden names) nor a
        framework's beside them (:data:`FRAMEWORK_FILES`): a manager takes over what it finds
        there (it removes attempts, sets aside, prunes), so it starts only where that is safe."""
        dirs = self.storage.children()
        files = sorted(set(self.storage.list()) - set(dirs))  # a local listing names directories too
        if checkpoint_files(files):
            raise CheckpointError(f"{self.location} is a checkpoint itself, not a root of checkpoints; nothing was "
                                  "written: give the manager a directory of its own (it keeps one checkpoint per "
                                  "step under it), or load this checkpoint with zerostall.load")
        unrelated = [n for n in files if not (n.startswith(".") or n in (LATEST_NAME, *FRAMEWORK_FILES)
                                              or _update_temp(n))]
        unrelated += [f"{n}/" for n in dirs if not (n.startswith(".") or tag_step(n) is not None  # ours by name
                                                     or _holds_nothing_foreign(self.storage.child(n)))]
        links = self.storage.links()
        if links:
            raise CheckpointError(f"{self.location} holds links to directories ({few(links)}), whose targets a "
                                  "manager deleting checkpoints there would delete; nothing was written: copy such a "
                                  "checkpoint in, or load it from its own path (zerostall.load) before the first save")
        if unrelated:
            raise CheckpointError(f"{self.location} holds files that are neither checkpoints nor a checkpoint "
                                  f"manager's own ({few(unrelated)}); nothing was written: give the manager an "
                                  "empty directory or one of its own roots, or move those files out")

    # -- the latest pointer --------------------------------------------------------------------
    def read_latest(self) -> str | None:
        """The tag that the ``latest`` file names (a mirror of :meth:`latest` for other tools; ours
        is JSON, DeepSpeed's the plain tag), or None."""
        try:
            data = self.storage.read_bytes(LATEST_NAME, SMALL_FILE_BYTES)
        except OSError:  # absent, unreadable or too big
            return None
        try:
            pointer = json.loads(data)
        except (ValueError, RecursionError):
            pointer = None  # a plain tag, as DeepSpeed writes it (also one that reads as JSON: 100, true, null)
        if isinstance(pointer, dict):
            return pointer["tag"] if isinstance(pointer.get("tag"), str) else None
        plain = data.decode("utf-8", "replace").strip()  # DeepSpeed reads it so: any tag a save takes
        if plain.startswith(("{", "[")):  # a pointer of ours that does not read, or no pointer: no tag
            return None
        try:
            return validate_tag(plain) if plain else None
        except InvalidPathError:
            return None

    def write_latest(self, tag: str, step: int | None) -> None:
        """Point ``latest`` at ``tag`` (atomically, once it committed); OSError if it cannot be written."""
        self.storage.put(LATEST_NAME, json.dumps({"tag": tag, "step": step}).encode())

    # -- removing ------------------------------------------------------------------------------
    def references(self, but: str | None = None) -> dict[str, set[str]]:
        """The data files of each checkpoint (by tag) that the committed checkpoints of the root
        other than ``but`` refer to, those set aside included (they may be moved back)."""
        return referenced([i.refs for i in self._all_read(but) if i.name != but]
                          + refs_set_aside(self.storage.child(SUPERSEDED_NAME)))

    def _all_read(self, but: str | None = None) -> list[CheckpointInfo]:
        """The committed checkpoints; raises if a manifest other than ``but``'s cannot be read now
        (a damaged one refers to nothing): what it refers to is unknown, so nothing may go."""
        found = self.checkpoints()
        for name, exc in self.unreadable.items():
            if name != but and not isinstance(exc, (*DAMAGE, CheckpointNotFoundError)):  # gone: refers to nothing
                raise exc
        return found

    def delete(self, tag: str) -> bool:
        """Delete checkpoint ``tag`` so that it never looks valid half-way: the manifest goes first.
        Its data files that other checkpoints refer to stay, behind a retained record (see
        :mod:`zerostall.roots.sharing`). True when nothing of it is left. Never through a symbolic link."""
        if tag in self.storage.links():
            raise CheckpointError(f"{self.where(tag)} is a link to a directory: not deleted (nor its target)")
        return delete_checkpoint(self.storage, tag, self.references(but=tag).get(tag, set()))

    def collect_retained(self) -> None:
        """Remove retained data that no checkpoint refers to any more (see :mod:`zerostall.roots.sharing`),
        and the checkpoints that committed re-saves replaced (see :mod:`zerostall.roots.resaving`)."""
        collect_retained(self.storage, self.references)
        resaving.settle(self.storage, takeover=False)

    def set_aside(self, tags: list[str], step: int, target: str) -> None:
        """Move ``tags`` into ``.superseded/`` (see :func:`zerostall.roots.sharing.set_aside`): saving ``step`` as
        ``target`` below them forks the run (see :mod:`zerostall.roots.forking`). A save of a tag, or over ``target``
        alone, is noted first for a takeover to undo should it never commit (see :mod:`zerostall.roots.resaving`)."""
        def note(going: dict[str, str]) -> None:
            alone = list(going) == [target] and target not in self.unreadable  # a damaged one is kept
            if alone or tag_step(target) is None:
                self.journaled = True
                resaving.record(self.storage, target, f"{SUPERSEDED_NAME}/{going[target]}" if alone else None)

        set_aside(self.storage, tags, step, target, {i.name: i.refs for i in self._all_read()}, note)

    def clean_stale_attempts(self, temp_age: float) -> None:
        """Remove what dead writers left (see :func:`~zerostall.roots.stale.remove_attempts`), and
        temp files of ``latest``/lease updates older than ``temp_age`` seconds (a younger one may be
        another writer's, in flight). Only for the lease holder: the other writers are dead."""
        remove_attempts(self.storage, self.where)
        resaving.settle(self.storage, takeover=True)
        for name in self.storage.list():
            if _update_temp(name):
                self._remove_if_older(name, temp_age)  # a publish that a crash interrupted

    def _remove_if_older(self, name: str, seconds: float) -> None:
        try:
            if time.time() - self.storage.stat(name).modified > seconds:
                self.storage.delete(name)
        except FileNotFoundError:
            pass
