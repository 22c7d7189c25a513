"""Running the strategies on the cluster and measuring them.

The job's ranks, memory from ``/proc/self/status``, the step times of one built
strategy (:class:`Instance`), the bytes its collectives put on each link, and the
start-up calibration that turns this cluster into the planner's hardware.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh
from lins_dtensor.bench.model import MODEL_SIZES, batch, build_model, loss_fn
from lins_dtensor.formats import FORMATS
from lins_dtensor.planner.bandwidth import BandwidthTable
from lins_dtensor.planner.compute import model_flops_per_token
from lins_dtensor.planner.cost import network_bytes
from lins_dtensor.planner.memory import rank0_units
from lins_dtensor.planner.models import model_from_module
from lins_dtensor.planner.profile import message_numel, time_collective
from lins_dtensor.runtime import default_units
from lins_dtensor.schedule import GRAD_REDUCE_SCATTER, CollectiveRecord, UnitSchedule, fsdp2_copy_bytes, local_copy_bytes

# The in-run probe of the collectives inside a node: the ops Lins' plans run there (the
# parameters' gathers, the gradients' reduce-scatters), at a message size the profile
# measures (scripts/bench_cluster.sh: 64 KiB to 4 MiB by factors of 4).
INTRA_NODE_PROBE_OPS = ("all_gather", "reduce_scatter")
INTRA_NODE_PROBE_BYTES = 1 << 20
LR = 3e-4  # AdamW's learning rate, for every strategy and the calibration's optimizer step
# Rounds of the start-up calibration after a warm-up round: each quantity is the slowest
# rank's median over them (3 rounds once gave a host time per unit of 0 on 2 shared cores).
CALIBRATION_ROUNDS = 6


# ----- the job --------------------------------------------------------------------------------
class Ranks(NamedTuple):
    """This process's place in the job: its rank, the world size and the ranks per node
    (the launcher's LOCAL_WORLD_SIZE; all of them on one node if it is unset)."""

    rank: int
    world: int
    per_node: int

    @classmethod
    def of_job(cls) -> Ranks:
        world = dist.get_world_size()
        return cls(dist.get_rank(), world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))

    @property
    def nodes(self) -> int:
        return self.world // self.per_node


