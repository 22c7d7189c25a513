"""Every collective Lins issues, the record of each one, and the stream it runs on.

All communication of the runtime goes through the functions here: FSDP2's own
parameter all-gather and gradient reduce-scatter come in through its documented
extension points (:class:`LinsAllGather`, :class:`LinsReduceScatter`), and the
gradient, optimizer and update collectives that FSDP2 cannot express are started by
:func:`start_all_gather`, :func:`start_reduce_scatter`, :func:`start_all_reduce` and
:func:`start_all_to_all` (the wire half of a reduction in a lossy format),
always asynchronously: each returns a :class:`Flight` that the executor
(:mod:`lins_dtensor.executor`) joins where the result is needed. The hosts agree on
which parameters took part in a step with a :class:`HostAllReduce`. Each call is recorded
with its :class:`~lins_dtensor.schedule.CollectiveSpec`, so the accounting
(:func:`lins_dtensor.lins_stats`) sees exactly what went on the wire, with a
:class:`CommTiming` that says how long it ran and how much of that a consumer waited
for (exposed) rather than spent computing (hidden). Each runs inside a profiler range
``lins::<name>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.profiler import record_function

from lins_dtensor.compat import AllGather, ReduceScatter, all_gather_single, fsdp_wait_all_gather_streams, in_backward, reduce_scatter_single
from lins_dtensor.formats import CommFormats
from lins_dtensor.schedule import (
    GRAD_REDUCE_SCATTER,
    PARAM_ALL_GATHER,
    PARAM_REGATHER,
    CollectiveRecord,
    CollectiveSpec,
    Encoded,
    Op,
    link_level,
)


@dataclasses.dataclass(eq=False)
class CommTiming:
    """How long one collective took and how much of it was exposed.

    On CPU (gloo) ``seconds`` runs from the call to when the host first saw it
    completed (the executor polls at every Lins hook, so within one unit's compute of
    gloo's completion; :class:`Flight` says why not exactly then), and ``exposed`` is
    the host time spent blocked on it. On an accelerator both come from
    events: on the Lins side stream before the call and after the stream has waited for
    it, and on the consumer's stream when it needed the result; they are read once the
    events have completed (:meth:`resolve`). ``exposed`` is ``None`` where it is not
    measured: FSDP2's asynchronous collectives, waited for inside FSDP2.
    """

    name: str
    state: str
    started_at: float
    finished_at: float | None = None
    exposed: float | None = 0.0
    start_event: object = None
    end_event: object = None
    need_event: object = None

    @property
    def seconds(self) -> float | None:
        self.resolve()
        return None if self.finished_at is None else self.finished_at - self.started_at

    @property
    def hidden(self) -> float | None:
        total = self.seconds
        return None if total is None or self.exposed is None else max(0.0, total - self.exposed)

    def mark_finished(self) -> None:
        if self.finished_at is None:
            self.finished_at = time.perf_counter()

    def needed_at(self, event: object) -> None:
        """The consumer's stream needed the result at ``event`` (accelerators). Only the
        first consumer counts: a later wait for the same collective (the next step's
        first accumulate re-waiting a reduction) finds it long done and would report
        nothing exposed."""
        if self.need_event is None:
            self.need_event = event

    def resolve(self, block: bool = True) -> bool:
        """Turn device events into seconds; True once they are known. ``elapsed_time``
        needs both of its events completed: with ``block`` the host waits for every
        event involved (only the accounting does, :func:`lins_dtensor.lins_stats`),
        without it a timing whose events are not all complete stays unknown for now."""
        if self.start_event is None or self.end_event is None:
            return True  # CPU, or resolved already
        events = [e for e in (self.start_event, self.end_event, self.need_event) if e is not None]
        if not block and not all(e.query() for e in events):
            return False
        for event in events:
            event.synchronize()
        self.finished_at = self.started_at + self.start_event.elapsed_time(self.end_event) / 1e3
        if self.need_event is not None:
            self.exposed = max(0.0, self.need_event.elapsed_time(self.end_event) / 1e3)
        self.start_event = self.end_event = self.need_event = None
        return True


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """A process group as Lins' collectives see it."""

    size: int
    nodes: int  # the nodes its ranks span
    rank: int  # this rank's index in it
    backend: str


class CommRecorder:
    """The record of every collective, by the optimizer step it belongs to.

    A collective belongs to the step whose work submitted it, even when it is issued
    later (an update gather still queued when the next step begins): callers pass the
    step they captured at submission. The last two ended steps are kept: ``ended(1)``
    is complete once nothing of it is in flight any more, ``ended(2)`` (whose update
    gathers the last step's forward waited for) always is."""

    def __init__(self, ranks_per_node: int, groups: Iterable[dist.ProcessGroup] = ()) -> None:
        self.ranks_per_node = ranks_per_node
        self.step = 0  # steps ended so far: the index of the running one
        self._records: dict[int, list[CollectiveRecord]] = {0: []}
        self._timings: dict[int, list[CommTiming]] = {0: []}
        self._groups: dict[dist.ProcessGroup | None, GroupInfo] = {}
        for group in groups:  # now, while torch's registry knows them
            self.describe(group)

    def ended(self, back: int = 1) -> tuple[list[CollectiveRecord], list[CommTiming]]:
        """Records and timings of the step ``back`` steps before the running one."""
        return self._records.get(self.step - back, []), self._timings.get(self.step - back, [])

    @property
    def last_step(self) -> list[CollectiveRecord]:
        return self.ended(1)[0]

    def describe(self, group: dist.ProcessGroup | None) -> GroupInfo:
        """What Lins needs of ``group``, read from torch's registry once (it forgets a
        group at destroy_process_group, before Lins' last chains run at exit:
        executor.py); the mesh's groups are read when the recorder is made."""
        if group not in self._groups:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            self._groups[group] = GroupInfo(len(ranks), len({r // self.ranks_per_node for r in ranks}),
                                            dist.get_rank(group), dist.get_backend(group))
        return self._groups[group]

    def record(self, spec: CollectiveSpec, group: dist.ProcessGroup | None, message: torch.Tensor, step: int | None = None,
               op: Op | None = None, fmt: str = "exact", exact_bytes: int | None = None) -> CommTiming:
        """Record one collective of ``spec`` (as ``op`` in wire format ``fmt``, standing
        for ``exact_bytes`` of values, when it runs encoded: :class:`~lins_dtensor.schedule.Encoded`)."""
        step = self.step if step is None else step
        info = self.describe(group)
        nbytes = message.numel() * message.element_size()
        timing = CommTiming(spec.name, spec.state, time.perf_counter())
        if step in self._records:  # else: a step already dropped (three steps back)
            self._records[step].append(CollectiveRecord(spec.name, spec.state, op or spec.op, info.size, info.nodes, nbytes, format=fmt, exact_bytes=exact_bytes))
            self._timings[step].append(timing)
        return timing

    def discard_running_step(self) -> None:
        """Forget what the running step recorded (it raised, and is done again)."""
        self._records[self.step], self._timings[self.step] = [], []

    def end_step(self) -> None:
        self.step += 1
        self._records[self.step], self._timings[self.step] = [], []
        for old in [s for s in self._records if s < self.step - 2]:
            del self._records[old], self._timings[old]


# FSDP2 runs its copy-in, all-gather and reduce-scatter streams at high priority, so
# that communication kernels are scheduled ahead of compute kernels queued before them.
HIGH_PRIORITY = -1


class DeviceStreams:
    """The accelerator API Lins' communication needs (streams, events, the caching
    allocator's cross-stream marks), over torch's device module (``torch.cuda``).

    Everything the executor does on a device goes through one of these, so tests can run
    the on-device logic on CPU with a stand-in whose events complete when the test says
    (``tests/fake_device.py``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = torch.get_device_module(device.type)

    def new_stream(self) -> object:
        return self.module.Stream(self.device, priority=HIGH_PRIORITY)

    def current_stream(self) -> object:
        return self.module.current_stream(self.device)

    def use(self, stream: object):
        return self.module.stream(stream)

    def event(self, stream: object, timing: bool) -> object:
        """An event recorded on ``stream`` now; ``timing`` only where its time is read
        (timing events cost a timestamp each)."""
        event = self.module.Event(enable_timing=timing)
        event.record(stream)
        return event

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        tensor.record_stream(stream)

    def fsdp_waits(self, module: torch.nn.Module, event: object) -> None:
        fsdp_wait_all_gather_streams(module, event)


class CommStream:
    """Where Lins' own communication work runs.

    On an accelerator: one high-priority side stream per model, on which Lins packs and
    unpacks buffers, issues its collectives (c10d's NCCL stream waits for it at each
    call) and waits for them (a stream wait, never the host); consumers on other
    streams wait for its events. One stream keeps the buffer lifetimes simple: a buffer
    a chain allocates and drops on it is reused only by work queued after, in stream
    order. Its price is that the collectives of different chains run one after another.
    On CPU there are no streams: gloo runs asynchronous collectives on its own threads
    and the host orders what follows by waiting on work handles.
    """

    def __init__(self, device: torch.device, streams: DeviceStreams | None = None) -> None:
        self.device = device
        self.api = streams if streams is not None else (None if device.type == "cpu" else DeviceStreams(device))
        self.stream = self.api.new_stream() if self.api is not None else None

    @property
    def on_device(self) -> bool:
        return self.stream is not None

    def scope(self):
        """Run what follows on the side stream (nothing to do on CPU)."""
        return self.api.use(self.stream) if self.stream is not None else contextlib.nullcontext()

    def current_stream(self) -> object:
        """The caller's current stream (None on CPU)."""
        return None if self.api is None else self.api.current_stream()

    def event_on_current(self, timing: bool = False) -> object:
        """An event on the caller's current stream (None on CPU)."""
        return None if self.api is None else self.api.event(self.api.current_stream(), timing)

    def event_on_side(self, timing: bool = False) -> object:
        return None if self.stream is None else self.api.event(self.stream, timing)

    def side_waits(self, event: object) -> None:
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def current_waits(self, event: object) -> None:
        self.stream_waits(self.current_stream(), event)

    def stream_waits(self, stream: object, event: object) -> None:
        """``stream`` waits for ``event`` (nothing on CPU, where both are None)."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    def fsdp_waits(self, module: torch.nn.Module, event: object) -> None:
        """FSDP2's all-gather streams for ``module`` wait for ``event`` (Lins wrote its
        sharded parameters on the side stream)."""
        if self.api is not None and event is not None:
            self.api.fsdp_waits(module, event)

    def use_on_side(self, *tensors: torch.Tensor) -> None:
        """Tensors allocated on another stream and read or written on the side stream:
        the caching allocator must not hand their memory out again before the side
        stream is past its work on them."""
        if self.stream is not None:
            for t in tensors:
                self.api.record_stream(t, self.stream)

    def use_on_current(self, *tensors: torch.Tensor) -> None:
        """Tensors allocated on the side stream and kept by the caller's stream."""
        if self.api is not None:
            current = self.api.current_stream()
            for t in tensors:
                self.api.record_stream(t, current)


class Flight:
    """One asynchronous collective: its work handle and its timing. The tensors it
    reads and writes are held by whoever started it until it is joined (and, with
    NCCL, by c10d until its work is waited on)."""

    def __init__(self, work: dist.Work, spec: CollectiveSpec, timing: CommTiming, stream: CommStream,
                 on_join: Callable[[], object] | None = None) -> None:
        self.work, self.spec, self.timing, self.stream = work, spec, timing, stream
        self._on_join = on_join  # what completes the collective once its work is done (gloo's reduce-scatter)
        # No Python callback on the work's future: gloo would run it on its own thread,
        # and one that runs (or is freed) there after the interpreter began to shut down
        # aborts the process ("terminate called without an active exception": the thread
        # cannot take the GIL any more). The finish time is when the host sees the work
        # completed instead (completed(), polled at every Lins hook, or join()).
        self.joined = False
        _LIVE_FLIGHTS.add(self)  # waited for at exit

    def completed(self) -> bool:
        """CPU: has gloo finished it, so that what depends on it can start without
        blocking the host? (On a device only the exit hook asks: the side stream orders
        the rest.)"""
        if self.joined:
            return True
        if self.work.is_completed():
            self.timing.mark_finished()
            return True
        return False

    def join(self) -> None:
        """Order what follows after this collective: on a device the side stream waits
        for it (the host does not block); on CPU the host blocks, and the time it spends
        blocked is this collective's exposed time."""
        if self.joined:
            return
        with _naming_failures(self.spec):
            if self.stream.on_device:
                with self.stream.scope():
                    self.work.wait()
                    if self._on_join is not None:
                        self._on_join()
                self.timing.end_event = self.stream.event_on_side(timing=True)
            else:
                start = time.perf_counter()
                self.work.wait()
                self.timing.exposed += time.perf_counter() - start
                self.timing.mark_finished()
                if self._on_join is not None:
                    self._on_join()
        self.joined = True


# ----- In flight when the interpreter exits ---------------------------------------------
# A loop may end with collectives still running: the last step's update gathers always
# are (each unit's next forward would wait for its own). c10d's work then holds their
# tensors on gloo's (or NCCL's watchdog) thread, and if the interpreter's shutdown drops
# Lins' last reference first, that thread frees the tensors after the interpreter stopped
# taking the GIL: the thread cannot release their Python objects and the process aborts
# ("terminate called without an active exception" in ~AsyncAllgatherWork, seen one
# torchtitan run in eight). A work the host has waited for is not safe yet either: gloo
# marks it completed before its thread drops its own reference, and a run that waits
# for its last gathers (LinsTrainer.train) reaches the shutdown milliseconds later.
# torch's destroy_process_group waits only for works with Python hooks
# (ProcessGroup._wait_for_pending_works); Lins waits for its own at exit: the executor's
# exit hook (:func:`lins_dtensor.executor.finish_at_exit`) first runs every chain to its
# end, then calls :func:`finish_in_flight_at_exit`.
_LIVE_FLIGHTS: weakref.WeakSet[Flight] = weakref.WeakSet()
# After the last work completes, the time c10d's thread may take to drop its reference
# to it (microseconds; longer when the thread is descheduled on a busy host).
_RELEASE_GRACE_S = 0.2


def leaving_on_an_exception() -> bool:
    """Whether the interpreter is exiting on an uncaught exception (its peers may never
    start the same collectives; they learn of the failure from torchrun)."""
    return getattr(sys, "last_value", None) is not None


def finish_in_flight_at_exit() -> None:
    """At exit: wait for every Lins collective still running, then give c10d's threads
    the grace to drop their references to the last ones, so that none frees their
    tensors after the interpreter shut down.

    A rank leaving on an uncaught exception does not wait: it ends at once, past the
    interpreter's shutdown, with exit status 1. A collective that fails here (a peer gone)
    is named on one line and the rank ends with status 1 the same way."""
    running = [f for f in list(_LIVE_FLIGHTS) if not f.completed()]
    if running and leaving_on_an_exception():
        end_process_now(f"lins: exiting on an uncaught exception with {len(running)} collective(s) in flight "
                        f"(e.g. {running[0].spec.name}): not waiting for them")
    for flight in running:
        try:
            flight.join()  # CPU: the host blocks until gloo is done (naming a failure)
        except RuntimeError as error:
            end_process_now(f"{error} (at exit)")
        # A device: join() only ordered the side stream (on CPU it blocked until done).
        while flight.stream.on_device and not flight.work.is_completed():
            time.sleep(0.001)
    time.sleep(_RELEASE_GRACE_S)


def end_process_now(message: str) -> None:
    """Print ``message`` on one line and end the process with status 1 at once (also
    past the interpreter's shutdown)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


# ----- Lins' own collectives: asynchronous, recorded ---------------------------------
def _start(recorder: CommRecorder, stream: CommStream, spec: CollectiveSpec, group, message: torch.Tensor, call, step: int | None,
           op: Op | None = None, fmt: str = "exact", exact_bytes: int | None = None,
           on_join: Callable[[], object] | None = None) -> Flight:
    with record_function(f"lins::{spec.name}"):
        timing = recorder.record(spec, group, message, step, op, fmt, exact_bytes)
        with stream.scope():
            timing.start_event = stream.event_on_side(timing=True)  # None on CPU
            with _naming_failures(spec):
                work = call()
        return Flight(work, spec, timing, stream, on_join)


def start_all_gather(recorder: CommRecorder, stream: CommStream, spec: CollectiveSpec, output: torch.Tensor, input: torch.Tensor, group,
                     step: int | None = None, fmt: str = "exact", exact_bytes: int | None = None) -> Flight:
    """All-gather ``input`` into ``output``; ``fmt``: the wire format their bytes are in
    (encoded bytes standing for ``exact_bytes``, :mod:`lins_dtensor.formats`), also for
    the gather half of an encoded all-reduce."""
    return _start(recorder, stream, spec, group, output,
                  lambda: all_gather_single(output, input, group=group, async_op=True), step, Op.ALL_GATHER, fmt, exact_bytes)


def start_all_to_all(recorder: CommRecorder, stream: CommStream, spec: CollectiveSpec, output: torch.Tensor, input: torch.Tensor, group,
                     step: int | None = None, fmt: str = "exact", exact_bytes: int | None = None) -> Flight:
    """Send chunk ``j`` of ``input`` (encoded bytes) to rank ``j`` of ``group``, receive
    theirs into ``output``: the wire half of a reduction in a lossy format."""
    return _start(recorder, stream, spec, group, input,
                  lambda: dist.all_to_all_single(output, input, group=group, async_op=True), step, Op.ALL_TO_ALL, fmt, exact_bytes)


def start_reduce_scatter(recorder: CommRecorder, stream: CommStream, spec: CollectiveSpec, output: torch.Tensor, input: torch.Tensor, group, step: int | None = None) -> Flight:
    """``output`` = this rank's chunk of ``input`` summed over ``group``.

    gloo (CPU tensors) has no reduce-scatter of its own: it clones the input, all-reduces
    the clone and copies this rank's chunk out when the work is waited for
    (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), and that work never reports
    ``is_completed()``, so the CPU executor, which polls, could start nothing after it
    until the host blocked. Lins takes the same three steps around an all-reduce whose
    work does report it: the same bytes on the wire and bitwise the same sums."""
    info = recorder.describe(group)
    if input.device.type == "cpu" and info.backend == "gloo":
        summed, chunks, rank = input.clone(), info.size, info.rank
        return _start(recorder, stream, spec, group, input,
                      lambda: dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group, async_op=True), step,
                      on_join=lambda: output.copy_(summed.chunk(chunks)[rank]))
    return _start(recorder, stream, spec, group, input,
                  lambda: reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True), step)


def start_all_reduce(recorder: CommRecorder, stream: CommStream, spec: CollectiveSpec, tensor: torch.Tensor, group, step: int | None = None) -> Flight:
    return _start(recorder, stream, spec, group, tensor,
                  lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True), step)


def all_reduce(recorder: CommRecorder, spec: CollectiveSpec, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """A blocking all-reduce on the caller's stream (the clipping norm's scalar)."""
    with record_function(f"lins::{spec.name}"):
        timing = recorder.record(spec, group, tensor)
        with _naming_failures(spec):
            dist.all_reduce(tensor, op=op, group=group)
        _time_blocking_call(timing, tensor.device)


class HostAllReduce:
    """An all-reduce of a small host tensor over the hosts' gloo group, started now and
    waited for where its result is read: gloo runs it on its own threads, so neither
    the host nor any device stream waits for it in between. The time the host spends
    blocked in :meth:`result` is its exposed time. Over a group of one rank there is
    nothing to agree on: no collective, nothing recorded (as the schedule counts it)."""

    def __init__(self, recorder: CommRecorder, spec: CollectiveSpec, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
        self.tensor, self.spec = tensor, spec
        self._work: dist.Work | None = None
        if dist.get_world_size(group) == 1:
            return
        with record_function(f"lins::{spec.name}"):
            self.timing = recorder.record(spec, group, tensor)
            with _naming_failures(spec):
                self._work = dist.all_reduce(tensor, op=op, group=group, async_op=True)

    def result(self) -> torch.Tensor:
        if self._work is not None:
            start = time.perf_counter()
            with _naming_failures(self.spec):
                self._work.wait()
            self.timing.exposed = time.perf_counter() - start
            self.timing.mark_finished()
            self._work = None
        return self.tensor


@contextlib.contextmanager
def _naming_failures(spec: CollectiveSpec):
    """A collective that fails (a peer died, stopped or timed out: c10d's
    DistBackendError is a RuntimeError) fails with Lins' name for it, on one line."""
    try:
        yield
    except RuntimeError as error:
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError(f"lins: collective {spec.name} ({spec.state}) failed: {cause}") from error


def _time_blocking_call(timing: CommTiming, device: torch.device) -> None:
    if device.type == "cpu":  # gloo finished it inside the call: all of it was waited for
        timing.mark_finished()
        timing.exposed = timing.finished_at - timing.started_at
    else:  # only launched: it runs on a stream Lins does not watch
        timing.exposed = None


# ----- FSDP2's collectives, recorded through its extension points ----------------------
def _fsdp_call(recorder: CommRecorder, spec: CollectiveSpec, group, message: torch.Tensor, call, async_op: bool,
               fmt: str = "exact", exact_bytes: int | None = None):
    with record_function(f"lins::{spec.name}"):
        timing = recorder.record(spec, group, message, fmt=fmt, exact_bytes=exact_bytes)
        work = call()
        if async_op:
            timing.exposed = None  # FSDP2 waits for it where Lins cannot see
        else:
            _time_blocking_call(timing, message.device)
    return work


class LinsAllGather(AllGather):
    """FSDP2's parameter all-gather, recorded (FSDP2 ``set_custom_all_gather``), in the
    wire format ``formats`` gives parameters on its group's link level.

    Lossy: each rank encodes its shard, the encoded shards are gathered, and every rank,
    the owner of a shard included, writes the decoded values into FSDP2's output, so every
    rank computes with bitwise the same parameters (forward and backward alike: the
    encoding is deterministic) while its shard stays what it was. Streams: FSDP2 calls
    this on its all-gather stream; the encode, the collective and (synchronous) the
    decode are ordered on it, and the encoded buffers are allocated there and freed once
    the decode is enqueued. Asynchronous (CPU, explicit prefetch): FSDP2 waits through
    :class:`_DecodedOnWait`, which decodes once the gather has completed and keeps the
    encoded buffers alive until then. A unit whose gather FSDP2 packs as bytes (parameters
    of several dtypes) is gathered exact."""

    def __init__(self, recorder: CommRecorder, formats: CommFormats = CommFormats()) -> None:
        self.recorder = recorder
        self.formats = formats

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        spec = PARAM_REGATHER if in_backward() else PARAM_ALL_GATHER
        encoded = self._encoded(spec, group, input_tensor) if self.formats.lossy else None
        if encoded is None:
            call = lambda: all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)  # noqa: E731
            return _fsdp_call(self.recorder, spec, group, output_tensor, call, async_op)
        fmt, size, device = encoded.fmt, encoded.chunks, input_tensor.device
        sent = fmt.encode(input_tensor, 1, torch.empty(encoded.chunk_bytes, dtype=torch.uint8, device=device))
        gathered = torch.empty(encoded.message_bytes, dtype=torch.uint8, device=device)

        def decode() -> None:
            output_tensor.view(size, -1).copy_(fmt.decode(gathered, size, encoded.chunk_numel))

        call = lambda: all_gather_single(gathered, sent, group=group, async_op=async_op)  # noqa: E731
        work = _fsdp_call(self.recorder, spec, group, gathered, call, async_op, fmt=fmt.name, exact_bytes=encoded.exact_message_bytes)
        if async_op:
            return _DecodedOnWait(work, decode)
        decode()
        return work

    def _encoded(self, spec: CollectiveSpec, group, input_tensor: torch.Tensor) -> Encoded | None:
        """How this gather runs in the params format of its group's level (None: exact)."""
        if not input_tensor.is_floating_point():
            return None
        info = self.recorder.describe(group)
        fmt = self.formats.of("params", link_level(info.nodes))
        return Encoded.shrinking(spec, fmt, info.size, input_tensor.numel(), input_tensor.element_size())


class _DecodedOnWait(dist.Work):
    """An asynchronous lossy gather as FSDP2 waits for it: :meth:`wait` waits for the
    encoded gather, then decodes it into FSDP2's output (once)."""

    def __init__(self, work: dist.Work, decode) -> None:
        super().__init__()
        self._work, self._decode = work, decode

    def wait(self, *args) -> bool:
        if self._decode is not None:
            self._work.wait(*args)
            self._decode()
            self._decode = None
        return True


class LinsReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter over the P group, recorded (``set_custom_reduce_scatter``)."""

    def __init__(self, recorder: CommRecorder) -> None:
        self.recorder = recorder

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        call = lambda: reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)  # noqa: E731
        return _fsdp_call(self.recorder, GRAD_REDUCE_SCATTER, group, input_tensor, call, async_op)
