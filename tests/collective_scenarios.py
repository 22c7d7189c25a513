"""Lins' collectives on real gloo ranks (run by :func:`distributed.run`)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lins_dtensor.collectives import CommRecorder, CommStream, start_reduce_scatter
from lins_dtensor.schedule import GRAD_SHARD_REDUCE_SCATTER


def polled_reduce_scatter(numel: int) -> dict:
    """One Lins reduce-scatter of ``numel`` values per rank, polled until the host sees it
    completed without blocking, against torch's blocking reduce-scatter of the same input."""
    world, rank = dist.get_world_size(), dist.get_rank()
    message = torch.randn(world * numel, generator=torch.Generator().manual_seed(rank))
    ours, torchs = torch.empty(numel), torch.empty(numel)
    flight = start_reduce_scatter(CommRecorder(ranks_per_node=world), CommStream(torch.device("cpu")),
                                  GRAD_SHARD_REDUCE_SCATTER, ours, message, dist.group.WORLD)
    deadline = time.monotonic() + 20
    while not flight.completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    seen = flight.completed()
    flight.join()
    dist.reduce_scatter_tensor(torchs, message.clone())
    return {"seen_completed": seen, "bitwise": torch.equal(ours, torchs), "input_kept": torch.equal(
        message, torch.randn(world * numel, generator=torch.Generator().manual_seed(rank)))}
