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
    return TitanJob.from_sections(job_config, job_config.lins, "toml", job_config.activation_checkpoint.mode,
                                  _refusals(job_config))
