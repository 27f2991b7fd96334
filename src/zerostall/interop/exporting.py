"""Export: a checkpoint's model weights as files other tools read, consolidated from any number of
ranks and streamed (``zs.export``, ``zerostall export``).

``hf``: the Hugging Face layout (``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
shards and ``model.safetensors.index.json``); ``torch``: one file that ``torch.load`` reads as a
flat ``{key: tensor}`` dict. Here: what is exported (:func:`select`: a prefix, renames, casts, tied
weights, the entries skipped) and the run; the files are written by :mod:`.export_files`. Tensors
are read a slab at a time (:mod:`zerostall.loading.tensor_stream`: every stored byte read once,
every block's checksum verified), the next slab while the last is written, so memory holds two
slabs (for ``torch``, the largest tensor), a block per reader thread for bytes cast or gathered,
and the blocks a tensor saved by many ranks side by side holds between slabs, never the model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..errors import CheckpointExistsError, ExportError
from ..format import codec
from ..format.layout import Manifest
from ..format.safetensors_file import safetensors_dtype
from ..loading.checkpoint import Checkpoint
from ..loading.load_plan import relative
from ..loading.reader import resolve
from ..loading.tensor_stream import TensorStream
from ..options import LoadOptions, _Options, default_threads
from ..roots.naming import Naming
from ..state import fqn
from ..storage import Storage
from ..storage.local import check_path
from ..storage.location import within
from .export_files import LEFT_BY_AN_EXPORT, Item, write_hf, write_torch

log = logging.getLogger(__name__)

_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
SLAB_BYTES = 16 << 20  # of a tensor read (and cast) at a time, into one of two reused buffers
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes in ``value``: an int, or a string as ``save_pretrained`` takes (``"5GB"`` is 5 * 10**9
    bytes, ``"256MiB"`` 256 * 2**20)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a size: give bytes, or a number with a unit (500MB, 5GB, 256MiB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


@dataclass(frozen=True)
class ExportOptions(_Options):
    """What an export writes (``zs.export``, ``zerostall export``)."""

    format: str = "hf"
    """``"hf"``: Hugging Face safetensors files (sharded, with an index, when more than one);
    ``"torch"``: one file that ``torch.load(path, weights_only=True)`` reads as ``{key: tensor}``."""

    prefix: str | tuple[Any, ...] | None = None
    """Export only the entries under this prefix, with the prefix stripped, read as loads read it:
    ``"model"`` (or ``"model."``) makes ``{"model": module}`` export the module's own
    ``state_dict`` keys; a tuple is a key path (for keys that hold dots). A prefix that selects
    nothing is an error naming the top-level keys."""

    rename: tuple[tuple[str, str], ...] = ()
    """Rules ``(regex, replacement)`` (or ``"REGEX=REPLACEMENT"`` strings, split at the last ``=``)
    applied in order to every key, after the prefix, by ``re.sub``; two keys renamed onto one name
    are an error naming both."""

    dtype: Any = None
    """Cast floating tensors to this floating dtype (``torch.bfloat16``, ``"bfloat16"`` or ``"bf16"``);
    other tensors keep theirs. None: every tensor as saved."""

    max_shard_size: int | str = "5GB"
    """The most bytes of one ``hf`` file, as ``save_pretrained`` takes it (an int, ``"5GB"`` = 5 *
    10**9, ``"256MiB"``); a larger tensor gets a file of its own. Read as bytes (an int)."""

    overwrite: bool = False
    """Write into a non-empty directory (replacing its model files, keeping the others) or over an
    existing ``torch`` file; without it that is refused before anything is read."""

    tied_weights_keys: tuple[str, ...] = ()
    """For ``hf``, which keys of tied weights (keys that alias one tensor, written once: safetensors
    holds no aliases) to leave out, as ``save_pretrained`` does with a transformers model's
    ``_tied_weights_keys`` (give that, or its keys: regular expressions, searched in each key after
    renames): the matching keys of a tied set are left out, the others written (when all match, the
    last in sorted order is written). Empty: the first key of each tied set in save order is
    written (a transformers model's input embeddings, ahead of the head tied to them). ``from_pretrained``
    ties the left-out keys back. A ``torch`` file keeps every key, tied ones sharing one storage."""

    allow_pickle: bool = False
    """Read a PyTorch DCP checkpoint (its ``.metadata`` and non-tensor items are pickles, which can
    run code when read): only one you trust. An open :class:`Checkpoint` keeps the setting it was
    opened with."""

    threads: int | None = None
    """Reader threads; None: one per core, at least 2, at most 8."""

    def __post_init__(self) -> None:
        self._check("format", self.format in ("hf", "torch"), '"hf" or "torch"')
        self._check("prefix", self.prefix is None or isinstance(self.prefix, (str, tuple)),
                    "None, a dotted name (str) or a key path (tuple)")
        rules = []
        for rule in self.rename:
            if isinstance(rule, str):
                pattern, sep, replacement = rule.rpartition("=")
                self._check("rename", bool(sep), 'rules "REGEX=REPLACEMENT" or (regex, replacement) pairs')
                rule = (pattern, replacement)
            self._check("rename", isinstance(rule, tuple) and len(rule) == 2 and all(isinstance(r, str) for r in rule),
                        'rules "REGEX=REPLACEMENT" or (regex, replacement) pairs')
            self._compiles("rename", rule[0])
            try:
                re.compile(rule[0]).sub(rule[1], "")
            except re.error as exc:
                raise ValueError(f"ExportOptions.rename: the replacement {rule[1]!r} of {rule[0]!r} is not valid: "
                                 f"{exc}") from None
            rules.append(rule)
        object.__setattr__(self, "rename", tuple(rules))
        dtype = codec.torch_dtype(_DTYPE_ALIASES.get(self.dtype, self.dtype).removeprefix("torch.")) \
            if isinstance(self.dtype, str) else self.dtype
        self._check("dtype", self.dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point,
                    "None or a floating dtype (bfloat16, float16, float32...; bf16, fp16, fp32)")
        object.__setattr__(self, "dtype", dtype)
        try:
            object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size))
        except ValueError as exc:
            raise ValueError(f"ExportOptions.max_shard_size: {exc}") from None
        self._check("max_shard_size", self.max_shard_size >= 1, "at least 1 byte")
        tied = self.tied_weights_keys if self.tied_weights_keys is not None else ()  # a model may hold None
        self._check("tied_weights_keys", isinstance(tied, (tuple, list, dict)) and all(isinstance(k, str)
                                                                                        for k in tied),
                    "a model's _tied_weights_keys (a dict: its keys are used) or a tuple of regular expressions")
        for pattern in tied:
            self._compiles("tied_weights_keys", pattern)
        object.__setattr__(self, "tied_weights_keys", tuple(tied))
        self._check_bools("overwrite", "allow_pickle")
        self._check_threads()

    def _compiles(self, name: str, pattern: str) -> None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"ExportOptions.{name}: {pattern!r} is not a regular expression: {exc}") from None


@dataclass
class ExportInfo:
    """What an export wrote."""

    format: str
    path: str
    files: list[str]  # paths of the files written, the index last
    keys: list[str]  # the exported keys, in save order
    bytes: int  # tensor bytes written (a tied tensor once)
    skipped: list[str]  # entries that are not model weights: rank-local, python values, tensor subclasses
    tied: dict[str, str]  # key -> the key of the same tensor: hf: left out of the files; torch: sharing its storage


@dataclass
class Selection:
    """What an export writes: its tensors in save order (``hf``: one key of each tied set), the
    entries skipped as not model weights, and the tied keys (see :attr:`ExportInfo.tied`)."""

    items: list[Item]
    skipped: list[str]
    tied: dict[str, str]

    @property
    def nbytes(self) -> int:
        """Tensor bytes written, a tied tensor once."""
        return sum(i.nbytes for i in self.items if i.key not in self.tied)


def select(manifest: Manifest, where: str, options: ExportOptions) -> Selection:
    """The tensors to export (under the prefix, renamed, in save order), the selected entries
    skipped as not model weights and the tied keys; raises :class:`ExportError` for a prefix that
    selects nothing, a name collision, or a dtype the format cannot hold."""
    prefix = options.prefix or ""
    dotted = prefix if isinstance(prefix, str) else fqn(prefix)  # left-out items are known by name only
    lost = [key for key in manifest.left_out if relative((key,), dotted)]
    if lost:  # a foreign checkpoint's tensors that cannot be read in place: an export holds them all, or nothing
        raise ExportError(f"{where} has {len(lost)} tensor item(s) zerostall cannot read in place under the prefix "
                          f"({', '.join(lost[:10])}; the warnings logged when it was opened say why)")
    items: list[Item] = []
    skipped: list[str] = []
    names: dict[str, str] = {}
    matched = False
    for entry in manifest.entries:
        if entry.inner_of is not None:  # part of a tensor subclass entry
            continue
        rel = relative(entry.path, prefix)
        if not rel:  # not under the prefix (or the prefix itself)
            continue
        name = entry.fqn if entry.rank is None else f"{entry.fqn}@rank{entry.rank}"
        matched = True
        target = resolve(manifest, entry, where)
        if entry.rank is not None or target.kind != "tensor":
            skipped.append(name)
            continue
        key = fqn(rel)
        for pattern, replacement in options.rename:
            key = re.sub(pattern, replacement, key)
        if not key or key == "__metadata__" or not _utf8(key):
            raise ExportError(f"entry {name} of {where} would be exported as {key!r}, a name no file may hold: "
                              "change the prefix or the rename rules")
        if key in names:
            raise ExportError(f"entries {names[key]} and {name} of {where} are both exported as {key!r}: change the "
                              "rename rules so that they differ")
        names[key] = name
        stored = target.torch_dtype
        dtype = options.dtype if options.dtype is not None and stored.is_floating_point else stored
        items.append(Item(key, name, target, dtype))
    if not matched:
        tops = sorted({str(e.path[0]) for e in manifest.entries if e.path})
        raise ExportError(f"prefix {options.prefix!r} selects no entry of {where}; its top-level keys are: "
                          f"{', '.join(tops) or '(none)'}")
    if not items:
        raise ExportError(f"{where} holds no tensors to export under prefix {options.prefix!r} (skipped as not "
                          f"model weights: {', '.join(skipped[:10])})")
    if options.format == "hf":
        bad = [f"{i.source} ({i.dtype})" for i in items if safetensors_dtype(i.dtype, every=True) is None]
        if bad:
            raise ExportError(f"safetensors cannot hold the dtype of {', '.join(bad[:10])} in {where}: export with "
                              "format torch, or cast floating tensors with dtype")
    tied = _tied(items, options)
    return Selection([i for i in items if i.key not in tied] if options.format == "hf" else items, skipped, tied)


def _utf8(key: str) -> bool:
    """Whether ``key`` is valid UTF-8 text (a lone surrogate is not: safetensors refuses its header)."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _tied(items: list[Item], options: ExportOptions) -> dict[str, str]:
    """Keys whose entry aliases the tensor of another exported key, each with the key written for
    it: ``hf`` leaves them out as ``save_pretrained`` does (see ``tied_weights_keys``), ``torch``
    writes them over the first key's storage."""
    sets: dict[int, list[str]] = {}
    for item in items:
        sets.setdefault(id(item.entry), []).append(item.key)
    tied: dict[str, str] = {}
    for keys in (k for k in sets.values() if len(k) > 1):
        kept = keys[:1]
        if options.format == "hf" and options.tied_weights_keys:
            matching = [k for k in sorted(keys) if any(re.search(p, k) for p in options.tied_weights_keys)]
            left_out = set(matching[:len(keys) - 1])  # all match: the last in sorted order stays
            kept = [k for k in keys if k not in left_out]
        tied.update((key, kept[0]) for key in keys if key not in kept)
    return tied


def export_checkpoint(ckpt: str | os.PathLike[str] | Storage | Checkpoint, out: str | os.PathLike[str],
                      options: ExportOptions, progress: Callable[[int], None] | None = None) -> ExportInfo:
    """Export the checkpoint ``ckpt`` (see :func:`opened`) to ``out`` as ``options`` say, with a
    warning naming the entries skipped; ``progress(nbytes)`` is called as tensor bytes are written."""
    target = check_target(out, options)
    with opened(ckpt, options) as ck:
        selection = select(ck.manifest, ck.path, options)
        if selection.skipped:
            log.warning("export of %s skips %d entries that are not model weights (rank-local, python values, "
                        "tensor subclasses): %s", ck.path, len(selection.skipped), ", ".join(selection.skipped))
        return write_selection(ck, selection, target, options, progress)


def write_selection(ck: Checkpoint, selection: Selection, target: str, options: ExportOptions,
                    progress: Callable[[int], None] | None = None) -> ExportInfo:
    """Write the ``selection`` of ``ck`` at ``target`` (from :func:`check_target`)."""
    if within(target, ck.storage.location):  # its files would become foreign files of the checkpoint
        raise ExportError(f"{target} lies inside the checkpoint it exports ({ck.path}); nothing was written: "
                          "export to a location outside it")
    threads = options.threads or ck.options.threads or default_threads()
    stream = TensorStream(ck.storage, ck.manifest, threads, SLAB_BYTES, ck.options.max_staging_bytes)
    progress = progress or (lambda n: None)
    try:
        if options.format == "hf":
            files = write_hf(stream, selection.items, target, options.max_shard_size, progress)
        else:
            files = write_torch(stream, selection.items, selection.tied, target, progress)
    finally:
        stream.close()
    return ExportInfo(options.format, target, files, [i.key for i in selection.items], selection.nbytes,
                      selection.skipped, selection.tied)


@contextlib.contextmanager
def opened(ckpt: str | os.PathLike[str] | Storage | Checkpoint, options: ExportOptions) -> Iterator[Checkpoint]:
    """A read session on ``ckpt``: a checkpoint (a PyTorch DCP one with ``allow_pickle``, Hugging
    Face safetensors), a root, ``ROOT/latest`` or ``ROOT/<step>`` (see
    :class:`~zerostall.roots.naming.Naming`), or an open :class:`Checkpoint`, used as it is;
    closed after, unless the caller opened it."""
    if isinstance(ckpt, Checkpoint):
        yield ckpt
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:  # opening by path would wait for every rank
        raise ExportError(f"export reads {os.fspath(ckpt)} in one process, but torch.distributed is initialized "
                          f"with {torch.distributed.get_world_size()} ranks: open it with zs.open(...) on every "
                          "rank and pass that checkpoint to zs.export on one rank")
    load = LoadOptions(threads=options.threads, allow_pickle=options.allow_pickle)
    with Checkpoint(ckpt, load, instead=Naming(ckpt)) as ck:
        yield ck


def check_target(out: str | os.PathLike[str], options: ExportOptions) -> str:
    """The absolute local path ``out``; refuses one that holds something (unless ``overwrite``), before
    anything is read."""
    path = os.fspath(out)
    if "://" in path and not path.startswith("file://"):
        raise ExportError(f"export writes to a local path, not {path!r}: export there, then copy the files")
    path = os.path.abspath(check_path(path.removeprefix("file://")))
    if options.format == "hf":
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ExportError(f"{path} is a file: a hf export writes a directory")
        held = sorted(n for n in os.listdir(path) if not LEFT_BY_AN_EXPORT.match(n)) if os.path.isdir(path) else []
        if held and not options.overwrite:
            raise CheckpointExistsError(f"{path} is not empty ({len(held)} entries: {', '.join(held[:5])}): pass "
                                        "overwrite=True (--overwrite) to replace its model files")
    elif os.path.isdir(path):
        raise ExportError(f"{path} is a directory: a torch export writes one file")
    elif os.path.lexists(path) and not options.overwrite:
        raise CheckpointExistsError(f"{path} exists: pass overwrite=True (--overwrite) to replace it")
    return path
