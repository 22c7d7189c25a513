"""Misuse that must fail with a clear error before any collective (inside spawned ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh

from lins_dtensor import LinsPlan, LinsPlanError, apply_lins, build_lins_mesh
from tiny_llama import build_model


def _message(fn) -> str:
    try:
        fn()
    except LinsPlanError as e:
        return str(e)
    return "no error"


def misuse_messages() -> dict[str, str]:
    world = dist.get_world_size()
    good = LinsPlan(2, 2, 4)
    mesh = build_lins_mesh(good, ranks_per_node=2, device_type="cpu")
    out = {
        "world_mismatch": _message(lambda: build_lins_mesh(good, world_size=8, ranks_per_node=2, device_type="cpu")),
        "not_nested": _message(lambda: build_lins_mesh(LinsPlan(2, 1, 4), ranks_per_node=2, device_type="cpu")),
        "rpn_not_dividing": _message(lambda: build_lins_mesh(good, ranks_per_node=3, device_type="cpu")),
        "plan_mesh_mismatch": _message(lambda: apply_lins(build_model(), mesh, LinsPlan(1, 2, 4))),
        "raw_device_mesh": _message(lambda: apply_lins(build_model(), init_device_mesh("cpu", (world,)), good)),
    }
    twice = build_model()
    apply_lins(twice, mesh)
    out["applied_twice"] = _message(lambda: apply_lins(twice, mesh))
    fsdp_model = build_model()
    fully_shard(fsdp_model.layers[0], mesh=init_device_mesh("cpu", (world,)))
    out["already_fsdp"] = _message(lambda: apply_lins(fsdp_model, mesh))
    ddp_model = torch.nn.parallel.DistributedDataParallel(build_model())
    out["ddp_wrapped"] = _message(lambda: apply_lins(ddp_model, mesh))
    return out
