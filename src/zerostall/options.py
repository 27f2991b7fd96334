"""Options of saves and loads: dataclasses checked when built, so a bad value fails where it is given.

Every public function that saves or loads takes ``options=`` (one of these) and also each field
as a keyword, as shorthand: ``zs.save(state, path, fsync=False)`` is
``zs.save(state, path, options=SaveOptions(fsync=False))``; keywords override the object's fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeVar

from .format.layout import DEFAULT_BLOCK_SIZE
from .format.head_check import MAX_BLOCK_SIZE

KeyFilter = Callable[[str], bool] | Iterable[str] | None
T = TypeVar("T", bound="_Options")


def default_threads() -> int:
    """Writer/reader threads per process: one per core, at least 2, at most 8."""
    return max(2, min(8, os.cpu_count() or 1))


class _Options:
    """What both options classes share: building from an object plus keyword overrides."""

    @classmethod
    def of(cls: type[T], options: T | None = None, overrides: Mapping[str, Any] | None = None) -> T:
        """``options`` (default: all defaults) with ``overrides`` applied; an unknown keyword is a
        ``TypeError`` that names it and the closest field."""
        base = cls() if options is None else options
        if not isinstance(base, cls):
            raise TypeError(f"options must be a zerostall.{cls.__name__}, not {type(base).__name__}")
        if not overrides:
            return base
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        for key in overrides:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the fields are {', '.join(names)}"
                raise TypeError(f"{key!r} is not a {cls.__name__} field{hint}")
        return dataclasses.replace(base, **overrides)  # type: ignore[type-var]

    def _check(self, name: str, ok: bool, wanted: str) -> None:
        if not ok:
            raise ValueError(f"{type(self).__name__}.{name} must be {wanted}, not {getattr(self, name)!r}")

    def _check_bools(self, *names: str) -> None:
        for name in names:
            self._check(name, isinstance(getattr(self, name), bool), "True or False")

    def _check_threads(self) -> None:
        threads = getattr(self, "threads")
        self._check("threads", threads is None or (_is_int(threads) and threads >= 1), "None or an int >= 1")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SaveOptions(_Options):
    """How a save writes (``zs.save``, ``zs.async_save``, ``AsyncSaver.save``, ``CheckpointManager``)."""

    threads: int | None = None
    """Writer threads per process (and data files per rank); None: one per core, at least 2, at most 8."""

    fsync: bool = True
    """Make data files, the manifest and directory entries durable before the save returns; False
    trades durability for speed on scratch storage (a RAM disk, a node-local tier)."""

    allow_pickle: bool = False
    """Store python values outside the safe encoding with pickle (they then need ``allow_pickle``
    to load, too); without it such a value fails the save with an error naming its key."""

    block_size: int = DEFAULT_BLOCK_SIZE
    """Bytes per checksum block (1 to 1 GiB): a load verifies whole blocks, so smaller blocks make
    partial (resharded) reads cheaper and the manifest larger."""

    overwrite: bool = False
    """Replace a committed checkpoint already at the path (it stays readable until the new manifest
    commits, and is deleted after); False refuses such a save with ``CheckpointExistsError`` before
    anything is written. ``CheckpointManager`` never saves over a checkpoint: a re-saved step is set
    aside instead."""

    before_commit: Callable[[], None] | None = None
    """Called on the coordinator right before the commit (the manifest switch), at a moment no
    other save into the path can commit; if it raises, the save is not committed and its error is
    raised. A fence for an outside lease or lock (``CheckpointManager`` checks its writer lease
    here); with ``AsyncSaver(writer="process")`` it must be picklable."""

    commit_timeout: float = 600.0
    """Seconds the coordinator waits for every rank's data (and the other ranks for the commit)
    before the save fails everywhere; a dead rank fails the save after this long."""

    incremental: bool = False
    """Under a ``CheckpointManager``: a chunk whose bytes equal (by checksum) those of the same chunk
    in the manager's last committed save is not written again; the manifest refers to its bytes
    where they lie, in that root (its ``refs``). A plain ``zs.save`` has no root to refer to
    and refuses it."""

    full_save_every: int | None = None
    """With ``incremental``: every N-th save of the manager writes every chunk again (a full save),
    so references stop reaching back to old steps; None: only the first save after start-up."""

    def __post_init__(self) -> None:
        self._check_threads()
        self._check_bools("fsync", "allow_pickle", "overwrite", "incremental")
        self._check("full_save_every", self.full_save_every is None
                    or (_is_int(self.full_save_every) and self.full_save_every >= 1), "None or an int >= 1")
        self._check("before_commit", self.before_commit is None or callable(self.before_commit), "None or a callable")
        self._check("block_size", _is_int(self.block_size) and 1 <= self.block_size <= MAX_BLOCK_SIZE,
                    f"an int from 1 to {MAX_BLOCK_SIZE} (1 GiB)")
        self._check("commit_timeout", isinstance(self.commit_timeout, (int, float))
                    and not isinstance(self.commit_timeout, bool) and self.commit_timeout > 0, "a number > 0")


@dataclass(frozen=True)
class LoadOptions(_Options):
    """How a load matches and reads (``zs.load``, ``zs.open``, ``Checkpoint.load``, ``CheckpointManager``)."""

    strict: bool = True
    """Raise ``StateMismatchError`` on any missing or unexpected key or shape mismatch, before
    anything is modified; False loads what matches and returns ``(state, Mismatch)``."""

    prefix: str | tuple[Any, ...] = ()
    """Load the checkpoint's subtree under this prefix (``"model"`` loads a bare model from a full
    training checkpoint). A str is a dotted name (``"model."`` is the same; it also selects flat
    keys such as a Hugging Face ``"model.embed_tokens.weight"``); a tuple is a key path, matched key
    by key (for keys that hold dots). Exports read a prefix the same way."""

    keys: KeyFilter = None
    """Only entries whose dotted names pass: a predicate, or glob patterns (a pattern also selects
    everything under it)."""

    strip: tuple[str, ...] = ()
    """Wrapper segments dropped from dotted key names on both sides, e.g. ``("module", "_orig_mod")``
    for DDP and ``torch.compile`` names; a single string is one segment."""

    strict_dtype: bool = False
    """Treat a dtype difference as a mismatch; by default values convert as ``load_state_dict`` does."""

    materialize: bool = False
    """Allocate targets on the meta device from the checkpoint (otherwise they are an error)."""

    verify: bool = True
    """Check every block read against its checksum."""

    broadcast: bool = False
    """When distributed: one rank reads each chunk that every rank needs whole and broadcasts it
    (over a process group that moves host tensors: gloo)."""

    max_staging_bytes: int = 256 << 20
    """Host memory a load may use beyond the targets themselves, for reads that cannot go straight
    into a target (dtype conversion, slices, GPU targets, broadcast buffers); at least a block a thread."""

    allow_pickle: bool = False
    """Unpickle python values that were saved with pickle; never needed for tensors."""

    tensor_subclasses: tuple[type, ...] = ()
    """Tensor subclasses (with ``__tensor_unflatten__``) trusted to rebuild the checkpoint's entries of
    their class (matched by module and qualified name) where no target of that class is given:
    ``read`` and ``state()`` then return such a tensor instead of a ``FlattenedTensor``, and a plain
    target is filled with its value (``copy_``, as ``load_state_dict`` does). A class named by a
    checkpoint is never imported: a checkpoint is untrusted input. Not needed to load into targets
    of the class itself, whose inner tensors are filled in place."""

    threads: int | None = None
    """Reader threads per process; None: one per core, at least 2, at most 8."""

    def __post_init__(self) -> None:
        self._check_bools("strict", "strict_dtype", "materialize", "verify", "broadcast", "allow_pickle")
        self._check_threads()
        self._check("max_staging_bytes", _is_int(self.max_staging_bytes) and self.max_staging_bytes >= 0,
                    "an int >= 0")
        if isinstance(self.strip, str):
            object.__setattr__(self, "strip", (self.strip,))
        self._check("strip", isinstance(self.strip, (tuple, list)) and all(isinstance(s, str) for s in self.strip),
                    "a sequence of names")
        object.__setattr__(self, "strip", tuple(self.strip))
        self._check("prefix", isinstance(self.prefix, (str, tuple)), "a key (str) or a key path (tuple)")
        self._check("keys", self.keys is None or callable(self.keys) or isinstance(self.keys, (str, list, tuple, set)),
                    "None, a predicate or glob patterns")
        if isinstance(self.tensor_subclasses, type):
            object.__setattr__(self, "tensor_subclasses", (self.tensor_subclasses,))
        self._check("tensor_subclasses", isinstance(self.tensor_subclasses, (tuple, list)) and all(
            isinstance(c, type) and hasattr(c, "__tensor_unflatten__") for c in self.tensor_subclasses),
            "a sequence of tensor subclasses with __tensor_unflatten__")
        object.__setattr__(self, "tensor_subclasses", tuple(self.tensor_subclasses))
