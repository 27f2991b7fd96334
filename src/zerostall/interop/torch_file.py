"""A ``torch.save`` file of a flat ``{key: tensor}`` dict, written one tensor at a time.

torch's file is a zip archive: a pickle of the structure whose tensors refer to storages by key,
then one record per storage. The pickle needs only each tensor's dtype and shape, so it is written
first and each tensor's bytes are asked for only when its record is written: one tensor is in
memory at a time. The records are the ones ``torch.save`` writes (``_rebuild_tensor_v3``, an
untyped storage per tensor, aligned for ``torch.load(..., mmap=True)``), so
``torch.load(..., weights_only=True)`` reads the file.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import sys
from typing import Any, Callable

import torch

_PROTOCOL = 2  # torch.save's default


class _Storage:
    """A storage record of the archive, pickled as torch's persistent id."""

    __slots__ = ("key", "nbytes")

    def __init__(self, key: str, nbytes: int) -> None:
        self.key, self.nbytes = key, nbytes


class _Tensor:
    """A tensor that is not in memory: pickles as the one ``torch.save`` writes, over its record."""

    __slots__ = ("storage", "dtype", "shape")

    def __init__(self, storage: _Storage, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.storage, self.dtype, self.shape = storage, dtype, shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        stride, step = [], 1
        for size in reversed(self.shape):
            stride.insert(0, step)
            step *= max(size, 1)
        return (torch._utils._rebuild_tensor_v3,
                (self.storage, 0, tuple(self.shape), tuple(stride), False, collections.OrderedDict(), self.dtype))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.nbytes)
        return None


def write_torch_file(path: str, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
                     data: Callable[[int], torch.Tensor], shared: dict[int, int] | None = None) -> None:
    """Write ``path`` as ``torch.save`` would write the dict of ``tensors`` (key, dtype, shape);
    ``data(i)`` gives the values of the ``i``-th tensor (contiguous, in host memory; its storage may
    be longer, a reused buffer) when its record is written, and is then dropped. A tensor ``i`` in
    ``shared`` is the tensor ``shared[i]`` (tied weights): one storage record serves both, as
    ``torch.save`` writes them, so ``torch.load`` gives them tied again."""
    shared = shared or {}
    structure = {}
    storages: list[_Storage] = []
    sizes = {}
    for i, (key, dtype, shape) in enumerate(tensors):
        if i in shared:
            storage = storages[shared[i]]
        else:
            storage = _Storage(str(i), dtype.itemsize * math.prod(shape))
            sizes[i] = storage.nbytes
        storages.append(storage)
        structure[key] = _Tensor(storage, dtype, tuple(shape))
    buf = io.BytesIO()
    _Pickler(buf, protocol=_PROTOCOL).dump(structure)
    alignment = torch.serialization._get_storage_alignment()
    writer = torch._C.PyTorchFileWriter(path, True, alignment)
    for name, record in (("data.pkl", buf.getvalue()), (".format_version", b"1"),
                         (".storage_alignment", str(alignment).encode()), ("byteorder", sys.byteorder.encode())):
        writer.write_record(name, record, len(record))
    for i, nbytes in sizes.items():
        tensor = data(i)
        if tensor.nbytes != nbytes or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"tensor {tensors[i][0]} is not {nbytes} contiguous bytes in host memory")
        if tensor.storage_offset():
            tensor = tensor.clone()  # the record is written from the start of the storage
        writer.write_record(f"data/{i}", tensor.untyped_storage(), nbytes)
        del tensor
    writer.write_end_of_file()