def run_in_job(body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``body(args)`` in the launcher's job (torchrun): one thread per rank, warnings off,
    on a gloo process group destroyed afterwards, whatever happens."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return body(args)
    finally:
        dist.destroy_process_group()


class SharedGroups:
    """One process group per set of ranks, for every Lins mesh and probe of the run
    (``build_lins_mesh(..., group_for=)``).

    Each gloo group keeps a thread that wakes every 10 ms (gloo's tcp device loop), and
    on 2 cores shared by 8 ranks those wake-ups delay Lins' chains, which go on only
    when their collectives' completions are noticed: with a mesh of its own per
    strategy (4 groups a Lins plan, one-rank dims included) a full run held 87 groups
    per rank, and 80 idle groups made a Lins plan's step 1.4x (exact) to 1.8x (int8)
    slower, DDP's 1.04x and a plain forward+backward not at all (docs/benchmark.md).
    Sharing is safe here because strategies run one at a time, each settled before the
    next starts (:meth:`Instance.timed`), so no two of them have collectives in flight.
    """

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def __call__(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The group of ``ranks``, created (a collective: every rank asks in one order) the first time."""
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks))
        return self._groups[ranks]


def log(rank: int, msg: str) -> None:
    """Progress on rank 0 only, so that the log has one line per event."""
    if rank == 0:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----- /proc memory ------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _release_memory() -> None:
    """Free what can be freed, so that resident-size differences are the strategy's."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> bool:
    """Reset VmHWM to the current resident size (False where the kernel refuses)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ----- one strategy, built and timed -------------------------------------------------------------
@dataclasses.dataclass
class Built:
    """A strategy's model and optimizer, and how the timing loop drives and reads it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    clip: Callable[[], object]
    records: Callable[[], Iterable[CollectiveRecord]]  # the collectives of the last step
    end_step: Callable[[], None]
    state_bytes: Callable[[], dict]  # persistent params / grads / optim bytes on this rank
    microbatch_context: Callable[[int, int], contextlib.AbstractContextManager] | None = None  # (mb, M)
    comm_time: Callable[[], dict] | None = None  # exposed / hidden seconds per state (Lins)
    # Work a step leaves in flight for the next one (Lins' update gathers, which the
    # next forward waits for): None, or a callable that waits for it (untimed).
    settle: Callable[[], None] | None = None
    # The first step that runs as the strategy is measured (PowerSGD: the step it starts
    # compressing at); the warm-up runs through it.
    measured_from_step: int = 0


class Instance:
    """One built strategy (model, optimizer, counters), trained across every M it is used for.

    Memory per rank is measured in two parts, each around a quiet phase (nothing else
    runs): ``persistent`` = VmRSS after building minus VmRSS before (after gc and
    malloc_trim), and ``transient`` = VmHWM during this instance's warm-up steps at M,
    the high-water mark reset just before, minus VmRSS at that moment. Their sum is the
    training peak above the footprint the process had before the strategy existed.
    """

    def __init__(self, key: str, build: Callable[[], Built], args: argparse.Namespace, rank: int) -> None:
        self.key, self.args, self.rank = key, args, rank
        _release_memory()
        dist.barrier()
        before = _status_kib("VmRSS")
        self.built = build()
        _release_memory()
        dist.barrier()
        self.persistent_bytes = (_status_kib("VmRSS") - before) * 1024
        self.step_count = 0
        self.times: dict[int, list[float]] = {}
        self.transient_bytes: dict[int, int | None] = {}
        self.records: dict[int, list] = {}
        self.state_bytes: dict[int, dict] = {}
        self.losses: dict[int, float] = {}
        self.comm_times: dict[int, list[dict]] = {}  # Lins' exposed / hidden seconds per state, per timed step

    def step(self, microbatches: int, measure_states: bool = False, barrier: bool = True,
             marks: list[tuple[str, float]] | None = None) -> float:
        """One optimizer step; returns the slowest rank's wall time. ``measure_states``
        reads the model-state bytes after the optimizer (warm-up steps only, so that the
        timed steps do no accounting). ``barrier=False`` starts the clock as soon as the
        previous step ended on this rank, with its work still in flight. ``marks`` gets
        this rank's ``time.perf_counter()`` at the start and after each part of the step
        (:mod:`.timeline`)."""
        ma = MODEL_SIZES[self.args.model]
        b = self.built
        mark = (lambda _: None) if marks is None else (lambda what: marks.append((what, time.perf_counter())))
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        mark("start")
        for mb in range(microbatches):
            tokens = batch(self.step_count, self.rank, mb, ma.vocab_size, self.args.seq_len, self.args.batch_size)
            ctx = b.microbatch_context(mb, microbatches) if b.microbatch_context else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(b.model, tokens) / microbatches
                mark(f"forward {mb}")
                loss.backward()
                mark(f"backward {mb}")
        b.clip()
        mark("clip")
        b.optimizer.step()
        mark("optimizer")
        if measure_states:
            self.state_bytes[microbatches] = b.state_bytes()
        b.optimizer.zero_grad(set_to_none=True)
        b.end_step()
        mark("end")
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        self.losses[microbatches] = float(loss.detach()) * microbatches
        self.step_count += 1
        return float(elapsed.item())

    def warmup(self, microbatches: int, steps: int) -> None:
        """Untimed steps, alone; they give the transient memory peak at this M. At least
        through the strategy's ``measured_from_step``, so that its peak and the timed
        steps are of the steady state."""
        steps = max(steps, self.built.measured_from_step + 1 - self.step_count)
        _release_memory()
        dist.barrier()
        before = _status_kib("VmRSS")
        reset = _reset_peak()
        for _ in range(steps):
            self.step(microbatches, measure_states=True)
        self.transient_bytes[microbatches] = (_status_kib("VmHWM") - before) * 1024 if reset and steps else None
        if self.built.settle is not None:  # nothing of it in flight while the next strategy warms up
            self.built.settle()
        self.times[microbatches] = []
        self.comm_times[microbatches] = []

    def timed(self, microbatches: int) -> None:
        """One timed step in steady state. A strategy that leaves work in flight for the
        next step (Lins' update gathers, waited for in the next forward) runs an untimed
        lead-in step first, so that the timed step starts with the previous step's
        gathers in flight as in a training loop, and is settled, untimed, afterwards, so
        that its own gathers neither run behind the next strategy's step nor slow it."""
        settle = self.built.settle
        if settle is None:
            self.times[microbatches].append(self.step(microbatches))
        else:
            self.step(microbatches)
            self.times[microbatches].append(self.step(microbatches, barrier=False))
            settle()
        if self.built.comm_time is not None:
            self.comm_times[microbatches].append(self.built.comm_time())

    def finish(self, microbatches: int) -> dict:
        """This rank's measurements at M: times, memory, the last step's collectives and loss."""
        self.records[microbatches] = list(self.built.records())
        transient = self.transient_bytes.get(microbatches)
        return {
            "times": self.times[microbatches],
            "peak_delta_bytes": None if transient is None else self.persistent_bytes + transient,
            "persistent_bytes": self.persistent_bytes,
            "transient_bytes": transient,
            "state_bytes": self.state_bytes.get(microbatches, {}),
            "records": self.records[microbatches],
            "last_loss": self.losses.get(microbatches),
            "comm_time": median_comm_time(self.comm_times.get(microbatches) or [self.built.comm_time()]) if self.built.comm_time else None,
        }


def median_comm_time(steps: list[dict]) -> dict:
    """Per state, the median over the timed steps of Lins' exposed and hidden seconds: a
    single step's split is as noisy as its step time (the calibration reads the median
    step, and so do these)."""
    states = {state for step in steps for state in step}
    return {state: {k: statistics.median(step.get(state, {}).get(k, 0.0) for step in steps) for k in ("exposed", "hidden")}
            for state in sorted(states)}


def summarize_times(times: list[float]) -> dict:
    """Median, extremes and quartiles of the step times, with the samples themselves."""
    ts = sorted(times)
    q = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) >= 2 else [ts[0], ts[0], ts[0]]
    return {"median": statistics.median(ts), "min": ts[0], "max": ts[-1], "q1": q[0], "q3": q[2], "samples": times}


def link_bytes(records: Iterable[CollectiveRecord]) -> dict:
    """Per-rank bytes by link: message bytes (what lins_stats.bytes_by reports) and the
    ring-algorithm bytes through the node's NIC (the planner's network_bytes)."""
    out = {"inter_message_bytes": 0, "intra_message_bytes": 0, "inter_nic_bytes": 0.0, "intra_wire_bytes": 0.0, "collectives": 0}
    for r in records:
        out["collectives"] += r.count
        if r.link == "inter":
            out["inter_message_bytes"] += r.message_bytes * r.count
            out["inter_nic_bytes"] += network_bytes(r)
        else:
            out["intra_message_bytes"] += r.message_bytes * r.count
            out["intra_wire_bytes"] += r.wire_bytes
    return out


# ----- calibration ---------------------------------------------------------------------------------
class InRunProbe:
    """Passes of the start-up, timed again in every timed round of the benchmark, all
    ranks starting together: the plain forward + backward of one micro-batch (the model
    with no strategy applied), the calibration's all-reduce across the nodes (of the size
    each rank reduces under os=<node size>), and the profile's all-gather and
    reduce-scatter over each node's ranks (:data:`INTRA_NODE_PROBE_OPS`, one message of
    :data:`INTRA_NODE_PROBE_BYTES`, timed as the bandwidth table's points are).

    The start-up measures the cores before any strategy exists; timing the same passes
    inside the rounds measures how fast the cores compute, and the links carry, while
    the rows are measured, so that drift of the shared machine and model error can be
    told apart (:meth:`lins_dtensor.bench.planning.Planning.in_run`). Its first run
    showed no drift where rows ran 16-34 % slow, which led to the cause: idle process
    groups' wake-ups, which delay chained collectives and not a plain pass
    (:class:`SharedGroups`). The collectives inside a node run on the same cores, over
    loopback, and are compared with the bandwidth table, profiled before the start-up.
    """

    def __init__(self, args: argparse.Namespace, ranks: Ranks, groups: SharedGroups, table: BandwidthTable) -> None:
        self.model = build_model(args.model)
        self.args, self.rank = args, ranks.rank
        rpn = ranks.per_node
        # Every rank asks for every group (creating one is collective), then keeps its own.
        self.cross = [groups(tuple(local + n * rpn for n in range(ranks.nodes))) for local in range(rpn)][ranks.rank % rpn]
        self.node = [groups(tuple(range(n * rpn, (n + 1) * rpn))) for n in range(ranks.nodes)][ranks.rank // rpn]
        self.message = torch.zeros(sum(p.numel() for p in self.model.parameters()) // rpn)
        self.rpn, self.iters = rpn, int(table.meta.get("iters", 3))
        self.intra_numel = message_numel(INTRA_NODE_PROBE_BYTES, 4, rpn)
        # The same calls as the table has them (None where it lacks the shape, or a node has one rank).
        profiled = [table.seconds(op, rpn, 1, self.intra_numel * 4) for op in INTRA_NODE_PROBE_OPS] if rpn > 1 else [None]
        self.intra_node_profiled_s = None if None in profiled else sum(profiled)
        keys = ["forward_backward_s", "all_reduce_s"] + (["intra_node_s"] if self.intra_node_profiled_s else [])
        self.samples: dict[str, list[float]] = {k: [] for k in keys}

    def forward_backward(self, i: int) -> None:
        ma = MODEL_SIZES[self.args.model]
        loss_fn(self.model, batch(99, self.rank, i, ma.vocab_size, self.args.seq_len, self.args.batch_size)).backward()

    def all_reduce(self) -> None:
        dist.all_reduce(self.message, group=self.cross)

    def intra_node(self) -> float:
        """Seconds of the intra-node probe's calls, timed as :func:`time_collective` times the table's."""
        return sum(time_collective(op, self.node, self.rpn, self.intra_numel, torch.float32, torch.device("cpu"), self.iters)
                   for op in INTRA_NODE_PROBE_OPS)

    def sample(self) -> None:
        """One timed pass of each, all ranks starting together (as at start-up)."""
        for key, work in (("forward_backward_s", lambda: self.forward_backward(len(self.samples["forward_backward_s"]))),
                          ("all_reduce_s", self.all_reduce)):
            dist.barrier()
            t0 = time.perf_counter()
            work()
            self.samples[key].append(time.perf_counter() - t0)
        self.model.zero_grad(set_to_none=True)
        if "intra_node_s" in self.samples:
            self.samples["intra_node_s"].append(self.intra_node())

    def take(self) -> dict:
        """Of each pass, the slowest rank's median of its samples since the last call (a
        collective, as the calibration's figures are); the samples are cleared."""
        keys = list(self.samples)
        mine = torch.tensor([statistics.median(self.samples[k]) for k in keys], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        out = {**dict(zip(keys, (float(v) for v in mine))), "samples": len(self.samples[keys[0]])}
        self.samples = {k: [] for k in keys}
        return out


def calibrate(args: argparse.Namespace, ranks: Ranks, probe: InRunProbe, groups: SharedGroups) -> dict:
    """This machine as the planner sees it, measured while every rank does the same work:

    * the compute rate (forward + backward of one micro-batch), the optimizer rate (an
      AdamW step over the whole model) and the copy rate (a model-sized copy);
    * the host time per unit and micro-batch of FSDP2 (the same forward + backward with
      ``fully_shard`` on one-rank groups, which gather nothing) and of Lins where P is
      replicated (under ``apply_lins`` with the ddp plan, which communicates nothing
      before the step), each less the copies the planner counts for it, taken from each
      round's difference to the plain pass timed just before;
    * how much compute an asynchronous collective hides behind (Lins' executor): an
      all-reduce across the nodes, of the size each rank reduces under os=<node size>,
      alone, two forward + backward passes alone, and the two at once;
    * each lossy wire format's seconds per value: an encode and a decode of that
      message's values, timed in the same rounds as the rest (a separate long pass at
      the end, behind its own barriers, measured bf16 at 15-24 ns per value in the
      benchmark, where its kernels cost about 2 in the run's chains; why is not pinned
      down).
    """
    rank, world, rpn = ranks
    ma = MODEL_SIZES[args.model]
    model = probe.model  # the plain pass is the probe's, so that the rounds' probe compares with it
    replicated_model, fsdp_model = (build_model(args.model) for _ in range(2))
    spec = model_from_module(model, name=f"bench-{args.model}", ffn_dim=ma.ffn_dim)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    replicated = LinsPlan.parse("ddp", world)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mesh = build_lins_mesh(replicated, ranks_per_node=rpn, device_type="cpu", group_for=groups)
    apply_lins(replicated_model, mesh, mp_policy=fp32)
    for unit in [*default_units(fsdp_model), fsdp_model]:
        fully_shard(unit, mesh=mesh.param_mesh(), mp_policy=fp32)  # one-rank groups: FSDP2's host work alone
    numel = sum(p.numel() for p in model.parameters())
    src, dst = torch.randn(numel), torch.empty(numel)
    cross, message = probe.cross, probe.message

    def timed(fn: Callable[[], object]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def forward_backward(net: nn.Module, i: int) -> Callable[[], None]:
        return lambda: loss_fn(net, batch(99, rank, i, ma.vocab_size, args.seq_len, args.batch_size)).backward()

    def compute_twice() -> None:
        forward_backward(model, 0)()
        forward_backward(model, 1)()

    def both() -> None:
        work = dist.all_reduce(message, group=cross, async_op=True)
        compute_twice()
        work.wait()

    lossy = {name: fmt for name, fmt in FORMATS.items() if fmt.lossy}
    encoded = {name: torch.empty(fmt.chunk_bytes(message.numel(), 4), dtype=torch.uint8) for name, fmt in lossy.items()}

    def codec(name: str) -> Callable[[], object]:  # one encode and one decode of every value of the message
        fmt = lossy[name]
        return lambda: fmt.decode(fmt.encode(src[: message.numel()], 1, encoded[name]), 1, message.numel())

    keys = ("plain", "lins", "fsdp", "lins_extra", "fsdp_extra", "step", "copy", "comm", "compute2", "both", *lossy)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    for i in range(CALIBRATION_ROUNDS + 1):
        values = {
            "plain": timed(forward_backward(model, i)),
            "lins": timed(forward_backward(replicated_model, i)),
            "fsdp": timed(forward_backward(fsdp_model, i)),
            "step": timed(opt.step),
            "copy": timed(lambda: dst.copy_(src)),
            "comm": timed(probe.all_reduce),
            "compute2": timed(compute_twice),
            "both": timed(both),
            **{name: timed(codec(name)) for name in lossy},
        }
        # The host time of the hooks, each round against the plain pass just before it:
        # the load on the shared cores drifts less within a round than across the run
        # (a difference of separate medians once measured Lins' hooks as negative).
        values["lins_extra"] = values["lins"] - values["plain"]
        values["fsdp_extra"] = values["fsdp"] - values["plain"]
        for net in (model, replicated_model, fsdp_model):
            net.zero_grad(set_to_none=True)
        if i:  # the first round warms allocators and caches
            for key, value in values.items():
                samples[key].append(value)
    worst = torch.tensor([statistics.median(samples[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    t = dict(zip(keys, (float(v) for v in worst)))
    flops = model_flops_per_token(spec, args.seq_len) * args.seq_len * args.batch_size
    copy_bytes_per_s = 2 * numel * 4 / t["copy"]
    units = rank0_units(spec, replicated)
    copies = local_copy_bytes(replicated, units, microbatches=1, param_bytes=4, reduce_bytes=4)
    replicated_copies = copies["forward"] + copies["backward"]  # its gradients into the G buffers
    fsdp_copies = _one_rank_fsdp2_copy_bytes(units)
    hidden = t["comm"] + t["compute2"] - t["both"]
    return {
        "forward_backward_s": t["plain"],
        "optimizer_step_s": t["step"],
        "copy_s": t["copy"],
        "lins_forward_backward_s": t["lins"],
        "fsdp_forward_backward_s": t["fsdp"],
        "flops_per_microbatch": flops,
        "flops_per_s": flops / t["plain"],
        # The planner's optimizer model: numel * (2 * 4 * (1 + 2) + 4) bytes at hbm_bw.
        "optimizer_bytes_per_s": numel * (2 * 4 * 3 + 4) / t["step"],
        "copy_bytes_per_s": copy_bytes_per_s,
        "unit_overhead_s": max(0.0, (t["fsdp_extra"] - fsdp_copies / copy_bytes_per_s) / len(units)),
        "replicated_unit_overhead_s": max(0.0, (t["lins_extra"] - replicated_copies / copy_bytes_per_s) / len(units)),
        "overlap_probe": {"all_reduce_s": t["comm"], "compute_s": t["compute2"], "both_s": t["both"], "message_bytes": message.numel() * 4},
        "lins_overlap_fraction": min(1.0, max(0.0, hidden / min(t["comm"], t["compute2"]))),
        # Seconds per value encoded or decoded by each lossy wire format (what lins-plan profile measures).
        "codec_s_per_value": {name: t[name] / (2 * message.numel()) for name in lossy},
    }


def _one_rank_fsdp2_copy_bytes(units: Iterable[UnitSchedule]) -> int:
    """Bytes FSDP2 copies in one fp32 forward + backward on one-rank groups (every unit
    resharded after forward, none the root), so that the calibration leaves host time only:

    * its own copies, as the planner charges them for every sharded plan
      (:func:`lins_dtensor.schedule.fsdp2_copy_bytes`, with the shard the whole unit):
      the all-gather's copy-in and copy-out in forward and again in backward, and the
      reduce-scatter's copy-in, 10 passes of the model's bytes;
    * the reduce-scatter itself, which torch replaces on a one-rank group by a copy of
      its input into its output (2 more passes): on real groups it is the collective the
      planner times from the bandwidth table, not host time.
    """
    total = 0
    for unit in units:
        geo = unit.geometry
        own = fsdp2_copy_bytes(geo.params.total_numel, geo.params.chunk_numel, True, microbatches=1, param_bytes=4, reduce_bytes=4)
        total += sum(own.values()) + 2 * geo.message_numel(GRAD_REDUCE_SCATTER) * 4
    return total
