"""CUDA bookkeeping for work done in zerostall's own threads on the caller's behalf.

CUDA keeps the current device per host thread (starting at 0) and the current stream per thread
and device, so a worker thread sees neither the caller's device nor its streams. Three rules
follow, and this module is where they are kept:

- a worker sets its device first (:meth:`CallerStreams.enter`): a CUDA call that is not guarded
  by a device otherwise initializes a context on GPU 0, in every rank's process;
- work queued on the caller's behalf goes on a side stream of the tensor's own device that first
  waits for an event recorded on the caller's current stream of that device when the call was
  made (:meth:`CallerStreams.side_stream`), and is waited for on each of those streams
  (:meth:`CallerStreams.synchronize`);
- a stream is made current only with its device made current too (:func:`on_stream`):
  ``torch.cuda.stream`` alone switches the thread to the stream's device and, when leaving, back
  to the thread's previous device, initializing a context there.

Nothing here calls CUDA unless a tensor is on a CUDA device (or pinning is asked for).
"""

from __future__ import annotations

import contextlib
import operator
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator, Sequence

import torch

_IS_CUDA = operator.attrgetter("is_cuda")
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not one


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The indices of the CUDA devices ``tensors`` are on, in order."""
    tensors = list(tensors)
    on_cuda = list(map(_IS_CUDA, tensors))  # read in C: a save may hold 100,000 tensors, mostly on the host
    return sorted({t.device.index for t, cuda in zip(tensors, on_cuda) if cuda}) if any(on_cuda) else []


def worker_device(current: int, devices: Sequence[int]) -> int:
    """The device a worker thread should make current for work on ``devices``: the caller's
    ``current`` one when the work touches it (or touches none), else the first of ``devices``,
    so that no thread initializes a context on a device the work never uses."""
    return current if current in devices or not devices else devices[0]


class CallerStreams:
    """Where the caller's queued CUDA work stands on each of ``devices``, recorded in the caller's
    thread when it asks for the work: an event on its current stream of each device. Worker
    threads then :meth:`enter` the right device and queue their work on :meth:`side_stream` s,
    which :meth:`synchronize` waits for."""

    def __init__(self, devices: Sequence[int]) -> None:
        self.devices = list(devices)
        self.device = worker_device(torch.cuda.current_device(), self.devices)
        self.events: dict[int, torch.cuda.Event] = {}
        for device in self.devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.events[device] = event
        self._streams: list[torch.cuda.Stream] = []
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor]) -> CallerStreams | None:
        """The caller's streams on the devices of ``tensors``; None when none is on a CUDA device."""
        devices = cuda_devices(tensors)
        return cls(devices) if devices else None

    def enter(self) -> None:
        """Make the work's device current in the calling (worker) thread."""
        torch.cuda.set_device(self.device)

    def side_stream(self, device: int) -> torch.cuda.Stream:
        """A new stream on ``device`` whose work starts after the caller's work queued there
        before this object was made."""
        stream = torch.cuda.Stream(device=device)
        stream.wait_event(self.events[device])
        with self._lock:
            self._streams.append(stream)
        return stream

    def wait(self) -> None:
        """Wait, in any thread, until the caller's work recorded at construction is done."""
        for device, event in self.events.items():
            with torch.cuda.device(device):
                event.synchronize()

    def synchronize(self) -> None:
        """Wait for the work queued so far on every side stream made by :meth:`side_stream`."""
        with self._lock:
            streams = list(self._streams)
        for stream in streams:
            stream.synchronize()


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Queue the block's CUDA work on ``stream``, with its device current for the block only."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


def host_register(ptr: int, nbytes: int, device: int) -> int:
    """Pin ``nbytes`` of host memory at ``ptr`` for every device (``cudaHostRegister``); returns
    cudart's error code (0: pinned). It runs in a thread of its own with ``device`` current:
    cudart keeps a failure as the calling thread's last error, which torch's check after that
    thread's next kernel launch would raise as if the kernel had failed."""

    def register() -> int:
        torch.cuda.set_device(device)
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE))

    with ThreadPoolExecutor(1, thread_name_prefix="zerostall-pin") as pool:
        return pool.submit(register).result()


def host_unregister(ptr: int) -> int:
    """Unpin host memory pinned by :func:`host_register`; returns cudart's error code."""
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))
