"""Cluster benchmark: Lins (planner's plan and presets) vs FSDP2, HSDP, hpZ and DDP.

Run under a launcher that sets RANK / WORLD_SIZE / LOCAL_WORLD_SIZE (torchrun), on
gloo; ``scripts/bench_cluster.sh`` runs it on an emulated multi-node cluster (network
namespaces, rate-limited links) after profiling the planner's bandwidth table there.

Every strategy is built once (a LLaMA-style model, :mod:`.model`) and trained through
every M. For each micro-batch count M: each strategy runs ``--warmup`` untimed steps
alone (its memory is measured there), then ``--steps`` timed rounds run one step of
every strategy each, in an order rotated every round, so that load drifting on the
shared CPUs hits all strategies alike. It records:

* step time (slowest rank of each step; median, min, max, quartiles) and tokens/s;
* peak memory per rank from ``/proc/self/status``: resident growth while the strategy
  is built (VmRSS after - before) plus the peak of its warm-up steps (VmHWM, reset via
  ``/proc/self/clear_refs`` just before, minus VmRSS then); plus the persistent
  model-state bytes read from the live tensors;
* bytes per rank on inter-node and intra-node groups, counted as they are issued:
  Lins by its own recorder (``lins_stats``); FSDP2 / HSDP / hpZ with the same
  recording comm objects installed through ``set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` and HSDP's all-reduce through ``set_all_reduce_hook``;
  DDP through a recording communication hook;
* the planner's prediction for the same strategy (its cost model with the measured
  bandwidth table and a compute rate calibrated on this cluster at start-up).

Rank 0 writes ``cluster.json``, ``cluster.md`` and ``cluster.png`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lins_dtensor.bench.model import MODEL_SIZES, batch, build_model, loss_fn

GiB = 1 << 30
MAX_NORM = 1.0
LR = 3e-4

STRATEGIES = ("lins-planner", "lins-fsdp", "lins-zero1", "lins-zero2", "fsdp2", "hsdp", "hsdp-deferred", "hpz", "ddp")
DESCRIPTIONS = {
    "lins-planner": "Lins, the planner's plan",
    "lins-fsdp": "Lins, fsdp preset (FSDP-equivalent plan)",
    "lins-zero1": "Lins, zero1 preset",
    "lins-zero2": "Lins, zero2 preset",
    "fsdp2": "stock FSDP2 (fully_shard per block over all ranks)",
    "hsdp": "FSDP2 HSDP, node = shard group (all-reduce every micro-batch)",
    "hsdp-deferred": "FSDP2 HSDP, all-reduce only on the last micro-batch (hand-tuned)",
    "hpz": "FSDP2, reshard_after_forward=<node size> (ZeRO++ hpZ)",
    "ddp": "torch DistributedDataParallel (no_sync on all but the last micro-batch)",
}


# ----- /proc memory ------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _release_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ----- a strategy's model, optimizer and byte counter ------------------------------------------
@dataclasses.dataclass
class Built:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    clip: object  # callable() -> None
    records: object  # callable() -> list[CollectiveRecord] of the last step
    end_step: object  # callable() -> None
    state_bytes: object  # callable() -> dict
    microbatch_context: object = None  # callable(mb, M) -> context manager
    comm_time: object = None  # callable() -> exposed / hidden seconds per state (Lins)
    # Work a step leaves in flight for the next one (Lins' update gathers, which the
    # next forward waits for): None, or a callable that waits for it (untimed).
    settle: object = None


def _nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _torch_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from lins_dtensor.optimizer import optimizer_state_bytes

    params = [p for p in model.parameters()]
    return {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params),
        "optim": optimizer_state_bytes(optimizer),
    }


def _torch_built(trained: nn.Module, model: nn.Module, recorder, microbatch_context=None) -> Built:
    """A torch-native strategy (FSDP2 family, DDP): AdamW and torch's clipping over the
    parameters of ``model``, trained through ``trained`` (the model or its wrapper)."""
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=True)
    return Built(
        trained, opt,
        clip=lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM),
        records=lambda: recorder.last_step,
        end_step=recorder.end_step,
        state_bytes=lambda: _torch_state_bytes(model, opt),
        microbatch_context=microbatch_context,
    )


class Strategies:
    """Builds each strategy on the same model; caches meshes so M=1 and M=4 share them."""

    def __init__(self, args, world: int, rpn: int) -> None:
        self.args, self.world, self.rpn = args, world, rpn
        self._meshes: dict = {}

    def lins_mesh(self, plan):
        from lins_dtensor import build_lins_mesh

        key = ("lins", str(plan))
        if key not in self._meshes:
            self._meshes[key] = build_lins_mesh(plan, ranks_per_node=self.rpn, device_type="cpu")
        return self._meshes[key]

    def device_mesh(self, shape: tuple, names: tuple | None):
        from torch.distributed.device_mesh import init_device_mesh

        key = ("dm", shape)
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return self._meshes[key]

    # ----- Lins ---------------------------------------------------------------------------
    def lins(self, plan_text: str) -> Built:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from lins_dtensor import LinsPlan, apply_lins, clip_grad_norm_, lins_optimizer, lins_stats, set_gradient_accumulation_steps, wait_for_updates
        from lins_dtensor.stats import memory_bytes

        plan = LinsPlan.parse(plan_text, self.world)
        mesh = self.lins_mesh(plan)
        model = build_model(self.args.model)
        apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
        opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.1, foreach=True)

        def context(mb: int, m_total: int):
            # The trainer tells Lins the step's micro-batch count, as torchtitan's
            # integration does, so the last one reduces during its backward.
            set_gradient_accumulation_steps(model, m_total)
            return contextlib.nullcontext()

        return Built(
            model, opt,
            clip=lambda: clip_grad_norm_(model, MAX_NORM),
            records=lambda: lins_stats(model).collectives,
            end_step=lambda: None,  # the Lins optimizer hook ends the recorder's step
            state_bytes=lambda: memory_bytes(model),
            microbatch_context=context,
            comm_time=lambda: lins_stats(model).comm_time(),
            settle=lambda: wait_for_updates(model),
        )

    # ----- FSDP2 family (torchtitan-style units) ------------------------------------------------
    def fsdp2(self, kind: str) -> Built:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from lins_dtensor.collectives import CommRecorder, LinsAllGather, LinsReduceScatter
        from lins_dtensor.runtime import default_units
        from lins_dtensor.schedule import OPTIM_ALL_REDUCE

        if kind in ("hsdp", "hsdp-deferred"):
            mesh = self.device_mesh((self.world // self.rpn, self.rpn), ("replicate", "shard"))
        else:
            mesh = self.device_mesh((self.world,), None)
        reshard = self.rpn if kind == "hpz" else True
        model = build_model(self.args.model)
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        recorder = CommRecorder(self.rpn)
        # The same units Lins shards (torchtitan's: embedding, each block, norm, output),
        # every one resharded after forward (torchtitan's "always" policy), then the root.
        units = [*default_units(model), model]
        for m in units:
            fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard if m is not model else True)
        for m in units:
            m.set_custom_all_gather(LinsAllGather(recorder))
            m.set_custom_reduce_scatter(LinsReduceScatter(recorder))
            # gloo has no AVG / PREMUL_SUM reductions: sum, then scale (same result).
            m.set_force_sum_reduction_for_comms(True)
            if kind in ("hsdp", "hsdp-deferred"):
                group = mesh.get_group("replicate")
                m.set_all_reduce_hook(lambda out, g=group: recorder.record(OPTIM_ALL_REDUCE, g, out))
        context = None
        if kind == "hsdp-deferred":
            @contextlib.contextmanager
            def context(mb: int, m_total: int):
                model.set_requires_all_reduce(mb == m_total - 1)
                yield

        return _torch_built(model, model, recorder, context)

    # ----- DDP ----------------------------------------------------------------------------------
    def ddp(self) -> Built:
        from lins_dtensor.collectives import CommRecorder
        from lins_dtensor.schedule import OPTIM_ALL_REDUCE

        model = build_model(self.args.model)
        recorder = CommRecorder(self.rpn)

        def hook(state, bucket):
            buf = bucket.buffer()
            recorder.record(OPTIM_ALL_REDUCE, None, buf)
            buf.div_(self.world)
            fut = dist.all_reduce(buf, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, hook)

        def context(mb: int, m_total: int):
            return ddp.no_sync() if mb < m_total - 1 else contextlib.nullcontext()

        return _torch_built(ddp, model, recorder, context)


# ----- measuring ---------------------------------------------------------------------------------
class Instance:
    """One built strategy (model, optimizer, counters), trained across every M it is used for.

    Memory per rank is measured in two parts, each around a quiet phase (nothing else
    runs): ``persistent`` = VmRSS after building minus VmRSS before (after gc and
    malloc_trim), and ``transient`` = VmHWM during this instance's warm-up steps at M,
    the high-water mark reset just before, minus VmRSS at that moment. Their sum is the
    training peak above the footprint the process had before the strategy existed.
    """

    def __init__(self, key: str, build, args, rank: int) -> None:
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

    def step(self, microbatches: int, measure_states: bool = False, barrier: bool = True) -> float:
        """One optimizer step; returns the slowest rank's wall time. ``measure_states``
        reads the model-state bytes after the optimizer (warm-up steps only, so that the
        timed steps do no accounting). ``barrier=False`` starts the clock as soon as the
        previous step ended on this rank, with its work still in flight."""
        ma = MODEL_SIZES[self.args.model]
        b = self.built
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        for mb in range(microbatches):
            tokens = batch(self.step_count, self.rank, mb, ma.vocab_size, self.args.seq_len, self.args.batch_size)
            ctx = b.microbatch_context(mb, microbatches) if b.microbatch_context else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(b.model, tokens) / microbatches
                loss.backward()
        b.clip()
        b.optimizer.step()
        if measure_states:
            self.state_bytes[microbatches] = b.state_bytes()
        b.optimizer.zero_grad(set_to_none=True)
        b.end_step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        self.losses[microbatches] = float(loss.detach()) * microbatches
        self.step_count += 1
        return float(elapsed.item())

    def warmup(self, microbatches: int, steps: int) -> None:
        """Untimed steps, alone; they give the transient memory peak at this M."""
        _release_memory()
        dist.barrier()
        before = _status_kib("VmRSS")
        reset = _reset_peak()
        for _ in range(steps):
            self.step(microbatches, measure_states=True)
        self.transient_bytes[microbatches] = (_status_kib("VmHWM") - before) * 1024 if reset and steps else None
        self.times[microbatches] = []

    def timed(self, microbatches: int) -> None:
        """One timed step in steady state. A strategy that leaves work in flight for the
        next step (Lins' update gathers, waited for in the next forward) runs an untimed
        lead-in step first, so that the timed step starts with the previous step's
        gathers in flight as in a training loop, and is settled, untimed, afterwards, so
        that its own gathers neither run behind the next strategy's step nor slow it."""
        settle = self.built.settle
        if settle is None:
            self.times[microbatches].append(self.step(microbatches))
            return
        self.step(microbatches)
        self.times[microbatches].append(self.step(microbatches, barrier=False))
        settle()

    def finish(self, microbatches: int) -> dict:
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
            "comm_time": self.built.comm_time() if self.built.comm_time else None,
        }


