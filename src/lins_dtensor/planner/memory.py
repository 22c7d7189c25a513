"""Per-rank memory of a plan: model states, activations and transient buffers.

Model-state bytes are not re-derived here: each unit's geometry for rank coordinate 0
(which holds the largest, ceil-sized chunks) is built with
:class:`lins_dtensor.schedule.UnitGeometry` and summed by
:func:`lins_dtensor.schedule.state_memory_bytes`, the same code the runtime's layouts
come from. Activations follow a LLaMA block with FlashAttention (no s^2 term).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from lins_dtensor.formats import CommFormats
from lins_dtensor.mesh import MESH_DIMS
from lins_dtensor.plan import LinsPlan
from lins_dtensor.planner.models import ModelSpec, PlannerError, block_matmuls, shapes_numel, tensor_parallel_local
from lins_dtensor.planner.training import TrainingSpec
from lins_dtensor.schedule import (
    FSDP2_GATHERS,
    Encoded,
    UnitGeometry,
    UnitSchedule,
    chain_buffer_bytes,
    default_max_inflight_bytes,
    encoded_collectives,
    error_feedback_bytes,
    state_memory_bytes,
)

GiB = 1 << 30


def figure(value: float, decimals: int = 1) -> str:
    """``decimals`` places from 1 up, three significant figures below: a 64 MiB budget
    is 0.0625 GiB in a message, not 0.1, and a small model's link bytes are not 0.00 GB."""
    return f"{value:.{decimals}f}" if abs(value) >= 1 else f"{value:.3g}"


_RANK0 = {dim: 0 for dim in MESH_DIMS}


def rank0_units(model: ModelSpec, plan: LinsPlan) -> list[UnitSchedule]:
    """The units of ``model`` under ``plan`` for rank coordinate 0 (identical blocks share
    one geometry object). No unit is the FSDP root: the runtime's root has no own params."""
    cache: dict[tuple, UnitSchedule] = {}
    out = []
    for shapes in model.unit_shapes():
        if shapes not in cache:
            cache[shapes] = UnitSchedule(UnitGeometry.build([torch.Size(s) for s in shapes], plan, _RANK0))
        out.append(cache[shapes])
    return out


