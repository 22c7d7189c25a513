"""torchtitan 0.2.2's ``JobConfig`` as the release-neutral :class:`TitanJob` that Lins'
validation and planning (:mod:`lins_dtensor.integrations.titan_common.plan`) read."""

from __future__ import annotations

from lins_dtensor.integrations.titan_common.job import TitanJob


def _refusals(job_config) -> tuple[str, ...]:
    """0.2.2 settings Lins does not compose with, each as its one-line message."""
    out = []
    if job_config.optimizer.early_step_in_backward:
        out.append("[optimizer] early_step_in_backward = true: not supported with [lins] enable = true")
    if job_config.model.converters:
        out.append(
            f"[model] converters = {list(job_config.model.converters)}: Lins shards plain tensors and does not "
            "compose with float8 / quantized converters yet; remove them or set [lins] enable = false"
        )
    return tuple(out)


def titan_job(job_config) -> TitanJob:
    par, training = job_config.parallelism, job_config.training
    return TitanJob(
        lins=job_config.lins,
        key_style="toml",
        tp=par.tensor_parallel_degree,
        pp=par.pipeline_parallel_degree,
        cp=par.context_parallel_degree,
        ep=par.expert_parallel_degree,
        seq_len=training.seq_len,
        local_batch_size=training.local_batch_size,
        global_batch_size=training.global_batch_size,
        activation_checkpoint=job_config.activation_checkpoint.mode,
        param_dtype=training.mixed_precision_param,
        reduce_dtype=training.mixed_precision_reduce,
        max_norm=float(training.max_norm),
        cpu_offload=training.enable_cpu_offload,
        seed_checkpoint=job_config.checkpoint.create_seed_checkpoint,
        init_timeout_s=job_config.comm.init_timeout_seconds,
        train_timeout_s=job_config.comm.train_timeout_seconds,
        refusals=_refusals(job_config),
    )
