"""Foreign checkpoints read in place of a zerostall one: PyTorch DCP and Hugging Face safetensors.

A foreign checkpoint is translated into the same in-memory :class:`~zerostall.format.layout.Manifest` a
zerostall checkpoint opens to (entries with chunks: data file, offset, length, box in the global
tensor), so the load plan, fetch, broadcast and ``Checkpoint.read`` run unchanged. What differs
is said by ``Manifest.foreign``: its data carry no checksums. Which kind a location holds is found
from what is there: ``.metadata`` (DCP), ``*.safetensors`` files or their index (Hugging Face).
Nothing is imported from torch here: the DCP module is imported only for a DCP checkpoint.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ...format.codec import encode
from ...format.layout import DEFAULT_BLOCK_SIZE, MANIFEST_NAME, Manifest
from ...storage import Storage, storage_for
from .safetensors import INDEX_NAME, hf_entries, hf_files, is_hf_file

DCP = "dcp"
SAFETENSORS = "safetensors"
_DCP_METADATA = ".metadata"  # sources.dcp.METADATA_NAME, without importing torch to detect it


def split_file(path: Any) -> tuple[Storage, str | None]:
    """The storage of ``path`` and, where ``path`` names a single ``.safetensors`` file rather
    than a directory (or prefix), that file's name in its parent's storage. A local file named so
    is followed if it is a symbolic link (a Hugging Face cache's snapshots are links to its blobs):
    the caller named it; links inside a checkpoint are never followed."""
    if isinstance(path, Storage):
        return path, None
    text = os.fspath(path).rstrip("/")
    if text.endswith(".safetensors") and not (os.path.isdir(text) and "://" not in text):
        if "://" not in text and os.path.islink(text):
            text = os.path.realpath(text)
        parent, _, name = text.rpartition("/")
        return storage_for(parent or "."), name
    return storage_for(path), None


def kind_of(names: list[str]) -> str | None:
    """Which foreign checkpoint the location holds (its files are ``names``): DCP, safetensors or none."""
    if MANIFEST_NAME in names:
        return None
    if _DCP_METADATA in names:
        return DCP
    if INDEX_NAME in names or any(is_hf_file(n) for n in names):
        return SAFETENSORS
    return None


def foreign_manifest(storage: Storage, kind: str, *, allow_pickle: bool, file: str | None = None) -> Manifest:
    """The manifest of the foreign checkpoint of ``kind`` at ``storage`` (the one ``file`` only, if given)."""
    if kind == DCP:
        from .dcp import dcp_entries  # imports torch

        entries, files, left_out = dcp_entries(storage, allow_pickle)
    else:
        entries, files = hf_entries(storage, [file]) if file is not None else \
            hf_entries(storage, *hf_files(storage, storage.list()))
        left_out = []
    return Manifest(generation=f"{kind}-0", entries=entries, files=files, tree=encode({}),
                    block_size=DEFAULT_BLOCK_SIZE, created=time.time(), foreign=kind, left_out=left_out)


def describe(kind: str) -> str:
    """How messages name a foreign kind."""
    return "a PyTorch DCP checkpoint" if kind == DCP else "a Hugging Face safetensors checkpoint"
