"""Lins' own communication at run time: chains of collectives, overlapped with compute.

A :class:`Chain` is the sequence of collectives, and the local copies between them,
that moves one unit's state from one layout to another: a micro-batch's gradient into
the G buffer, the G buffer to the OS-layout gradient (reduce-scatter over optim_shard,
then all-reduce over optim_replica), or the updated masters back to P (all-gathers
over optim_shard and grad_shard). Chains are submitted where their input is ready
(a unit's gradient exists, the optimizer has run) and waited for where their result is
needed (the optimizer step, the unit's next forward); in between they advance on their
own while the model computes:

* **Issue order.** Every rank must issue the collectives of one process group in the
  same order. A chain issues its next collective only when no earlier chain still has
  one to issue on the same mesh dim, so each group sees the chains in submission order,
  which is the same on every rank; collectives on different groups pass each other.
* **Progress.** On CPU, gloo runs asynchronous collectives on its own threads; a chain
  takes its next step when the host finds its collective completed (:meth:`Executor.pump`,
  run at every Lins hook) or when a consumer blocks on it (:meth:`Executor.wait`). On an
  accelerator the host never waits for the device: a chain's whole body is enqueued on
  the Lins side stream when it is submitted, each step behind a stream wait for the
  previous collective, so every group sees the chains in submission order as well.
* **Memory.** A chain holds its transient buffers (packed inputs, gathered outputs;
  :func:`~lins_dtensor.schedule.chain_buffer_bytes` counts them with its input) from
  its first step until it is done. On CPU chains start in submission order, each only
  while the bytes held stay within ``max_inflight_bytes`` (the oldest is waited for
  otherwise); since a chain only ever waits for earlier ones, and every earlier one has
  started, they cannot wait on each other in a circle. On an accelerator a chain's
  buffers live on the side stream and are reused in its order, so at most one body's
  are allocated at a time; what needs a bound is the chain's *input*, made on the
  submitter's stream (autograd's gradient): the chain keeps a reference to it, and
  drops it only once that stream has waited for the chain's end (so the stream reuses
  the memory after the side stream has read it; FSDP2 holds its reduce-scatter inputs
  the same way). When the inputs held would exceed ``max_inflight_bytes``, the oldest
  are released that way: the producer waits, the host goes on.

Chain bodies run without autograd (they move data, never compute on it). Stream
contract (accelerators). A chain's body runs on the side stream
(:class:`~lins_dtensor.collectives.CommStream`). At submission the submitter's current
stream is captured in an event (ordering only, no timestamp) that the side stream waits
on before the body's first step, so the body sees everything the submitter enqueued
(the gradient, the optimizer update). The chain's inputs from the submitter's stream are
held as above; other tensors the body reads that were allocated on another stream
(FSDP2's reduced shard, made on FSDP2's own stream) are marked used on the side stream
(``CommStream.use_on_side``) so that the allocator keeps them until the side stream is
past them. Buffers the body allocates live on the side stream, and c10d keeps the ones
a collective uses until its work is waited on. A consumer's :meth:`Executor.wait` makes
its current stream wait for the chain's end event, and a consumer that keeps a
side-stream buffer (the optimizer's gradients) marks it used on its stream.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
from collections.abc import Callable, Generator, Iterator, Sequence

import torch

from lins_dtensor.collectives import CommStream, CommTiming, Flight, end_process_now, finish_in_flight_at_exit, leaving_on_an_exception


@dataclasses.dataclass(frozen=True)
class Request:
    """A chain asks for its next collective: the executor calls ``start`` (on the side
    stream) when the chain's turn on ``dim`` has come."""

    dim: str
    start: Callable[[], Flight]


Body = Generator[Request, None, None]
_START = "<start>"  # in the blocked set: an earlier chain has not started, so none after it may


class _ChainStage(enum.Enum):
    """Where a chain is in its life (not a training phase: that is :class:`lins_dtensor.schedule.Phase`)."""

    NEW = "new"  # body not started
    RUNNING = "running"  # holding its buffers: a collective in flight or waiting its turn
    DONE = "done"


class Chain:
    """One unit's collectives in sequence. ``dims`` lists the mesh dims of the
    collectives ``body`` will request, in order; ``transient_bytes`` what it allocates
    and holds until done; ``inputs`` the tensors it reads that the submitter's stream
    made (held until that stream no longer needs them kept: see the module docstring)."""

    def __init__(self, name: str, dims: Sequence[str], body: Body, transient_bytes: int,
                 inputs: Sequence[torch.Tensor] = ()) -> None:
        self.name = name
        self.dims = tuple(dims)
        self.body = body
        self.transient_bytes = transient_bytes
        self.inputs = tuple(inputs)
        self.input_bytes = sum(t.numel() * t.element_size() for t in self.inputs)
        self.stage = _ChainStage.NEW
        self.issued = 0  # collectives started
        self.flight: Flight | None = None
        self.request: Request | None = None
        self.ready_event: object = None  # the submitter's stream at submission (accelerators)
        self.input_stream: object = None  # ... and that stream itself, which made the inputs
        self.end_event: object = None  # the side stream after the body's last step (accelerators)
        self.timings: list[CommTiming] = []

    @property
    def done(self) -> bool:
        return self.stage is _ChainStage.DONE

    def remaining_dims(self) -> tuple[str, ...]:
        return self.dims[self.issued :]


