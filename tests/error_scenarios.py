"""Misuse that must fail with a clear error before any collective (inside spawned ranks)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh

from lins_dtensor import (
    LinsError,
    LinsPlan,
    apply_lins,
    build_lins_mesh,
    clip_grad_norm_,
    lins_optimizer,
    set_gradient_accumulation_steps,
    set_reduce_in_backward,
    set_requires_gradient_sync,
)
from lins_dtensor.runtime import lins_state
from tiny_llama import batch, build_model, loss_fn


def _message(fn) -> str:
    """``"<error class>: <message>"`` of the Lins error ``fn`` raises."""
    try:
        fn()
    except LinsError as e:
        return f"{type(e).__name__}: {e}"
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
    out["accumulation_steps"] = _message(lambda: set_gradient_accumulation_steps(twice, 0))
    out["gradient_sync"] = _message(lambda: set_requires_gradient_sync(twice, "yes"))
    out["inflight_bytes"] = _message(lambda: apply_lins(build_model(), mesh, max_inflight_bytes=-1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_reduce_in_backward(twice, True)
    deprecated = [w for w in caught if issubclass(w.category, FutureWarning)]
    out["set_reduce_in_backward"] = (
        f"warns: {deprecated[0].message}; syncs: {lins_state(twice).requires_gradient_sync}" if deprecated else "no warning"
    )
    tied = build_model(tied=True)
    out["tied_units"] = _message(lambda: apply_lins(tied, mesh, units=[tied.tok_embeddings, *tied.layers, tied.output]))
    out["units_class"] = _message(lambda: apply_lins(build_model(), mesh, units=torch.nn.LSTM))
    subclassed = build_model()
    subclassed.norm.weight = torch.nn.Parameter(torch.Tensor._make_subclass(_Float8Like, subclassed.norm.weight.detach()))
    out["tensor_subclass"] = _message(lambda: apply_lins(subclassed, mesh))
    out.update(_nonfinite_clipping(mesh))
    out["bf16_model_masters"] = str(lins_state(apply_lins(build_model().to(torch.bfloat16), mesh)).ctx.master_dtype)
    out["bf16_masters_asked"] = str(lins_state(apply_lins(build_model().to(torch.bfloat16), mesh, master_dtype=torch.bfloat16)).ctx.master_dtype)
    out["master_dtype"] = _message(lambda: apply_lins(build_model(), mesh, master_dtype=torch.int32))
    loaded = apply_lins(build_model(), mesh)
    out["other_model_shapes"] = _message(lambda: loaded.load_state_dict(build_model(dim=30).state_dict()))
    partial = {k: v for k, v in build_model().state_dict().items() if not k.startswith("norm.")}
    out["missing_key"] = _message(lambda: loaded.load_state_dict(partial))
    out.update(_param_group_messages(mesh))
    return out


def _param_group_messages(mesh) -> dict[str, str]:
    """lins_optimizer's param groups: each trainable parameter in exactly one, and the
    model's parameters as they are after apply_lins (FSDP2 replaces them: p=2 here)."""
    before = build_model()
    collected_early = [p for p in before.parameters() if p.requires_grad]
    model = apply_lins(before, mesh)
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def groups(*lists) -> list[dict]:
        return [{"params": names_, "weight_decay": 0.0} for names_ in lists]

    return {
        "param_in_no_group": _message(lambda: lins_optimizer(model, torch.optim.AdamW, groups(names[:3], names[4:]))),
        "param_in_two_groups": _message(lambda: lins_optimizer(model, torch.optim.AdamW, groups(names, ["output.weight"]))),
        "param_collected_early": _message(lambda: lins_optimizer(model, torch.optim.AdamW, collected_early)),
    }


class _Float8Like(torch.Tensor):
    """Stands in for a tensor subclass such as torchao's float8 weights."""


def _nonfinite_clipping(mesh) -> dict[str, str]:
    out = {}
    for error in (False, True):
        model = apply_lins(build_model(), mesh)
        lins_optimizer(model, torch.optim.SGD, lr=0.1)
        (loss_fn(model, batch(0, dist.get_rank(), 0)) * float("inf")).backward()
        try:
            norm = clip_grad_norm_(model, 1.0, error_if_nonfinite=error)
            out[f"nonfinite_clip_{error}"] = f"returned {norm.item()}"
        except RuntimeError as e:
            out[f"nonfinite_clip_{error}"] = str(e)
    return out
