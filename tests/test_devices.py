"""The CUDA bookkeeping that CPU can check: which devices a state is on, which device a worker
thread takes, that nothing touches CUDA for CPU state, and (with a fake ``torch.cuda``) which
device and stream each copy of a capture uses (the CUDA paths themselves are in test_gpu.py)."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from zerostall.saving.capture import BufferPool, capture, record_caller_stream
from zerostall.saving.collect import versions
from zerostall.saving.collect import collect
from zerostall.devices import CallerStreams, cuda_devices, worker_device


def test_cuda_devices_are_the_indices_of_the_cuda_tensors_once_each_in_order():
    with FakeTensorMode():  # CUDA tensors without CUDA: device and metadata only
        tensors = [torch.empty(2, device="cuda:3"), torch.empty(1, device="cuda:1"), torch.empty(4, device="cuda:3")]
    tensors.append(torch.empty(3))
    assert cuda_devices(tensors) == [1, 3]
    assert cuda_devices([torch.empty(1), torch.empty(1, device="meta")]) == []


def test_a_worker_takes_the_callers_device_when_the_work_is_there_else_the_works_first():
    assert worker_device(1, [0, 1]) == 1  # a torchrun rank on cuda:1, or a state over two GPUs
    assert worker_device(0, [1]) == 1  # state on cuda:1 only: no context on GPU 0
    assert worker_device(2, [0, 1]) == 0
    assert worker_device(1, []) == 1


def test_cpu_state_records_no_streams_and_is_not_pinned(tmp_path):
    items = collect({"w": torch.ones(8), "b": torch.zeros(2, 2)}, 0, allow_pickle=False).items
    assert record_caller_stream(items) is None and CallerStreams.of(i.tensor for i in items) is None
    pool = BufferPool()
    pool.buffers(items)
    assert pool.nbytes > 0 and pool.pinned_bytes == 0
    pool.close()
    assert pool.nbytes == 0


class FakeCuda:
    """Just enough of ``torch.cuda`` to follow which device and stream each thread uses: streams,
    events and devices are recorded, nothing runs."""

    def __init__(self, current: int) -> None:
        self.caller = threading.get_ident()
        self.devices = {self.caller: current}  # the current device of each thread (0 until set)
        self.streams: dict[tuple[int, int], Any] = {}  # (thread, device) -> current stream

    def thread_device(self) -> int:
        return self.devices.get(threading.get_ident(), 0)

    def install(self, monkeypatch) -> None:
        cuda = self

        class Stream:
            def __init__(self, device: int | None = None, name: str = "side") -> None:
                self.device = torch.device("cuda", cuda.thread_device() if device is None else device)
                self.name, self.waited, self.synchronized = name, [], False

            def wait_event(self, event) -> None:
                self.waited.append(event)

            def synchronize(self) -> None:
                self.synchronized = True

        class Event:
            def record(self, stream) -> None:
                self.stream = stream

        @contextlib.contextmanager
        def device(d):
            index = d.index if isinstance(d, torch.device) else d
            me, previous = threading.get_ident(), cuda.thread_device()
            cuda.devices[me] = index
            yield
            cuda.devices[me] = previous

        @contextlib.contextmanager
        def stream(s):
            key = (threading.get_ident(), s.device.index)
            previous = cuda.streams.get(key)
            cuda.streams[key] = s
            yield
            cuda.streams[key] = previous

        def current_stream(d: int):
            key = (threading.get_ident(), d)
            return cuda.streams.setdefault(key, Stream(d, name=f"caller's current on {d}"))

        self.Stream = Stream
        for name, value in {"Stream": Stream, "Event": Event, "device": device, "stream": stream,
                            "current_stream": current_stream, "current_device": cuda.thread_device,
                            "set_device": lambda d: cuda.devices.__setitem__(threading.get_ident(), d)}.items():
            monkeypatch.setattr(torch.cuda, name, value)


class FakeDeviceTensor:
    """A tensor on CUDA device ``index``, as far as capture looks at it."""

    def __init__(self, index: int) -> None:
        self.is_cuda, self.device, self._version = True, torch.device("cuda", index), 0
        self.streams: list[Any] = []

    def record_stream(self, stream) -> None:
        self.streams.append(stream)


class Buffer:
    """A host buffer that notes the device and stream current when something is copied into it."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.copies = cuda, []

    def copy_(self, source, non_blocking: bool = False) -> None:
        device = self.cuda.thread_device()
        self.copies.append((source, device, self.cuda.streams.get((threading.get_ident(), source.device.index)),
                            non_blocking))


def test_capture_copies_each_device_on_its_side_stream_after_the_callers_work_there(monkeypatch):
    """A state on cuda:1 and cuda:2 saved from a thread whose current device is 1: the worker takes
    device 1 (never 0), copies each tensor on a side stream of its own device that waited for the
    caller's current stream there, and synchronizes every side stream before capture returns."""
    cuda = FakeCuda(current=1)
    cuda.install(monkeypatch)
    sources = [FakeDeviceTensor(1), FakeDeviceTensor(2), FakeDeviceTensor(2)]
    items = [SimpleNamespace(tensor=t, watch=None, entry=SimpleNamespace(fqn=f"t{n}")) for n, t in enumerate(sources)]
    ready = record_caller_stream(items)
    assert ready is not None and ready.devices == [1, 2] and ready.device == 1
    buffers = [Buffer(cuda) for _ in items]
    worker = threading.Thread(target=capture, args=(items, buffers, ready, versions(items)))
    worker.start()
    worker.join()
    assert cuda.devices[worker.ident] == 1  # set first, and back to it after each copy
    sides = {}
    for source, buf, item in zip(sources, buffers, items):
        [(copied, device, stream, non_blocking)] = buf.copies
        assert copied is source and device == source.device.index and non_blocking and item.tensor is buf
        assert stream.name == "side" and stream.device == source.device and source.streams == [stream]
        sides[device] = stream
    for device, stream in sides.items():
        [event] = stream.waited
        assert event.stream.name == f"caller's current on {device}"
        assert stream.synchronized
