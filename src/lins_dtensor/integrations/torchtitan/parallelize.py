"""The TrainSpec's ``parallelize_fn``: torchtitan's TP, AC and compile, then Lins for DP.

It keeps torchtitan's order (tensor parallelism, activation checkpointing, per-block
``torch.compile``, then data parallelism) and replaces its ``apply_fsdp`` with
:func:`lins_dtensor.apply_lins` over every data-parallel rank. torchtitan's own TP plan
(sequence-parallel norms, loss parallel) runs on the Lins mesh's ``tp`` dim rather than
on torchtitan's world mesh, so that FSDP2 and the masters can describe each
parameter's TP and data-parallel sharding on one mesh. With ``[lins] enable = false`` it
is torchtitan's ``parallelize_llama`` unchanged.
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.infra import parallelize as llama_parallelize
from torchtitan.tools.logging import logger

from lins_dtensor import apply_lins, build_lins_mesh
from lins_dtensor.integrations.torchtitan import plan as lins_plan
from lins_dtensor.integrations.torchtitan.planning import table
from lins_dtensor.runtime import lins_state

# Set on the model for the optimizer builder and the metrics processor.
RESOLVED_ATTR = "_lins_resolved"
MAX_NORM_ATTR = "_lins_max_norm"
REPORT_ATTR = "_lins_report"


def parallelize_lins(model: nn.Module, parallel_dims, job_config):
    lins = job_config.lins
    if not lins.enable:
        return llama_parallelize.parallelize_llama(model, parallel_dims, job_config)
    lins_plan.check_parallelism(job_config)
    # A seed checkpoint is written by one rank from the unsharded model, as torchtitan
    # does: it then loads under any plan (or under torchtitan's FSDP).
    seed_run = job_config.checkpoint.create_seed_checkpoint
    if not seed_run:
        resolved = lins_plan.resolve(job_config, model)
        world = lins_plan.world_size()
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        # Lins' groups follow torchtitan's timeouts: start-up now, training after step 1
        # (LinsTrainer), so a stopped rank ends the job instead of hanging it.
        mesh = build_lins_mesh(resolved.plan, world, resolved.ranks_per_node, device_type,
                               timeout=timedelta(seconds=job_config.comm.init_timeout_seconds), tp=resolved.tp)
        if resolved.tp > 1:
            # [model] converters (float8) are refused with Lins, hence no float8 TP styles.
            llama_parallelize.apply_tp(model, mesh.tp_mesh(), loss_parallel=not job_config.parallelism.disable_loss_parallel,
                                       enable_float8_tensorwise_tp=False)
            maybe_enable_async_tp(job_config, mesh.tp_mesh())

    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=compile_model,
            op_sac_save_list=llama_parallelize._op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if compile_model:
        llama_parallelize.apply_compile(model, job_config.compile)
    if seed_run:
        logger.info("Lins: seed checkpoint run, model left unsharded")
        return model

    param_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    reduce_dtype = TORCH_DTYPE_MAP[lins.grad_dtype or job_config.training.mixed_precision_reduce]
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report = table(resolved.plan, resolved.prediction, world, resolved.ranks_per_node, num_params, param_dtype.itemsize,
                   reduce_dtype.itemsize, resolved.tp)
    if torch.distributed.get_rank() == 0:
        logger.info("\n" + report)
    # torchtitan's loss is (local token-loss sum) / (global token count), so the
    # gradients must be *summed* over the data-parallel ranks, as torchtitan's FSDP does
    # (gradient_divide_factor 1.0).
    apply_lins(
        model,
        mesh,
        resolved.plan,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        gradient_divide_factor=1.0,
    )
    setattr(model, RESOLVED_ATTR, resolved)
    setattr(model, MAX_NORM_ATTR, float(job_config.training.max_norm))
    setattr(model, REPORT_ATTR, report)
    logger.info(
        f"Applied Lins plan {resolved.plan} (tensor parallel {resolved.tp}) to the model: parameters in {param_dtype}, gradients reduced in "
        f"{reduce_dtype}, optimizer on {lins_state(model).ctx.master_dtype} masters"
    )
    return model
