"""The few collectives zerostall needs, over a process group or trivially in one process."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from . import errors
from .doorbell import store_address
from .errors import CheckpointError
from .memory import owned_bytes


ALONE = object()
"""A ``process_group`` that means this process alone even under ``torch.distributed``: the local
tier's per-rank copies are saved and loaded with it, without any collective."""


class Group:
    """This process's view of the ranks taking part in a save or load.

    ``process_group=None`` means the default group when ``torch.distributed`` is initialized, and a
    world of one otherwise, so single-process code takes exactly the same path.
    """

    def __init__(self, process_group: Any = None) -> None:
        if process_group is ALONE:  # this process on its own, though torch.distributed is initialized
            self.pg, self.rank, self.size, self.store, self.device = None, 0, 1, None, torch.device("cpu")
            return
        active = dist.is_available() and dist.is_initialized()
        if process_group is not None and not active:
            raise ValueError("a process_group was given but torch.distributed is not initialized")
        self.pg = (process_group or dist.group.WORLD) if active else None
        self.rank = dist.get_rank(self.pg) if self.pg is not None else 0
        self.size = dist.get_world_size(self.pg) if self.pg is not None else 1
        self.store = store_address(self.pg) if self.size > 1 else None  # where the commit's doorbell rings
        self.device = torch.device("cpu")
        if self.pg is not None and dist.get_backend(self.pg) == "nccl":
            self.device = self._nccl_device()

    def _nccl_device(self) -> torch.device:
        """The GPU this rank's NCCL collectives use: the one the group is bound to
        (``init_process_group(device_id=...)``), else the current device (``torch.cuda.set_device``)."""
        bound = getattr(self.pg, "bound_device_id", None)
        return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())

    def detached(self) -> "Group":
        """This rank's place in the group without the process group itself (picklable): what the
        background commit needs, since it never runs a collective."""
        copy = object.__new__(Group)
        copy.pg, copy.rank, copy.size, copy.device = None, self.rank, self.size, torch.device("cpu")
        copy.store = self.store
        return copy

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_reduce_ints(self, values: list[int]) -> list[int]:
        """The element-wise sums over ranks of int64 values: one collective of fixed size."""
        if self.pg is None:
            return list(values)
        total = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(total, group=self.pg)
        return total.tolist()

    def all_reduce_min(self, values: list[int]) -> list[int]:
        """The element-wise minima over ranks of int64 values: one collective of fixed size."""
        return self.minima(torch.tensor(values, dtype=torch.int64)).tolist()

    def minima(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise minima over ranks of an int64 CPU tensor (returned on the CPU)."""
        if self.pg is None:
            return values
        least = values.to(self.device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=self.pg)
        return least.cpu()

    def all_reduce_or_fail(self, values: list[int], message: str, *, failed: bool = False) -> list[int]:
        """The sums of ``values`` over ranks, in the same all-reduce as a count of the ranks that
        failed (this one when ``failed``). If any did, the others raise ``CheckpointError(message)``
        (``{failed}`` in it: their number); a failed rank gets the sums and raises its own error.
        Ranks that went on alone would wait for the failed ones in the next collective for good."""
        *sums, count = self.all_reduce_ints([*values, int(failed)])
        if count and not failed:
            raise CheckpointError(message.format(failed=count))
        return sums

    @contextlib.contextmanager
    def failing_together(self, message: str, points: int = 1) -> Iterator[Callable[[], None]]:
        """Run the block on every rank; if it raised on any, raise on all (see :meth:`all_reduce_or_fail`).
        ``points``: the agreements every rank makes, the last at the block's end; the block calls what
        this yields at each earlier one, before a collective of its own (which a rank that failed
        earlier would never join): a failure on any rank by then raises there on every rank."""
        left = [points]

        def agree(failed: bool = False) -> None:
            if left[0] > 0:
                left[0] -= 1
                self.all_reduce_or_fail([], message, failed=failed)

        try:
            yield agree
            while left[0]:
                agree()
        except Exception:  # this rank failed, or learnt another did: it makes every agreement it has not made yet
            while left[0]:
                agree(failed=True)
            raise

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's python object (planning metadata only, never tensor data)."""
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def all_gather_or_fail(self, make: Callable[[], Any], message: str) -> list[Any]:
        """Every rank's ``make()`` in one all-gather; where it raised on any rank, that rank raises
        its error and the others ``CheckpointError(message)`` (see :meth:`all_reduce_or_fail`)."""
        try:
            mine, failure = (True, make()), None
        except Exception as exc:
            mine, failure = (False, None), exc
        got = self.all_gather_object(mine)
        if failure is not None:
            raise failure
        if failed := sum(not ok for ok, _ in got):
            raise CheckpointError(message.format(failed=failed))
        return [value for _, value in got]

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        """``data`` from ``src`` on every rank, sent as a tensor (size first, then the bytes)."""
        if self.pg is None:
            assert data is not None
            return data
        size = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=self._global(src), group=self.pg)
        if self.rank == src and data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src=self._global(src), group=self.pg)
        return bytes(owned_bytes(buf.cpu()))

    def agree(self, decide: Callable[[], bytes]) -> bytes:
        """What ``decide()`` returns on the coordinator, on every rank (one broadcast of bytes); a
        :class:`CheckpointError` it raises is raised on every rank, with its type (any other error
        as a :class:`CheckpointError` naming it, so no rank is left waiting in a collective).
        Ranks deciding for themselves could see different things (a save committing in between)."""
        if self.pg is None:
            return decide()
        payload = None
        failed: Exception | None = None
        if self.is_coordinator:
            try:
                payload = b"V" + decide()
            except CheckpointError as exc:
                payload = b"E" + json.dumps([type(exc).__name__, str(exc)]).encode()
            except Exception as exc:
                failed = exc
                payload = b"E" + json.dumps(["CheckpointError", f"rank 0 failed: {type(exc).__name__}: {exc}"]).encode()
        data = self.broadcast_bytes(payload)
        if failed is not None:
            raise failed
        if data[:1] == b"E":
            kind, message = json.loads(data[1:])
            raise getattr(errors, kind, CheckpointError)(message)
        return data[1:]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast a preallocated tensor in place from group rank ``src``."""
        if self.pg is not None:
            dist.broadcast(tensor, src=self._global(src), group=self.pg)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.pg, group_rank) if self.pg is not dist.group.WORLD else group_rank
