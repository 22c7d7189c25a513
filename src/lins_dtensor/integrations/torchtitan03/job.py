"""torchtitan 0.3's ``Trainer.Config`` as the release-neutral :class:`TitanJob` that Lins'
validation and planning (:mod:`lins_dtensor.integrations.titan_common.plan`) read."""

from __future__ import annotations

from torchtitan.components.quantization.utils import has_quantization
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

from lins_dtensor.integrations.titan_common.job import TitanJob
from lins_dtensor.integrations.titan_common.settings import Lins

SPMD_BACKEND = "partial_dtensor"


def activation_checkpoint_mode(ac_config) -> str:
    """0.2.2's mode name of a 0.3 activation-checkpointing config (a class per mode)."""
    modes = {SelectiveAC.Config: "selective", FullAC.Config: "full", MemoryBudgetAC.Config: "memory_budget"}
    return "none" if ac_config is None else modes.get(type(ac_config), "selective")


def _refusals(config) -> tuple[str, ...]:
    """0.3 settings Lins does not compose with, each as its one-line message."""
    out = []
    if config.parallelism.spmd_backend != SPMD_BACKEND:
        out.append(
            f"parallelism.spmd_backend = '{config.parallelism.spmd_backend}': Lins keeps each parameter a DTensor on "
            f"its own mesh; set --parallelism.spmd_backend {SPMD_BACKEND} (the Lins configs do)"
        )
    if config.parallelism.data_parallel_replicate_degree != 1:
        out.append(
            f"parallelism.data_parallel_replicate_degree = {config.parallelism.data_parallel_replicate_degree}: Lins "
            "shards the data-parallel ranks itself; use the plan (e.g. lins.plan hsdp:<k>) and keep it 1"
        )
    if config.model_spec is not None and has_quantization(config.model_spec.model):
        out.append(
            "model_spec: the model has float8 / quantized linears (converters): Lins shards plain tensors and does not "
            "compose with them yet; use a config without converters or set --lins.no-enable"
        )
    return tuple(out)


def titan_job(config, lins: Lins) -> TitanJob:
    return TitanJob.from_sections(config, lins, "cli", activation_checkpoint_mode(config.activation_checkpoint),
                                  _refusals(config))
