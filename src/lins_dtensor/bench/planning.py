"""The planner's side of the benchmark: its hardware (calibrated on this cluster), its
choice of plan for each M and memory budget, and its prediction for every strategy.

Predictions run under two overlap models (:class:`Overlap`): the run's (FSDP2 blocks on
its collectives on CPU, Lins' asynchronous ones hide as calibrated) and a reference
one (the planner's GPU default), so that the results show how much of the model's
error the overlap assumption accounts for.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch.distributed as dist

from lins_dtensor import CommFormats, LinsPlan
from lins_dtensor.bench.measure import Ranks
from lins_dtensor.bench.model import MODEL_SIZES, build_model
from lins_dtensor.bench.strategies import FORMAT_STRATEGIES, PLANNER_STRATEGIES, Equivalent
from lins_dtensor.planner import (
    BandwidthTable,
    ClusterSpec,
    CollectiveTimer,
    HardwareSpec,
    ModelSpec,
    PlannerError,
    TrainingSpec,
    choose_plan,
    evaluate,
    hardware_preset,
    model_from_module,
    rank0_units,
)
from lins_dtensor.schedule import step_collectives

GiB = 1 << 30


def budget_label(budget_gib: float | None) -> str:
    """How a memory budget is named in the results (None: no budget)."""
    return "unlimited" if budget_gib is None else f"{budget_gib:g} GiB"


def reference_label(reference_overlap_fraction: float) -> str:
    """How the planner's choice under the reference overlap model is named."""
    return f"unlimited, overlap model {reference_overlap_fraction:g}"


def bench_model_spec(size: str) -> ModelSpec:
    """The planner's description of the benchmark model of ``size`` (:data:`MODEL_SIZES`)."""
    return model_from_module(build_model(size), name=f"bench-{size}", ffn_dim=MODEL_SIZES[size].ffn_dim)


FREE_S = 1e-12  # a collective across nodes with the links between nodes taken away (the table interpolates logs)

# torch DistributedDataParallel's default gradient buckets (the benchmark builds DDP with
# its defaults): the first holds at least 1 MiB (torch.distributed's
# _DEFAULT_FIRST_BUCKET_BYTES), the others 25 MiB (bucket_cap_mb).
DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_BUCKET_BYTES = 25 << 20


def ddp_buckets(spec: ModelSpec, grad_bytes: int) -> list[tuple[int, set[int]]]:
    """DDP's gradient buckets for ``spec``, in the order they are all-reduced: (bytes,
    indices of the units with a gradient in it). DDP rebuilds its buckets after the first
    step in the order the gradients became ready, about the reverse of the parameters'
    (taken as exactly that here), filling each until a gradient brings it to its cap,
    as torch's reducer does (``compute_bucket_assignment_by_size``). A bucket's
    all-reduce waits for all of its gradients, so the last one, which holds the first
    unit, has no backward left to hide behind."""
    buckets: list[tuple[int, set[int]]] = []
    size, units = 0, set()
    for index, unit in reversed(list(enumerate(spec.unit_shapes()))):
        for shape in reversed(unit):
            size += math.prod(shape) * grad_bytes
            units.add(index)
            if size >= (DDP_FIRST_BUCKET_BYTES if not buckets else DDP_BUCKET_BYTES):
                buckets.append((size, units))
                size, units = 0, set()
    if units:
        buckets.append((size, units))
    return buckets


def calibrated_hardware(calib: dict, ranks_per_node: int) -> HardwareSpec:
    """The ``cpu-emulated`` preset with the rates :func:`~.measure.calibrate` measured."""
    return dataclasses.replace(
        hardware_preset("cpu-emulated"), name="cpu-emulated (calibrated)", ranks_per_node=ranks_per_node,
        peak_flops=calib["flops_per_s"], efficiency=1.0, hbm_bw=calib["optimizer_bytes_per_s"], copy_bw=calib["copy_bytes_per_s"],
        unit_overhead_s=calib["unit_overhead_s"], replicated_unit_overhead_s=calib["replicated_unit_overhead_s"],
        codec_s_per_value=calib["codec_s_per_value"],
    )


def scaled_hardware(hardware: HardwareSpec, slowdown: float) -> HardwareSpec:
    """``hardware`` with every rate measured on this host's cores ``slowdown`` times
    slower: compute, optimizer, copies, host time per unit, gemm calls and the lossy
    formats' codec. The links (the bandwidth table) are left as profiled.

    The benchmark's in-run calibration: ``slowdown`` is the probe's forward + backward
    during the timed rounds over the start-up one (:class:`~.measure.InRunProbe`).
    One factor for all of them is a simplification: it reads how fast the shared cores
    compute while the rows run, not each kind of work's own rate."""
    return dataclasses.replace(
        hardware, name=f"{hardware.name}, in-run x{slowdown:.2f}", peak_flops=hardware.peak_flops / slowdown,
        hbm_bw=hardware.hbm_bw / slowdown, copy_bw=None if hardware.copy_bw is None else hardware.copy_bw / slowdown,
        unit_overhead_s=hardware.unit_overhead_s * slowdown, replicated_unit_overhead_s=hardware.replicated_unit_overhead_s * slowdown,
        gemm_call_s=hardware.gemm_call_s * slowdown,
        codec_s_per_value={fmt: s * slowdown for fmt, s in hardware.codec_s_per_value.items()},
    )