def summarize_times(times: list[float]) -> dict:
    ts = sorted(times)
    q = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) >= 2 else [ts[0], ts[0], ts[0]]
    return {"median": statistics.median(ts), "min": ts[0], "max": ts[-1], "q1": q[0], "q3": q[2], "samples": times}


def link_bytes(records) -> dict:
    """Per-rank bytes by link: message bytes (what lins_stats.bytes_by reports) and the
    ring-algorithm bytes through the node's NIC (the planner's network_bytes)."""
    from lins_dtensor.planner.cost import network_bytes

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


# ----- calibration and the planner ---------------------------------------------------------------
def calibrate(args, rank: int, world: int, rpn: int) -> dict:
    """This machine as the planner sees it, measured while every rank does the same work:

    * the compute rate (forward + backward of one micro-batch), the optimizer rate (an
      AdamW step over the whole model) and the copy rate (a model-sized copy);
    * the host time per unit and micro-batch of FSDP2 (the same forward + backward with
      ``fully_shard`` on one-rank groups, which gather nothing) and of Lins where P is
      replicated (under ``apply_lins`` with the ddp plan, which communicates nothing
      before the step), each less the copies the planner counts for it;
    * how much compute an asynchronous collective hides behind (Lins' executor): an
      all-reduce across the nodes, of the size each rank reduces under os=<node size>,
      alone, two forward + backward passes alone, and the two at once.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh
    from lins_dtensor.planner.cost import model_flops_per_token
    from lins_dtensor.planner.memory import rank0_units
    from lins_dtensor.planner.models import model_from_module
    from lins_dtensor.runtime import default_units
    from lins_dtensor.schedule import local_copy_bytes

    ma = MODEL_SIZES[args.model]
    model, replicated_model, fsdp_model = (build_model(args.model) for _ in range(3))
    spec = model_from_module(model, name=f"bench-{args.model}", ffn_dim=ma.ffn_dim)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    replicated = LinsPlan.parse("ddp", world)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mesh = build_lins_mesh(replicated, ranks_per_node=rpn, device_type="cpu")
    apply_lins(replicated_model, mesh, mp_policy=fp32)
    for unit in [*default_units(fsdp_model), fsdp_model]:
        fully_shard(unit, mesh=mesh.param_mesh(), mp_policy=fp32)  # one-rank groups: FSDP2's host work alone
    numel = sum(p.numel() for p in model.parameters())
    src, dst = torch.randn(numel), torch.empty(numel)
    nodes = world // rpn
    cross = [dist.new_group([local + n * rpn for n in range(nodes)]) for local in range(rpn)][rank % rpn]
    message = torch.zeros(numel // rpn)

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def forward_backward(net: nn.Module, i: int):
        return lambda: loss_fn(net, batch(99, rank, i, ma.vocab_size, args.seq_len, args.batch_size)).backward()

    def compute_twice():
        forward_backward(model, 0)()
        forward_backward(model, 1)()

    def both():
        work = dist.all_reduce(message, group=cross, async_op=True)
        compute_twice()
        work.wait()

    samples: dict[str, list[float]] = {k: [] for k in ("plain", "step", "copy", "lins", "fsdp", "comm", "compute2", "both")}
    for i in range(4):
        values = {
            "plain": timed(forward_backward(model, i)),
            "step": timed(opt.step),
            "copy": timed(lambda: dst.copy_(src)),
            "lins": timed(forward_backward(replicated_model, i)),
            "fsdp": timed(forward_backward(fsdp_model, i)),
            "comm": timed(lambda: dist.all_reduce(message, group=cross)),
            "compute2": timed(compute_twice),
            "both": timed(both),
        }
        for net in (model, replicated_model, fsdp_model):
            net.zero_grad(set_to_none=True)
        if i:  # the first round warms allocators and caches
            for key, value in values.items():
                samples[key].append(value)
    worst = torch.tensor([statistics.median(v) for v in samples.values()], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    t = dict(zip(samples, (float(v) for v in worst)))
    flops = model_flops_per_token(spec, args.seq_len) * args.seq_len * args.batch_size
    copy_bytes_per_s = 2 * numel * 4 / t["copy"]
    units = rank0_units(spec, replicated)
    copies = local_copy_bytes(replicated, units, microbatches=1, param_bytes=4, reduce_bytes=4)
    replicated_copies = copies["forward"] + copies["backward"]  # its gradients into the G buffers
    # FSDP2 on one rank copies each unit into its all-gather input and out again, in
    # forward and in the re-gather of backward, and its gradient into the reduce-scatter
    # input and out (12 passes of the model's bytes; cf. schedule.local_copy_bytes).
    fsdp_copies = 12 * numel * 4
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
        "unit_overhead_s": max(0.0, (t["fsdp"] - t["plain"] - fsdp_copies / copy_bytes_per_s) / len(units)),
        "replicated_unit_overhead_s": max(0.0, (t["lins"] - t["plain"] - replicated_copies / copy_bytes_per_s) / len(units)),
        "overlap_probe": {"all_reduce_s": t["comm"], "compute_s": t["compute2"], "both_s": t["both"], "message_bytes": message.numel() * 4},
        "lins_overlap_fraction": min(1.0, max(0.0, hidden / min(t["comm"], t["compute2"]))),
    }


class Overlap(NamedTuple):
    """An overlap model of the planner: how much compute hides FSDP2's per-micro-batch
    collectives, and Lins' asynchronous ones (TrainingSpec's two fractions)."""

    fsdp: float
    lins: float

    def __str__(self) -> str:
        return f"FSDP2 {self.fsdp:g} / Lins {self.lins:g}"


@dataclasses.dataclass
class Planning:
    spec: object
    hardware: object
    table: object
    world: int
    rpn: int
    args: object
    run_overlap: Overlap  # the run's: FSDP2 blocks on CPU, Lins' as calibrated
    reference_overlap: Overlap  # the planner's GPU defaults

    def cluster(self, budget_gib: float | None):
        from lins_dtensor.planner import ClusterSpec

        budget = math.inf if budget_gib is None else budget_gib * GiB
        return ClusterSpec(self.world, self.rpn, self.hardware, self.table, budget)

    def training(self, microbatches: int, overlap: Overlap):
        from lins_dtensor.planner import TrainingSpec

        a = self.args
        return TrainingSpec(
            seq_len=a.seq_len, micro_batch=a.batch_size, global_batch_tokens=a.seq_len * a.batch_size * self.world * microbatches,
            param_bytes=4, reduce_bytes=4, master_bytes=4, activation_bytes=4, clip_grad_norm=True,
            overlap_fraction=overlap.fsdp, lins_overlap_fraction=overlap.lins,
        )

    def choose(self, microbatches: int, budget_gib: float | None, overlap: Overlap) -> dict:
        """Rank 0's choice, sent to every rank: each rank building a different plan from a
        near-tie would deadlock the first collective that only some of them issue."""
        choice = [self._choose(microbatches, budget_gib, overlap) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def _choose(self, microbatches: int, budget_gib: float | None, overlap: Overlap) -> dict:
        from lins_dtensor.planner import PlannerError, choose_plan

        try:
            plan, ex = choose_plan(self.spec, self.cluster(budget_gib), self.training(microbatches, overlap))
        except PlannerError as exc:
            return {"plan": None, "error": str(exc)}
        return {
            "plan": str(plan), "reason": ex.reason, "predicted_step_s": ex.cost.step_s,
            "predicted_peak_bytes": ex.cost.memory.peak, "valid_plans": len(ex.ranked) + len(ex.dropped),
            "dropped_for_memory": len(ex.dropped), "table_fallbacks": [list(s) for s in ex.table_fallbacks],
            "top5": [{"plan": str(c.plan), "step_s": c.step_s} for c in ex.ranked[:5]],
        }

    def predict(self, microbatches: int, eq: "Equivalent") -> dict:
        """The planner's prediction with the run's overlap model, plus the reference one's step time."""
        out = self._predict(microbatches, eq, self.run_overlap)
        out["step_s_reference"] = self._predict(microbatches, eq, self.reference_overlap)["step_s"]
        return out

    def _predict(self, microbatches: int, eq: "Equivalent", overlap: Overlap) -> dict:
        """The planner's cost of ``eq.plan`` as run by the strategy ``eq`` describes:
        stock HSDP has FSDP2 all-reduce (``fsdp2_reductions``), on every micro-batch but the
        last too (``extra_all_reduce``); DDP has neither FSDP2's nor Lins' host time per
        unit and copies (``fsdp_hooks=False``; its own bucket copies are not modelled)."""
        from lins_dtensor import LinsPlan
        from lins_dtensor.planner import evaluate
        from lins_dtensor.planner.bandwidth import CollectiveTimer
        from lins_dtensor.planner.memory import rank0_units
        from lins_dtensor.schedule import step_collectives

        plan = LinsPlan.parse(eq.plan, self.world)
        cluster, training = self.cluster(None), self.training(microbatches, overlap)
        if not eq.fsdp_hooks:
            bare = dataclasses.replace(cluster.hardware, unit_overhead_s=0.0, replicated_unit_overhead_s=0.0, copy_bw=math.inf)
            cluster = dataclasses.replace(cluster, hardware=bare)
        timer = CollectiveTimer(cluster.hardware, self.rpn, self.table)
        extra = []
        if eq.extra_all_reduce and microbatches > 1:
            once = step_collectives(
                plan, rank0_units(self.spec, plan), world_size=self.world, ranks_per_node=self.rpn, microbatches=1,
                param_bytes=training.param_bytes, reduce_bytes=training.reduce_bytes,
            )
            extra = [dataclasses.replace(r, count=r.count * (microbatches - 1)) for r in once if r.name == "optim_all_reduce"]
        cost = evaluate(plan, self.spec, cluster, training, timer, extra_backward=extra, fsdp2_reductions=eq.fsdp2_reductions)
        step_s, exposed, comm = cost.step_s, cost.exposed_s, cost.comm_s
        inter_nic, intra = cost.link_bytes("inter"), cost.link_bytes("intra")
        return {
            "plan": eq.plan, "step_s": step_s, "compute_s": cost.compute_s, "comm_s": comm, "exposed_s": exposed,
            "memory": cost.memory.gib(), "peak_bytes": cost.memory.peak,
            "state_bytes": {"params": cost.memory.params, "grads": cost.memory.grads, "optim": cost.memory.optim},
            "inter_nic_bytes": inter_nic, "intra_wire_bytes": intra,
        }


