"""The Lins optimizer behind torchtitan 0.3's ``OptimizersContainer`` contract.

0.3 builds its container from ``config.optimizer`` as ``Config.build(model_parts=...)``,
the config holding regex param groups, each with an optimizer name and its kwargs.
:class:`LinsOptimizersContainer` reads the same config (the trainer swaps the class,
:func:`lins_config`) and builds, per model part, one
:func:`lins_dtensor.lins_optimizer` over the masters with those param groups;
clipping and the FQN-keyed state dict are
:class:`~lins_dtensor.integrations.titan_common.optimizer.LinsOptimizers`'. The groups
come from the container's own helpers (``_build_impl_kwargs``,
``_build_param_groups``, ``_validate_params``, ``_post_init``: underscore methods, but
0.3's one definition of the regex grouping). Waits for: a public per-group builder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

from lins_dtensor import lins_optimizer
from lins_dtensor.integrations.titan_common.apply import MAX_NORM_ATTR
from lins_dtensor.integrations.titan_common.optimizer import LinsOptimizers
from lins_dtensor.integrations.titan_common.settings import LinsConfigError

_CLASSES = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


class LinsOptimizersContainer(LinsOptimizers, OptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """torchtitan's optimizer config, built into Lins optimizers."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        impl_kwargs = self._build_impl_kwargs(config)
        self.model_parts = model_parts
        self.optimizers = []
        all_params: list[nn.Parameter] = []
        for model in model_parts:
            groups, _ = self._build_param_groups(model, config.param_groups, impl_kwargs)
            if len(groups) != 1 or next(iter(groups)) not in _CLASSES:
                raise LinsConfigError(
                    f"optimizer.param_groups use {sorted(groups)}: Lins steps one Adam or AdamW optimizer per model part"
                )
            (name, param_groups), = groups.items()
            # torch.optim keeps "param_names" beside "params"; the Lins optimizer's
            # groups hold the same parameters and are named by their FQNs already.
            param_groups = [{k: v for k, v in g.items() if k != "param_names"} for g in param_groups]
            self.optimizers.append(lins_optimizer(model, _CLASSES[name], params=param_groups))
            all_params.extend(p for g in param_groups for p in g["params"])
        self._validate_params(all_params)
        self.max_norm = min(getattr(m, MAX_NORM_ATTR, 0.0) for m in model_parts)
        self._post_init(all_params)


def lins_config(config: OptimizersContainer.Config) -> LinsOptimizersContainer.Config:
    """The same settings, built into the Lins container."""
    return LinsOptimizersContainer.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})
