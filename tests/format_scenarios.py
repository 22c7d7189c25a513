"""Runs with lossy wire formats, executed inside the spawned ranks (see distributed.run)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, lins_optimizer
from lins_dtensor.runtime import lins_state
from tiny_llama import batch, build_model, loss_fn


def reduced_gradients(plan_text: str, formats: str) -> dict:
    """One backward on every rank (2 emulated nodes of 2 ranks), then the whole gradient
    Lins hands the optimizer, and every rank's own gradient of the same batch computed
    by a plain copy of the model: what the test derives the expected sum from."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = LinsPlan.parse(plan_text, world)
    model, plain = build_model(), build_model()
    apply_lins(model, build_lins_mesh(plan, ranks_per_node=2, device_type="cpu"), comm_formats=formats)
    loss_fn(model, batch(0, rank, 0)).backward()
    state = lins_state(model)
    state.reduce_gradients()
    reduced = {}
    for unit in state.units:
        for fqn, master, local in zip(unit.fqns, unit.masters, unit.local_masters):
            if local.grad is not None:
                whole = DTensor.from_local(local.grad, master.device_mesh, master.placements, run_check=False,
                                           shape=master.shape, stride=master.stride())
                reduced[fqn] = whole.full_tensor()
    loss_fn(plain, batch(0, rank, 0)).backward()
    own = {name: p.grad.clone() for name, p in plain.named_parameters() if p.grad is not None}
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, own)
    return {"reduced": reduced, "per_rank": every_rank}


def computed_parameters(plan_text: str, formats: str) -> dict:
    """One training step, then the parameter values every leaf module computed with in
    the next forward (read in forward pre-hooks, after FSDP2 gathered them) on every
    rank, the whole P (its shards, as the update left them) and which parameters are
    frozen (replicated, never gathered)."""
    from scenarios import _full

    rank, world = dist.get_rank(), dist.get_world_size()
    plan = LinsPlan.parse(plan_text, world)
    model = build_model()
    apply_lins(model, build_lins_mesh(plan, ranks_per_node=2, device_type="cpu"), comm_formats=formats)
    opt = lins_optimizer(model, torch.optim.AdamW, lr=1e-2)
    loss_fn(model, batch(0, rank, 0)).backward()
    opt.step()
    opt.zero_grad()
    computed: dict[str, torch.Tensor] = {}

    def read(prefix: str):
        def hook(module, args) -> None:
            for name, param in module.named_parameters(recurse=False):
                computed[prefix + name] = param.detach().float().clone()
        return hook

    handles = [m.register_forward_pre_hook(read(f"{fqn}." if fqn else "")) for fqn, m in model.named_modules()]
    loss_fn(model, batch(1, rank, 0)).backward()
    for handle in handles:
        handle.remove()
    every_rank: list = [None] * world
    dist.all_gather_object(every_rank, computed)
    return {"computed": every_rank, "params": {n: _full(p).float() for n, p in model.named_parameters()},
            "frozen": {n for n, p in model.named_parameters() if not p.requires_grad}}
