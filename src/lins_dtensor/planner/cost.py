"""Predicted step time of one plan: compute, every collective, and how much of it hides.

The collectives come from :func:`lins_dtensor.schedule.step_collectives`, the function
the runtime's byte accounting is tested against, so the planner times exactly what the
runtime sends. Overlap model (the runtime's): a micro-batch's parameter all-gathers can
hide behind forward compute and its gradient reduce-scatters (and backward re-gathers)
behind backward compute, up to ``overlap_fraction`` of it, except the first collective
of each phase, which has nothing to hide behind; the optimizer-step reductions hide
behind the last backward when the runtime reduces there (``reduce_in_backward``) and
the update gathers are exposed (``overlap_step`` models the paper's executor, which
also hides them behind the next forward).

Compute is the model FLOPs at the device's rate, plus the memory-bound work around the
collectives (:func:`lins_dtensor.schedule.local_copy_bytes` at the copy bandwidth) and
FSDP2's host time per unit, both of which matter on CPUs and barely on GPUs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lins_dtensor.plan import LinsPlan
from lins_dtensor.planner.bandwidth import CollectiveTimer
from lins_dtensor.planner.hardware import ClusterSpec
from lins_dtensor.planner.memory import MemoryBreakdown, memory_breakdown, rank0_units
from lins_dtensor.planner.models import ModelSpec
from lins_dtensor.planner.training import TrainingSpec
from lins_dtensor.schedule import ALL_SPECS, CollectiveRecord, Phase, local_copy_bytes, step_collectives

PHASE_OF = {spec.name: spec.phase.value for spec in ALL_SPECS}
PHASES = tuple(p.value for p in Phase)


def network_bytes(record: CollectiveRecord) -> float:
    """Bytes per rank that cross the node boundary: a ring with r ranks on each node
    crosses it once per node, so its wire bytes are shared by the r ranks' NIC shares;
    for an intra-node group this is its (NVLink) wire bytes."""
    if record.nodes <= 1:
        return record.wire_bytes
    return record.wire_bytes / (record.group_size // record.nodes)


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul parameter plus causal-free attention
    12 * layers * dim * seq (the PaLM-appendix convention MFU is usually quoted in)."""
    return 6.0 * model.matmul_params + 12.0 * model.n_layers * model.dim * seq_len


@dataclasses.dataclass
class PlanCost:
    """Everything predicted for one plan on one cluster."""

    plan: LinsPlan
    microbatches: int
    memory: MemoryBreakdown
    budget: float
    compute_s: dict[str, float]  # per step: forward, backward (incl. recompute), step (optimizer), each with its local copies
    comm_s: dict[str, float]  # per step, raw time of each phase's collectives
    exposed_s: dict[str, float]  # per step, the part not hidden behind compute
    step_s: float
    mfu: float
    tokens_per_s: float  # whole cluster
    records: list[CollectiveRecord]
    record_s: list[float]  # time of each record (all its calls)
    record_phase: list[str]  # the phase each record runs in

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.budget

    @property
    def over_bytes(self) -> float:
        return self.memory.peak - self.budget

    def by_link(self, exposed: bool = False) -> dict[tuple[str, str], dict[str, float]]:
        """Wire bytes, link bytes (see :func:`network_bytes`) and seconds keyed by
        (state, link); ``exposed`` scales each record's
        time by its phase's exposed share."""
        out: dict[tuple[str, str], dict[str, float]] = {}
        for r, t, phase in zip(self.records, self.record_s, self.record_phase):
            share = (self.exposed_s[phase] / self.comm_s[phase]) if exposed and self.comm_s[phase] else 1.0
            e = out.setdefault((r.state, r.link), {"wire_bytes": 0.0, "link_bytes": 0.0, "seconds": 0.0})
            e["wire_bytes"] += r.wire_bytes
            e["link_bytes"] += network_bytes(r)
            e["seconds"] += t * share
        return out

    def link_bytes(self, link: str) -> float:
        """Per-rank bytes on ``link`` ("intra": NVLink wire bytes, "inter": NIC bytes)."""
        return sum(network_bytes(r) for r in self.records if r.link == link)