# The plan the planner costs for each strategy (same bytes on the same groups).
class Equivalent(NamedTuple):
    plan: str
    extra_all_reduce: bool  # stock HSDP: an all-reduce on every micro-batch, not once per step
    fsdp_hooks: bool  # runs FSDP2's or Lins' per-unit hooks and copies (calibrated host time, local_copy_bytes)
    note: str
    fsdp2_reductions: bool = False  # the step reductions are FSDP2's (blocking on CPU), not Lins' chains


def equivalent_plan(strategy: str, rpn: int, plan: str | None = None) -> Equivalent:
    if strategy in ("lins-planner", "lins-plan"):
        return Equivalent(plan, False, True, "the planner's own plan" if strategy == "lins-planner" else "a Lins plan given on the command line")
    return {
        "fsdp2": Equivalent("fsdp", False, True, "costed as Lins p=N,g=N,os=N (same collectives)"),
        "hsdp": Equivalent(f"hsdp:{rpn}", True, True, f"costed as hsdp:{rpn} with FSDP2's all-reduce, on every micro-batch", True),
        "hsdp-deferred": Equivalent(f"hsdp:{rpn}", False, True, f"costed as hsdp:{rpn} with FSDP2's all-reduce, last micro-batch only", True),
        "hpz": Equivalent(f"hpz:{rpn}", False, True, f"costed as hpz:{rpn}"),
        "ddp": Equivalent("ddp", False, False, "costed as Lins ddp without per-unit host time and copies (one all-reduce per "
                          "step, overlapped with the last backward as DDP's buckets are)"),
        "lins-fsdp": Equivalent("fsdp", False, True, ""),
        "lins-zero1": Equivalent("zero1", False, True, ""),
        "lins-zero2": Equivalent("zero2", False, True, ""),
    }[strategy]


