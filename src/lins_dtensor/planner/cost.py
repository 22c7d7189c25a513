"""Predicted step time of one plan: compute, every collective, and how much of it hides.

The collectives come from :func:`lins_dtensor.schedule.step_collectives`, the function
the runtime's byte accounting is tested against, so the planner times exactly what the
runtime sends. Overlap follows who issues each collective (``CollectiveSpec.issuer``):

* FSDP2's per-micro-batch parameter gathers and P-group reduce-scatters hide behind
  their phase's compute up to ``overlap_fraction`` of it, except the first of each
  phase (nothing to hide behind); on CPU FSDP2 blocks on them (fraction 0).
* Lins' own collectives run as chains on its executor, asynchronous on CPU and GPU
  alike, and hide up to ``lins_overlap_fraction`` of the compute they overlap, minus
  the time FSDP2's collectives hold the links then (all of FSDP2's, but in the
  backward where intra-node traffic is the cores' copies: there those on the chain's
  links, and FSDP2's exposed time on the other links is room too): a micro-batch's G-level
  reduce-scatter behind the rest of that micro-batch and the next one; the step
  reductions behind the last micro-batch's backward (the chain of the unit whose
  gradient comes last, the first unit, always shows); the update gathers behind the
  next forward (the first unit's always shows). Where the hardware says a collective
  inside a node cannot hide (``intra_comm_hides``: the emulated CPU cluster, whose
  loopback copies run on the cores that compute), Lins' intra-node ones are exposed, and
  so are its lossy all-to-alls with several ranks on a node (:func:`_can_hide`); the
  cross-node links of a chain that starts with such a link still hide behind the rest of
  the backward (the executor starts them as soon as it sees that link done; until gloo's
  reduce-scatter was polled to completion, 2026-12-06, they waited for the step).

Lins' collectives in a lossy wire format (``formats``, :mod:`lins_dtensor.formats`) are
the encoded collectives ``step_collectives`` counts for them, classified by the spec
they come from (a lossy all-reduce's all-gather half is a step reduction, not an update
gather); their encode and decode work is compute of their phase.

Compute is the model's kernels at the device's compute curve
(:mod:`lins_dtensor.planner.compute`), plus the memory-bound work around the collectives (:func:`lins_dtensor.schedule.local_copy_bytes` at the copy bandwidth) and
the host time per unit of FSDP2's hooks (where P is sharded) or Lins' gradient hooks
(where it is replicated), both of which matter on CPUs and barely on GPUs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lins_dtensor.formats import CommFormats
from lins_dtensor.plan import LinsPlan
from lins_dtensor.planner.bandwidth import CollectiveTimer, cross_node_bytes
from lins_dtensor.planner.compute import StepCompute, step_compute
from lins_dtensor.planner.hardware import ClusterSpec
from lins_dtensor.planner.memory import MemoryBreakdown, memory_breakdown, rank0_units
from lins_dtensor.planner.models import ModelSpec, tensor_parallel_local
from lins_dtensor.planner.training import TrainingSpec
from lins_dtensor.schedule import (
    ALL_SPECS,
    GRAD_NORM_ALL_REDUCE,
    GRAD_SHARD_REDUCE_SCATTER,
    OPTIM_REDUCE_SCATTER,
    UPDATE_GATHER_GRAD,
    UPDATE_GATHER_OPTIM,
    CollectiveRecord,
    Op,
    Phase,
    codec_values,
    local_copy_bytes,
    step_collectives,
)

PHASE_OF = {spec.name: spec.phase.value for spec in ALL_SPECS}
ISSUER_OF = {spec.name: spec.issuer for spec in ALL_SPECS}
PHASES = tuple(p.value for p in Phase)
# The update gathers (masters back to P), by name: a lossy all-reduce's second half is an
# all-gather too, but one of the step's reduction chain.
UPDATE_GATHERS = frozenset((UPDATE_GATHER_OPTIM.name, UPDATE_GATHER_GRAD.name))


def network_bytes(record: CollectiveRecord) -> float:
    """Bytes per rank that cross the node boundary: a ring with r ranks on each node
    crosses it once per node, so its wire bytes are shared by the r ranks' NIC shares;
    an all-to-all's ranks each send their own (:func:`cross_node_bytes`); for an
    intra-node group this is its (NVLink) wire bytes."""
    if record.nodes <= 1:
        return record.wire_bytes
    r = record.group_size // record.nodes
    if record.op is Op.ALL_TO_ALL:
        return cross_node_bytes(record.op.value, record.group_size, record.nodes, record.message_bytes) * record.count / r
    return record.wire_bytes / r


@dataclasses.dataclass
class PlanCost:
    """Everything predicted for one plan on one cluster."""

    plan: LinsPlan
    microbatches: int
    memory: MemoryBreakdown
    budget: float
    compute_s: dict[str, float]  # per step: forward, backward (incl. recompute), step (optimizer), each with its local copies
    kernels: StepCompute  # the model's kernels in compute_s: each kind's seconds and the efficiency it ran at
    comm_s: dict[str, float]  # per step, raw time of each phase's collectives
    exposed_s: dict[str, float]  # per step, the part not hidden behind compute
    exposed_state_s: dict[str, float]  # the same Lins/FSDP2 seconds by state (params, grads, optim); TP's are not a state
    step_s: float
    mfu: float
    tokens_per_s: float  # whole cluster
    records: list[CollectiveRecord]
    record_s: list[float]  # time of each record (all its calls)
    record_phase: list[str]  # the phase each record runs in
    formats: CommFormats = CommFormats()  # the wire formats of Lins' collectives
    codec_s: dict[str, float] = dataclasses.field(default_factory=dict)  # per step, the lossy formats' encode/decode (in compute_s)

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: MFU with the recomputed forward's FLOPs counted."""
        return self.mfu * (1 + self.kernels.recomputed_model_flops / self.kernels.model_flops)

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
    fsdp2_reductions: bool = False,
    formats: CommFormats = CommFormats(),
    final_chain_units: int = 1,
) -> PlanCost:
    """Predict memory and step time of ``plan`` (assumed valid for the cluster) with
    Lins' collectives in the wire ``formats``: their encoded collectives, the encode and
    decode work (:func:`lins_dtensor.schedule.codec_values`, at the hardware's
    ``codec_seconds``) as compute of its phase, and their buffers and error-feedback
    residuals in memory.

    For the benchmark's costing of other runtimes with a plan's collectives:
    ``extra_backward`` adds collectives another runtime issues in backward (stock HSDP's
    all-reduce of micro-batches 1..M-1), ``fsdp2_reductions`` has FSDP2 issue the
    step reductions in the last backward (stock HSDP's all-reduce) instead of Lins, and
    ``final_chain_units`` is how many leading units' step reductions start only once the
    backward is done, with no compute left to hide behind: Lins issues each unit's as its
    gradient is final, so only the first unit's (1); torch DDP issues a gradient bucket's
    when all of it is, so every unit its last bucket holds."""
    timer = timer or CollectiveTimer(cluster.hardware, cluster.gpus_per_node, cluster.bandwidth)  # type: ignore[arg-type]
    hw = cluster.hardware
    m = training.microbatches(cluster.dp_ranks)
    units = rank0_units(tensor_parallel_local(model, cluster.tp), plan)
    memory = memory_breakdown(model, plan, training, units, cluster.tp, formats=formats, world_size=cluster.dp_ranks,
                              ranks_per_node=cluster.dp_per_node)

    def collectives(of_units, microbatches: int, norm: bool) -> list[CollectiveRecord]:
        return step_collectives(
            plan, of_units, world_size=cluster.dp_ranks, ranks_per_node=cluster.dp_per_node, microbatches=microbatches,
            param_bytes=training.param_bytes, reduce_bytes=training.reduce_bytes, clip_grad_norm=norm, tp=cluster.tp, formats=formats,
        )

    def seconds(record: CollectiveRecord) -> float:
        return record.count * timer.seconds(record.op.value, record.group_size, record.nodes, _costed_bytes(record, hw.intra_comm_hides))

    records = collectives(units, m, training.clip_grad_norm)
    record_phase = [PHASE_OF[r.name] for r in records]
    issuer = [ISSUER_OF[r.name] for r in records]
    for i, r in enumerate(records):
        if fsdp2_reductions and record_phase[i] == Phase.STEP.value and r.name not in UPDATE_GATHERS:
            record_phase[i], issuer[i] = Phase.BACKWARD.value, "fsdp2"
    records += list(extra_backward)
    record_phase += [Phase.BACKWARD.value] * len(extra_backward)
    issuer += ["fsdp2"] * len(extra_backward)
    record_s = [seconds(r) for r in records]
    comm = dict.fromkeys(PHASES, 0.0)
    for t, phase in zip(record_s, record_phase):
        comm[phase] += t

    # Compute: the model's kernels (recomputation runs in backward), then the optimizer.
    tokens = training.microbatch_tokens * m  # per data-parallel rank (a TP group shares them)
    kernels = step_compute(model, training, hw, cluster.tp, m)
    # Adam reads and writes master, m, v and reads the gradient: memory-bound.
    os_numel = memory.optim / (training.master_bytes * (1 + training.optim_states))
    optimizer = os_numel * (2 * training.master_bytes * (1 + training.optim_states) + training.reduce_bytes) / hw.hbm_bw
    compute = {"forward": kernels.seconds("forward"), "backward": kernels.seconds("backward", "recompute"), "step": optimizer}
    copies = local_copy_bytes(
        plan, units, microbatches=m, param_bytes=training.param_bytes, reduce_bytes=training.reduce_bytes, master_bytes=training.master_bytes,
    )
    for phase, nbytes in copies.items():
        compute[phase] += nbytes / hw.copy_bandwidth
    per_unit = hw.unit_overhead_s if plan.params > 1 else hw.replicated_unit_overhead_s
    hooks = m * len(units) * per_unit  # split like the FLOPs
    compute["forward"] += hooks / 3
    compute["backward"] += 2 * hooks / 3
    codec = codec_values(
        plan, units, world_size=cluster.dp_ranks, ranks_per_node=cluster.dp_per_node, microbatches=m,
        param_bytes=training.param_bytes, reduce_bytes=training.reduce_bytes, formats=formats,
    )
    codec_s = {phase: sum((values * hw.codec_seconds(fmt) for fmt, values in by_format.items()), 0.0) for phase, by_format in codec.items()}
    for phase, seconds_codec in codec_s.items():
        if seconds_codec:
            compute[phase] += seconds_codec

    # The codec work gives Lins' collectives no room to hide in: a lossy collective's
    # encode runs before it is issued and its decode after it completes (measured on the
    # emulated cluster: counting it as room predicted a fifth of int8's exposed time).
    room = {phase: seconds - codec_s.get(phase, 0.0) for phase, seconds in compute.items()}
    exposed, exposed_state = _exposed(records, record_s, record_phase, issuer, room, m, training,
                                      _first_unit_chains(collectives, seconds, units[:final_chain_units], hw.intra_comm_hides),
                                      hw.intra_comm_hides)
    for phase, seconds_tp in tensor_parallel_seconds(model, cluster, training, timer, m).items():
        comm[phase] += seconds_tp
        exposed[phase] += seconds_tp
    step_s = sum(compute.values()) + sum(exposed.values())
    mfu = kernels.model_flops / (step_s * hw.peak_flops)
    return PlanCost(
        plan, m, memory, cluster.memory_budget, compute, kernels, comm, exposed, exposed_state, step_s, mfu, tokens * cluster.dp_ranks / step_s,
        records, record_s, record_phase, formats, codec_s,
    )