class Executor:
    """Runs chains in submission order per process group, overlapped with compute."""

    def __init__(self, stream: CommStream, max_inflight_bytes: int) -> None:
        self.stream = stream
        self.max_inflight_bytes = max_inflight_bytes
        self.chains: list[Chain] = []  # CPU: not done
        # Accelerators: chains enqueued (done on the host) that still hold their inputs,
        # the oldest first; and the end of the last chain enqueued (the side stream runs
        # them in order, so waiting for it waits for all).
        self.holding: list[Chain] = []
        self.last_end: object = None
        # A collective of this executor failed to start or to finish (a peer gone or
        # timed out): its groups cannot be trusted again, and at exit nothing more is
        # issued on them.
        self.failed = False
        # Whether the chains left may be run to their end at exit: the runtime says so
        # only between optimizer steps (a rank that leaves mid-step has peers waiting
        # elsewhere, in collectives it never issues, who would never issue the rest).
        self.drain_at_exit: Callable[[], bool] = lambda: True
        _register_exit_hook()

    # ----- submitting and advancing --------------------------------------------------
    def submit(self, chain: Chain) -> Chain:
        chain.ready_event = self.stream.event_on_current()
        if self.stream.on_device:
            self._enqueue(chain)
            return chain
        self.chains.append(chain)
        _WITH_CHAINS_LEFT[self] = None
        self.pump()
        return chain

    def _enqueue(self, chain: Chain) -> None:
        """Accelerators: enqueue the whole chain on the side stream now. Its inputs stay
        held; the oldest chains' inputs are released first where the bound requires."""
        held = sum(c.input_bytes for c in self.holding)
        while self.holding and held + chain.input_bytes > self.max_inflight_bytes:
            oldest = self.holding.pop(0)
            held -= oldest.input_bytes
            self._release_inputs(oldest)
        chain.input_stream = self.stream.current_stream()
        self._resume(chain)
        while not chain.done:
            self._issue(chain)
            self._resume(chain)
        self.last_end = chain.end_event
        if chain.inputs:
            self.holding.append(chain)

    def _release_inputs(self, chain: Chain) -> None:
        """Accelerators: the stream that made the chain's inputs waits for the chain's
        end, then they are dropped: that stream reuses their memory only after the side
        stream has read them."""
        if chain.inputs:
            self.stream.stream_waits(chain.input_stream, chain.end_event)
            chain.inputs = ()

    def pump(self) -> None:
        """Advance every chain as far as it can go without blocking (CPU; on an
        accelerator every chain was enqueued whole when submitted)."""
        if not self.chains:
            return
        blocked: set[str] = set()
        held = sum(c.transient_bytes for c in self.chains if c.stage is _ChainStage.RUNNING)
        for chain in self.chains:
            held = self._advance(chain, blocked, held)
            if chain.stage is _ChainStage.NEW:
                blocked.add(_START)  # chains start in submission order
        self.chains = [c for c in self.chains if not c.done]
        if not self.chains:
            _WITH_CHAINS_LEFT.pop(self, None)

    def _advance(self, chain: Chain, blocked: set[str], held: int) -> int:
        while not chain.done:
            if chain.flight is not None:
                if not chain.flight.completed():
                    break
                self._resume(chain)
                if chain.done:
                    held -= chain.transient_bytes  # its buffers are free again
                continue
            if chain.remaining_dims()[0] in blocked:
                break
            if chain.stage is _ChainStage.NEW:
                if _START in blocked or (held and held + chain.transient_bytes > self.max_inflight_bytes):
                    break
                held += chain.transient_bytes
                self._resume(chain)
                continue
            self._issue(chain)
        if not chain.done:
            blocked.update(chain.remaining_dims())
        return held

    @contextlib.contextmanager
    def _failing_for_good(self) -> Iterator[None]:
        """Around starting or joining a collective: if it fails, the executor is failed
        (nothing more is issued at exit, so nothing is held for it)."""
        try:
            yield
        except RuntimeError:
            self.failed = True
            _WITH_CHAINS_LEFT.pop(self, None)
            raise

    def _join(self, flight: Flight) -> None:
        with self._failing_for_good():
            flight.join()

    def _issue(self, chain: Chain) -> None:
        """Start the collective the chain asked for (on the side stream)."""
        with self.stream.scope(), self._failing_for_good():
            chain.flight = chain.request.start()
        chain.timings.append(chain.flight.timing)
        chain.request = None
        chain.issued += 1

    def _resume(self, chain: Chain) -> None:
        """Run the chain's body up to its next request (or its end), on the side stream,
        after the collective it waited for."""
        with torch.no_grad(), self.stream.scope():
            if chain.flight is not None:
                self._join(chain.flight)
                chain.flight = None
            else:
                chain.stage = _ChainStage.RUNNING
                self.stream.side_waits(chain.ready_event)
            try:
                request = next(chain.body)
                if not self.stream.on_device:
                    chain.inputs = ()  # the body's first step copied them (packed) on the host
            except StopIteration:
                chain.stage = _ChainStage.DONE
                chain.end_event = self.stream.event_on_side()
                return
        if request.dim != chain.dims[chain.issued]:
            raise RuntimeError(f"lins: chain {chain.name} asked for a collective on {request.dim}, declared {chain.dims[chain.issued]}")
        chain.request = request

    # ----- waiting -------------------------------------------------------------------
    def wait(self, chain: Chain | None) -> None:
        """Block until ``chain`` is done (CPU) or make the caller's stream wait for it
        (accelerators: the host goes on). On CPU host time spent blocked counts as the
        waited collective's exposed time; on an accelerator the first wait's position on
        the caller's stream is where the result was needed."""
        if chain is None:
            return
        if self.stream.on_device:
            if chain.timings and chain.timings[-1].need_event is None:
                chain.timings[-1].needed_at(self.stream.event_on_current(timing=True))
            self.stream.current_waits(chain.end_event)
            return
        while not chain.done:
            self.pump()
            if chain.done:
                break
            self._block_on_oldest(chain)

    def release_inputs(self) -> None:
        """Accelerators: release every chain's inputs (the step does, once it has waited
        for the reductions, so nothing is held through the next forward)."""
        for chain in self.holding:
            self._release_inputs(chain)
        self.holding.clear()

    def wait_all(self) -> None:
        """Everything submitted so far is done (CPU) or waited for by the caller's
        stream, and no chain holds inputs any more."""
        for chain in list(self.chains):
            self.wait(chain)
        self.stream.current_waits(self.last_end)
        self.release_inputs()

    def run_chains_to_end(self) -> None:
        """CPU: issue and wait for everything left of every chain (the host blocks). On
        an accelerator each chain was enqueued whole when submitted: nothing is left;
        after a failed collective, or where :attr:`drain_at_exit` says no, nothing is."""
        if not self.stream.on_device and not self.failed and self.drain_at_exit():
            for chain in list(self.chains):
                self.wait(chain)

    def _block_on_oldest(self, chain: Chain) -> None:
        """Block on the first collective in flight up to ``chain``: the one that must
        finish before anything else up to it can move."""
        for other in self.chains:
            if other.flight is not None:
                self._join(other.flight)  # returns at once if it completed since the pump
                return
            if other is chain:
                break
        raise RuntimeError(f"lins: the executor cannot advance chain {chain.name}: nothing in flight ahead of it")


