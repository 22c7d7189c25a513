"""``lins-plan profile``: measure collective times on this cluster for the planner.

Run under torchrun (every rank runs it; gloo on CPU works). For every group shape the
search can need on this world size, all groups of that shape run the collective at
once, as the mesh dims do in training, so NIC sharing is measured, not assumed. Each
time is the slowest rank's mean over ``iters`` calls after a warm-up call.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch
import torch.distributed as dist

from lins_dtensor.compat import all_gather_single, reduce_scatter_single
from lins_dtensor.plan import valid_plans
from lins_dtensor.planner.bandwidth import BandwidthTable, monotone
from lins_dtensor.planner.models import PlannerError
from lins_dtensor.schedule import ALL_SPECS, group_size, group_stride, nodes_spanned

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise PlannerError(f"size '{text}' is not like 64KiB, 4MiB or 1024")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def message_sizes(smallest: int, largest: int, factor: int = 4) -> list[int]:
    if smallest < 1 or largest < smallest or factor < 2:
        raise PlannerError(f"need 1 <= min ({smallest}) <= max ({largest}) and factor >= 2")
    sizes, s = [], smallest
    while s < largest:
        sizes.append(s)
        s *= factor
    return sizes + [largest]


def needed_shapes(world_size: int, ranks_per_node: int) -> list[tuple[str, int, int]]:
    """(op, group ranks per node, nodes) of every collective any valid plan issues."""
    shapes: set[tuple[str, int, int]] = set()
    for plan in valid_plans(world_size, ranks_per_node, with_hpz=True):
        groups = [(spec.op.value, group_size(plan, world_size, spec.mesh_dim), group_stride(plan, spec.mesh_dim)) for spec in ALL_SPECS]
        if not isinstance(plan.reshard_after_forward, bool):
            groups.append(("all_gather", plan.reshard_after_forward, 1))
        for op, size, stride in groups:
            if size > 1:
                nodes = nodes_spanned(size, stride, ranks_per_node)
                shapes.add((op, size // nodes, nodes))
    return sorted(shapes)


def shape_groups(world_size: int, ranks_per_node: int, r: int, nodes: int) -> list[list[int]]:
    """A partition of the world into groups with ``r`` ranks on each of ``nodes`` nodes."""
    stride = 1 if nodes == 1 or r == ranks_per_node else ranks_per_node // r
    size = r * nodes
    span = size * stride
    return [[hi * span + k * stride + lo for k in range(size)] for hi in range(world_size // span) for lo in range(stride)]


def profile_bandwidth(
    sizes: list[int], *, ranks_per_node: int, iters: int = 5, shapes: list[tuple[str, int, int]] | None = None, dtype=None,
) -> BandwidthTable:
    """Measure every needed shape at every message size (a collective: all ranks call it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ranks_per_node:
        raise PlannerError(f"world size {world} is not divisible by ranks_per_node={ranks_per_node}")
    dtype = dtype or torch.float32
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    elem = torch.empty((), dtype=dtype).element_size()
    shapes = needed_shapes(world, ranks_per_node) if shapes is None else shapes
    groups_by_shape = {}
    for _, r, m in shapes:
        if (r, m) not in groups_by_shape:
            # Every rank creates every group, in the same order.
            mine, _ = dist.new_subgroups_by_enumeration(shape_groups(world, ranks_per_node, r, m))
            groups_by_shape[(r, m)] = mine
    entries: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for op, r, m in shapes:
        group, n = groups_by_shape[(r, m)], r * m
        points = []
        for nbytes in sizes:
            numel = max(n, (nbytes // elem) // n * n)  # the message: AG output / RS input / AR tensor
            big = torch.ones(numel, dtype=dtype, device=device)
            small = torch.ones(numel // n, dtype=dtype, device=device)
            if op == "all_gather":
                call = lambda: all_gather_single(big, small, group=group)  # noqa: E731
            elif op == "reduce_scatter":
                call = lambda: reduce_scatter_single(small, big, group=group)  # noqa: E731
            else:
                call = lambda: dist.all_reduce(big, group=group)  # noqa: E731
            call()
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            _sync(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            points.append((float(numel * elem), float(elapsed.item())))
        entries[(op, r, m)] = monotone(points)
    meta = {"world_size": world, "backend": dist.get_backend(), "dtype": str(dtype), "iters": iters, "rank": rank}
    return BandwidthTable(ranks_per_node, entries, meta)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_profile(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lins-plan profile", description="Measure all_gather / reduce_scatter / all_reduce times "
                                "for every group shape the planner needs; run under torchrun.")
    p.add_argument("--out", required=True, help="JSON file to write (rank 0)")
    p.add_argument("--min-size", default="64KiB")
    p.add_argument("--max-size", default="256MiB")
    p.add_argument("--factor", type=int, default=4, help="ratio between consecutive message sizes")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE (set by torchrun)")
    p.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    args = p.parse_args(argv)
    sizes = message_sizes(parse_size(args.min_size), parse_size(args.max_size), args.factor)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise PlannerError("lins-plan profile must run under torchrun (RANK / WORLD_SIZE are not set)")
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        rpn = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        table = profile_bandwidth(sizes, ranks_per_node=rpn, iters=args.iters)
        if dist.get_rank() == 0:
            table.save(args.out)
            print(f"lins-plan profile: {len(table.entries)} shapes x {len(sizes)} sizes -> {args.out}")
    finally:
        dist.destroy_process_group()
    return 0