# ----- main -------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m lins_dtensor.bench.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--microbatches", default="1,4", help="comma list of M (micro-batches per step)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed steps per strategy and M")
    p.add_argument("--strategies", default="all", help=f"comma list of {','.join(STRATEGIES)} or 'all'; 'lins:<plan>' "
                   "adds a Lins plan of your choice (separate with ';' when a plan has commas)")
    p.add_argument("--memory-budget-gib", type=float, default=0.0625,
                   help="per-rank budget the planner must respect (the run also plans with no budget); 0: only unlimited")
    p.add_argument("--bandwidth", required=True, help="table from 'python -m lins_dtensor.planner profile'")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--link-rate", default="", help="the emulated link rate (recorded in the results)")
    p.add_argument("--overlap-fraction", type=float, default=0.0,
                   help="the planner's overlap_fraction (FSDP2's collectives) for its plans and predictions; 0 (nothing "
                        "hides) is how FSDP2 runs on CPU, where it blocks on its collectives")
    p.add_argument("--lins-overlap-fraction", type=float, default=None,
                   help="the planner's lins_overlap_fraction (Lins' asynchronous collectives); default: measured at start-up")
    p.add_argument("--reference-overlap-fraction", type=float, default=0.8,
                   help="a second overlap model, for FSDP2's and Lins' collectives alike (default: the planner's GPU "
                        "default); every row gets its prediction, and its unlimited-memory pick is measured too")
    p.add_argument("--skip-reference-plan", action="store_true",
                   help="do not measure the plan picked under --reference-overlap-fraction")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.microbatches = [int(x) for x in str(args.microbatches).split(",") if x.strip()]
    args.strategies = list(STRATEGIES) if args.strategies == "all" else [s.strip() for s in args.strategies.split(";" if ";" in args.strategies else ",") if s.strip()]
    unknown = [s for s in args.strategies if s not in STRATEGIES and not s.startswith("lins:")]
    if unknown:
        p.error(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    if args.steps < 1 or args.warmup < 1 or not args.microbatches or min(args.microbatches) < 1:
        p.error("need --steps >= 1, --warmup >= 1 (it measures memory) and micro-batch counts >= 1")
    return args


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return run(args)
    finally:
        dist.destroy_process_group()


def run(args) -> int:
    from lins_dtensor.planner import hardware_preset
    from lins_dtensor.planner.bandwidth import BandwidthTable
    from lins_dtensor.planner.models import model_from_module

    from lins_dtensor.bench import report

    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    t_start = time.time()
    ma = MODEL_SIZES[args.model]
    log(rank, f"world {world} = {world // rpn} nodes x {rpn}; model {args.model} ({ma.num_params() / 1e6:.2f} M params), "
        f"seq {args.seq_len} x {args.batch_size} per micro-batch, M in {args.microbatches}")

    calib = calibrate(args, rank, world, rpn)
    log(rank, f"calibration: fwd+bwd {calib['forward_backward_s']:.3f} s/micro-batch -> {calib['flops_per_s'] / 1e9:.2f} GFLOP/s per rank; "
        f"AdamW step {calib['optimizer_step_s']:.3f} s; copies {calib['copy_bytes_per_s'] / 1e9:.2f} GB/s; "
        f"host time per unit and micro-batch: FSDP2 {calib['unit_overhead_s'] * 1e3:.1f} ms, Lins with P replicated "
        f"{calib['replicated_unit_overhead_s'] * 1e3:.1f} ms; async collectives hide behind {calib['lins_overlap_fraction']:.2f} "
        f"of the compute they overlap")
    hw = dataclasses.replace(
        hardware_preset("cpu-emulated"), name="cpu-emulated (calibrated)", ranks_per_node=rpn,
        peak_flops=calib["flops_per_s"], efficiency=1.0, hbm_bw=calib["optimizer_bytes_per_s"], copy_bw=calib["copy_bytes_per_s"],
        unit_overhead_s=calib["unit_overhead_s"], replicated_unit_overhead_s=calib["replicated_unit_overhead_s"],
    )
    table = BandwidthTable.load(args.bandwidth)
    spec = model_from_module(build_model(args.model), name=f"bench-{args.model}", ffn_dim=ma.ffn_dim)
    lins_overlap = calib["lins_overlap_fraction"] if args.lins_overlap_fraction is None else args.lins_overlap_fraction
    run_overlap = Overlap(args.overlap_fraction, lins_overlap)
    reference_overlap = Overlap(args.reference_overlap_fraction, args.reference_overlap_fraction)
    planning = Planning(spec, hw, table, world, rpn, args, run_overlap, reference_overlap)
    budgets = [None] + ([args.memory_budget_gib] if args.memory_budget_gib else [])

    choices = {}  # (M, budget label) -> dict
    for m in args.microbatches:
        for b in budgets:
            choices[(m, budget_label(b))] = planning.choose(m, b, run_overlap)
        if not args.skip_reference_plan:
            choices[(m, reference_label(args))] = planning.choose(m, None, reference_overlap)

    strategies = Strategies(args, world, rpn)
    from lins_dtensor import LinsPlan

    # Rows to report per M: (strategy, label, plan text or None, instance key).
    plan_of = {}
    chosen_for: dict[tuple[int, str], list[str]] = {}  # (M, plan) -> the budget labels it was picked for
    wanted: dict[int, list[tuple[str, str, str | None, str]]] = {}
    for m in args.microbatches:
        rows_m = []
        if "lins-planner" in args.strategies:
            seen = set()
            for lb in [budget_label(b) for b in budgets] + ([reference_label(args)] if not args.skip_reference_plan else []):
                plan = choices[(m, lb)]["plan"]
                if plan and plan not in seen:
                    seen.add(plan)
                    chosen_for[(m, plan)] = [lb for (mm, lb), c in choices.items() if mm == m and c["plan"] == plan]
                    rows_m.append(("lins-planner", f"Lins planner [{', '.join(chosen_for[(m, plan)])}]", plan, f"lins:{plan}"))
        for s in args.strategies:
            if s == "lins-planner" or (s == "hsdp-deferred" and m == 1):
                continue  # hsdp-deferred is hsdp itself with one micro-batch
            if s.startswith("lins:"):
                plan = str(LinsPlan.parse(s[len("lins:"):], world))
                rows_m.append(("lins-plan", f"Lins, plan {plan}", plan, f"lins:{plan}"))
            elif s.startswith("lins-"):
                plan = str(LinsPlan.parse(equivalent_plan(s, rpn).plan, world))
                rows_m.append((s, DESCRIPTIONS[s], plan, f"lins:{plan}"))
            else:
                rows_m.append((s, DESCRIPTIONS[s], None, s))
        wanted[m] = rows_m
        for _, _, plan, key in rows_m:
            plan_of[key] = plan

    # Build every distinct strategy once (Lins rows with the same plan share one).
    instances: dict[str, Instance] = {}
    for key, plan in plan_of.items():
        t0 = time.time()
        if plan is not None:
            build = lambda p=plan: strategies.lins(p)  # noqa: E731
        elif key == "ddp":
            build = strategies.ddp
        else:
            build = lambda k=key: strategies.fsdp2(k)  # noqa: E731
        instances[key] = Instance(key, build, args, rank)
        log(rank, f"built {key} ({time.time() - t0:.0f} s)")

    def write_results(done: list) -> None:
        if rank != 0:
            return
        meta = {
            "world_size": world, "nodes": world // rpn, "ranks_per_node": rpn, "link_rate": args.link_rate,
            "backend": "gloo", "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "model": {"size": args.model, **dataclasses.asdict(ma), "params": ma.num_params(), "units": len(spec.unit_shapes())},
            "seq_len": args.seq_len, "batch_size": args.batch_size, "microbatches": args.microbatches,
            "warmup_steps": args.warmup, "timed_steps": args.steps, "dtype": "fp32 params, fp32 gradient reduction, AdamW",
            "overlap_fraction": run_overlap.fsdp, "lins_overlap_fraction": run_overlap.lins,
            "reference_overlap_fraction": args.reference_overlap_fraction,
            "memory_budget_gib": args.memory_budget_gib or None, "bandwidth_table": os.path.abspath(args.bandwidth),
            "calibration": calib, "hardware": {k: v for k, v in dataclasses.asdict(hw).items()},
            "planner": [{"microbatches": m, "budget": lb, **c} for (m, lb), c in choices.items()],
            "elapsed_s": time.time() - t_start, "completed_microbatches": list(done),
            "methods": report.METHODS,
        }
        result = report.assemble(meta, rows)
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "cluster.json"), "w") as f:
            json.dump(result, f, indent=1, default=_json_default)
            f.write("\n")
        with open(os.path.join(args.out_dir, "cluster.md"), "w") as f:
            f.write(report.markdown(result))
        if not args.no_plot:
            report.plot(result, os.path.join(args.out_dir, "cluster.png"))
        log(rank, f"wrote {args.out_dir}/cluster.json, cluster.md{'' if args.no_plot else ', cluster.png'} ({time.time() - t_start:.0f} s)")

    rows, done = [], []
    for m in args.microbatches:
        active = list(dict.fromkeys(key for _, _, _, key in wanted[m]))
        for key in active:
            instances[key].warmup(m, args.warmup)
        log(rank, f"M={m}: warmed up {len(active)} strategies; {args.steps} timed rounds")
        # Interleaved: one step of each strategy per round, the order rotated every round,
        # so that load drifting on the shared CPUs hits every strategy alike.
        for r in range(args.steps):
            shift = r % len(active)
            for key in active[shift:] + active[:shift]:
                instances[key].timed(m)
        results = {key: instances[key].finish(m) for key in active}
        for name, label, plan, key in wanted[m]:
            result = results[key]
            gathered = [None] * world
            dist.all_gather_object(gathered, {"peak": result["peak_delta_bytes"], "persistent": result["persistent_bytes"],
                                              "transient": result["transient_bytes"], "states": result["state_bytes"],
                                              "comm_time": result["comm_time"]})
            if rank == 0:
                eq = equivalent_plan(name, rpn, plan)
                pred, note = planning.predict(m, eq), eq.note
                reused = any(r_["microbatches"] == m and r_["instance"] == key for r_ in rows)
                rows.append(make_row(name, label, plan, m, result, gathered, pred, note, reused, args, world, budgets, key))
                if name == "lins-planner":
                    rows[-1]["chosen_for"] = chosen_for[(m, plan)]
            times = summarize_times(result["times"])
            log(rank, f"M={m} {label:60.60s} {plan or '':22s} median {times['median']:.3f} s [{times['min']:.3f}, {times['max']:.3f}]")
        done.append(m)
        write_results(done)  # after every M, so that a run cut short keeps what it measured

    dist.barrier()
    return 0


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "value"):
        return o.value
    return str(o)


