"""Any ``torch.optim`` optimizer on the masters (``master_dtype``), which live on the OS layout.

The optimizer is a plain instance of the user's class. Its param groups hold the
model's parameters, as torch.optim's do (so that torch.distributed.checkpoint.state_dict
and users' code find them there); its step updates this rank's shards of their masters
(plain tensors sharing storage with the master DTensors), so its states are sharded
s_os ways too, and LR schedulers, ``zero_grad`` and torchtitan's container treat it as
usual. Step hooks do the Lins part: before the step the G buffers are reduced into the
masters' gradients and the masters' shards take the parameters' place in the groups,
after it the parameters are back and the new values are all-gathered into them. Its
state dict is keyed by parameter FQN and holds every state shaped like its parameter
as a DTensor on the OS layout, so torch.distributed.checkpoint can reload it under
another plan; ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` give and take
the same.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lins_dtensor import collectives
from lins_dtensor.compat import foreach_mul_, keep_own_state_dict
from lins_dtensor.errors import LinsCheckpointError, LinsUsageError
from lins_dtensor.runtime import LinsState, lins_state
from lins_dtensor.units import local_values
from lins_dtensor.schedule import GRAD_NORM_ALL_REDUCE

# What lins_optimizer takes as ``params``: torch.optim's forms, with names for parameters.
ParamsArg = Iterable[torch.Tensor | str] | Iterable[dict[str, Any]]


class _StepHooks:
    """Before the step: G buffers -> master gradients, and the masters' shards into the
    param groups in place of the parameters. After: the parameters back, masters -> P.

    Two steps only create the optimizer's states, with a zero learning rate on zero
    gradients: :func:`_init_state_if_empty`'s (the hooks disabled: nothing reduced or
    gathered), and torch.distributed.checkpoint.state_dict's before the first step,
    which puts zeros in the parameters' ``.grad`` while Lins has received no gradient.
    The masters take zero gradients for them, as the parameters would."""

    def __init__(self, state: LinsState, optimizer: torch.optim.Optimizer, params: list[list[nn.Parameter]],
                 masters: list[list[nn.Parameter]]) -> None:
        self.state = state
        self.optimizer = weakref.proxy(optimizer)  # the optimizer holds its hooks
        self.params, self.masters = params, masters
        self.master_of = {id(p): m for ps, ms in zip(params, masters) for p, m in zip(ps, ms)}
        self.param_of = {id(m): p for ps, ms in zip(params, masters) for p, m in zip(ps, ms)}
        self.on_masters = True  # the optimizer is built on them
        self.enabled = True
        self.zero_grads: list[nn.Parameter] = []

    def hold(self, masters: bool) -> None:
        """Put the masters' shards (or the parameters) in the param groups; the
        optimizer's states move with them. Loading a state dict holds the masters too:
        torch casts the loaded states to their parameters' dtype (P may be bf16)."""
        if self.on_masters == masters:
            return
        tensors, counterpart = (self.masters, self.master_of) if masters else (self.params, self.param_of)
        for group, group_tensors in zip(self.optimizer.param_groups, tensors):
            group["params"][:] = group_tensors  # in place: code holding the list sees the swap
        states = self.optimizer.state
        moved = [(counterpart[id(key)], value) for key, value in states.items()]
        states.clear()
        states.update(moved)
        self.on_masters = masters

    def before(self, optimizer, args, kwargs) -> None:
        if self.enabled:
            self.state.reduce_gradients()
        self.hold(masters=True)
        masters = [m for group in self.masters for m in group]
        if not self.enabled or self._torch_creates_states(masters):
            for master in masters:
                master.grad = torch.zeros_like(master)
            self.zero_grads = masters

    def _torch_creates_states(self, masters: list[nn.Parameter]) -> bool:
        return all(m.grad is None for m in masters) and any(p.grad is not None for group in self.params for p in group)

    def discard(self) -> None:
        """After a step that raised inside ``optimizer.step()`` (the masters in the param
        groups, perhaps with zero gradients of the state-creating step): the parameters
        go back (:meth:`LinsState.discard_step`)."""
        for master in self.zero_grads:
            master.grad = None
        self.zero_grads = []
        self.hold(masters=False)

    def after(self, optimizer, args, kwargs) -> None:
        self.hold(masters=False)
        for master in self.zero_grads:
            master.grad = None
        self.zero_grads = []
        if self.enabled:
            self.state.finish_step()


