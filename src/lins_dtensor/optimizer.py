"""Any ``torch.optim`` optimizer on the fp32 masters, which live on the OS layout.

The optimizer is a plain instance of the user's class over this rank's shards of the
masters (plain tensors sharing storage with the master DTensors), so its states are
sharded s_os ways too, and LR schedulers, ``zero_grad`` and torchtitan's container
treat it as usual. Step hooks do the Lins part: before the step the G buffers are
reduced into the masters' gradients, after it the new values are all-gathered into
the parameters. Its state dict is keyed by parameter FQN and holds every state shaped
like its parameter as a DTensor on the OS layout, so torch.distributed.checkpoint can
reload it under another plan.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lins_dtensor import collectives
from lins_dtensor.compat import foreach_mul_
from lins_dtensor.plan import LinsPlanError
from lins_dtensor.runtime import lins_state
from lins_dtensor.units import local_values
from lins_dtensor.schedule import GRAD_NORM_ALL_REDUCE


class _StepHooks:
    """Before the step: G buffers -> master gradients. After: masters -> parameters."""

    def __init__(self, model: nn.Module) -> None:
        self.state = lins_state(model)
        self.enabled = True

    def before(self, optimizer, args, kwargs) -> None:
        if self.enabled:
            self.state.reduce_gradients()

    def after(self, optimizer, args, kwargs) -> None:
        if self.enabled:
            self.state.finish_step()


def lins_optimizer(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
    """``optimizer_cls(masters, **kwargs)`` wired to the Lins model ``model``."""
    state = lins_state(model)
    masters = state.masters()
    locals_ = [m for unit in state.units for m in unit.local_masters]
    optimizer = optimizer_cls(locals_, **kwargs)
    hooks = _StepHooks(model)
    optimizer.register_step_pre_hook(hooks.before)
    optimizer.register_step_post_hook(hooks.after)
    optimizer._lins_hooks = hooks  # type: ignore[attr-defined]
    optimizer._lins_fqns = list(masters)  # type: ignore[attr-defined]
    optimizer._lins_masters = list(masters.values())  # type: ignore[attr-defined]
    optimizer.register_state_dict_pre_hook(_init_state_if_empty)
    optimizer.register_state_dict_post_hook(_keys_to_fqns)
    optimizer.register_load_state_dict_pre_hook(_keys_from_fqns)
    state.optimizer = optimizer
    return optimizer


def _init_state_if_empty(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer states before the first step, so that a fresh optimizer's
    state dict can be loaded into (DCP loads in place): a zero-learning-rate step on
    zero gradients, as torch.distributed.checkpoint.state_dict does, with the Lins
    hooks off (no gradients to reduce, no values to spread)."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer._lins_hooks.enabled = False
    try:
        optimizer.step()
    finally:
        optimizer._lins_hooks.enabled = True
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p in params:
            p.grad = None


def _as_dtensor(value, master: DTensor):
    if isinstance(value, torch.Tensor) and value.shape == master.to_local().shape and value.dim() > 0:
        return DTensor.from_local(value, master.device_mesh, master.placements, run_check=False, shape=master.shape, stride=master.stride())
    return value


def _keys_to_fqns(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    fqns, masters = optimizer._lins_fqns, optimizer._lins_masters
    state_dict["state"] = {
        fqns[i]: {name: _as_dtensor(value, masters[i]) for name, value in per_param.items()}
        for i, per_param in state_dict["state"].items()
    }
    for group in state_dict["param_groups"]:
        group["params"] = [fqns[i] for i in group["params"]]
    return state_dict


def _keys_from_fqns(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Back to torch's integer keys. torch pairs saved and current parameters by their
    position in each param group, and the order of a unit's parameters depends on the
    plan (FSDP2's order where P is sharded, the module's where it is replicated), so the
    groups are matched by the parameters' names and keep the current order."""
    fqns = optimizer._lins_fqns
    index = {fqn: i for i, fqn in enumerate(fqns)}
    state_dict = dict(state_dict)
    state_dict["state"] = {
        index[k] if isinstance(k, str) else k: {n: v.to_local() if isinstance(v, DTensor) else v for n, v in per_param.items()}
        for k, per_param in state_dict["state"].items()
    }
    groups, start = [], 0
    for number, (saved, current) in enumerate(zip(state_dict["param_groups"], optimizer.param_groups)):
        names = fqns[start : start + len(current["params"])]
        saved_names = {fqns[p] if isinstance(p, int) else p for p in saved["params"]}
        if saved_names != set(names):
            raise LinsPlanError(f"optimizer param group {number} holds other parameters than the checkpoint's group {number}")
        groups.append({**saved, "params": [index[n] for n in names]})
        start += len(current["params"])
    state_dict["param_groups"] = groups
    return state_dict


def local_nbytes(tensor: torch.Tensor | None) -> int:
    """Bytes this rank holds of ``tensor`` (its local shard for a DTensor; 0 for None)."""
    if tensor is None:
        return 0
    local = local_values(tensor)
    return local.numel() * local.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of optimizer states (e.g. Adam's two moments) this rank holds."""
    if optimizer is None:
        return 0
    total = 0
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += local_nbytes(value)  # FSDP2's states are DTensors
    return total


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a Lins model by their global norm; returns the norm.

    Call it between backward and ``optimizer.step()``. The model's own parameters carry
    no gradients under Lins (they live in G buffers until the step), so
    ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would see none: use this.
    It reduces the gradients into the masters (the step then reuses them) and takes
    the norm over the OS shards with one scalar all-reduce. A non-finite norm behaves
    as in ``torch.nn.utils.clip_grad_norm_``: returned, and the gradients scaled by it,
    or, with ``error_if_nonfinite``, a ``RuntimeError`` on every rank (all ranks see the
    same reduced norm) before anything is scaled.
    """
    state = lins_state(model)
    state.reduce_gradients()
    # Under TP a master that TP replicates (a norm's weight) is held, with the same
    # gradient, by every rank of the TP group: its share of the sum counts once.
    tp_replicas = state.mesh.tp
    grads, replicated = [], []
    for unit in state.units:
        for master, tp_slice in zip(unit.local_masters, unit.slices):
            if master.grad is not None:
                (grads if tp_slice.tp_sharded or tp_replicas == 1 else replicated).append(master.grad)
    norm_type = float(norm_type)
    device = state.device
    all_grads = grads + replicated
    if math.isinf(norm_type):
        maxima = [g.abs().max() for g in all_grads if g.numel()]
        local = torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
        total = local.float().reshape(1)
        collectives.all_reduce(state.recorder, GRAD_NORM_ALL_REDUCE, total, None, op=dist.ReduceOp.MAX)
        norm = total[0]
    else:
        def powered_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
            return sum((g.float().norm(norm_type) ** norm_type for g in tensors if g.numel()), torch.zeros((), device=device))

        local = powered_sum(grads) + powered_sum(replicated) / tp_replicas
        total = local.reshape(1)
        collectives.all_reduce(state.recorder, GRAD_NORM_ALL_REDUCE, total, None)
        # Every OS shard is held by N / s_os data-parallel replicas, each of which added it.
        replicas = state.mesh.dp_world_size // state.plan.optim
        norm = (total[0] / replicas) ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"lins: clip_grad_norm_: the order-{norm_type:g} norm of the gradients is {norm.item()}, not finite; "
            "nothing was clipped (error_if_nonfinite=False scales the gradients by it, like torch)"
        )
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if all_grads:
        foreach_mul_(all_grads, coef)
    return norm