class Overlap(NamedTuple):
    """An overlap model of the planner: how much compute hides FSDP2's per-micro-batch
    collectives, and Lins' asynchronous ones (TrainingSpec's two fractions)."""

    fsdp: float
    lins: float


@dataclasses.dataclass
class Planning:
    """The planner on this run's model, cluster and batch shape."""

    spec: ModelSpec
    hardware: HardwareSpec
    table: BandwidthTable
    ranks: Ranks
    args: argparse.Namespace
    run_overlap: Overlap  # the run's: FSDP2 blocks on CPU, Lins' as calibrated
    reference_overlap: Overlap  # the planner's GPU defaults

    def cluster(self, budget_gib: float | None) -> ClusterSpec:
        budget = math.inf if budget_gib is None else budget_gib * GiB
        return ClusterSpec(self.ranks.world, self.ranks.per_node, self.hardware, self.table, budget)

    def training(self, microbatches: int, overlap: Overlap) -> TrainingSpec:
        a = self.args
        return TrainingSpec(
            seq_len=a.seq_len, micro_batch=a.batch_size, global_batch_tokens=a.seq_len * a.batch_size * self.ranks.world * microbatches,
            param_bytes=4, reduce_bytes=4, master_bytes=4, activation_bytes=4, clip_grad_norm=True,
            overlap_fraction=overlap.fsdp, lins_overlap_fraction=overlap.lins,
        )

    def choose_all(self, budgets_gib: Sequence[float | None], with_reference: bool, strategies: Sequence[str]) -> dict[str, dict[tuple[int, str], dict]]:
        """Per planner strategy (the exact "lins-planner" always, for the results' record;
        those of :data:`FORMAT_STRATEGIES` asked for), the choice for every M of the run:
        under each budget with the run's overlap model and, ``with_reference`` (exact
        only), with no budget under the reference one; keyed by (M, budget label)."""
        choices = {}
        for strategy in PLANNER_STRATEGIES:
            if strategy != "lins-planner" and strategy not in strategies:
                continue
            allowed = FORMAT_STRATEGIES.get(strategy)
            picks = {}
            for m in self.args.microbatches:
                for b in budgets_gib:
                    picks[(m, budget_label(b))] = self.choose(m, b, self.run_overlap, allowed)
                if with_reference and allowed is None:
                    picks[(m, reference_label(self.reference_overlap.fsdp))] = self.choose(m, None, self.reference_overlap)
            choices[strategy] = picks
        return choices

    def choose(self, microbatches: int, budget_gib: float | None, overlap: Overlap, allowed_formats: str | None = None) -> dict:
        """Rank 0's choice, sent to every rank: each rank building a different plan from a
        near-tie would deadlock the first collective that only some of them issue."""
        choice = [self.local_choice(microbatches, budget_gib, overlap, allowed_formats) if self.ranks.rank == 0 else None]
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def local_choice(self, microbatches: int, budget_gib: float | None, overlap: Overlap, allowed_formats: str | None = None) -> dict:
        """This process's choice (:meth:`choose` sends rank 0's to every rank)."""
        try:
            plan, ex = choose_plan(self.spec, self.cluster(budget_gib), self.training(microbatches, overlap), allowed_formats=allowed_formats)
        except PlannerError as exc:
            return {"plan": None, "error": exc.detail}
        return {
            "plan": str(plan), "formats": str(ex.cost.formats), "reason": ex.reason, "predicted_step_s": ex.cost.step_s,
            "predicted_peak_bytes": ex.cost.memory.peak, "valid_plans": len(ex.ranked) + len(ex.dropped),
            "dropped_for_memory": len(ex.dropped), "table_fallbacks": [list(s) for s in ex.table_fallbacks],
            "top5": [{"plan": str(c.plan), "formats": str(c.formats), "step_s": c.step_s} for c in ex.ranked[:5]],
        }

    def in_run(self, slowdown: float, intra_node_slowdown: float = 1.0) -> Planning:
        """This planner with the in-run calibration: on :func:`scaled_hardware` (the cores
        ``slowdown`` times slower) and with the table's collectives inside a node
        ``intra_node_slowdown`` times slower. Those run over loopback on the same cores,
        but have a factor of their own: the profile runs minutes before the start-up's
        forward+backward, and one run's profile timed them 1.1-2.5x the committed run's
        where its forward+backward was 1.18x. The links between nodes stay as profiled
        (a rate limit, not the cores: the in-run all-reduce across them came out within
        12 % of the start-up's in every run)."""
        planning = dataclasses.replace(self, hardware=scaled_hardware(self.hardware, slowdown))
        return planning if self.table is None else planning._with_table_times(lambda shape, s: s * intra_node_slowdown if shape[2] == 1 else s)

    def without_cross_node_time(self) -> Planning:
        """This planner with every collective whose group spans nodes timed at (almost) 0 s:
        what is left of a prediction is the compute, the codec work and the traffic inside
        the nodes, the floor no wire format (nor a faster network) can take a plan below.
        (The benchmark's profile measures every shape the plans need, so no collective falls
        back to the alpha-beta model, which this leaves as it is.)"""
        return self._with_table_times(lambda shape, s: FREE_S if shape[2] > 1 else s)

    def _with_table_times(self, seconds: Callable[[tuple[str, int, int], float], float]) -> Planning:
        """This planner with each point of the table re-timed by ``seconds(shape, its time)``
        (a shape is (op, ranks of the group per node, nodes))."""
        table = self.table
        entries = {shape: [(size, seconds(shape, s)) for size, s in points] for shape, points in table.entries.items()}
        return dataclasses.replace(self, table=BandwidthTable(table.ranks_per_node, entries, table.meta))

    def predict(self, microbatches: int, eq: Equivalent) -> dict:
        """The planner's prediction with the run's overlap model, plus the reference one's
        step time; for a strategy it cannot cost, no numbers (``step_s`` None) and why."""
        if eq.not_costed is not None:  # the strategy does what the planner's model lacks (PowerSGD)
            return {"plan": eq.plan, "formats": eq.formats, "not_costed": eq.not_costed, "step_s": None, "step_s_reference": None}
        out = self._predict(microbatches, eq, self.run_overlap)
        out["step_s_reference"] = self._predict(microbatches, eq, self.reference_overlap)["step_s"]
        return out

    def _predict(self, microbatches: int, eq: Equivalent, overlap: Overlap) -> dict:
        """The planner's cost of ``eq.plan`` as run by the strategy ``eq`` describes:
        stock HSDP has FSDP2 all-reduce (``fsdp2_reductions``), on every micro-batch but the
        last too (``extra_all_reduce``); DDP has neither FSDP2's nor Lins' host time per
        unit and copies (``fsdp_hooks=False``; its own bucket copies are not modelled), and
        its last gradient bucket's all-reduce has no compute to hide behind (``bucketed``,
        :func:`ddp_buckets`); DDP's bf16 hook all-reduces cast values (``cast_reduce_bytes``)."""
        world, rpn = self.ranks.world, self.ranks.per_node
        plan, formats = LinsPlan.parse(eq.plan, world), CommFormats.parse(eq.formats)
        cluster, training = self.cluster(None), self.training(microbatches, overlap)
        if not eq.fsdp_hooks:
            bare = dataclasses.replace(cluster.hardware, unit_overhead_s=0.0, replicated_unit_overhead_s=0.0, copy_bw=math.inf)
            cluster = dataclasses.replace(cluster, hardware=bare)
        timer = CollectiveTimer(cluster.hardware, rpn, self.table)
        # DDP buckets the parameters' own gradients (a hook casts a bucket only once it is full).
        final_units = max(ddp_buckets(self.spec, training.param_bytes)[-1][1]) + 1 if eq.bucketed else 1
        extra = []
        if eq.extra_all_reduce and microbatches > 1:
            once = step_collectives(
                plan, rank0_units(self.spec, plan), world_size=world, ranks_per_node=rpn, microbatches=1,
                param_bytes=training.param_bytes, reduce_bytes=training.reduce_bytes, formats=formats,
            )
            extra = [dataclasses.replace(r, count=r.count * (microbatches - 1)) for r in once if r.name == "optim_all_reduce"]
        cast_s = 0.0
        if eq.cast_reduce_bytes is not None:
            # The hook's own all-reduce moves the cast values (not Lins' encoded collectives);
            # every gradient value is cast down and back once a step in the last backward,
            # at the bf16 format's measured encode/decode rate (the same kernels: a rounding cast).
            training, formats = dataclasses.replace(training, reduce_bytes=eq.cast_reduce_bytes), CommFormats()
            cast_s = 2 * self.spec.num_params * cluster.hardware.codec_seconds("bf16")
        cost = evaluate(plan, self.spec, cluster, training, timer, extra_backward=extra, fsdp2_reductions=eq.fsdp2_reductions,
                        formats=formats, final_chain_units=final_units)
        step_s, exposed, comm = cost.step_s + cast_s, cost.exposed_s, cost.comm_s
        compute = {**cost.compute_s, "backward": cost.compute_s["backward"] + cast_s}
        inter_nic, intra = cost.link_bytes("inter"), cost.link_bytes("intra")
        return {
            "plan": eq.plan, "formats": eq.formats, "step_s": step_s, "compute_s": compute, "comm_s": comm, "exposed_s": exposed,
            "memory": cost.memory.gib(), "peak_bytes": cost.memory.peak,
            "state_bytes": {"params": cost.memory.params, "grads": cost.memory.grads, "optim": cost.memory.optim},
            "inter_nic_bytes": inter_nic, "intra_wire_bytes": intra,
        }
