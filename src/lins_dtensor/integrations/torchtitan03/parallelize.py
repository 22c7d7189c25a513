"""torchtitan 0.3's ``ModelSpec.parallelize_fn`` with Lins for the data-parallel dims.

0.3 calls ``parallelize_fn(model, *, parallel_dims, training, parallelism,
compile_config, ac_config, dump_folder)``; the Lins settings are not among them, so
:class:`~lins_dtensor.integrations.torchtitan03.trainer.LinsTrainer` binds
:func:`parallelize_lins` to its job (``functools.partial``) before torchtitan calls
it. The order is :mod:`lins_dtensor.integrations.titan_common.apply`'s: the Lins mesh,
tensor parallelism on its ``tp`` dim (:mod:`.tp`), activation checkpointing,
per-block ``torch.compile``, then Lins, with checkpoints in torchtitan's stock layout
(:mod:`.checkpoint_layout`).
"""

from __future__ import annotations

from torch import nn
from torchtitan.distributed.compile import apply_compile

from lins_dtensor.integrations.titan_common import plan as lins_plan
from lins_dtensor.integrations.titan_common.apply import build_mesh, shard
from lins_dtensor.integrations.titan_common.job import TitanJob
from lins_dtensor.integrations.torchtitan03.checkpoint_layout import merge_before_lins, split_after_lins
from lins_dtensor.integrations.torchtitan03.tp import parallelize_tp


def parallelize_lins(model: nn.Module, *, job: TitanJob, parallel_dims, training, parallelism, compile_config, ac_config,
                     dump_folder: str) -> nn.Module:
    """torchtitan 0.3's parallelize contract (a seed-checkpoint run never calls it)."""
    resolved = lins_plan.resolve(job, model)
    mesh = build_mesh(job, resolved)
    if resolved.tp > 1:
        parallelize_tp(model, parallel_dims, mesh)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    merge_before_lins(model)
    shard(model, job, resolved, mesh)
    split_after_lins(model)
    return model
