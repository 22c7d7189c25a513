"""The TrainSpec's ``build_optimizers_fn``: the Lins optimizer behind torchtitan 0.2.2's container.

:class:`LinsOptimizersContainer` is an ``OptimizersContainer`` whose optimizers are
:func:`lins_dtensor.lins_optimizer` instances over the masters; clipping and the
FQN-keyed state dict are :class:`~lins_dtensor.integrations.titan_common.optimizer.LinsOptimizers`'.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers

from lins_dtensor import lins_optimizer
from lins_dtensor.errors import LinsConfigError
from lins_dtensor.integrations.titan_common.optimizer import LinsOptimizers
from lins_dtensor.integrations.titan_common.apply import MAX_NORM_ATTR


class LinsOptimizersContainer(LinsOptimizers, OptimizersContainer):
    def __init__(self, model_parts: list[nn.Module], optimizer_cls, optimizer_kwargs: dict[str, Any], max_norm: float) -> None:
        # torchtitan's container builds one optimizer per model part, in order, from the
        # part's trainable parameters; under Lins each part's optimizer steps its fp32
        # masters, so the builder it is given ignores the parameters (P) it is handed.
        parts = iter(model_parts)

        def build(params: list[nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
            return lins_optimizer(next(parts), optimizer_cls, **kwargs)

        super().__init__(model_parts, build, optimizer_kwargs)
        self.max_norm = max_norm


def build_lins_optimizers(model_parts: list[nn.Module], optimizer_config, parallel_dims, ft_manager=None):
    """torchtitan's ``build_optimizers`` contract; Lins models get the Lins container."""
    if not all(hasattr(m, "_lins_state") for m in model_parts):
        return build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    if optimizer_config.early_step_in_backward:
        raise LinsConfigError("[optimizer] early_step_in_backward = true: not supported with [lins] enable = true")
    classes = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
    if optimizer_config.name not in classes:
        raise LinsConfigError(f"[optimizer] name = '{optimizer_config.name}': Lins builds {' or '.join(classes)} only")
    kwargs = {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        # Masters are DTensors on the Lins mesh (4-D, 5-D with TP): the foreach path works on every device.
        "foreach": optimizer_config.implementation != "for-loop",
    }
    max_norm = min(getattr(m, MAX_NORM_ATTR, 0.0) for m in model_parts)
    return LinsOptimizersContainer(model_parts, classes[optimizer_config.name], kwargs, max_norm)
