"""The TrainSpec's ``parallelize_fn``: torchtitan 0.2.2's TP, AC and compile, then Lins for DP.

The order and the Lins steps are :mod:`lins_dtensor.integrations.titan_common.apply`'s.
torchtitan's own TP plan (sequence-parallel norms, loss parallel) runs on the Lins
mesh's ``tp`` dim rather than on torchtitan's world mesh. With ``[lins] enable =
false`` it is torchtitan's ``parallelize_llama`` unchanged.
"""

from __future__ import annotations

from torch import nn
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.infra import parallelize as llama_parallelize
from torchtitan.tools.logging import logger

from lins_dtensor.integrations.titan_common import plan as lins_plan
from lins_dtensor.integrations.titan_common.apply import build_mesh, shard
from lins_dtensor.integrations.torchtitan.plan import titan_job


def parallelize_lins(model: nn.Module, parallel_dims, job_config):
    lins = job_config.lins
    if not lins.enable:
        return llama_parallelize.parallelize_llama(model, parallel_dims, job_config)
    job = titan_job(job_config)
    lins_plan.check_parallelism(job)
    # A seed checkpoint is written by one rank from the unsharded model, as torchtitan
    # does: it then loads under any plan (or under torchtitan's FSDP).
    seed_run = job_config.checkpoint.create_seed_checkpoint
    if not seed_run:
        resolved = lins_plan.resolve(job, model)
        mesh = build_mesh(job, resolved)
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

    return shard(model, job, resolved, mesh)
