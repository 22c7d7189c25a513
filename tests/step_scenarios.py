"""Training loops written for FSDP2 or DDP, run on a Lins model inside the forked ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, clip_grad_norm_, lins_optimizer
from scenarios import LR, MAX_NORM, WEIGHT_DECAY
from tiny_llama import batch, build_model, loss_fn, tensor_parallelize


def torch_clip_on_lins_model(configs: list[dict]) -> list[dict]:
    """Each config: plan, tp, param_dtype. Two steps of M=2; after each step's last
    backward, torch's own clip_grad_norm_ over model.parameters() (what a user moving
    from FSDP2 writes), then Lins' clip and the step. Returns what torch's call raised,
    how many parameters had a gradient to read, and Lins' norms."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        tp = cfg.get("tp", 1)
        model = build_model(**({"n_heads": 4} if tp > 1 else {}))
        mesh = build_lins_mesh(LinsPlan.parse(cfg["plan"], world // tp), ranks_per_node=2, device_type="cpu", tp=tp)
        if tp > 1:
            tensor_parallelize(model, mesh.tp_mesh())
        apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=cfg.get("param_dtype"), reduce_dtype=torch.float32))
        opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
        raised, with_grad, norms = [], [], []
        for step in range(2):
            for mb in range(2):
                (loss_fn(model, batch(step, rank // tp, mb)) / 2).backward()
            with_grad.append(sum(p.grad is not None for p in model.parameters()))
            try:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                raised.append(None)
            except RuntimeError as error:
                raised.append(str(error))
            norms.append(float(clip_grad_norm_(model, MAX_NORM)))
            opt.step()
            opt.zero_grad()
        results.append({"config": cfg, "raised": raised, "with_grad": with_grad, "trainable": sum(p.requires_grad for p in model.parameters()),
                        "norms": norms})
    return results
