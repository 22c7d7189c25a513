"""Faults inside spawned ranks: a peer that stops responding."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, clip_grad_norm_, lins_optimizer, set_requires_gradient_sync
from tiny_llama import batch, build_model, loss_fn


def stalled_peer(timeout_s: float, stall_s: float) -> dict:
    """Rank 1 stops taking part (it sleeps) after apply_lins; rank 0 trains a micro-batch
    whose gradient reduction needs rank 1, and reports how it ended."""
    rank = dist.get_rank()
    mesh = build_lins_mesh(LinsPlan(1, 2, 2), ranks_per_node=2, device_type="cpu", timeout=datetime.timedelta(seconds=timeout_s))
    model = apply_lins(build_model(), mesh)
    lins_optimizer(model, torch.optim.SGD, lr=0.1)
    if rank == 1:
        time.sleep(stall_s)
        return {}
    start = time.perf_counter()
    try:
        set_requires_gradient_sync(model, True)
        loss_fn(model, batch(0, rank, 0)).backward()
        clip_grad_norm_(model, 1.0)
        message = "no error"
    except RuntimeError as error:
        message = str(error)
    return {"elapsed_s": time.perf_counter() - start, "message": message}


def program_collectives_between_lins_chains(plan: str, timeout_s: float) -> dict:
    """The program's own collectives on the default group (a loss all-reduce, a timing
    max) while Lins' update gathers run: they must not share a process group, since
    Lins issues each chain's collectives when earlier ones complete, which differs
    between ranks. Rank 0 reaches every optimizer step late; one chain at a time."""
    rank = dist.get_rank()
    mesh = build_lins_mesh(LinsPlan.parse(plan, dist.get_world_size()), ranks_per_node=2, device_type="cpu",
                           timeout=datetime.timedelta(seconds=timeout_s))
    shared = [dim for dim in mesh.device_mesh.mesh_dim_names if mesh.group(dim) is dist.group.WORLD]
    model = apply_lins(build_model(), mesh, max_inflight_bytes=1)
    optimizer = lins_optimizer(model, torch.optim.SGD, lr=0.1)
    message = "no error"
    try:
        for step in range(3):
            loss = loss_fn(model, batch(step, rank, 0))
            loss.backward()
            if rank == 0:
                time.sleep(0.3)
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(loss.detach())
    except RuntimeError as error:
        message = str(error).splitlines()[0]
    return {"shared_with_default_group": shared, "message": message}