def reference_label(args) -> str:
    return f"unlimited, overlap model {args.reference_overlap_fraction:g}"


def budget_label(budget_gib: float | None) -> str:
    return "unlimited" if budget_gib is None else f"{budget_gib:g} GiB"


def make_row(name, label, plan, m, result, gathered, pred, note, reused, args, world, budgets, instance) -> dict:
    times = summarize_times(result["times"])
    tokens = world * m * args.batch_size * args.seq_len
    peaks = [g["peak"] for g in gathered if g["peak"] is not None]
    states = [sum(g["states"].values()) for g in gathered if g["states"]]
    fits = {}
    for b in budgets:
        if b is not None:
            fits[budget_label(b)] = pred["peak_bytes"] <= b * GiB
    fits["unlimited"] = True
    return {
        "strategy": name,
        "label": label,
        "plan": plan,
        "microbatches": m,
        "instance": instance,
        "reused_measurement": reused,
        "step_time_s": times,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / times["median"],
        "peak_memory": {
            "rss_delta_max_bytes": max(peaks) if peaks else None,
            "rss_delta_mean_bytes": statistics.mean(peaks) if peaks else None,
            "rss_persistent_max_bytes": max(g["persistent"] for g in gathered),
            "rss_transient_max_bytes": max((g["transient"] for g in gathered if g["transient"] is not None), default=None),
            "model_state_bytes_max": max(states) if states else None,
            "model_state_bytes_rank0": gathered[0]["states"],
        },
        "bytes_per_rank": link_bytes(result["records"]),
        "comm_time_s": mean_comm_time([g["comm_time"] for g in gathered]),
        "link_floor_s": link_floor(pred, link_bytes(result["records"]), args),
        "predicted": {**pred, "note": note},
        "fits": fits,
        "last_loss": result["last_loss"],
    }


