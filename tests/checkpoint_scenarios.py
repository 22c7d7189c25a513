"""DCP save under one plan, reload under another (run inside spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, clip_grad_norm_, lins_optimizer
from scenarios import LR, MAX_NORM, WEIGHT_DECAY
from tiny_llama import batch, build_model, loss_fn


def _setup(plan_text: str):
    world = dist.get_world_size()
    model = build_model()
    apply_lins(model, build_lins_mesh(LinsPlan.parse(plan_text, world), ranks_per_node=2, device_type="cpu"))
    return model, lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)


def _step(model, opt, step: int) -> float:
    loss = loss_fn(model, batch(step, dist.get_rank(), 0))
    loss.backward()
    clip_grad_norm_(model, MAX_NORM)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}


def save_then_resume(path: str, save_plan: str, load_plans: list[str]) -> dict:
    """Train 2 steps under ``save_plan``, save, take step 3; then for each load plan:
    fresh model, load, take step 3. Returns the step-3 losses and parameters."""
    model, opt = _setup(save_plan)
    for step in range(2):
        _step(model, opt, step)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    results = {"uninterrupted": (_step(model, opt, 2), _full(model))}
    for plan in load_plans:
        model, opt = _setup(plan)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        results[plan] = (_step(model, opt, 2), _full(model))
    return results


def load_plain_state_dict(plan_text: str) -> bool:
    """A full, unsharded state dict (e.g. from a single-GPU run) loads into any plan."""
    reference = build_model().state_dict()
    model, _ = _setup(plan_text)
    model.load_state_dict({k: (v + 1.0) for k, v in reference.items()})
    full = _full(model)
    params_ok = all(torch.equal(p.full_tensor().float(), full[n]) for n, p in model.named_parameters() if hasattr(p, "full_tensor"))
    return params_ok and all(torch.equal(full[k], reference[k] + 1.0) for k in full)