# ----- When the process ends --------------------------------------------------------
# On CPU a chain issues its next collective only when a Lins hook finds the previous one
# done, so a rank can leave its loop after the last optimizer.step() with collectives of
# its last update gathers not yet issued that faster peers have issued (a gather over
# the node after one across the nodes): they wait in them until this process ends, then
# fail ("Connection closed by peer") and the job fails after training well. At exit
# every executor with chains left first runs them to their end, then the collectives
# still running are waited for (collectives.py says why). This runs after the program's
# destroy_process_group too: torch forgets a destroyed gloo group, but the group object
# Lins holds still runs collectives (gloo's ProcessGroup.shutdown leaves it usable; seen
# on torch 2.11, 2.13 and 2.15: scripts/test_torch_versions.sh), and every peer issues
# the same ones in the same order. Executors with chains left are held here, so that a
# model freed before exit still issues its rest. Children of torch.multiprocessing skip
# atexit: a function run there calls wait_for_updates (or run_every_chain_to_end) before
# it returns. Several models' executors are run to their end in the order they got
# chains, which may differ between ranks: models that share groups are settled with
# wait_for_updates before another steps (build_lins_mesh's group_for).
_WITH_CHAINS_LEFT: dict[Executor, None] = {}  # an ordered set
_exit_hook_registered = False


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(finish_at_exit)
        _exit_hook_registered = True


def run_every_chain_to_end() -> None:
    """Issue and wait for everything left of every executor's chains (CPU): what a
    process does before it ends, so that no peer waits for a collective it never issues."""
    for executor in list(_WITH_CHAINS_LEFT):
        executor.run_chains_to_end()


def finish_at_exit() -> None:
    """Registered with :mod:`atexit` once this process builds an executor: every chain
    run to its end (unless the process leaves on an uncaught exception: its peers may
    never start the same collectives), a failure named on one line with exit status 1;
    then :func:`~lins_dtensor.collectives.finish_in_flight_at_exit`."""
    if not leaving_on_an_exception():
        try:
            run_every_chain_to_end()
        except Exception as error:  # of any kind: named, and the rank ends at once (status 1)
            end_process_now(f"{error} (at exit)")
    finish_in_flight_at_exit()
