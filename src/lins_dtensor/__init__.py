"""lins_dtensor: Lins sharding (independent P / G / OS placements) on FSDP2 and DTensor."""

from lins_dtensor.errors import (
    LinsCheckpointError,
    LinsError,
    LinsPlanError,
    LinsUsageError,
)
from lins_dtensor.formats import CommFormats
from lins_dtensor.mesh import LinsMesh, build_lins_mesh
from lins_dtensor.optimizer import clip_grad_norm_, lins_optimizer
from lins_dtensor.plan import LinsPlan, valid_plans
from lins_dtensor.runtime import (
    apply_lins,
    reset_step,
    set_gradient_accumulation_steps,
    set_reduce_in_backward,
    set_requires_gradient_sync,
    wait_for_updates,
)
from lins_dtensor.stats import LinsStats, lins_stats

__all__ = [
    "CommFormats",
    "LinsCheckpointError",
    "LinsError",
    "LinsMesh",
    "LinsPlan",
    "LinsPlanError",
    "LinsStats",
    "LinsUsageError",
    "apply_lins",
    "build_lins_mesh",
    "clip_grad_norm_",
    "lins_optimizer",
    "lins_stats",
    "reset_step",
    "set_gradient_accumulation_steps",
    "set_reduce_in_backward",
    "set_requires_gradient_sync",
    "valid_plans",
    "wait_for_updates",
]
