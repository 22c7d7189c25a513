"""Lins calls no torch API that the torch it runs on marks deprecated (torch 2.13 renamed
the single-tensor collectives; compat.py picks the name each release has)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from distributed import run
from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, lins_optimizer, set_gradient_accumulation_steps
from tiny_llama import batch, build_model, loss_fn


def _deprecations(plans: list[str]) -> list[str]:
    """Two training steps of two micro-batches under each plan; the deprecation warnings
    raised from apply_lins to the optimizer step, each once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    found = set()
    for plan in plans:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = build_model()
            apply_lins(model, build_lins_mesh(LinsPlan.parse(plan, world), ranks_per_node=world, device_type="cpu"))
            opt = lins_optimizer(model, torch.optim.AdamW, lr=1e-2)
            set_gradient_accumulation_steps(model, 2)
            for step in range(2):
                for mb in range(2):
                    (loss_fn(model, batch(step, rank, mb)) / 2).backward()
                opt.step()
                opt.zero_grad()
        found |= {f"{plan}: {w.category.__name__}: {w.message}" for w in caught if "deprecated" in str(w.message).lower()}
    return sorted(found)


def test_lins_calls_no_deprecated_torch_api():
    # P by FSDP2 (Lins' custom all-gather and reduce-scatter), G and OS finer than P
    # (Lins' own reduce-scatters and update all-gathers).
    assert run(_deprecations, 4, ["p=2,g=4,os=4", "p=1,g=2,os=4"]) == []
