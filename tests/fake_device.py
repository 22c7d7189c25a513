"""A stand-in accelerator for Lins' on-device logic, on CPU.

:class:`FakeDevice` implements what :class:`lins_dtensor.collectives.DeviceStreams`
offers (streams, events, the allocator's cross-stream marks, FSDP2's stream waits) and
keeps a record the tests read: how often the host synchronised with the "device", which
event each stream waited for, which tensors were marked for which stream. Its events do
not complete by themselves: the device runs only when the host synchronises on one
(everything recorded up to it completes) or when the test calls :meth:`FakeDevice.run`,
so the host always runs ahead, as it does on a GPU. As on CUDA, ``elapsed_time`` refuses
events that have not both completed, or that were made without timing.

Data still moves eagerly on CPU (gloo's collectives complete when waited for): the fake
checks the order Lins imposes on the device, not the values, which the same runs check
against the CPU path.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from unittest import mock

import torch


class FakeEvent:
    def __init__(self, device: "FakeDevice", stream: "FakeStream", timing: bool) -> None:
        self.device, self.stream, self.timing = device, stream, timing
        self.seq = next(device.sequence)  # recording order, across streams
        self.time: float | None = None  # ms, set when the device completes it
        self.completes_at: float | None = None  # the test's choice of that time, else seq

    def query(self) -> bool:
        return self.time is not None

    def synchronize(self) -> None:
        self.device.host_syncs += 1
        self.device.run(through=self.seq)

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.time is None or end.time is None:
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return end.time - self.time


class FakeStream:
    def __init__(self, device: "FakeDevice", name: str) -> None:
        self.device, self.name = device, name
        self.waited: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)

    def has_waited_for(self, event: FakeEvent) -> bool:
        """Whether this stream waited for ``event`` or a later event of its stream (a
        stream runs in order, so a later point implies the earlier)."""
        return any(w.stream is event.stream and w.seq >= event.seq for w in self.waited)

    def synchronize(self) -> None:
        self.device.host_syncs += 1
        self.device.run()


class FakeDevice:
    """The device API :class:`~lins_dtensor.collectives.DeviceStreams` wraps, faked."""

    def __init__(self) -> None:
        self.sequence = itertools.count()
        self.host_syncs = 0
        self.default = FakeStream(self, "default")
        self.current = self.default
        self.side_streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.marked: list[tuple[torch.Tensor, FakeStream]] = []  # record_stream calls
        self.fsdp_waited: list[tuple[torch.nn.Module, FakeEvent]] = []

    # ----- the DeviceStreams API ---------------------------------------------------------
    def new_stream(self) -> FakeStream:
        stream = FakeStream(self, f"side{len(self.side_streams)}")
        self.side_streams.append(stream)
        return stream

    def current_stream(self) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def event(self, stream: FakeStream, timing: bool) -> FakeEvent:
        event = FakeEvent(self, stream, timing)
        self.events.append(event)
        return event

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.marked.append((tensor, stream))

    def fsdp_waits(self, module: torch.nn.Module, event: FakeEvent) -> None:
        self.fsdp_waited.append((module, event))

    # ----- the test's controls -------------------------------------------------------------
    def run(self, through: int | None = None) -> None:
        """Let the device complete every event recorded so far (or up to ``through``), at
        the time the test set (``completes_at``), else 1 ms apart in recording order."""
        for event in self.events:
            if event.time is None and (through is None or event.seq <= through):
                event.time = float(event.seq) if event.completes_at is None else event.completes_at

    @contextlib.contextmanager
    def installed(self):
        """``apply_lins`` inside this context runs its communication on this device."""
        from lins_dtensor.collectives import CommStream

        with mock.patch("lins_dtensor.runtime.CommStream", functools.partial(CommStream, streams=self)):
            yield self
