"""How the model is trained: the knobs that change memory, FLOPs and micro-batch count."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from lins_dtensor.errors import PlannerError
from lins_dtensor.schedule import Op


@dataclasses.dataclass(frozen=True)
class RecomputePolicy:
    """What activation checkpointing re-runs of each block's forward during backward.

    ``matmul_every``: every n-th matmul of the block's forward (counted from 1) is
    recomputed, its output not kept: 1 all of them, 2 torchtitan's selective op policy
    (it saves the outputs of mm "except every second mm"), 0 none. ``attention``,
    ``elementwise`` (norms, RoPE, SwiGLU, residual adds): whether those are re-run.
    ``tp_collectives``: the tensor-parallel activation collectives re-run (torchtitan
    saves reduce-scatter outputs under its op policy, not all-gather ones).
    """

    matmul_every: int
    attention: bool
    elementwise: bool
    tp_collectives: tuple[Op, ...]

    def recomputes_matmul(self, index: int) -> bool:
        """Whether the block's matmul at 0-based forward position ``index`` is re-run."""
        return self.matmul_every > 0 and (index + 1) % self.matmul_every == 0


ActivationCheckpointing = Literal["none", "selective", "full"]
"""torchtitan's ``[activation_checkpoint] mode`` values the planner costs (``memory_budget``
aside: the torchtitan integration costs it as "selective")."""

# Per torchtitan mode: "full" wraps each block in a checkpoint (its whole forward re-runs);
# "selective" is its op policy (torchtitan/distributed/activation_checkpoint.py,
# _apply_op_sac, with llama3's _op_sac_save_list: mm, SDPA and reduce_scatter saved).
RECOMPUTED_FORWARD: dict[ActivationCheckpointing, RecomputePolicy] = {
    "none": RecomputePolicy(0, attention=False, elementwise=False, tp_collectives=()),
    "selective": RecomputePolicy(2, attention=False, elementwise=True, tp_collectives=(Op.ALL_GATHER,)),
    "full": RecomputePolicy(1, attention=True, elementwise=True, tp_collectives=(Op.ALL_GATHER, Op.REDUCE_SCATTER)),
}


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
    """One optimizer step = ``global_batch_tokens`` over all ranks, in micro-batches of
    ``micro_batch`` sequences of ``seq_len`` tokens (None: one micro-batch per rank).

    Byte sizes default to the runtime's bf16 parameters with fp32 gradient reduction,
    fp32 masters and Adam (2 states). ``overlap_fraction`` is how much of a phase's
    compute can hide FSDP2's per-micro-batch collectives (0 on CPU, where FSDP2 blocks
    on them), ``lins_overlap_fraction`` how much of the compute they overlap Lins' own
    asynchronous collectives hide behind (:mod:`lins_dtensor.planner.cost`; the
    benchmark measures it on CPU); ``overlap=False`` shows the exposed worst case.
    ``reduce_in_backward``: the runtime knows the last micro-batch (told or learned)
    and reduces to the optimizer layout during its backward; off, the reductions run
    at the optimizer step (``set_requires_gradient_sync(model, False)``).
    ``overlap_step``: the update gathers run behind the next forward, as the runtime
    does; off, they are exposed. ``activation_checkpointing`` is torchtitan's mode:
    "none", "selective" (its per-op policy: every second matmul and the elementwise work
    re-run, attention kept; :data:`RECOMPUTED_FORWARD`) or "full" (every block).
    """

    seq_len: int = 4096
    micro_batch: int = 1
    global_batch_tokens: int | None = None
    activation_checkpointing: ActivationCheckpointing = "none"
    param_bytes: int = 2
    reduce_bytes: int = 4
    master_bytes: int = 4
    optim_states: int = 2
    activation_bytes: int = 2
    overlap: bool = True
    overlap_fraction: float = 0.8
    lins_overlap_fraction: float = 0.8
    reduce_in_backward: bool = True
    overlap_step: bool = True
    clip_grad_norm: bool = False

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in typing.get_args(ActivationCheckpointing):
            raise PlannerError(
                f"activation_checkpointing={self.activation_checkpointing!r} must be one of "
                f"{', '.join(typing.get_args(ActivationCheckpointing))}"
            )
        if self.seq_len < 1 or self.micro_batch < 1:
            raise PlannerError(f"seq_len={self.seq_len} and micro_batch={self.micro_batch} must be >= 1")
        for name in ("overlap_fraction", "lins_overlap_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise PlannerError(f"{name}={getattr(self, name)} must be in [0, 1]")

    @property
    def recompute(self) -> RecomputePolicy:
        return RECOMPUTED_FORWARD[self.activation_checkpointing]

    @property
    def microbatch_tokens(self) -> int:
        return self.seq_len * self.micro_batch

    def microbatches(self, world_size: int) -> int:
        """Micro-batches per rank per step (M)."""
        if self.global_batch_tokens is None:
            return 1
        per_round = self.microbatch_tokens * world_size
        if self.global_batch_tokens < per_round or self.global_batch_tokens % per_round:
            raise PlannerError(
                f"global batch of {self.global_batch_tokens} tokens is not a positive multiple of "
                f"seq_len x micro_batch x gpus = {per_round}"
            )
        return self.global_batch_tokens // per_round