def evaluate(
    plan: LinsPlan,
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    timer: CollectiveTimer | None = None,
    extra_backward: Sequence[CollectiveRecord] = (),
) -> PlanCost:
    """Predict memory and step time of ``plan`` (assumed valid for the cluster).

    ``extra_backward``: collectives another runtime issues in backward on top of the
    plan's (the benchmark costs stock HSDP's all-reduce of every micro-batch with it)."""
    timer = timer or CollectiveTimer(cluster.hardware, cluster.gpus_per_node, cluster.bandwidth)  # type: ignore[arg-type]
    hw = cluster.hardware
    m = training.microbatches(cluster.gpus)
    units = rank0_units(model, plan)
    memory = memory_breakdown(model, plan, training, units)

    records = step_collectives(
        plan, units, world_size=cluster.gpus, ranks_per_node=cluster.gpus_per_node, microbatches=m,
        param_bytes=training.param_bytes, reduce_bytes=training.reduce_bytes, clip_grad_norm=training.clip_grad_norm,
    )
    record_phase = [PHASE_OF[r.name] for r in records] + [Phase.BACKWARD.value] * len(extra_backward)
    records = records + list(extra_backward)
    record_s = [r.count * timer.seconds(r.op.value, r.group_size, r.nodes, r.message_bytes) for r in records]
    comm = dict.fromkeys(PHASES, 0.0)
    calls = dict.fromkeys(PHASES, 0)
    for r, t, phase in zip(records, record_s, record_phase):
        comm[phase] += t
        calls[phase] += r.count

    # Compute: forward is a third of the model FLOPs, backward two thirds, plus one
    # more forward when activations are recomputed.
    tokens = training.microbatch_tokens * m
    flops = model_flops_per_token(model, training.seq_len) * tokens
    rate = hw.peak_flops * hw.efficiency
    forward = flops / 3 / rate
    backward = 2 * flops / 3 / rate + (forward if training.activation_checkpointing else 0.0)
    # Adam reads and writes master, m, v and reads the gradient: memory-bound.
    os_numel = memory.optim / (training.master_bytes * (1 + training.optim_states))
    optimizer = os_numel * (2 * training.master_bytes * (1 + training.optim_states) + training.reduce_bytes) / hw.hbm_bw
    compute = {"forward": forward, "backward": backward, "step": optimizer}
    copies = local_copy_bytes(
        plan, units, microbatches=m, param_bytes=training.param_bytes, reduce_bytes=training.reduce_bytes, master_bytes=training.master_bytes,
    )
    for phase, nbytes in copies.items():
        compute[phase] += nbytes / hw.copy_bandwidth
    hooks = m * len(units) * hw.unit_overhead_s  # split like the FLOPs
    compute["forward"] += hooks / 3
    compute["backward"] += 2 * hooks / 3

    exposed = dict(comm)
    if training.overlap:
        for phase in ("forward", "backward"):
            if comm[phase]:
                first = comm[phase] / calls[phase] * m  # one unhidden collective per micro-batch
                exposed[phase] = max(comm[phase] - training.overlap_fraction * compute[phase], min(first, comm[phase]))
        if (training.reduce_in_backward or training.overlap_step) and comm["step"]:
            exposed["step"] = _overlapped_step(records, record_s, record_phase, comm, compute, m, training.overlap_fraction, training.overlap_step)
    step_s = sum(compute.values()) + sum(exposed.values())
    mfu = flops / (step_s * hw.peak_flops)
    return PlanCost(plan, m, memory, cluster.memory_budget, compute, comm, exposed, step_s, mfu, tokens * cluster.gpus / step_s, records, record_s, record_phase)


def _overlapped_step(records, record_s, record_phase, comm, compute, m: int, fraction: float, gathers_overlap: bool) -> float:
    """Exposed step time when reductions overlap the last micro-batch's backward and (with
    ``gathers_overlap``) the update gathers the next forward, each using the capacity
    left by that micro-batch's own collectives."""
    gathers = sum(t for r, t, phase in zip(records, record_s, record_phase) if phase == "step" and r.op.value == "all_gather")
    reductions = comm["step"] - gathers
    backward_room = max(0.0, (fraction * compute["backward"] - comm["backward"]) / m)
    forward_room = max(0.0, (fraction * compute["forward"] - comm["forward"]) / m)
    return max(0.0, reductions - backward_room) + (max(0.0, gathers - forward_room) if gathers_overlap else gathers)
