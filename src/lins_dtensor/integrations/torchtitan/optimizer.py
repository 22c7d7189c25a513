"""The TrainSpec's ``build_optimizers_fn``: the Lins optimizer behind torchtitan's container.

:class:`LinsOptimizersContainer` is an ``OptimizersContainer`` whose optimizers are
:func:`lins_dtensor.lins_optimizer` instances over the masters. Its state dict
uses the same flat ``state.<fqn>.<name>`` / ``param_groups.<fqn>.<key>`` keys as
torchtitan's own container, so checkpoints are keyed by parameter FQN. It also owns
gradient clipping: :meth:`clip_grad_norm_` clips through Lins (the model's parameters
carry no ``.grad`` under Lins), and ``step`` clips by ``training.max_norm`` itself if
nothing did before it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers

from lins_dtensor import clip_grad_norm_, lins_optimizer
from lins_dtensor.errors import LinsConfigError
from lins_dtensor.integrations.torchtitan.parallelize import MAX_NORM_ATTR


def _key(fqn: str) -> str:
    """The checkpoint name of a parameter: without torch.compile's wrapper level, as
    torch.distributed.checkpoint.state_dict names it (compiled or not, same keys)."""
    return fqn.replace("_orig_mod.", "")


def _flatten(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fqn, per_param in sd["state"].items():
        for name, value in per_param.items():
            out[f"state.{_key(fqn)}.{name}"] = value
    for group in sd["param_groups"]:
        for fqn in group["params"]:
            for key, value in group.items():
                if key != "params":
                    out[f"param_groups.{_key(fqn)}.{key}"] = value
    return out


def _unflatten(flat: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`_flatten` for the FQNs in ``template`` (an optimizer's own
    state dict); keys of other model parts are ignored."""
    state: dict[str, dict[str, Any]] = {}
    for fqn, per_param in template["state"].items():
        state[fqn] = {name: flat.get(f"state.{_key(fqn)}.{name}", value) for name, value in per_param.items()}
    groups = []
    for group in template["param_groups"]:
        first = group["params"][0] if group["params"] else None
        new = {key: flat.get(f"param_groups.{_key(first) if first else first}.{key}", value) for key, value in group.items() if key != "params"}
        new["params"] = list(group["params"])
        groups.append(new)
    return {"state": state, "param_groups": groups}


class LinsOptimizersContainer(OptimizersContainer):
    def __init__(self, model_parts: list[nn.Module], optimizer_cls, optimizer_kwargs: dict[str, Any], max_norm: float) -> None:
        # torchtitan's container builds one optimizer per model part, in order, from the
        # part's trainable parameters; under Lins each part's optimizer steps its fp32
        # masters, so the builder it is given ignores the parameters (P) it is handed.
        parts = iter(model_parts)

        def build(params: list[nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
            return lins_optimizer(next(parts), optimizer_cls, **kwargs)

        super().__init__(model_parts, build, optimizer_kwargs)
        self.max_norm = max_norm
        self._clipped = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of every model part by their global norm; returns it."""
        norms = [clip_grad_norm_(model, max_norm, norm_type) for model in self.model_parts]
        self._clipped = True
        if len(norms) == 1:
            return norms[0]
        return torch.stack(norms).float().norm(norm_type)

    def step(self, *args, **kwargs) -> None:
        if not self._clipped and self.max_norm > 0:
            self.clip_grad_norm_(self.max_norm)
        self._clipped = False
        super().step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for opt in self.optimizers for k, v in _flatten(opt.state_dict()).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt in self.optimizers:
            opt.load_state_dict(_unflatten(state_dict, opt.state_dict()))


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