def tensor_parallel_seconds(model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, timer: CollectiveTimer, m: int) -> dict[str, float]:
    """Per step, the activation collectives of tensor + sequence parallelism inside the
    node: each block gathers its input and reduce-scatters its output around attention
    and around the MLP, in forward and mirrored in backward, plus those that activation
    checkpointing re-runs. They sit on the critical path (no asynchronous TP): all exposed."""
    if cluster.tp == 1:
        return {}
    message = training.microbatch_tokens * model.dim * training.activation_bytes

    def per_step(ops: Sequence[Op]) -> float:  # each op twice per block (attention, MLP)
        return 2 * model.n_layers * m * sum(timer.seconds(op.value, cluster.tp, 1, message) for op in ops)

    forward = per_step((Op.ALL_GATHER, Op.REDUCE_SCATTER))
    return {"forward": forward, "backward": forward + per_step(training.recompute.tp_collectives)}


def _costed_bytes(record: CollectiveRecord, intra_hides: bool) -> int:
    """The message bytes a collective is timed at: its own, but for a lossy one inside a
    node where intra-node traffic is copies on the cores that compute
    (``HardwareSpec.intra_comm_hides`` False): there encoding saves none of its time,
    and it is timed at its exact bytes (its codec is charged besides). Measured on the
    emulated cluster, FSDP2's gathers of P inside the node per step at M = 1 / M = 4:
    exact 0.54 / 1.80 s, int8 0.49 / 1.63 s, bf16 0.51 / 1.68 s, where the bandwidth
    table, timed at their bytes, gave int8 a quarter of exact's time."""
    if intra_hides or record.link != "intra" or record.exact_bytes is None:
        return record.message_bytes
    return record.exact_bytes