def activation_bytes(model: ModelSpec, training: TrainingSpec) -> int:
    """Activations one micro-batch keeps for backward (peak, per rank).

    Per block and token, saved for backward: block input, both norm outputs, the
    residual, q, k, v, the attention output, w1 and w3 outputs, their SwiGLU product
    (2 bytes each in bf16), and FlashAttention's fp32 log-sum-exp per head. With
    activation checkpointing each block keeps its input and what the policy does not
    recompute (:data:`~lins_dtensor.planner.training.RECOMPUTED_FORWARD`: under
    torchtitan's op policy the outputs of every other matmul and of attention), plus one
    block recomputed at a time.
    """
    t = training.microbatch_tokens
    a = training.activation_bytes
    d, kv, f = model.dim, model.kv_heads * model.head_dim, model.ffn_dim
    attention_output = a * d + 4 * model.n_heads  # with its log-sum-exp
    block = t * (a * (5 * d + 2 * kv) + a * 3 * f + attention_output)
    policy = training.recompute
    if training.activation_checkpointing == "none":
        blocks = model.n_layers * block
    else:
        kept = sum(out for i, (out, _) in enumerate(block_matmuls(model)) if not policy.recomputes_matmul(i)) * a
        kept += 0 if policy.attention else attention_output
        blocks = model.n_layers * t * (a * d + kept) + block
    # Final norm in/out, logits in bf16, their fp32 copy for the loss and its gradient.
    head = t * (2 * a * d + model.vocab_size * (a + 4 + 4))
    return blocks + head


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank; ``peak`` is states plus the larger of the two transient phases."""

    params: int
    grads: int
    optim: int
    activations: int
    buffers: int  # gathered parameters and gradient/reduce buffers during forward/backward
    step_buffers: int  # optimizer-step gradients and pack buffers (activations freed)
    error_feedback: int = 0  # lossy gradient formats' fp32 residuals, kept from step to step

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optim

    @property
    def peak(self) -> int:
        return self.states + self.error_feedback + max(self.activations + self.buffers, self.step_buffers)

    def gib(self) -> dict[str, float]:
        keys = ("params", "grads", "optim", "error_feedback", "activations", "buffers", "step_buffers")
        out = {k: round(getattr(self, k) / GiB, 3) for k in keys}
        out["peak"] = round(self.peak / GiB, 3)
        return out


def memory_breakdown(
    model: ModelSpec, plan: LinsPlan, training: TrainingSpec, units: list[UnitSchedule] | None = None, tp: int = 1, *,
    formats: CommFormats = CommFormats(), world_size: int | None = None, ranks_per_node: int | None = None,
) -> MemoryBreakdown:
    """``tp``: each rank holds its tensor-parallel slice of the parameters and, with
    sequence parallelism, 1/tp of the activations. Lossy ``formats`` add their encoded
    buffers to the chains and their error-feedback residuals (as
    :mod:`lins_dtensor.schedule` counts both); which collectives take them depends on
    the links, so they need the data-parallel ``world_size`` and ``ranks_per_node``."""
    units = rank0_units(tensor_parallel_local(model, tp), plan) if units is None else units
    pb, rb = training.param_bytes, training.reduce_bytes
    feedback = 0
    encoded: list[list[Encoded]] = [[] for _ in units]
    if formats.lossy:
        if world_size is None or ranks_per_node is None:
            raise PlannerError("memory_breakdown: lossy formats need world_size and ranks_per_node")
        where = dict(world_size=world_size, ranks_per_node=ranks_per_node, microbatches=1, param_bytes=pb, reduce_bytes=rb, formats=formats)
        feedback = error_feedback_bytes(plan, units, **where)
        encoded = [[e for e, _ in encoded_collectives(plan, [u], **where)] for u in units]
    # FSDP2's gathers in a lossy format (collectives.LinsAllGather) hold, per gather in
    # flight (the unit computed and the prefetched one), the encoded shard and the encoded
    # gathered buffer, and one decoded fp32 copy while it is written into FSDP2's output.
    fsdp2_encoded = [max((e.chunk_bytes + e.message_bytes for e in unit if e.spec in FSDP2_GATHERS), default=0) for unit in encoded]
    fsdp2_decoded = max((e.chunks * e.chunk_numel * 4 for unit in encoded for e in unit if e.spec in FSDP2_GATHERS), default=0)
    encoded = [[e for e in unit if e.spec not in FSDP2_GATHERS] for unit in encoded]
    states = state_memory_bytes(units, param_bytes=pb, reduce_bytes=rb, master_bytes=training.master_bytes, optim_states=training.optim_states)
    biggest = max((u.geometry.params.total_numel for u in units), default=0)
    if plan.params > 1:
        # FSDP2 holds the gathered unit being computed and the prefetched next one; in
        # backward also that unit's unsharded gradient (param dtype) and its
        # reduce-scatter input (reduce dtype), and where P is not stored in the reduce
        # dtype, its cast of the reduced shard (schedule.local_copy_bytes says why).
        buffers = 2 * biggest * pb + 2 * biggest * (pb + rb)
        if pb != rb:
            buffers += math.ceil(biggest / plan.params) * pb
    else:
        # With P replicated, one unit's gradients from autograd until they are in G.
        buffers = biggest * pb
    if fsdp2_decoded:
        buffers += 2 * max(fsdp2_encoded) + fsdp2_decoded
    hpz = plan.reshard_after_forward
    if plan.params > 1 and hpz is False:
        buffers += sum(u.geometry.params.total_numel for u in units) * pb
    elif plan.params > 1 and hpz is not True:
        # hpZ keeps every unit's parameters between forward and backward, sharded k ways.
        buffers += sum(math.ceil(shapes_numel(u.geometry.shapes) / hpz) for u in units) * pb
    # Lins' executor: transient buffers of its collectives in flight (its default bound,
    # twice the largest chain's), and each unit's reduced OS-layout gradient, held from
    # its reduction (in the last backward) to the end of the step unless it is the G
    # buffer itself.
    chains = [chain_buffer_bytes(u.geometry, param_bytes=pb, reduce_bytes=rb, master_bytes=training.master_bytes, encoded=e)
              for u, e in zip(units, encoded)]
    in_flight = default_max_inflight_bytes(chains)
    os_grads = sum(u.geometry.optim.chunk_numel * rb for u in units if not u.geometry.os_is_g_chunk)
    buffers += in_flight + (os_grads if training.reduce_in_backward else 0)
    step = os_grads + in_flight
    if rb != training.master_bytes:  # the masters' gradients, cast from the reduce dtype
        step += sum(u.geometry.optim.chunk_numel for u in units) * training.master_bytes
    return MemoryBreakdown(states["params"], states["grads"], states["optim"], activation_bytes(model, training) // tp, buffers, step, feedback)