def lins_optimizer(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], params: ParamsArg | None = None,
                   **kwargs: Any) -> torch.optim.Optimizer:
    """``optimizer_cls(params, **kwargs)`` on the masters of the Lins model ``model``.

    Each trainable parameter must be in exactly one group, since Lins reduces and
    updates them all; frozen ones are skipped (they have no master). Collect parameters
    after ``apply_lins``: FSDP2 replaces them (names work either way).

    Args:
        model (nn.Module): a model :func:`~lins_dtensor.apply_lins` has sharded.
        optimizer_cls (type[torch.optim.Optimizer]): any ``torch.optim`` optimizer class;
            it steps this rank's OS shards of the masters.
        params (ParamsArg | None): what torch.optim takes: the model's parameters, or
            param groups (dicts whose ``"params"`` list them, with per-group options
            such as ``weight_decay=0.0``); a parameter may also be given by its name.
            ``None``: every trainable parameter, one group.
        **kwargs: the optimizer's options (``lr``, ...), passed to ``optimizer_cls``.

    Returns:
        torch.optim.Optimizer: a plain ``optimizer_cls`` instance whose step hooks do
        the Lins part, and whose state dict is keyed by parameter FQN.

    Raises:
        LinsUsageError: a parameter in no group or in two, or one not of the model.
    """
    state = lins_state(model)
    state.materialize()
    masters = state.masters()
    groups = _param_groups(model, state, params)
    locals_by_fqn = {fqn: m for unit in state.units for fqn, m in zip(unit.fqns, unit.local_masters)}
    params_by_fqn = {fqn: p for unit in state.units for fqn, p in zip(unit.fqns, unit.params)}
    group_masters = [[locals_by_fqn[fqn] for fqn in fqns] for _, fqns in groups]
    if params is None:  # exactly what torch.optim makes of a plain list
        optimizer = optimizer_cls(group_masters[0], **kwargs)
    else:
        optimizer = optimizer_cls([{**options, "params": ms} for (options, _), ms in zip(groups, group_masters)], **kwargs)
    hooks = _StepHooks(state, optimizer, [[params_by_fqn[fqn] for fqn in fqns] for _, fqns in groups], group_masters)
    hooks.hold(masters=False)
    optimizer.register_step_pre_hook(hooks.before)
    optimizer.register_step_post_hook(hooks.after)
    state.discard_optimizer_step = hooks.discard
    _discard_failed_step_on_zero_grad(optimizer, state)
    fqns = [fqn for _, group_fqns in groups for fqn in group_fqns]
    optimizer._lins_hooks = hooks  # type: ignore[attr-defined]
    optimizer._lins_fqns = fqns  # type: ignore[attr-defined]
    optimizer._lins_masters = [masters[fqn] for fqn in fqns]  # type: ignore[attr-defined]
    optimizer.register_state_dict_pre_hook(_before_state_dict)
    optimizer.register_state_dict_post_hook(_states_as_dtensors)
    optimizer.register_load_state_dict_pre_hook(_keys_from_fqns)
    optimizer.register_load_state_dict_post_hook(lambda opt: hooks.hold(masters=False))
    # Users' state_dict() is keyed by FQN; torch's state-dict API reads the class's
    # (parameter ids, which it maps to FQNs through the param groups itself).
    keep_own_state_dict(optimizer, _state_dict_by_fqn(weakref.ref(optimizer)))
    state.optimizer = optimizer
    return optimizer


def _discard_failed_step_on_zero_grad(optimizer: torch.optim.Optimizer, state: LinsState) -> None:
    """``zero_grad()`` discards the gradients of micro-batches whose step failed, in
    PyTorch; Lins' are in its G buffers and chains, which :meth:`LinsState.discard_step`
    forgets (a no-op between steps). torch.optim has step hooks but none for
    ``zero_grad``: the instance's method is wrapped."""
    zero_grad = optimizer.zero_grad

    def zero_grad_and_discard_failed_step(set_to_none: bool = True) -> None:
        state.discard_step()
        zero_grad(set_to_none)

    optimizer.zero_grad = zero_grad_and_discard_failed_step