def _can_hide(record: CollectiveRecord, intra_hides: bool) -> bool:
    """Whether a Lins collective can run behind compute. Where the hardware moves
    intra-node traffic with the cores that compute (``HardwareSpec.intra_comm_hides``),
    not one inside a node, nor a lossy reduction's all-to-all with several ranks on a node.
    The second is measured, its cause not pinned down: on the emulated cluster int8
    reductions over 4 ranks on each of 2 nodes stayed exposed 0.42 s (M = 1) and 1.19 s
    (M = 4) a step where hiding them predicted 0 and 0.2 s, while exact ring collectives
    over the same ranks hid as predicted (bench/results/codec-fixes-2026-12-02)."""
    if intra_hides:
        return True
    return record.link != "intra" and not (record.op is Op.ALL_TO_ALL and record.group_size > record.nodes)


def _first_unit_chains(collectives, seconds, first_units, intra_hides: bool) -> tuple[float, float]:
    """Seconds of the step reductions and of the update gathers of ``first_units`` (Lins:
    the first unit alone): their gradients are the last ones backward produces and their
    parameters the first forward needs, so neither has compute to hide behind (the
    intra-node ones, where they cannot hide at all, are charged in full already)."""
    if not first_units:
        return 0.0, 0.0
    reduce_s = gather_s = 0.0
    for r in collectives(first_units, 1, False):
        if PHASE_OF[r.name] == Phase.STEP.value and _can_hide(r, intra_hides):
            if r.name in UPDATE_GATHERS:
                gather_s += seconds(r)
            else:
                reduce_s += seconds(r)
    return reduce_s, gather_s


