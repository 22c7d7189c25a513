"""Which collective moves which state, on which group, how many bytes, how often.

This module is the single description of Lins' communication. The runtime issues
each collective through one of the :class:`CollectiveSpec` below (the spec names the
mesh dim whose process group it runs on), and :func:`step_collectives` derives the
bytes a training step must move from the same specs and the same buffer geometry
(:mod:`lins_dtensor.layout`). The accounting tests check the runtime's recorded
collectives against :func:`step_collectives`; the planner times them.

Closed form, per rank and per step, for Φ parameters (padding aside), element sizes
b_p (param dtype) and b_r (reduce dtype), M micro-batches, ring algorithm; N is the
number of data-parallel ranks, and under tensor parallelism Φ is this rank's TP slices:

* params  all-gather over s_p, forward and (if resharded) backward, every micro-batch:
  message Φ·b_p, on the wire (s_p-1)/s_p · Φ·b_p each.
* grads   reduce-scatter over s_p every micro-batch: Φ·b_r, wire (s_p-1)/s_p · Φ·b_r;
  then reduce-scatter over s_g/s_p every micro-batch: Φ/s_p·b_r,
  wire (1/s_p - 1/s_g) · Φ·b_r.
* optim   once per step: reduce-scatter over s_os/s_g of Φ/s_g·b_r
  (wire (1/s_g - 1/s_os)·Φ·b_r), all-reduce over N/s_os of Φ/s_os·b_r
  (wire 2(1/s_os - 1/N)·Φ·b_r), then all-gathers of the updated values back to the P
  layout: over s_os/s_g (Φ/s_g·b_p) and over s_g/s_p (Φ/s_p·b_p).
* flags   once per step, over every rank on the hosts (gloo): a MAX all-reduce of one
  byte per parameter tensor, which of them took part in the step anywhere.

Tensor parallelism's own collectives are not Lins': DTensor issues them on the TP
group, the activations' all-gathers and reduce-scatters in forward and backward (the
planner charges them as exposed compute-phase time) and the sum over the TP group of a
TP-replicated parameter's Partial gradient (a sequence-parallel norm's weight: 2·dim
values per block per micro-batch), which FSDP2 requests where P is sharded and Lins'
replicated-P backend requests the same way; none is recorded by ``lins_stats``.

Who issues what, and what it can hide behind. FSDP2 issues the parameter gathers and
the P-group reduce-scatter (``issuer`` "fsdp2"): blocking on CPU, on FSDP2's streams on
accelerators. Lins issues the rest ("lins") asynchronously, as chains
(:mod:`lins_dtensor.executor`), on CPU and accelerators alike: a micro-batch's G-level
reduce-scatter runs behind the rest of its backward; the step reductions of a unit
start once its last micro-batch's gradient is in the G buffer and run behind the rest
of that backward; the update gathers start when the optimizer has run and are waited
for in each unit's next forward.

Memory per rank: P Φ·b_p/s_p, G Φ·b_r/s_g, OS Φ·(4 + optimizer states)/s_os.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator, Sequence

import torch

from lins_dtensor.formats import EXACT, CommFormats, WireFormat
from lins_dtensor.layout import ChunkLayout, chunk_start
from lins_dtensor.mesh import GRAD_SHARD, OPTIM_REPLICA, OPTIM_SHARD, PARAM_SHARD, mesh_shape
from lins_dtensor.plan import LinsPlan


class Op(str, enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"  # a reduction in a lossy wire format (lins_dtensor.formats)


class Phase(str, enum.Enum):
    """The part of a training step a collective runs in (the cost model's phases)."""

    FORWARD = "forward"  # once per micro-batch
    BACKWARD = "backward"  # once per micro-batch
    STEP = "step"  # once per optimizer step


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
    """One kind of collective Lins issues.

    ``layout`` names the level of :class:`UnitGeometry` whose buffer it moves; its
    message is that layout's whole buffer (``total``), or one chunk row (``chunk``)
    for the all-reduce; "scalar" is one value, "flags" one per parameter of the model.
    ``dtype`` is "param", "reduce", "float32" or "uint8". ``carries`` says what a
    collective moves, "grads" or "params" (the kinds of
    :class:`~lins_dtensor.formats.CommFormats`), and so which wire format it may take;
    ``None`` (FSDP2's P-group reduce-scatter, the flags, the norm): always exact.
    """

    name: str
    state: str
    op: Op
    mesh_dim: str | None  # None: the whole world
    phase: Phase
    dtype: str
    layout: str
    issuer: str = "lins"  # "fsdp2": issued and waited for by FSDP2
    carries: str | None = None


PARAM_ALL_GATHER = CollectiveSpec("param_all_gather", "params", Op.ALL_GATHER, PARAM_SHARD, Phase.FORWARD, "param", "params", "fsdp2", "params")
PARAM_REGATHER = CollectiveSpec("param_regather", "params", Op.ALL_GATHER, PARAM_SHARD, Phase.BACKWARD, "param", "params", "fsdp2", "params")
GRAD_REDUCE_SCATTER = CollectiveSpec("grad_reduce_scatter", "grads", Op.REDUCE_SCATTER, PARAM_SHARD, Phase.BACKWARD, "reduce", "params", "fsdp2")
GRAD_SHARD_REDUCE_SCATTER = CollectiveSpec("grad_shard_reduce_scatter", "grads", Op.REDUCE_SCATTER, GRAD_SHARD, Phase.BACKWARD, "reduce", "grads", carries="grads")
OPTIM_REDUCE_SCATTER = CollectiveSpec("optim_reduce_scatter", "optim", Op.REDUCE_SCATTER, OPTIM_SHARD, Phase.STEP, "reduce", "optim", carries="grads")
OPTIM_ALL_REDUCE = CollectiveSpec("optim_all_reduce", "optim", Op.ALL_REDUCE, OPTIM_REPLICA, Phase.STEP, "reduce", "optim", carries="grads")
UPDATE_GATHER_OPTIM = CollectiveSpec("update_gather_optim", "optim", Op.ALL_GATHER, OPTIM_SHARD, Phase.STEP, "param", "optim", carries="params")
UPDATE_GATHER_GRAD = CollectiveSpec("update_gather_grad", "optim", Op.ALL_GATHER, GRAD_SHARD, Phase.STEP, "param", "grads", carries="params")
GRAD_NORM_ALL_REDUCE = CollectiveSpec("grad_norm_all_reduce", "optim", Op.ALL_REDUCE, None, Phase.STEP, "float32", "scalar")
# Which parameters took part in the step on any rank (a MAX of one byte per parameter,
# on the hosts' gloo group): those that took part nowhere get no optimizer update, as
# in PyTorch. Once per step, started at the end of the step's last backward when Lins
# knows it is the last, else at the step.
USED_PARAMS_ALL_REDUCE = CollectiveSpec("used_params_all_reduce", "grads", Op.ALL_REDUCE, None, Phase.STEP, "uint8", "flags")

ALL_SPECS = (
    PARAM_ALL_GATHER,
    PARAM_REGATHER,
    GRAD_REDUCE_SCATTER,
    GRAD_SHARD_REDUCE_SCATTER,
    OPTIM_REDUCE_SCATTER,
    OPTIM_ALL_REDUCE,
    UPDATE_GATHER_OPTIM,
    UPDATE_GATHER_GRAD,
    GRAD_NORM_ALL_REDUCE,
    USED_PARAMS_ALL_REDUCE,
)


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued (or predicted): what, on how many ranks and nodes, how big."""

    name: str
    state: str
    op: Op
    group_size: int
    nodes: int
    message_bytes: int
    count: int = 1
    format: str = "exact"  # the wire format (lins_dtensor.formats)
    exact_bytes: int | None = None  # lossy: the message's bytes had it run exact (each half of an all-reduce)

    @property
    def link(self) -> str:
        return "inter" if self.nodes > 1 else "intra"

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends with the ring algorithm (an all-to-all sends all chunks
        but its own), all ``count`` calls together."""
        n = self.group_size
        factor = 2 * (n - 1) / n if self.op is Op.ALL_REDUCE else (n - 1) / n
        return factor * self.message_bytes * self.count

    @property
    def exact_wire_bytes(self) -> float:
        """:attr:`wire_bytes` had the collective run exact (the compression's baseline)."""
        return self.wire_bytes if self.exact_bytes is None else self.wire_bytes * self.exact_bytes / self.message_bytes


@dataclasses.dataclass(frozen=True)
class UnitGeometry:
    """This rank's three buffer layouts for one FSDP unit (one group of parameters).

    ``params``: global rows cut s_p ways (FSDP2's padded layout); ``grads``: this
    rank's P rows cut s_g/s_p ways; ``optim``: this rank's G rows cut s_os/s_g ways.
    """

    shapes: tuple[torch.Size, ...]
    params: ChunkLayout
    grads: ChunkLayout
    optim: ChunkLayout
    param_index: int
    grad_index: int
    optim_index: int

    @classmethod
    def build(cls, shapes: Sequence[torch.Size], plan: LinsPlan, coords: dict[str, int]) -> "UnitGeometry":
        shapes = tuple(torch.Size(s) for s in shapes)
        rows = tuple(s[0] if len(s) else 1 for s in shapes)
        row_numels = tuple(s[1:].numel() if len(s) else 1 for s in shapes)
        p_index, g_index, o_index = coords[PARAM_SHARD], coords[GRAD_SHARD], coords[OPTIM_SHARD]
        params = ChunkLayout(rows, row_numels, plan.params)
        grads = params.next_level(p_index, plan.grads // plan.params)
        optim = grads.next_level(g_index, plan.optim // plan.grads)
        return cls(shapes, params, grads, optim, p_index, g_index, o_index)

    def layout(self, level: str) -> ChunkLayout:
        return getattr(self, level)

    @property
    def os_is_g_chunk(self) -> bool:
        """Is this rank's OS layout its G chunk itself (OS no finer than G, and no padding
        in this rank's G chunk)? Then the OS-layout gradient is the G buffer, and the
        masters' buffer is the G-level chunk of the update gather, with no copy."""
        return self.optim.k == 1 and self.grads.chunk_rows(self.grad_index) == self.grads.padded_rows

    def local_shapes(self, level: str) -> list[torch.Size]:
        """Shapes of this rank's shard of each tensor at ``level``."""
        index = {"params": self.param_index, "grads": self.grad_index, "optim": self.optim_index}[level]
        rows = self.layout(level).chunk_rows(index)
        return [torch.Size((r, *s[1:])) for r, s in zip(rows, self.shapes)]

    def row_starts(self, level: str) -> list[int]:
        """First global row of this rank's shard of each tensor at ``level`` (an empty
        shard starts at the end of its parent, so that narrowing by it stays in range)."""
        starts = [0] * len(self.shapes)
        for name, index in (("params", self.param_index), ("grads", self.grad_index), ("optim", self.optim_index)):
            layout = self.layout(name)
            starts = [s + chunk_start(r, layout.k, index) for s, r in zip(starts, layout.rows)]
            if name == level:
                return starts
        raise ValueError(level)

    def message_numel(self, spec: CollectiveSpec) -> int:
        if spec.layout == "scalar":
            return 1
        if spec.layout == "flags":
            return len(self.shapes)
        return layout_message_numel(spec, self.layout(spec.layout))


def layout_message_numel(spec: CollectiveSpec, layout: ChunkLayout) -> int:
    """Elements of one message of ``spec`` cut from ``layout``: one chunk row for the
    all-reduce, the whole buffer otherwise (reduce-scatter input, all-gather output)."""
    return layout.chunk_numel if spec.op is Op.ALL_REDUCE else layout.total_numel


# ----- the group of every spec, from the plan alone ---------------------------------
def group_size(plan: LinsPlan, world_size: int, mesh_dim: str | None) -> int:
    if mesh_dim is None:
        return world_size
    replica, p, g, o = mesh_shape(plan, world_size)
    return {OPTIM_REPLICA: replica, PARAM_SHARD: p, GRAD_SHARD: g, OPTIM_SHARD: o}[mesh_dim]


def group_stride(plan: LinsPlan, mesh_dim: str | None) -> int:
    """Distance between consecutive ranks of a group of ``mesh_dim``."""
    if mesh_dim is None:
        return 1
    return {OPTIM_REPLICA: plan.optim, PARAM_SHARD: 1, GRAD_SHARD: plan.params, OPTIM_SHARD: plan.grads}[mesh_dim]


def nodes_spanned(size: int, stride: int, ranks_per_node: int) -> int:
    """Nodes covered by ``size`` ranks ``stride`` apart (groups are node-aligned)."""
    return len({(i * stride) // ranks_per_node for i in range(size)})


def link_level(nodes: int) -> str:
    """A group's link level for wire formats: "inter" when it spans nodes, else "intra"."""
    return "inter" if nodes > 1 else "intra"


def spec_format(spec: CollectiveSpec, formats: CommFormats, level: str) -> WireFormat:
    """The wire format a collective of ``spec`` takes on a group at ``level``."""
    return EXACT if spec.carries is None else formats.of(spec.carries, level)


# ----- collectives in a lossy wire format ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Encoded:
    """How one collective of ``spec`` runs in the lossy format ``fmt`` on a group of
    ``chunks`` ranks, over a message of ``chunks`` x ``chunk_numel`` values: the
    collectives it becomes and their messages, the values each rank encodes and decodes,
    and the error-feedback residuals it keeps (fp32 values).

    * reduce-scatter: an all-to-all of the encoded chunks, then a local fp32 sum of the
      ``chunks`` decoded rows;
    * all-reduce: the same over ``chunks`` slices of the message (the last padded), then
      an all-gather of each rank's encoded sum, decoded by every rank, itself included;
    * all-gather: each rank encodes its chunk, every rank decodes all of them.
    """

    spec: CollectiveSpec
    fmt: WireFormat
    chunks: int
    chunk_numel: int
    exact_bytes: int

    @classmethod
    def of(cls, spec: CollectiveSpec, fmt: WireFormat, group: int, layout: ChunkLayout, exact_bytes: int) -> "Encoded | None":
        """A collective of ``spec`` over ``layout`` on ``group`` ranks in ``fmt``, or None
        where it runs exact (:meth:`shrinking`)."""
        numel = -(-layout.chunk_numel // group) if spec.op is Op.ALL_REDUCE else layout.chunk_numel
        return cls.shrinking(spec, fmt, group, numel, exact_bytes)

    @classmethod
    def shrinking(cls, spec: CollectiveSpec, fmt: WireFormat, chunks: int, chunk_numel: int, exact_bytes: int) -> "Encoded | None":
        """The encoded collective, or None when ``fmt`` is exact or would not shrink its
        chunks (int8 blocks padded around a few values, a small unit's norm weights):
        such a collective runs exact, in the runtime and in this schedule alike."""
        encoded = cls(spec, fmt, chunks, chunk_numel, exact_bytes)
        return encoded if fmt.lossy and encoded.chunk_bytes < chunk_numel * exact_bytes else None

    @property
    def chunk_bytes(self) -> int:
        return self.fmt.chunk_bytes(self.chunk_numel, self.exact_bytes)

    @property
    def message_bytes(self) -> int:
        """Bytes of the whole encoded buffer (all-to-all input, all-gather output)."""
        return self.chunks * self.chunk_bytes

    @property
    def exact_message_bytes(self) -> int:
        """The message's bytes in the collective's own dtype (what the format saves on)."""
        return self.chunks * self.chunk_numel * self.exact_bytes

    @property
    def ops(self) -> tuple[Op, ...]:
        return {Op.REDUCE_SCATTER: (Op.ALL_TO_ALL,), Op.ALL_REDUCE: (Op.ALL_TO_ALL, Op.ALL_GATHER), Op.ALL_GATHER: (Op.ALL_GATHER,)}[self.spec.op]

    @property
    def feedback(self) -> bool:
        """Error feedback: for gradients in a biased format (parameter values are encoded
        afresh from exact masters every step)."""
        return self.fmt.error_feedback and self.spec.carries == "grads"

    @property
    def residual_numels(self) -> tuple[int, ...]:
        """fp32 residuals kept between steps: of the all-to-all's input, and (all-reduce)
        of this rank's encoded sum."""
        if not self.feedback:
            return ()
        whole = self.chunks * self.chunk_numel
        return (whole, self.chunk_numel) if self.spec.op is Op.ALL_REDUCE else (whole,)

    @property
    def codec_values(self) -> int:
        """Values this rank encodes plus decodes in one call (error feedback decodes its
        own encoded input once more to know what rounding lost)."""
        whole = self.chunks * self.chunk_numel
        if self.spec.op is Op.ALL_GATHER:
            return self.chunk_numel + whole
        values = 2 * whole + (whole if self.feedback else 0)
        if self.spec.op is Op.ALL_REDUCE:
            values += self.chunk_numel + whole + (self.chunk_numel if self.feedback else 0)
        return values


# ----- the expected communication of one step ----------------------------------------
@dataclasses.dataclass(frozen=True)
class UnitSchedule:
    """A unit's geometry plus how FSDP2 treats it (the root is not resharded after forward)."""

    geometry: UnitGeometry
    is_root: bool = False


def unit_collectives(plan: LinsPlan, unit: UnitSchedule, *, world_size: int, microbatches: int
                     ) -> Iterator[tuple[CollectiveSpec, ChunkLayout, int, int, int]]:
    """Each collective one unit issues in one optimizer step, as (spec, the layout its
    message is cut from, calls per step, group size, group stride); groups of one rank
    issue none. The one enumeration :func:`step_collectives` (bytes) and
    :func:`encoded_collectives` (codec work, error feedback) both count from.

    FSDP2 regathers a unit resharded after forward in backward, over the P group or
    (hpZ, ``reshard_after_forward`` an int k dividing s_p) over k ranks 1 apart, each
    holding a k-th of the P-padded buffer (measured: FSDP2's post-forward shards); the
    root unit is never resharded."""
    geo = unit.geometry
    if not any(s.numel() for s in geo.shapes):
        return
    hpz = plan.reshard_after_forward
    issued: list[tuple[CollectiveSpec, int, int | None]] = [(PARAM_ALL_GATHER, microbatches, None)]
    if not unit.is_root and hpz is not False:
        issued.append((PARAM_REGATHER, microbatches, plan.params if hpz is True else hpz))
    issued += [(GRAD_REDUCE_SCATTER, microbatches, None), (GRAD_SHARD_REDUCE_SCATTER, microbatches, None)]
    issued += [(spec, 1, None) for spec in (OPTIM_REDUCE_SCATTER, OPTIM_ALL_REDUCE, UPDATE_GATHER_OPTIM, UPDATE_GATHER_GRAD)]
    for spec, times, regather_size in issued:
        if regather_size is None:
            size, stride, layout = group_size(plan, world_size, spec.mesh_dim), group_stride(plan, spec.mesh_dim), geo.layout(spec.layout)
        else:
            size, stride, layout = regather_size, 1, ChunkLayout((geo.params.total_numel,), (1,), regather_size)
        if size > 1 and times > 0:
            yield spec, layout, times, size, stride


def step_collectives(
    plan: LinsPlan,
    units: Iterable[UnitSchedule],
    *,
    world_size: int,
    ranks_per_node: int,
    microbatches: int,
    param_bytes: int,
    reduce_bytes: int,
    clip_grad_norm: bool = False,
    tp: int = 1,
    formats: CommFormats = CommFormats(),
) -> list[CollectiveRecord]:
    """The collectives one rank issues in one optimizer step, aggregated by kind, size and
    wire format.

    ``world_size`` and ``ranks_per_node`` count data-parallel ranks (the plan's); with
    tensor parallelism of degree ``tp`` the units' geometry is of this rank's TP slices,
    and only the host agreement and the gradient norm's all-reduce span the TP ranks too.
    A collective in a lossy format (``formats``) is counted as the collectives it
    becomes (:class:`Encoded`), with their encoded bytes."""
    dtype_bytes = _dtype_bytes(param_bytes, reduce_bytes)
    units = list(units)
    counts: dict[tuple, int] = {}

    def add(spec: CollectiveSpec, times: int, size: int, nodes: int, numel: int, encoded: Encoded | None = None) -> None:
        if encoded is not None:
            for op in encoded.ops:
                key = (spec.name, spec.state, op, size, nodes, encoded.message_bytes, encoded.fmt.name, encoded.exact_message_bytes)
                counts[key] = counts.get(key, 0) + times
            return
        key = (spec.name, spec.state, spec.op, size, nodes, numel * dtype_bytes[spec.dtype], EXACT.name, None)
        counts[key] = counts.get(key, 0) + times

    for unit in units:
        for spec, layout, times, size, stride in unit_collectives(plan, unit, world_size=world_size, microbatches=microbatches):
            nodes = nodes_spanned(size, stride, ranks_per_node)
            encoded = Encoded.of(spec, spec_format(spec, formats, link_level(nodes)), size, layout, dtype_bytes[spec.dtype])
            add(spec, times, size, nodes, layout_message_numel(spec, layout), encoded)
    every_rank = dict(size=world_size * tp, nodes=nodes_spanned(world_size, 1, ranks_per_node))
    if every_rank["size"] > 1:
        add(USED_PARAMS_ALL_REDUCE, 1, numel=sum(unit.geometry.message_numel(USED_PARAMS_ALL_REDUCE) for unit in units), **every_rank)
        if clip_grad_norm:
            add(GRAD_NORM_ALL_REDUCE, 1, numel=1, **every_rank)
    return [CollectiveRecord(*key[:6], count=count, format=key[6], exact_bytes=key[7]) for key, count in counts.items()]


def _dtype_bytes(param_bytes: int, reduce_bytes: int) -> dict[str, int]:
    return {"param": param_bytes, "reduce": reduce_bytes, "float32": 4, "uint8": 1}


# Lins' own collectives that may take a lossy format (``carries`` set), which its chains
# encode and decode (:mod:`lins_dtensor.units`); FSDP2's parameter gathers may too
# (:class:`lins_dtensor.collectives.LinsAllGather` encodes and decodes them).
LOSSY_CAPABLE = (GRAD_SHARD_REDUCE_SCATTER, OPTIM_REDUCE_SCATTER, OPTIM_ALL_REDUCE, UPDATE_GATHER_OPTIM, UPDATE_GATHER_GRAD)
FSDP2_GATHERS = (PARAM_ALL_GATHER, PARAM_REGATHER)


def encoded_collectives(
    plan: LinsPlan, units: Iterable[UnitSchedule], *, world_size: int, ranks_per_node: int, microbatches: int,
    param_bytes: int, reduce_bytes: int, formats: CommFormats,
) -> Iterator[tuple[Encoded, int]]:
    """Each lossy collective of one step (:class:`Encoded`) and how many times it runs:
    what the codec work and the error-feedback memory are counted from."""
    dtype_bytes = _dtype_bytes(param_bytes, reduce_bytes)
    for unit in units:
        for spec, layout, times, size, stride in unit_collectives(plan, unit, world_size=world_size, microbatches=microbatches):
            fmt = spec_format(spec, formats, link_level(nodes_spanned(size, stride, ranks_per_node)))
            encoded = Encoded.of(spec, fmt, size, layout, dtype_bytes[spec.dtype])
            if encoded is not None:
                yield encoded, times


def carried_levels(plan: LinsPlan, *, world_size: int, ranks_per_node: int) -> set[str]:
    """Each ``<kind>_<level>`` of :class:`~lins_dtensor.formats.CommFormats` on which
    ``plan`` issues a collective (of a unit other than the root, of any size): the
    formats that can change what it sends."""
    probe = UnitSchedule(UnitGeometry.build([torch.Size((world_size,))], plan, dict.fromkeys(
        (PARAM_SHARD, GRAD_SHARD, OPTIM_SHARD), 0)))
    return {f"{spec.carries}_{link_level(nodes_spanned(size, stride, ranks_per_node))}"
            for spec, _, _, size, stride in unit_collectives(plan, probe, world_size=world_size, microbatches=1) if spec.carries}


def codec_values(plan: LinsPlan, units: Iterable[UnitSchedule], **kwargs) -> dict[str, dict[str, int]]:
    """Values one rank encodes plus decodes in one step, by phase and format (the
    arguments of :func:`encoded_collectives`): the planner times them at the rate
    ``lins-plan profile`` measures for each format."""
    out: dict[str, dict[str, int]] = {phase.value: {} for phase in Phase}
    for encoded, times in encoded_collectives(plan, units, **kwargs):
        part = out[encoded.spec.phase.value]
        part[encoded.fmt.name] = part.get(encoded.fmt.name, 0) + times * encoded.codec_values
    return out


def error_feedback_bytes(plan: LinsPlan, units: Iterable[UnitSchedule], **kwargs) -> int:
    """Persistent bytes per rank of the error-feedback residuals (fp32) of the lossy
    gradient reductions (the arguments of :func:`encoded_collectives`)."""
    return 4 * sum(sum(encoded.residual_numels) for encoded, _ in encoded_collectives(plan, units, **kwargs))


def fsdp2_copy_bytes(
    full_numel: int,
    shard_numel: int,
    reshard_after_forward: bool | int,
    *,
    microbatches: int,
    param_bytes: int,
    reduce_bytes: int,
) -> dict[str, int]:
    """Bytes one rank reads plus writes in FSDP2's own copies around one unit's
    collectives in one step, by phase: the part of :func:`local_copy_bytes` for a plan
    with P sharded, on its own so that the benchmark's calibration of FSDP2 (on
    one-rank groups) subtracts the very bytes the planner charges.

    ``full_numel`` is the unit's padded unsharded size, ``shard_numel`` this rank's
    shard of it. Every micro-batch FSDP2 copies the shard into its all-gather input and
    the gathered parameters out, and again in backward when resharded after forward
    (``True``; with hpZ, ``k``, it keeps a 1/k shard after forward, a copy, and
    re-gathers from it; ``False``, as for the root, re-gathers nothing); it copies the
    unsharded gradients into its reduce-scatter input, and the sharded gradient is a
    view of the reduce-scatter's output when FSDP2 stores P in the reduce dtype (stock
    FSDP2 keeps fp32 parameters; Lins' P is in ``param_dtype``, and
    :func:`local_copy_bytes` charges the cast FSDP2 then makes).
    """
    m = microbatches
    unshard = 2 * full_numel * param_bytes + 2 * shard_numel * param_bytes
    forward = m * unshard
    backward = m * 2 * full_numel * reduce_bytes  # the reduce-scatter copy-in
    if reshard_after_forward is True:
        backward += m * unshard
    elif reshard_after_forward is not False:
        post_forward = 2 * (full_numel // reshard_after_forward) * param_bytes
        forward += m * post_forward
        backward += m * (2 * full_numel * param_bytes + post_forward)
    return {Phase.FORWARD.value: forward, Phase.BACKWARD.value: backward, Phase.STEP.value: 0}


def local_copy_bytes(
    plan: LinsPlan,
    units: Iterable[UnitSchedule],
    *,
    microbatches: int,
    param_bytes: int,
    reduce_bytes: int,
    master_bytes: int = 4,
    divide: bool = True,
) -> dict[str, int]:
    """Bytes one rank reads plus writes in local copies around its collectives in one
    step, by phase: the memory-bound work that surrounds the collectives above.

    With P sharded (s_p > 1), FSDP2 makes its own copies (:func:`fsdp2_copy_bytes`),
    and where P is stored in a dtype other than the reduce dtype, one more after Lins'
    all-reduce hook has taken the gradient: FSDP2 casts the reduce-scatter output to
    P's dtype for a ``.grad`` that Lins drops (``FSDPParamGroup`` casts to its
    ``orig_dtype`` unconditionally; no FSDP2 setting skips it while P is stored in
    ``param_dtype``). With P replicated Lins uses no FSDP2 and takes autograd's
    gradients as they are.
    Each micro-batch's gradient then goes into the G buffer: copied by the first
    micro-batch of a step and added by the others, after a pack for the reduce-scatter
    when G is sharded finer than P (the first micro-batch's reduce-scatter writes into
    the G buffer itself). The reduction to the OS layout packs the G buffer when OS is
    finer than G (none when the OS layout is the G chunk itself), the step divides the
    OS gradient (``divide``) and casts it to the masters' dtype, and the update casts
    the masters to the parameter dtype, packs the G-level chunk when both gathers run,
    and unpacks the gathered rows into the parameters.
    """
    copies = {phase.value: 0 for phase in Phase}
    hpz = plan.reshard_after_forward
    m = microbatches
    for unit in units:
        geo = unit.geometry
        if not any(s.numel() for s in geo.shapes):
            continue
        full, p_numel, g_numel, os_numel = geo.params.total_numel, geo.params.chunk_numel, geo.grads.chunk_numel, geo.optim.chunk_numel
        backward = 0
        if plan.params > 1:
            fsdp2 = fsdp2_copy_bytes(
                full, p_numel, False if unit.is_root else hpz, microbatches=m, param_bytes=param_bytes, reduce_bytes=reduce_bytes,
            )
            copies[Phase.FORWARD.value] += fsdp2[Phase.FORWARD.value]
            backward += fsdp2[Phase.BACKWARD.value]
            if param_bytes != reduce_bytes:
                backward += m * p_numel * (reduce_bytes + param_bytes)  # FSDP2's cast for the dropped .grad
            grad_bytes = reduce_bytes  # FSDP2 hands Lins the reduced shard in the reduce dtype
        else:
            grad_bytes = param_bytes  # autograd's gradient, in the parameter dtype
        if geo.grads.k == 1:
            backward += p_numel * (grad_bytes + reduce_bytes) + (m - 1) * p_numel * (grad_bytes + 2 * reduce_bytes)
        else:
            backward += m * (p_numel * grad_bytes + geo.grads.total_numel * reduce_bytes) + (m - 1) * 3 * g_numel * reduce_bytes
        if geo.optim.k > 1:
            backward += (g_numel + geo.optim.total_numel) * reduce_bytes
        elif not geo.os_is_g_chunk:
            backward += 2 * os_numel * reduce_bytes
        copies[Phase.BACKWARD.value] += backward
        step = 2 * os_numel * reduce_bytes if divide else 0
        if reduce_bytes != master_bytes:
            step += os_numel * (reduce_bytes + master_bytes)
        if param_bytes != master_bytes:
            step += os_numel * (master_bytes + param_bytes)
        if geo.grads.k > 1 and not geo.os_is_g_chunk:
            step += 2 * g_numel * param_bytes
        step += 2 * p_numel * param_bytes
        copies[Phase.STEP.value] += step
    return copies


def chain_buffer_bytes(geometry: UnitGeometry, *, param_bytes: int, reduce_bytes: int, master_bytes: int = 4,
                       encoded: Iterable[Encoded] = ()) -> dict[str, int]:
    """Transient bytes each of a unit's chains (:mod:`lins_dtensor.executor`) holds
    until it is done: "grads", a micro-batch's reduce-scatter into G (the P-sharded
    gradient it was handed, counted in the reduce dtype, FSDP2's; autograd's, with P
    replicated, is in the parameter dtype, so this bounds it; the packed input; the
    output a later micro-batch adds); "optim", the reduction to the OS layout (packed
    input; its output is the optimizer's gradient, held until the step); "update", the
    gathers back to P (cast masters, gathered outputs, packed G chunk). A collective in a
    lossy format (``encoded``) adds its encoded input and output and its decoded fp32 rows."""
    geo = geometry
    o_n, g_n = geo.optim.chunk_numel, geo.grads.chunk_numel
    grads = (geo.params.chunk_numel + geo.grads.total_numel + g_n) * reduce_bytes if geo.grads.k > 1 else 0
    optim = geo.optim.total_numel * reduce_bytes if geo.optim.k > 1 else 0
    update = o_n * param_bytes if param_bytes != master_bytes else 0
    if geo.optim.k > 1:
        update += geo.optim.total_numel * param_bytes
    if geo.grads.k > 1:
        update += geo.grads.total_numel * param_bytes + (0 if geo.os_is_g_chunk else g_n * param_bytes)
    held = {"grads": grads, "optim": optim, "update": update}
    for e in encoded:
        chain = "grads" if e.spec.phase is Phase.BACKWARD else "update" if e.spec.carries == "params" else "optim"
        held[chain] += 2 * e.message_bytes + 4 * e.chunks * e.chunk_numel
    return held


def default_max_inflight_bytes(chains: Iterable[dict[str, int]]) -> int:
    """The executor's default bound on transient bytes in flight: twice the largest
    chain's (:func:`chain_buffer_bytes` per unit), so that one chain can run while the
    next one starts."""
    return 2 * max((max(c.values()) for c in chains), default=0)


def state_memory_bytes(
    units: Iterable[UnitSchedule], *, param_bytes: int, reduce_bytes: int, master_bytes: int = 4, optim_states: int = 2
) -> dict[str, int]:
    """Persistent bytes per rank of each state: P shards (FSDP2 keeps them padded),
    G buffers (padded chunk rows) and OS (the masters' buffer, ``master_bytes`` an
    element, padded like the update all-gather's input, plus ``optim_states`` tensors
    of the real size, 2 for Adam)."""
    memory = {"params": 0, "grads": 0, "optim": 0}
    for unit in units:
        geo = unit.geometry
        memory["params"] += geo.params.chunk_numel * param_bytes
        memory["grads"] += geo.grads.chunk_numel * reduce_bytes
        os_numel = sum(s.numel() for s in geo.local_shapes("optim"))
        memory["optim"] += (geo.optim.chunk_numel + optim_states * os_numel) * master_bytes
    return memory


def summarize(records: Iterable[CollectiveRecord]) -> dict[tuple[str, str, str], dict[str, float]]:
    """Totals keyed by (state, op, link): message bytes, wire bytes and call count."""
    out: dict[tuple[str, str, str], dict[str, float]] = {}
    for r in records:
        entry = out.setdefault((r.state, r.op.value, r.link), {"message_bytes": 0, "wire_bytes": 0.0, "count": 0})
        entry["message_bytes"] += r.message_bytes * r.count
        entry["wire_bytes"] += r.wire_bytes
        entry["count"] += r.count
    return out
