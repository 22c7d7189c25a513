"""Lins in a torchtitan ``parallelize_fn``: its mesh before TP, its sharding after AC and compile.

Both releases keep torchtitan's order (tensor parallelism, activation checkpointing,
per-block ``torch.compile``, then data parallelism) and replace FSDP with
:func:`lins_dtensor.apply_lins` over every data-parallel rank: :func:`build_mesh`
comes first (TP runs on its ``tp`` dim, so that FSDP2 and the masters describe each
parameter's TP and data-parallel sharding on one mesh), :func:`shard` last.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from lins_dtensor import apply_lins, build_lins_mesh
from lins_dtensor.integrations.titan_common.job import TitanJob
from lins_dtensor.integrations.titan_common.plan import Resolved
from lins_dtensor.integrations.titan_common.planning import table
from lins_dtensor.mesh import LinsMesh
from lins_dtensor.runtime import lins_state

# Set on the model for the optimizer builder and the metrics processor.
RESOLVED_ATTR = "_lins_resolved"
MAX_NORM_ATTR = "_lins_max_norm"
REPORT_ATTR = "_lins_report"


def build_mesh(job: TitanJob, resolved: Resolved) -> LinsMesh:
    """The Lins mesh for the resolved plan; its groups follow torchtitan's start-up
    timeout now and the training one after step 1 (the trainers move them), so a
    stopped rank ends the job instead of hanging it."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return build_lins_mesh(resolved.plan, job.world_size, resolved.ranks_per_node, device_type,
                           timeout=timedelta(seconds=job.init_timeout_s), tp=resolved.tp)


def shard(model: nn.Module, job: TitanJob, resolved: Resolved, mesh: LinsMesh) -> nn.Module:
    """Print the start-up table (rank 0), apply the plan, and leave on the model what
    the optimizer container and the metrics processor read."""
    param_dtype = TORCH_DTYPE_MAP[job.param_dtype]
    reduce_dtype = TORCH_DTYPE_MAP[job.grad_dtype]
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report = table(resolved.plan, resolved.prediction, job.world_size, resolved.ranks_per_node, num_params,
                   param_dtype.itemsize, reduce_dtype.itemsize, resolved.tp, job.key("lins", "plan"))
    if torch.distributed.get_rank() == 0:
        logger.info("\n" + report)
    # torchtitan's loss is (local token-loss sum) / (global token count), so the
    # gradients must be *summed* over the data-parallel ranks, as torchtitan's FSDP does
    # (gradient_divide_factor 1.0).
    # The wire formats: the setting's, or with plan = "auto" the planner's choice among them.
    apply_lins(
        model,
        mesh,
        resolved.plan,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        gradient_divide_factor=1.0,
        comm_formats=resolved.formats,
    )
    setattr(model, RESOLVED_ATTR, resolved)
    setattr(model, MAX_NORM_ATTR, job.max_norm)
    setattr(model, REPORT_ATTR, report)
    logger.info(
        f"Applied Lins plan {resolved.plan} (tensor parallel {resolved.tp}) to the model: parameters in {param_dtype}, "
        f"gradients reduced in {reduce_dtype}, optimizer on {lins_state(model).ctx.master_dtype} masters, "
        f"wire formats {resolved.formats}"
    )
    return model
