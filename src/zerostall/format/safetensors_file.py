"""The data files' safetensors layout: a header padded so the data section starts 4 KiB-aligned,
tensors packed after it with no gaps (docs/format.md §3)."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from .layout import SAFETENSORS_DTYPES, dtype_name, dump_json

if TYPE_CHECKING:  # a header needs no torch: ``zerostall cp`` builds some, by the dtypes' manifest names
    import torch

DATA_ALIGNMENT = 4096

# those a data file's header names (fixed by the format); every other dtype is stored as U8
_WRITTEN = {SAFETENSORS_DTYPES[d]: d
            for d in "F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL F8_E4M3 F8_E5M2".split()}
_EVERY = {name: st for st, name in SAFETENSORS_DTYPES.items()}  # every one safetensors names (an export's)


@dataclass(slots=True)
class FileItem:
    """One tensor (or chunk) placed in a data file: its name there, dtype (or its manifest name,
    ``float32``), shape and size."""

    name: str
    dtype: torch.dtype | str
    shape: tuple[int, ...]
    nbytes: int


def safetensors_dtype(dtype: torch.dtype | str, every: bool = False) -> str | None:
    """The safetensors name of ``dtype`` or of the dtype a manifest names (``BF16``) as a data file
    names it (``every``: as safetensors itself does, for an export); None for one it does not."""
    return (_EVERY if every else _WRITTEN).get(dtype_name(dtype))


def safetensors_header(items: Iterable[FileItem], metadata: dict[str, str],
                       every: bool = False) -> tuple[bytes, list[int]]:
    """A safetensors header holding ``metadata``, padded with spaces so that the data section starts
    4 KiB-aligned (length prefix included), and each item's absolute byte offset in the file. Items
    come ordered by descending itemsize, so packing with no gaps keeps each at its natural alignment;
    a dtype safetensors lacks (or a data file does not name, unless ``every``) is stored as U8 bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    relative, pos = [], 0
    for item in items:
        st_dtype = safetensors_dtype(item.dtype, every)
        shape = list(item.shape) if st_dtype else [item.nbytes]
        header[item.name] = {"dtype": st_dtype or "U8", "shape": shape, "data_offsets": [pos, pos + item.nbytes]}
        relative.append(pos)
        pos += item.nbytes
    text = dump_json(header)
    data_start = -(-(8 + len(text)) // DATA_ALIGNMENT) * DATA_ALIGNMENT
    return struct.pack("<Q", data_start - 8) + text.ljust(data_start - 8), [data_start + r for r in relative]
