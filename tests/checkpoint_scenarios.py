"""DCP save under one (plan, tp) layout, reload under another, into plain FSDP2 + TP and
back (run inside spawned ranks)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, clip_grad_norm_, lins_optimizer
from scenarios import LR, MAX_NORM, WEIGHT_DECAY, decay_groups
from tiny_llama import batch, build_model, loss_fn, tensor_parallelize

Layout = tuple[str, int]  # (Lins plan, or "fsdp" for plain FSDP2 + TP; tensor-parallel degree)
TP_MODEL = {"n_heads": 4}  # 2 heads per TP rank at tp=2; the same model at every tp degree


class Trainer:
    """A model and its optimizer under one layout, stepped and (de)serialised the way
    that layout's users do: Lins through ``state_dict``, FSDP2 through
    torch.distributed.checkpoint.state_dict."""

    def __init__(self, layout: Layout, model_kwargs: dict, data_ranks: int | None,
                 weight_decays: tuple[float, float] | None = None) -> None:
        """``weight_decays``: the optimizer takes scenarios.decay_groups with these (Lins by
        the parameters' names, FSDP2 by the parameters) instead of one group."""
        plan_text, self.tp = layout
        world = dist.get_world_size()
        # All layouts train on the same global batch: the rank's data shard of ``data_ranks``
        # (default: one per rank); data-parallel replicas of a shard average to the same gradient.
        self.data_rank = dist.get_rank() * (data_ranks or world) // world
        self.model = build_model(**model_kwargs)
        self.fsdp = plan_text == "fsdp"
        if self.fsdp:  # scenarios.train_fsdp's FSDP2 + TP on a (shard, tp) mesh
            mesh = init_device_mesh("cpu", (world // self.tp, self.tp), mesh_dim_names=("shard", "tp"))
            if self.tp > 1:
                tensor_parallelize(self.model, mesh["tp"])
            for m in [self.model.tok_embeddings, *self.model.layers, self.model.norm, self.model.output, self.model]:
                fully_shard(m, mesh=mesh["shard"], ignored_params={self.model.pos})
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            groups = self.params if weight_decays is None else decay_groups(self.model.named_parameters(), weight_decays=weight_decays)
            self.opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)
            return
        mesh = build_lins_mesh(LinsPlan.parse(plan_text, world // self.tp), ranks_per_node=2, device_type="cpu", tp=self.tp)
        if self.tp > 1:
            tensor_parallelize(self.model, mesh.tp_mesh())
        apply_lins(self.model, mesh)
        groups = None if weight_decays is None else decay_groups(self.model.named_parameters(), True, weight_decays)
        self.opt = lins_optimizer(self.model, torch.optim.AdamW, groups, lr=LR, weight_decay=WEIGHT_DECAY)

    def step(self, step: int) -> float:
        loss = loss_fn(self.model, batch(step, self.data_rank, 0))
        loss.backward()
        if self.fsdp:
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        else:
            clip_grad_norm_(self.model, MAX_NORM)
        self.opt.step()
        self.opt.zero_grad()
        return loss.item()

    def state(self) -> dict:
        if self.fsdp:
            return {"model": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, self.opt)}
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def save(self, path: str) -> None:
        dcp.save(self.state(), checkpoint_id=path)

    def load(self, path: str) -> None:
        state = self.state()
        dcp.load(state, checkpoint_id=path)
        if self.fsdp:
            set_model_state_dict(self.model, state["model"])
            set_optimizer_state_dict(self.model, self.opt, state["optim"])
        else:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optim"])

    def full(self) -> dict[str, torch.Tensor]:
        """The whole trained values: Lins' masters, FSDP2's parameters."""
        if self.fsdp:
            return {n: p.full_tensor() for n, p in self.model.named_parameters() if p.requires_grad}
        return _full(self.model)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}


def save_then_resume(path: str, save: Layout, loads: list[Layout], model_kwargs: dict | None = None,
                     data_ranks: int | None = None, fsdp_round_trip: Layout | None = None) -> dict:
    """Train 2 steps under ``save``, save, take step 3; then for each load layout: fresh
    model, load, take step 3. With ``fsdp_round_trip``, each FSDP2 load also saves what it
    loaded (get_*_state_dict) before its step, and that layout loads it, then takes step 3.
    Returns the step-3 losses and parameters, keyed by layout ((layout, "round trip") for
    the second load)."""
    model_kwargs = model_kwargs or {}
    trainer = Trainer(save, model_kwargs, data_ranks)
    for step in range(2):
        trainer.step(step)
    trainer.save(path)
    results = {"uninterrupted": (trainer.step(2), trainer.full())}
    for layout in loads:
        trainer = Trainer(layout, model_kwargs, data_ranks)
        trainer.load(path)
        if trainer.fsdp and fsdp_round_trip is not None:
            trainer.save(f"{path}-fsdp")
            back = Trainer(fsdp_round_trip, model_kwargs, data_ranks)
            back.load(f"{path}-fsdp")
            results[layout, "round trip"] = (back.step(2), back.full())
        results[layout] = (trainer.step(2), trainer.full())
    return results


SHARDED = StateDictOptions()
FULL = StateDictOptions(full_state_dict=True)
FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 holds it, the others nothing


def _torch_state(trainer: Trainer, options: StateDictOptions) -> dict:
    model, optim = get_state_dict(trainer.model, trainer.opt, options=options)
    return {"model": model, "optim": optim}


def _load_with_torch_api(trainer: Trainer, path: str, options: StateDictOptions) -> None:
    """torch's documented resume: the state dicts as templates, DCP loads into them in
    place, set_state_dict hands them over."""
    state = _torch_state(trainer, options)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(trainer.model, trainer.opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def through_torch_state_dict_api(path: str, save: Layout, loads: list[tuple[Layout, str]], back: Layout) -> dict:
    """torch.distributed.checkpoint.state_dict on a Lins model and lins_optimizer with two
    param groups (scenarios.decay_groups). Train 2 steps under ``save``; save through
    get_state_dict, sharded and full on rank 0's CPU (FULL_ON_CPU); take step 3. Each load
    (layout, how): a fresh trainer whose groups have other weight decays (0.5, 0.5) loads
    the "sharded" or the "full" checkpoint through sharded state dicts, or the sharded
    checkpoint into "full" state dicts (every rank the whole values, set with
    full_state_dict=True); FSDP2 ("fsdp") with torch.optim.AdamW then saves what it
    loaded and ``back`` loads that. Returns the step-3 loss, parameters and weight decays
    per case."""
    trainer = Trainer(save, {}, None, weight_decays=(WEIGHT_DECAY, 0.0))
    for step in range(2):
        trainer.step(step)
    dcp.save(_torch_state(trainer, SHARDED), checkpoint_id=f"{path}/sharded")
    dcp.save(_torch_state(trainer, FULL_ON_CPU), checkpoint_id=f"{path}/full")

    def resumed(t: Trainer) -> tuple[float, dict, list[float]]:
        decays = [group["weight_decay"] for group in t.opt.param_groups]
        return t.step(2), t.full(), decays

    results = {"uninterrupted": resumed(trainer)}
    for layout, how in loads:
        trainer = Trainer(layout, {}, None, weight_decays=(0.5, 0.5))
        _load_with_torch_api(trainer, f"{path}/{'full' if how == 'full' else 'sharded'}", FULL if how == "full state dicts" else SHARDED)
        if trainer.fsdp:
            dcp.save(_torch_state(trainer, SHARDED), checkpoint_id=f"{path}/fsdp")
            returned = Trainer(back, {}, None, weight_decays=(0.5, 0.5))
            _load_with_torch_api(returned, f"{path}/fsdp", SHARDED)
            results[back, "from fsdp"] = resumed(returned)
        results[layout, how] = resumed(trainer)
    return results


def load_plain_state_dict(cases: list[tuple[Layout, dict]]) -> list[bool]:
    """A full, unsharded state dict (e.g. from a single-GPU run) loads into any layout:
    for each (layout, model kwargs), the masters and P hold its values."""
    ok = []
    for layout, model_kwargs in cases:
        reference = build_model(**model_kwargs).state_dict()
        model = Trainer(layout, model_kwargs, None).model
        model.load_state_dict({k: (v + 1.0) for k, v in reference.items()})
        full = _full(model)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        params_ok = all(torch.equal(p.full_tensor().float(), full[n]) for n, p in model.named_parameters() if hasattr(p, "full_tensor"))
        ok.append(params_ok and full.keys() == trainable and all(torch.equal(full[k], reference[k] + 1.0) for k in full))
    return ok


def in_one_launch(calls: list[Callable[[], object]]) -> list:
    """Each call in turn (``functools.partial`` of scenarios), so that several share one
    spawn of the ranks: about 14 s of a 4-rank launch on 2 cores go to starting them."""
    return [call() for call in calls]
