"""Training runs executed inside the spawned ranks (see distributed.run); each returns
plain data for the tests to check."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import warnings
from collections import Counter
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lins_dtensor import (
    LinsPlan,
    apply_lins,
    build_lins_mesh,
    clip_grad_norm_,
    lins_optimizer,
    lins_stats,
    set_gradient_accumulation_steps,
    set_requires_gradient_sync,
)
from lins_dtensor.formats import CommFormats
from lins_dtensor.runtime import lins_state
from lins_dtensor.schedule import error_feedback_bytes, state_memory_bytes, step_collectives
from lins_dtensor.units import local_values
from tiny_llama import Block, batch, build_model, loss_fn, tensor_parallelize

LR, WEIGHT_DECAY, MAX_NORM = 1e-2, 0.1, 0.5


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)


def decay_groups(named_params, by_name: bool = False, weight_decays: tuple[float, float] = (WEIGHT_DECAY, 0.0)) -> list[dict]:
    """nanoGPT's configure_optimizers: weight decay on the matrices, another (none) on
    norms and gains; the parameters themselves, or their names."""
    decay, other = [], []
    for name, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else other).append(name if by_name else p)
    return [{"params": decay, "weight_decay": weight_decays[0]}, {"params": other, "weight_decay": weight_decays[1]}]


def reference(world_size: int, microbatches: int, steps: int, model_kwargs: dict | None = None, clip: bool = True,
              param_groups: bool = False) -> dict:
    """Single-process fp32 training on the union of every rank's data (with
    ``param_groups``: torch.optim.AdamW on :func:`decay_groups`)."""
    model = build_model(**(model_kwargs or {}))
    opt = _optimizer(decay_groups(model.named_parameters()) if param_groups else [p for p in model.parameters() if p.requires_grad])
    for step in range(steps):
        for rank in range(world_size):
            for mb in range(microbatches):
                (loss_fn(model, batch(step, rank, mb)) / (microbatches * world_size)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_NORM)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter: FSDP2's are sharded DTensors, replicated ones plain."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param.detach()


def _record_key(r):
    return (r.name, r.op.value, r.group_size, r.nodes, r.message_bytes, r.format, r.exact_bytes)


@dataclasses.dataclass(frozen=True)
class LinsRun:
    """One training run of :func:`train_lins`: the tiny model under Lins for ``steps``
    AdamW steps of ``microbatches`` micro-batches each, on every rank of the launch.
    The fields past the first four change one thing each from the plain run."""

    plan: str  # LinsPlan.parse text, over the data-parallel ranks (world / tp)
    microbatches: int
    steps: int
    ranks_per_node: int
    param_dtype: torch.dtype | None = None  # MixedPrecisionPolicy.param_dtype (None: the model's fp32)
    model_kwargs: dict = dataclasses.field(default_factory=dict)  # build_model's (tiny_llama.py)
    clip: bool = True  # clip_grad_norm_ to MAX_NORM before each step
    max_inflight_bytes: int | None = None  # apply_lins' bound (None: its default)
    units: Literal["Block"] | None = None  # "Block": units given as a block class; None: the default units
    param_groups: Literal["params", "names"] | None = None  # decay_groups handed to lins_optimizer as parameters or names
    # None: built materialised; "meta": on the meta device, to_empty, then a full state
    # dict; "assign": load_state_dict(assign=True) after apply_lins.
    init: Literal["meta", "assign"] | None = None
    # Tensor-parallel degree: torchtitan's plan on the Lins mesh's TP dim first, and TP
    # ranks share their data-parallel rank's batches.
    tp: int = 1
    # How Lins learns which micro-batch is the last: "explicit" sets
    # set_requires_gradient_sync before each micro-batch (True on the last one only with
    # reduce_in_backward); "told" calls set_gradient_accumulation_steps(told_steps or M)
    # once; "learned" does nothing.
    mode: Literal["explicit", "told", "learned"] = "explicit"
    reduce_in_backward: bool = False
    told_steps: int | None = None
    tree_name: str | None = None  # which NESTED_TREES entry model_kwargs is (conftest.py): a label
    comm_formats: str | None = None  # apply_lins' wire formats (None: exact)
    # The mesh on process groups shared with the other such runs of the launch
    # (build_lins_mesh's group_for), each run settled before the next starts.
    shared_groups: bool = False


@dataclasses.dataclass(frozen=True)
class FsdpRun:
    """One training run of :func:`train_fsdp`: stock FSDP2 (``shard`` == data-parallel
    ranks) or HSDP (``shard`` smaller), same model, data and optimizer as :class:`LinsRun`."""

    shard: int
    microbatches: int
    steps: int
    ranks_per_node: int
    param_dtype: torch.dtype | None = None
    model_kwargs: dict = dataclasses.field(default_factory=dict)
    tp: int = 1


def train_lins(configs: list[LinsRun]) -> list[dict]:
    """Each :class:`LinsRun` in turn; per run, what the tests compare: the masters and
    parameters (whole), the recorded collectives against the schedule's and the memory
    against its closed form on every rank, the units, and Lins' warnings."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    shared: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def group_for(ranks: tuple[int, ...]) -> dist.ProcessGroup:
        if ranks not in shared:
            shared[ranks] = dist.new_group(list(ranks))
        return shared[ranks]

    for cfg in configs:
        tp = cfg.tp
        plan = LinsPlan.parse(cfg.plan, world // tp)
        init = cfg.init
        with torch.device("meta") if init == "meta" else contextlib.nullcontext():
            model = build_model(**cfg.model_kwargs)
        reference = build_model(**cfg.model_kwargs)  # the same values, unsharded
        frozen_before = reference.pos.detach().clone()
        mesh = build_lins_mesh(plan, ranks_per_node=cfg.ranks_per_node, device_type="cpu", tp=tp,
                               group_for=group_for if cfg.shared_groups else None)
        if tp > 1:
            tensor_parallelize(model, mesh.tp_mesh())
        param_dtype = cfg.param_dtype
        apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
                   max_inflight_bytes=cfg.max_inflight_bytes, units=Block if cfg.units == "Block" else None,
                   comm_formats=cfg.comm_formats)
        if init == "meta":
            model.to_empty(device="cpu")
        if init is not None:  # the values come from a plain full state dict
            model.load_state_dict(reference.state_dict(), assign=init == "assign")
        params = None if cfg.param_groups is None else decay_groups(model.named_parameters(), by_name=cfg.param_groups == "names")
        opt = lins_optimizer(model, torch.optim.AdamW, params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        mbs, mode, clip = cfg.microbatches, cfg.mode, cfg.clip
        if mode == "told":
            set_gradient_accumulation_steps(model, cfg.told_steps or mbs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(cfg.steps):
                for mb in range(mbs):
                    if mode == "explicit":
                        set_requires_gradient_sync(model, cfg.reduce_in_backward and mb == mbs - 1)
                    (loss_fn(model, batch(step, rank // tp, mb)) / mbs).backward()
                if clip:
                    clip_grad_norm_(model, MAX_NORM)
                opt.step()
                opt.zero_grad()
            # What a metrics logger reads right after the step: never blocks, a whole step.
            early = Counter(_record_key(r) for r in lins_stats(model, wait=False).collectives)
        state = lins_state(model)
        stats = lins_stats(model)
        pdt = param_dtype or torch.float32
        expected = step_collectives(
            plan, state.schedule(), world_size=world // tp, ranks_per_node=cfg.ranks_per_node // tp, microbatches=mbs,
            param_bytes=torch.finfo(pdt).bits // 8, reduce_bytes=4, clip_grad_norm=clip, tp=tp,
            formats=CommFormats.parse(cfg.comm_formats),
        )
        counted = Counter(_record_key(r) for r in stats.collectives)
        predicted = Counter()
        for r in expected:
            predicted[_record_key(r)] += r.count
        memory_expected = state_memory_bytes(state.schedule(), param_bytes=torch.finfo(pdt).bits // 8, reduce_bytes=4)
        if cfg.comm_formats is not None:
            memory_expected["feedback"] = error_feedback_bytes(
                plan, state.schedule(), world_size=world // tp, ranks_per_node=cfg.ranks_per_node // tp, microbatches=mbs,
                param_bytes=torch.finfo(pdt).bits // 8, reduce_bytes=4, formats=CommFormats.parse(cfg.comm_formats),
            )
        local = [local_values(p.detach()).reshape(-1).float() for p in model.parameters() if p.requires_grad]
        mine = {
            "param_digest": hashlib.sha1(torch.cat(local).numpy().tobytes()).hexdigest(),  # this rank's P, bitwise
            "bytes_match": counted == predicted,
            "unwaited_bytes_match": early == predicted,
            "counted": dict(counted) if counted != predicted else None,
            "predicted": dict(predicted) if counted != predicted else None,
            "memory": stats.memory_bytes,
            "memory_expected": memory_expected,
        }
        per_rank = [None] * world
        dist.all_gather_object(per_rank, mine)
        masters = {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
        params = {n: _full(p).float() for n, p in model.named_parameters() if p.requires_grad}
        local_params = [local_values(p) for p in model.parameters() if p.requires_grad]
        results.append({
            "param_dtypes": {str(p.dtype) for p in local_params},
            "master_placements": {k: tuple(map(str, v.placements)) for k, v in model.state_dict().items() if isinstance(v, DTensor)},
            "config": cfg,
            "masters": masters,
            "params": params,
            "units": [u.name for u in lins_state(model).units],
            "frozen_unchanged": bool(torch.equal(model.pos.detach().float(), frozen_before.to(model.pos.dtype).float())),
            "per_rank": per_rank,
            "records": counted,
            "comm_time": stats.comm_time(),
            "scalars": stats.scalars(),
            "lins_warnings": [str(w.message) for w in caught if str(w.message).startswith("lins:")],
            "dim_groups": {dim: mesh.group(dim).group_name for dim in mesh.device_mesh.mesh_dim_names},
        })
    return results


def train_fsdp(configs: list[FsdpRun]) -> list[dict]:
    """FSDP2 (shard == world / tp) or HSDP (shard smaller) with the same model, data and
    optimizer; with ``tp`` > 1 on torchtitan's 2-D (dp, tp) mesh after the TP plan.

    Collectives are counted with the same recording comm objects Lins gives FSDP2,
    and HSDP's all-reduce through FSDP2's all-reduce hook (it sees the reduced tensor).
    """
    from lins_dtensor.collectives import CommRecorder, LinsAllGather, LinsReduceScatter
    from lins_dtensor.schedule import OPTIM_ALL_REDUCE

    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        shard, tp = cfg.shard, cfg.tp
        dp = world // tp
        model = build_model(**cfg.model_kwargs)
        if tp > 1:
            world_mesh = init_device_mesh("cpu", (dp // shard, shard, tp), mesh_dim_names=("replicate", "shard", "tp"))
            tensor_parallelize(model, world_mesh["tp"])
            mesh = world_mesh["shard"] if shard == dp else world_mesh["replicate", "shard"]
        elif shard == world:
            mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        mp = MixedPrecisionPolicy(param_dtype=cfg.param_dtype, reduce_dtype=torch.float32)
        frozen = {model.pos}
        recorder = CommRecorder(cfg.ranks_per_node)
        modules = [model.tok_embeddings, *model.layers, model.norm, model.output, model]
        for m in modules:
            fully_shard(m, mesh=mesh, mp_policy=mp, ignored_params=frozen)
            m.set_custom_all_gather(LinsAllGather(recorder))
            m.set_custom_reduce_scatter(LinsReduceScatter(recorder))
            m.set_force_sum_reduction_for_comms(True)
            if shard != dp and any(True for _ in m.parameters(recurse=False)) or (m is not model and shard != dp):
                group = mesh.get_group("replicate")
                m.set_all_reduce_hook(lambda out, g=group: recorder.record(OPTIM_ALL_REDUCE, g, out))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _optimizer(params)
        mbs = cfg.microbatches
        for step in range(cfg.steps):
            for mb in range(mbs):
                (loss_fn(model, batch(step, rank // tp, mb)) / mbs).backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            opt.step()
            opt.zero_grad()
            recorder.end_step()
        results.append({
            "config": cfg,
            "params": {n: p.full_tensor().float() for n, p in model.named_parameters() if p.requires_grad},
            "records": Counter(_record_key(r) for r in recorder.last_step),
        })
    return results


def masters_from_initialisation(plans: list[str]) -> list[dict]:
    """bf16 compute, fp32 model: masters must hold the model's initial fp32 values, not
    their bf16 rounding. Built materialised, and built on the meta device then
    initialised in place after to_empty (torchtitan's init_weights)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    want = build_model().state_dict()
    out = []
    for plan_text in plans:
        for init in ("materialised", "meta"):
            plan = LinsPlan.parse(plan_text, world)
            with torch.device("meta") if init == "meta" else contextlib.nullcontext():
                model = build_model()
            mesh = build_lins_mesh(plan, ranks_per_node=2, device_type="cpu")
            apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            if init == "meta":
                model.to_empty(device="cpu")
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        value = want[name]
                        if isinstance(p, DTensor):
                            value = distribute_tensor(value, p.device_mesh, p.placements).to_local()
                            p = p.to_local()
                        p.copy_(value)
            lins_state(model).materialize()
            masters = lins_state(model).masters()
            mine = {
                "masters_exact": all(torch.equal(m.full_tensor(), want[n]) for n, m in masters.items()),
                "params_bf16": all(_full(p).dtype == torch.bfloat16 and torch.equal(_full(p), want[n].to(torch.bfloat16))
                                   for n, p in model.named_parameters() if p.requires_grad),
            }
            per_rank = [None] * world
            dist.all_gather_object(per_rank, mine)
            out.append({"plan": plan_text, "init": init, "per_rank": per_rank, "rank": rank})
    return out


def hooks_after_to_empty(tps: list[int]) -> list[list[int]]:
    """For each TP degree: a user's post-accumulate-grad hook registered after
    ``to_empty``, bf16 parameters, P replicated (Lins' own gradient hooks on the same
    parameters; ``to_empty`` swaps DTensor parameters in place): how often it fires in 2
    backwards, on every rank."""
    return [_hook_fires(tp) for tp in tps]


def _hook_fires(tp: int) -> list[int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = LinsPlan.parse("p=1,g=2,os=2" if tp > 1 else "p=1,g=2,os=4", world // tp)
    with torch.device("meta"):
        model = build_model(n_heads=4)
    mesh = build_lins_mesh(plan, ranks_per_node=2, device_type="cpu", tp=tp)
    if tp > 1:
        tensor_parallelize(model, mesh.tp_mesh())
    apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    model.to_empty(device="cpu")
    model.load_state_dict(build_model(n_heads=4).state_dict())
    fired = []
    model.layers[0].ffn_norm.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    for step in range(2):
        loss_fn(model, batch(step, rank // tp, 0)).backward()
    counts = [0] * world
    dist.all_gather_object(counts, len(fired))
    return counts