def mean_comm_time(per_rank: list[dict | None]) -> dict | None:
    """Lins' exposed and hidden collective seconds per state in the last timed step,
    averaged over the ranks (None for strategies Lins does not run)."""
    if not per_rank or per_rank[0] is None:
        return None
    states = per_rank[0]
    return {state: {k: statistics.mean(r[state][k] for r in per_rank) for k in ("exposed", "hidden")} for state in states}


def link_rate_bytes(rate: str) -> float | None:
    """A tc rate ("300mbit") in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit) and rate[: -len(unit)].replace(".", "", 1).isdigit():
            return float(rate[: -len(unit)]) * scale / 8
    return None


def link_floor(pred: dict, nbytes: dict, args) -> dict | None:
    """The step time if communication hid entirely behind compute: the larger of the
    predicted compute (FLOPs, optimizer, copies, host time) and the time the node's link
    needs for the inter-node bytes all its ranks send (each direction has the rate)."""
    rate = link_rate_bytes(args.link_rate or "")
    if rate is None:
        return None
    rpn = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    compute = sum(pred["compute_s"].values())
    link = nbytes["inter_nic_bytes"] * rpn / rate
    return {"compute_s": compute, "link_s": link, "floor_s": max(compute, link)}


if __name__ == "__main__":
    sys.exit(main())