def _exposed(records, record_s, record_phase, issuer, compute, m: int, training: TrainingSpec,
             first_unit: tuple[float, float], intra_hides: bool) -> tuple[dict[str, float], dict[str, float]]:
    """The part of each phase's communication that does not hide behind compute, and the
    same seconds by the state the collectives move (what Lins' stats measure: a run's
    exposed time per state calibrates the links separately); a term that collectives of
    several states share is split in proportion to their seconds."""
    fsdp: dict[str, dict[str, float]] = {phase: {} for phase in PHASES}
    fsdp_on_link: dict[str, dict[str, float]] = {phase: {} for phase in PHASES}  # FSDP2's seconds by link level
    fsdp_calls = dict.fromkeys(PHASES, 0)
    chain_links: set[str] = set()  # the link levels of Lins' reductions (and G-level reduce-scatters)
    grad_shard = 0.0
    norm: dict[str, float] = {}
    gathers: dict[str, float] = {}
    reductions: dict[str, float] = {}
    unhidden: dict[str, dict[str, float]] = {phase: {} for phase in PHASES}  # Lins' intra-node collectives where they cannot hide
    for r, t, phase, who in zip(records, record_s, record_phase, issuer):
        if who != "fsdp2" and not _can_hide(r, intra_hides):
            part = unhidden[phase]
            if r.name != GRAD_NORM_ALL_REDUCE.name and r.name not in UPDATE_GATHERS:
                chain_links.add(r.link)  # its links are the chain's all the same
        elif who == "fsdp2":
            part = fsdp[phase]
            fsdp_calls[phase] += r.count
            fsdp_on_link[phase][r.link] = fsdp_on_link[phase].get(r.link, 0.0) + t
        elif r.name == GRAD_SHARD_REDUCE_SCATTER.name:
            grad_shard += t
            chain_links.add(r.link)
            continue
        elif r.name == GRAD_NORM_ALL_REDUCE.name:
            part = norm
        elif r.name in UPDATE_GATHERS:
            part = gathers
        else:
            part = reductions
            chain_links.add(r.link)
        part[r.state] = part.get(r.state, 0.0) + t
    by_state: dict[str, float] = {}

    def charge(seconds: float, parts: dict[str, float]) -> float:
        total = sum(parts.values())
        for state, t in parts.items():
            by_state[state] = by_state.get(state, 0.0) + (seconds * t / total if total else 0.0)
        return seconds

    grads = GRAD_SHARD_REDUCE_SCATTER.state
    blocked = {phase: charge(sum(part.values()), part) for phase, part in unhidden.items()}
    if not training.overlap:
        exposed = {phase: charge(sum(fsdp[phase].values()), fsdp[phase]) for phase in ("forward", "backward")}
        exposed["backward"] += charge(grad_shard, {grads: grad_shard})
        exposed["step"] = sum(charge(sum(part.values()), part) for part in (reductions, gathers, norm))
        return {phase: v + blocked[phase] for phase, v in exposed.items()}, by_state

    exposed = {"step": charge(sum(norm.values()), norm)}
    for phase in ("forward", "backward"):
        raw = sum(fsdp[phase].values())
        hidden = training.overlap_fraction * compute[phase]
        first = raw / fsdp_calls[phase] * m if fsdp_calls[phase] else 0.0  # one unhidden collective per micro-batch
        exposed[phase] = charge(max(raw - hidden, min(first, raw)), fsdp[phase])

    def room(phase: str, links: set[str]) -> float:
        """A micro-batch's time in ``phase`` that Lins' chains on ``links`` hide behind:
        their share of its compute, less FSDP2's collectives. Where intra-node traffic
        hides (GPUs), all of FSDP2's: NCCL's kernels on either link take the SMs and
        copy engines the chain needs, and the published runs the planner is validated
        against (docs/planner-validation.md) fit that. Where it is the cores' own copies
        (``intra_comm_hides`` False), only FSDP2's collectives on ``links`` hold them,
        and FSDP2's exposed time on the other links lengthens the phase with the chain's
        links free: measured on the emulated cluster at M = 1 with P sharded in the node,
        Lins' cross-node reductions hid behind FSDP2's intra-node reduce-scatters, a step
        0.37 s shorter than stock HSDP's on the same groups, where taking those out of
        the room predicted the two equal (bench/results/rsfix-2026-12-06)."""
        raw = sum(fsdp[phase].values())
        on_links = raw if intra_hides else sum(t for link, t in fsdp_on_link[phase].items() if link in links)
        elsewhere = exposed[phase] * (raw - on_links) / raw if raw else 0.0
        return max(0.0, (training.lins_overlap_fraction * compute[phase] - on_links + elsewhere) / m)

    # The update gathers get no room from FSDP2's forward collectives: FSDP2 gathers a
    # unit's P only once the update gather has written its shard, after the chain, not
    # beside it (measured in three runs at M = 1: the update gathers of p=4,g=8,os=8
    # exposed 0.26-0.28 s a step; with that room its step came out 13-19 % short, without
    # it within 8 %).
    forward_room = room("forward", set(fsdp_on_link["forward"]))
    backward_room = room("backward", chain_links)
    # Micro-batches but the last: their G-level reduce-scatter runs until the same unit's
    # next gradient, behind the rest of that backward and the next forward.
    per_microbatch = grad_shard / m
    exposed["backward"] += charge((m - 1) * max(0.0, per_microbatch - backward_room - forward_room), {grads: 1.0})
    # The last micro-batch's G-level reduce-scatter heads its units' reduction chains.
    chain = {**reductions, grads: reductions.get(grads, 0.0) + per_microbatch}
    chain_s, gathers_s = sum(chain.values()), sum(gathers.values())
    first_reduce, first_gather = first_unit
    if training.reduce_in_backward:
        exposed["step"] += charge(max(min(first_reduce, chain_s), chain_s - backward_room), chain)
    else:
        exposed["step"] += charge(chain_s, chain)
    if training.overlap_step:
        exposed["step"] += charge(max(min(first_gather, gathers_s), gathers_s - forward_room), gathers)
    else:
        exposed["step"] += charge(gathers_s, gathers)
    return {phase: v + blocked[phase] for phase, v in exposed.items()}, by_state
