"""What both releases' Lins optimizer containers do beyond building their optimizers.

Each torchtitan release builds its ``OptimizersContainer`` differently (0.2.2 from a
class and kwargs, 0.3 from a config of param groups); under Lins the optimizers are
:func:`lins_dtensor.lins_optimizer` instances over the masters either way, and
:class:`LinsOptimizers` (mixed in before torchtitan's container) adds:

- clipping: :meth:`clip_grad_norm_` clips through Lins (the model's parameters carry
  no ``.grad`` under Lins), and ``step`` clips by ``max_norm`` itself if nothing did;
- checkpoints: the same flat ``state.<fqn>.<name>`` / ``param_groups.<fqn>.<key>``
  keys as torchtitan 0.2.2's container, so checkpoints are keyed by parameter FQN and
  a checkpoint saved under one plan loads under another.
"""

from __future__ import annotations

from typing import Any

import torch

from lins_dtensor import clip_grad_norm_


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


class LinsOptimizers:
    """Mixed in before torchtitan's ``OptimizersContainer``; the subclass sets
    ``self.max_norm`` (torchtitan's ``training.max_norm``)."""

    optimizers: list[torch.optim.Optimizer]
    model_parts: list[torch.nn.Module]
    max_norm: float = 0.0
    _clipped: bool = False

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