def _param_groups(model: nn.Module, state: LinsState, params: ParamsArg | None) -> list[tuple[dict[str, Any], list[str]]]:
    """Each param group's options and the FQNs of its masters, from torch.optim's forms."""
    fqns = [fqn for unit in state.units for fqn in unit.fqns]
    if params is None:
        return [({}, fqns)]
    entries = [params] if isinstance(params, (torch.Tensor, str)) else list(params)
    groups = entries if entries and all(isinstance(e, dict) for e in entries) else [{"params": entries}]
    fqn_of: dict[int | str, str] = {}
    for unit in state.units:
        for fqn, param in zip(unit.fqns, unit.params):
            fqn_of[id(param)] = fqn_of[fqn] = fqn
    frozen: set[int | str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in fqn_of:
            fqn_of[name] = fqn_of[id(param)]  # every name of a tied parameter
        elif not param.requires_grad:
            frozen.update((name, id(param)))
    group_of: dict[str, int] = {}
    out = []
    for index, group in enumerate(groups):
        members = group["params"]
        members = [members] if isinstance(members, (torch.Tensor, str)) else list(members)
        group_fqns = []
        for member in members:
            key = member if isinstance(member, str) else id(member)
            if key in frozen:
                continue
            if key not in fqn_of:
                what = f"'{member}'" if isinstance(member, str) else f"a tensor of shape {tuple(member.shape)}"
                raise LinsUsageError(
                    f"optimizer param group {index}: {what} is not a trainable parameter of the model "
                    "(collected before apply_lins? FSDP2 replaces them: collect them after, or give their names)"
                )
            fqn = fqn_of[key]
            if fqn in group_of:
                raise LinsUsageError(f"parameter '{fqn}' is in optimizer param groups {group_of[fqn]} and {index}: give each parameter one group")
            group_of[fqn] = index
            group_fqns.append(fqn)
        out.append(({k: v for k, v in group.items() if k != "params"}, group_fqns))
    for fqn in fqns:
        if fqn not in group_of:
            raise LinsUsageError(f"parameter '{fqn}' is in no optimizer param group: Lins updates every trainable parameter, give it one")
    return out


def _before_state_dict(optimizer: torch.optim.Optimizer) -> None:
    """Wait for the update gathers in flight, as ``model.state_dict()`` does: they run
    on the mesh's groups, which the DTensor states' own collectives (``full_tensor`` for
    a full state dict) use too, in whatever order each rank reaches them. Then create
    the states if there are none yet."""
    optimizer._lins_hooks.state.wait_for_updates()
    _init_state_if_empty(optimizer)


def _init_state_if_empty(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer states before the first step, so that a fresh optimizer's
    state dict can be loaded into (DCP loads in place): a zero-learning-rate step on
    zero gradients, as torch.distributed.checkpoint.state_dict does, with the Lins
    hooks off (gradients received so far stay for the real step, no values to spread)."""
    if optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer._lins_hooks.enabled = False
    try:
        optimizer.step()
    finally:
        optimizer._lins_hooks.enabled = True
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr


def _as_dtensor(value, master: DTensor):
    if isinstance(value, torch.Tensor) and value.shape == master.to_local().shape and value.dim() > 0:
        return DTensor.from_local(value, master.device_mesh, master.placements, run_check=False, shape=master.shape, stride=master.stride())
    return value


def _states_as_dtensors(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Parameter-shaped states as DTensors on the OS layout, their masters' (the keys
    stay torch's parameter ids here)."""
    masters = optimizer._lins_masters
    state_dict["state"] = {
        i: {name: _as_dtensor(value, masters[i]) for name, value in per_param.items()}
        for i, per_param in state_dict["state"].items()
    }
    return state_dict


def _state_dict_by_fqn(ref: weakref.ref) -> Callable[[], dict]:
    """``optimizer.state_dict()`` keyed by parameter FQN instead of id."""

    def state_dict_by_fqn() -> dict:
        optimizer = ref()
        by_id = type(optimizer).state_dict(optimizer)
        fqns = optimizer._lins_fqns
        by_id["state"] = {fqns[i]: per_param for i, per_param in by_id["state"].items()}
        for group in by_id["param_groups"]:
            group["params"] = [fqns[i] for i in group["params"]]
        return by_id

    return state_dict_by_fqn


def _keys_from_fqns(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Back to torch's integer keys. torch pairs saved and current parameters by their
    position in each param group, and the order of a unit's parameters depends on the
    plan (FSDP2's order where P is sharded, the module's where it is replicated), so the
    groups are matched by the parameters' names and keep the current order. The masters
    hold the groups while torch loads (:meth:`_StepHooks.hold`)."""
    optimizer._lins_hooks.hold(masters=True)
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
            raise LinsCheckpointError(f"optimizer param group {number} holds other parameters than the checkpoint's group {number}")
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
    no gradients under Lins (they live in G buffers until the step): their ``.grad``
    raises when read, so ``torch.nn.utils.clip_grad_norm_(model.parameters())`` fails
    with one line naming this function instead of clipping nothing.
    It reduces the gradients into the masters (the step then reuses them) and takes
    the norm over the OS shards with one scalar all-reduce.

    Args:
        model (nn.Module): a model :func:`~lins_dtensor.apply_lins` has sharded.
        max_norm (float): the largest total norm the gradients keep.
        norm_type (float): the order of the norm (``inf`` for the largest magnitude).
        error_if_nonfinite (bool): as in ``torch.nn.utils.clip_grad_norm_``: ``False``
            returns a non-finite norm and scales the gradients by it; ``True`` raises
            ``RuntimeError`` on every rank (all ranks see the same reduced norm) before
            anything is scaled.

    Returns:
        torch.Tensor: the total norm of the gradients before clipping (a scalar).
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
