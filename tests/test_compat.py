"""What compat.py bridges between the torch releases Lins supports: every FSDP2-sharded
parameter's gradient in every reduce (set_reduce_scatter_unused_params came in 2.13),
and no deprecated torch API called (2.13 renamed the single-tensor collectives)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from distributed import run
from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, lins_optimizer, set_gradient_accumulation_steps
from tiny_llama import batch, build_model, loss_fn


def _train(plan: str, model: nn.Module, steps: int = 2, microbatches: int = 2) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    apply_lins(model, build_lins_mesh(LinsPlan.parse(plan, world), ranks_per_node=world, device_type="cpu"))
    opt = lins_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.0)
    set_gradient_accumulation_steps(model, microbatches)
    for step in range(steps):
        for mb in range(microbatches):
            (loss_fn(model, batch(step, rank, mb)) / microbatches).backward()
        opt.step()
        opt.zero_grad()


def _deprecations(plans: list[str]) -> list[str]:
    """The deprecation warnings raised from apply_lins to the last optimizer step under
    each plan, each once."""
    found = set()
    for plan in plans:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(plan, build_model())
        found |= {f"{plan}: {w.category.__name__}: {w.message}" for w in caught if "deprecated" in str(w.message).lower()}
    return sorted(found)


def test_lins_calls_no_deprecated_torch_api():
    # P by FSDP2 (Lins' custom all-gather and reduce-scatter), G and OS finer than P
    # (Lins' own reduce-scatters and update all-gathers).
    assert run(_deprecations, 4, ["p=2,g=4,os=4", "p=1,g=2,os=4"]) == []


def _unused_parameter(plan: str) -> dict:
    """A block holding a parameter its forward never uses: no gradient reaches it."""
    model = build_model()
    model.layers[0].unused = nn.Parameter(torch.ones(6, 4))
    used_before = model.layers[0].attention_norm.weight.detach().clone()
    _train(plan, model)  # FSDP2 replaces the parameters by sharded ones
    return {
        "unused": model.layers[0].unused.full_tensor(),
        "used_changed": not torch.equal(model.layers[0].attention_norm.weight.full_tensor(), used_before),
    }


def test_a_parameter_without_gradient_is_reduced_as_zero():
    # FSDP2 shards P: a reduce-scatter without the unused parameter would not fit Lins'
    # buffer. With a zero gradient and no weight decay AdamW leaves it as it was.
    result = run(_unused_parameter, 2, "p=2,g=2,os=2")
    assert torch.equal(result["unused"], torch.ones(6, 4))
    assert result["used_changed"]
