"""Runs of Lins' on-device path on CPU ranks (gloo moves the data, :mod:`fake_device`
stands in for the streams and events), and of the hazards a GPU would expose."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fake_device import FakeDevice
from lins_dtensor import LinsPlan, apply_lins, build_lins_mesh, clip_grad_norm_, lins_optimizer, lins_stats, set_gradient_accumulation_steps
from lins_dtensor.runtime import lins_state
from scenarios import LR, MAX_NORM, WEIGHT_DECAY, LinsRun
from tiny_llama import batch, build_model, loss_fn


def _masters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}


def train_on_fake_device(configs: list[LinsRun]) -> list[dict]:
    """Each run's plan, microbatches, steps, ranks_per_node, max_inflight_bytes and
    param_dtype (the rest is fixed). Trains as a trainer does (Lins told M, clipping) with Lins'
    communication on a :class:`FakeDevice`; returns the masters, the host syncs during
    training, and any breach of the input rule (inputs held beyond the bound, or dropped
    before the stream that made them waited for their chain)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        plan = LinsPlan.parse(cfg.plan, world)
        model = build_model()
        mesh = build_lins_mesh(plan, ranks_per_node=cfg.ranks_per_node, device_type="cpu")
        device = FakeDevice()
        with device.installed():
            apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=cfg.param_dtype, reduce_dtype=torch.float32),
                       max_inflight_bytes=cfg.max_inflight_bytes)
        executor = lins_state(model).executor
        violations = []
        enqueue, release = executor._enqueue, executor._release_inputs

        def checked_enqueue(chain, enqueue=enqueue, executor=executor, violations=violations):
            enqueue(chain)
            held = sum(c.input_bytes for c in executor.holding)
            if held > max(executor.max_inflight_bytes, chain.input_bytes):
                violations.append(f"{chain.name}: {held} input bytes held, bound {executor.max_inflight_bytes}")

        def checked_release(chain, release=release, violations=violations):
            release(chain)
            if not chain.input_stream.has_waited_for(chain.end_event):
                violations.append(f"{chain.name}: inputs dropped before their stream waited for the chain")

        executor._enqueue, executor._release_inputs = checked_enqueue, checked_release
        opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        mbs = cfg.microbatches
        set_gradient_accumulation_steps(model, mbs)
        for step in range(cfg.steps):
            for mb in range(mbs):
                (loss_fn(model, batch(step, rank, mb)) / mbs).backward()
            clip_grad_norm_(model, MAX_NORM)
            opt.step()
            opt.zero_grad()
        syncs_in_training = device.host_syncs
        masters = _masters(model)
        comm_time = lins_stats(model).comm_time()  # reads the events: the accounting may sync
        results.append({
            "config": cfg,
            "masters": masters,
            "host_syncs": syncs_in_training,
            "violations": violations,
            "side_streams": len(device.side_streams),
            "timed_states": sorted(comm_time),
        })
    return results


class Branchy(nn.Module):
    """Blocks, then an ``aux`` layer that runs as a module on some steps and is read
    directly (its forward skipped, its weight still trained) on others."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.aux = nn.Linear(16, 16)
        self.aux_as_module = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        x = self.aux(x) if self.aux_as_module else F.linear(x, self.aux.weight, self.aux.bias)
        return x.square().mean()


def step_writes_after_pending_gathers(plan_text: str) -> list[tuple[str, bool]]:
    """Train Branchy 3 steps on CPU, ``aux``'s forward skipped on step 2 (its weight read
    directly). Returns (unit, whether the gather was still running) for each unit whose
    masters the optimizer was about to write while the last update gather that reads
    them had not been waited for."""
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = LinsPlan.parse(plan_text, world)
    model = Branchy()
    apply_lins(model, build_lins_mesh(plan, ranks_per_node=2, device_type="cpu"))
    state = lins_state(model)
    opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
    hazards = []

    def check_writes(optimizer, args, kwargs):  # after Lins' pre-step hook, before any write
        for unit in state.units:
            if unit.update_pending() and any(m.grad is not None for m in unit.local_masters):
                hazards.append((unit.name, not unit.update.done))

    opt.register_step_pre_hook(check_writes)
    for step in range(3):
        model.aux_as_module = step != 1
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, 8)).backward()
        opt.step()
        opt.zero_grad()
    return hazards


def _train_prefetching(model: nn.Module, rank: int) -> None:
    """Three AdamW steps of M = 2, Lins told M (updates gathered into the next forward)."""
    opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    set_gradient_accumulation_steps(model, 2)
    for step in range(3):
        for mb in range(2):
            (loss_fn(model, batch(step, rank, mb)) / 2).backward()
        opt.step()
        opt.zero_grad()


def forward_prefetch(configs: list[dict]) -> list[dict]:
    """Each config: plan, prefetch (bool), max_inflight_bytes. Trains the tiny LLaMA with
    FSDP2 forward prefetch of the next block from each block (as torchtitan can set it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        plan = LinsPlan.parse(cfg["plan"], world)
        model = build_model()
        apply_lins(model, build_lins_mesh(plan, ranks_per_node=2, device_type="cpu"), max_inflight_bytes=cfg["max_inflight_bytes"])
        if cfg["prefetch"]:
            blocks = list(model.layers)
            for block, following in zip(blocks, blocks[1:]):
                block.set_modules_to_forward_prefetch([following])
        _train_prefetching(model, rank)
        results.append({"config": cfg, "masters": _masters(model)})
    return results


def forward_prefetch_on_fake_device(plan_text: str) -> list[str]:
    """Three steps of the tiny LLaMA with FSDP2 forward prefetch of the next block, Lins'
    communication on the fake device. Returns every breach of the prefetch rule: when a
    block's pre-forward has run (FSDP2 has started gathering the next block), FSDP2's
    all-gather streams for the next block must have waited for its update, and the
    compute stream must not have (it waits in that block's own pre-forward)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    device = FakeDevice()
    with device.installed():
        apply_lins(model, build_lins_mesh(LinsPlan.parse(plan_text, world), ranks_per_node=2, device_type="cpu"))
    state = lins_state(model)
    blocks = list(model.layers)
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
    unit_of = {id(u.backend.module): u for u in state.units}
    breaches = []

    def after_pre_forwards(block, args, following):
        update = unit_of[id(following)].update
        if update is None:
            return
        if (following, update.end_event) not in device.fsdp_waited:
            breaches.append(f"{unit_of[id(following)].name}: gathered before FSDP2's streams waited for its update")
        if device.current.has_waited_for(update.end_event):
            breaches.append(f"{unit_of[id(following)].name}: compute waited for its update before the block that prefetches it")

    for block, following in zip(blocks, blocks[1:]):
        block.register_forward_pre_hook(lambda m, args, f=following: after_pre_forwards(m, args, f))  # after Lins' and FSDP2's
    _train_prefetching(model, rank)
    return breaches
