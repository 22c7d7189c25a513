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
