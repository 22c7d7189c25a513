"""Training loops written for FSDP2 or DDP, run on a Lins model inside the forked ranks."""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from lins_dtensor import (
    LinsPlan,
    apply_lins,
    build_lins_mesh,
    clip_grad_norm_,
    lins_optimizer,
    lins_stats,
    set_gradient_accumulation_steps,
)
from lins_dtensor.runtime import lins_state
from lins_dtensor.schedule import ALL_SPECS, step_collectives
from scenarios import LR, MAX_NORM, WEIGHT_DECAY
from tiny_llama import Block, batch, build_model, loss_fn, tensor_parallelize


def torch_clip_on_lins_model(configs: list[dict]) -> list[dict]:
    """Each config: plan, tp, param_dtype. Two steps of M=2; after each step's last
    backward, torch's own clip_grad_norm_ over model.parameters() (what a user moving
    from FSDP2 writes), then Lins' clip and the step. Returns what torch's call raised,
    how many parameters had a gradient to read, and Lins' norms."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        tp = cfg.get("tp", 1)
        model = build_model(**({"n_heads": 4} if tp > 1 else {}))
        mesh = build_lins_mesh(LinsPlan.parse(cfg["plan"], world // tp), ranks_per_node=2, device_type="cpu", tp=tp)
        if tp > 1:
            tensor_parallelize(model, mesh.tp_mesh())
        apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=cfg.get("param_dtype"), reduce_dtype=torch.float32))
        opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
        raised, with_grad, norms = [], [], []
        for step in range(2):
            for mb in range(2):
                (loss_fn(model, batch(step, rank // tp, mb)) / 2).backward()
            with_grad.append(sum(p.grad is not None for p in model.parameters()))
            try:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                raised.append(None)
            except RuntimeError as error:
                raised.append(str(error))
            norms.append(float(clip_grad_norm_(model, MAX_NORM)))
            opt.step()
            opt.zero_grad()
        results.append({"config": cfg, "raised": raised, "with_grad": with_grad, "trainable": sum(p.requires_grad for p in model.parameters()),
                        "norms": norms})
    return results


# ----- parameters that take no part in a step ------------------------------------------------
UNUSED_STEPS = 4


def branch_used(step: int, rank: int, microbatch: int) -> bool:
    """Whether the blocks' branch takes part: step 0 everywhere, step 1 nowhere (the
    optimizer must leave it alone), step 2 on rank 0 only (the others add zeros), step 3
    in micro-batch 0 only (on ranks 1 and 2)."""
    return (step == 0, False, rank == 0, microbatch == 0 and rank in (1, 2))[step]


def _set_branch(model: torch.nn.Module, used: bool) -> None:
    for block in model.modules():
        if isinstance(block, Block):
            block.use_branch = used


def unused_reference(world: int, microbatches: int) -> dict[str, torch.Tensor]:
    """One process, every rank's micro-batches, the same branch pattern: torch.optim
    skips a parameter whose .grad stayed None."""
    model = build_model(branch=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    for step in range(UNUSED_STEPS):
        for rank in range(world):
            for mb in range(microbatches):
                _set_branch(model, branch_used(step, rank, mb))
                (loss_fn(model, batch(step, rank, mb)) / (microbatches * world)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            _set_branch(model, True)
            loss_fn(model, batch(99, 0, 0))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unused_parameters(configs: list[dict]) -> list[dict]:
    """Each config: plan, microbatches. Lins with the branch pattern of :func:`branch_used`,
    a no_grad validation forward (branch on) after each step; the full masters, and
    whether the bytes each step recorded match schedule.step_collectives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        mbs = cfg["microbatches"]
        model = build_model(branch=True)
        plan = LinsPlan.parse(cfg["plan"], world)
        apply_lins(model, build_lins_mesh(plan, ranks_per_node=2, device_type="cpu"))
        opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        for step in range(UNUSED_STEPS):
            for mb in range(mbs):
                _set_branch(model, branch_used(step, rank, mb))
                (loss_fn(model, batch(step, rank, mb)) / mbs).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                _set_branch(model, True)
                loss_fn(model, batch(99, 0, 0))
        masters = {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
        results.append({"config": cfg, "masters": masters, "bytes_match": _bytes_match(model, plan, mbs, lins_only=True)})
    return results


def _bytes_match(model: torch.nn.Module, plan: LinsPlan, microbatches: int, clip: bool = False, lins_only: bool = False) -> bool:
    """Whether the last step recorded exactly what schedule.step_collectives counts
    (``lins_only``: the collectives Lins issues, not FSDP2's parameter gathers, which a
    validation forward between steps adds to)."""
    state = lins_state(model)
    expected = step_collectives(plan, state.schedule(), world_size=dist.get_world_size(), ranks_per_node=2,
                                microbatches=microbatches, param_bytes=4, reduce_bytes=4, clip_grad_norm=clip, formats=state.ctx.formats)
    counted = {spec.name for spec in ALL_SPECS if spec.issuer == "lins" or not lins_only}
    key = lambda r: (r.name, r.op.value, r.group_size, r.nodes, r.message_bytes, r.format)  # noqa: E731
    predicted = Counter()
    for r in expected:
        if r.name in counted:
            predicted[key(r)] += r.count
    return Counter(key(r) for r in lins_stats(model).collectives if r.name in counted) == predicted


# ----- a step that raises, and the step done again ------------------------------------------------
RECOVERY_STEPS, RECOVERY_MICROBATCHES, FAILED_STEP = 5, 3, 2


class InjectedFault(RuntimeError):
    pass


class _Tripwire(torch.autograd.Function):
    """Identity; raises in backward while ``armed`` (a fault in the middle of backward)."""

    armed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if _Tripwire.armed:
            raise InjectedFault("injected in backward")
        return grad


def _blocks(model: torch.nn.Module) -> list[Block]:
    return [m for m in model.modules() if isinstance(m, Block)]


def recovery(configs: list[dict]) -> list[dict]:
    """Each config: plan, fault (None, "forward", "backward", "before_step" or "in_step"),
    optionally formats (apply_lins' comm_formats).
    Lins told M=3; in step 2 the fault is injected on every rank (in forward of
    micro-batch 2, in backward of micro-batch 2 between the two blocks, after the last
    backward, or inside ``optimizer.step()`` once Lins has reduced the gradients and put
    the masters in the param groups), caught, ``opt.zero_grad()``, and the step done again. Returns the full masters and
    whether the last step's recorded bytes match the schedule."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for cfg in configs:
        model = build_model()
        plan = LinsPlan.parse(cfg["plan"], world)
        apply_lins(model, build_lins_mesh(plan, ranks_per_node=2, device_type="cpu"), comm_formats=cfg.get("formats"))
        set_gradient_accumulation_steps(model, RECOVERY_MICROBATCHES)
        opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        first, second = _blocks(model)[:2]
        fault = {"armed": False}

        def raise_in_forward(module, args):
            if fault["armed"] and cfg["fault"] == "forward":
                raise InjectedFault("injected in forward")

        def raise_in_step(optimizer, args, kwargs):
            if fault["armed"] and cfg["fault"] == "in_step":
                raise InjectedFault("injected in optimizer.step()")

        second.register_forward_pre_hook(raise_in_forward)
        opt.register_step_pre_hook(raise_in_step)  # after Lins' own
        first.register_forward_hook(lambda module, args, output: _Tripwire.apply(output))
        caught = []
        for step in range(RECOVERY_STEPS):
            attempts = 2 if step == FAILED_STEP and cfg["fault"] else 1
            for attempt in range(attempts):
                failing = attempt == 0 and attempts == 2
                try:
                    for mb in range(RECOVERY_MICROBATCHES):
                        fault["armed"] = failing and mb == 1
                        _Tripwire.armed = fault["armed"] and cfg["fault"] == "backward"
                        (loss_fn(model, batch(step, rank, mb)) / RECOVERY_MICROBATCHES).backward()
                    if failing and cfg["fault"] == "before_step":
                        raise InjectedFault("injected before the step")
                    clip_grad_norm_(model, MAX_NORM)
                    fault["armed"] = failing
                    opt.step()
                except InjectedFault as error:
                    caught.append(str(error))
                finally:
                    _Tripwire.armed = fault["armed"] = False
                opt.zero_grad()
        masters = {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
        results.append({"config": cfg, "masters": masters, "caught": caught,
                         "bytes_match": _bytes_match(model, plan, RECOVERY_MICROBATCHES, clip=True)})
    return results


# ----- a unit whose forward runs twice ------------------------------------------------------------
class _TwiceFirstBlock(torch.nn.Module):
    """The tiny model with its first block run twice in a row (a shared block): its
    unit's gradient can reach Lins twice in one backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_model()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        model = self.inner
        x = model.tok_embeddings(tokens) + model.pos[: tokens.shape[1]]
        x = model.layers[0](model.layers[0](x))
        for block in list(model.layers)[1:]:
            x = block(x)
        return model.output(model.norm(x))


def _one_process(model: torch.nn.Module, world: int, steps: int, as_rank=lambda model, rank: None) -> dict[str, torch.Tensor]:
    """torch.optim.AdamW in one process on every rank's one micro-batch per step
    (``as_rank`` sets the model up as that rank has it); the final state dict."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    for step in range(steps):
        for rank in range(world):
            as_rank(model, rank)
            (loss_fn(model, batch(step, rank, 0)) / world).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _lins_steps(model: torch.nn.Module, plan: LinsPlan, steps: int, units: list[torch.nn.Module], told: bool) -> None:
    """``steps`` AdamW steps of one micro-batch each under Lins (``told``: Lins knows M=1)."""
    rank = dist.get_rank()
    apply_lins(model, build_lins_mesh(plan, ranks_per_node=2, device_type="cpu"), units=units)
    if told:
        set_gradient_accumulation_steps(model, 1)
    opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
    for step in range(steps):
        loss_fn(model, batch(step, rank, 0)).backward()
        opt.step()
        opt.zero_grad()


def _full_masters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}


def twice_reference(world: int, steps: int) -> dict[str, torch.Tensor]:
    return _one_process(_TwiceFirstBlock(), world, steps)


def block_run_twice(configs: list[dict]) -> list[dict]:
    """Each config: plan. Two steps of one micro-batch of :class:`_TwiceFirstBlock`; the full masters."""
    results = []
    for cfg in configs:
        model = _TwiceFirstBlock()
        _lins_steps(model, LinsPlan.parse(cfg["plan"], dist.get_world_size()), cfg["steps"], list(model.inner.layers), told=False)
        results.append({"config": cfg, "masters": _full_masters(model)})
    return results


# ----- a unit whose forward runs but whose output some ranks do not use -----------------------------
class _AuxiliaryHead(torch.nn.Module):
    """The tiny model plus an auxiliary head, a unit of its own, that every rank runs in
    forward but only ranks that ``use_aux`` put in the loss: elsewhere none of its
    parameters gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_model()
        self.aux = torch.nn.Linear(self.inner.output.in_features, self.inner.output.out_features)
        self.use_aux = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        model = self.inner
        x = model.tok_embeddings(tokens) + model.pos[: tokens.shape[1]]
        for block in model.layers:
            x = block(x)
        aux = self.aux(x)
        logits = model.output(model.norm(x))
        return logits + aux if self.use_aux else logits


def aux_reference(world: int, steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return _one_process(_AuxiliaryHead(), world, steps, lambda model, rank: setattr(model, "use_aux", rank == 0))


def auxiliary_head_on_one_rank(configs: list[dict]) -> list[dict]:
    """Each config: plan. Two steps, the auxiliary head in the loss on rank 0 only."""
    results = []
    for cfg in configs:
        torch.manual_seed(0)
        model = _AuxiliaryHead()
        model.use_aux = dist.get_rank() == 0
        plan = LinsPlan.parse(cfg["plan"], dist.get_world_size())
        _lins_steps(model, plan, cfg["steps"], [*model.inner.layers, model.aux], told=True)
        results.append({"config": cfg, "masters": _full_masters(model), "bytes_match": _bytes_match(model, plan, 1)})
    return results
