"""A training script run by ``torchrun`` that ends the way the README's loop does: right
after ``optimizer.step()``, with the update gathers still in flight, then the process
group destroyed and the interpreter shut down normally (the suite's other ranks end
with ``os._exit`` and never shut an interpreter down)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, lins_optimizer  # noqa: E402
from lins_dtensor.runtime import lins_state  # noqa: E402
from tiny_llama import batch, build_model, loss_fn  # noqa: E402


def main(plan_text: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = LinsPlan.parse(plan_text, world_size=dist.get_world_size())
    model = apply_lins(build_model(), build_lins_mesh(plan, ranks_per_node=2, device_type="cpu"), plan)
    optimizer = lins_optimizer(model, torch.optim.AdamW, lr=1e-3)
    for step in range(2):
        loss_fn(model, batch(step, rank, 0)).backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {rank} updates in flight at exit: {lins_state(model).updates_in_flight()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
