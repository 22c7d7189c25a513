"""A training script run by ``torchrun`` that ends the way the README's loop does: right
after ``optimizer.step()``, with the update gathers still in flight, then the process
group destroyed and the interpreter shut down normally (the suite's other ranks end
with ``os._exit`` and never shut an interpreter down).

``late``: rank 0 starts its last step's update gathers a second after the others, so
that some of theirs still wait for rank 0 when their interpreters begin to shut down;
each rank says how many Lins collectives were still running once the shutdown had
begun (after :mod:`atexit`), when it frees the model."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import lins_dtensor.collectives as collectives  # noqa: E402
from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, lins_optimizer  # noqa: E402
from lins_dtensor.runtime import lins_state  # noqa: E402
from tiny_llama import batch, build_model, loss_fn  # noqa: E402

STEPS = 2


def main(plan_text: str, late: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan = LinsPlan.parse(plan_text, world_size=dist.get_world_size())
    model = apply_lins(build_model(), build_lins_mesh(plan, ranks_per_node=2, device_type="cpu"), plan)
    optimizer = lins_optimizer(model, torch.optim.AdamW, lr=1e-3)
    for step in range(STEPS):
        loss_fn(model, batch(step, rank, 0)).backward()
        if late and rank == 0 and step == STEPS - 1:
            _delay_first_gather(collectives, seconds=1.0)
        optimizer.step()
        optimizer.zero_grad()
    print(f"rank {rank} updates in flight at exit: {lins_state(model).updates_in_flight()}", flush=True)
    dist.destroy_process_group()
    if late:
        sys.modules[__name__].kept_until_shutdown = _ReportAtShutdown(rank, model, optimizer)


class _ReportAtShutdown:
    """Held by a module global, so freed while the interpreter shuts down (after atexit):
    says how many Lins collectives are still running then, before it frees the model."""

    def __init__(self, rank: int, *objects: object) -> None:
        self.rank, self.objects = rank, list(objects)

    # The module's globals may already be None when this runs: bind what it uses.
    def __del__(self, live=collectives._LIVE_FLIGHTS, err=sys.stderr) -> None:
        running = sum(not flight.completed() for flight in list(live))
        err.write(f"rank {self.rank} collectives running at shutdown: {running}\n")
        err.flush()
        self.objects.clear()


def _delay_first_gather(module, seconds: float) -> None:
    """Rank 0's next all-gather (the first update gather) starts ``seconds`` late."""
    gather = module.all_gather_single

    def late_gather(*args, **kwargs):
        module.all_gather_single = gather
        time.sleep(seconds)
        return gather(*args, **kwargs)

    module.all_gather_single = late_gather


if __name__ == "__main__":
    main(sys.argv[1], late="late" in sys.argv[2:])
