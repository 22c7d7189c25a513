"""The strategies the benchmark compares, each built on the same model, and the Lins
plan the planner costs each one as.

Lins runs plans through ``apply_lins``; the torch runtimes (FSDP2, HSDP, hpZ, DDP with
torch's communication hooks: plain all-reduce, bf16 compression, PowerSGD) run with the
same units and AdamW, their collectives recorded by the same
:class:`~lins_dtensor.collectives.CommRecorder` that Lins uses, so that their bytes
per link are counted alike.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lins_dtensor import (
    CommFormats,
    LinsMesh,
    LinsPlan,
    apply_lins,
    build_lins_mesh,
    clip_grad_norm_,
    lins_optimizer,
    lins_stats,
    set_gradient_accumulation_steps,
    wait_for_updates,
)
from lins_dtensor.bench.measure import LR, Built, Ranks, SharedGroups
from lins_dtensor.bench.model import build_model
from lins_dtensor.collectives import CommRecorder, LinsAllGather, LinsReduceScatter
from lins_dtensor.optimizer import local_nbytes, optimizer_state_bytes
from lins_dtensor.runtime import default_units
from lins_dtensor.schedule import OPTIM_ALL_REDUCE
from lins_dtensor.stats import memory_bytes

MAX_NORM = 1.0  # gradient clipping, for every strategy

# PowerSGD (torch's powerSGD_hook; docs/benchmark.md gives the reasons in full).
# Rank 4: every matrix of the small model (256 x 256, 256 x 768, 2048 x 256) compresses
# by 32x or more ((n + m) * 4 numbers instead of n * m; 43x over the whole model with
# the 1-D weights sent as they are); 4 is the top of the range torch's PowerSGDState
# docs give as typical (1-4), and 8 would halve the saving and add compression compute
# for accuracy a few-step benchmark does not measure. Start at iteration 2, torch's
# minimum with error feedback or warm start (DDP rebuilds its buckets after the first
# iteration): the warm-up runs through the vanilla steps, so every timed step is
# compressed (a training run would start at ~10 % of its steps, as torch advises).
# Error feedback and warm start on: torch's defaults and its advice for accuracy.
POWERSGD_RANK = 4
POWERSGD_START_ITER = 2

# The planner's pick with lossy wire formats allowed (lins_dtensor.formats): both
# formats, or one only; the planner decides where. Gradients may be reduced in bf16
# inside the node too (each rank's gradient rounded once, summed in fp32, the partial
# sum then encoded again across the nodes, as ZeRO++'s qgZ rounds twice): on the
# emulated cluster gloo reduce-scatters by all-reducing, so a bf16 all-to-all moves a
# quarter of the exact bytes over the cores; trained inside the fp32 band with int8
# and with bf16 across the nodes (docs/convergence.md). Not in int8 inside the node:
# no convergence run, and the int8 codec costs the cores more than it saves there.
# Parameters may be compressed on either level; a value gathered over both in a lossy
# format is encoded twice, which the time-to-loss table marks when no convergence run
# trained that way.
FORMAT_STRATEGIES = {
    "lins-planner-compressed": "grads=bf16|int8,grads:intra=bf16,params=bf16|int8,params:intra=bf16|int8",
    "lins-bf16": "grads=bf16,grads:intra=bf16,params=bf16,params:intra=bf16",
    "lins-int8": "grads=int8,params=int8,params:intra=int8",
}
PLANNER_STRATEGIES = ("lins-planner", *FORMAT_STRATEGIES)
STRATEGIES = ("lins-planner", *FORMAT_STRATEGIES, "lins-fsdp", "lins-zero1", "lins-zero2", "fsdp2", "hsdp", "hsdp-deferred", "hpz", "ddp",
              "ddp-bf16-hook", "ddp-powersgd")
DDP_STRATEGIES = ("ddp", "ddp-bf16-hook", "ddp-powersgd")
DESCRIPTIONS = {
    "lins-planner": "Lins, the planner's plan",
    "lins-planner-compressed": "Lins, the planner's plan and wire formats (bf16 or int8 allowed on every collective, gradients inside a node bf16 at most)",
    "lins-bf16": "Lins, the planner's plan and formats with bf16 allowed",
    "lins-int8": "Lins, the planner's plan and formats with int8 allowed",
    "lins-fsdp": "Lins, fsdp preset (FSDP-equivalent plan)",
    "lins-zero1": "Lins, zero1 preset",
    "lins-zero2": "Lins, zero2 preset",
    "fsdp2": "stock FSDP2 (fully_shard per block over all ranks)",
    "hsdp": "FSDP2 HSDP, node = shard group (all-reduce every micro-batch)",
    "hsdp-deferred": "FSDP2 HSDP, all-reduce only on the last micro-batch (hand-tuned)",
    "hpz": "FSDP2, reshard_after_forward=<node size> (ZeRO++ hpZ)",
    "ddp": "torch DistributedDataParallel (no_sync on all but the last micro-batch)",
    "ddp-bf16-hook": "DDP with torch's bf16_compress_hook (gradients all-reduced in bf16; no_sync as ddp)",
    "ddp-powersgd": f"DDP with torch's powerSGD_hook (rank {POWERSGD_RANK} from step {POWERSGD_START_ITER}, error feedback, "
                    "warm start; no_sync as ddp)",
}


def strategy_formats(strategy: str, formats: str = "exact") -> dict | str:
    """The wire format of each state's collectives on each link level, as the results
    record it: "exact" (everything in its own dtype, fp32 here), or per state a dict of
    link level ("inter", "intra") to format. DDP all-reduces over all ranks, so a hook's
    format is on both levels; a Lins row's are its ``formats`` (CommFormats text)."""
    grads = {"ddp-bf16-hook": "bf16", "ddp-powersgd": f"powersgd-r{POWERSGD_RANK}"}.get(strategy)
    return CommFormats.parse(formats).as_json() if grads is None else {"grads": {"inter": grads, "intra": grads}}


def formats_text(formats: dict | str) -> str:
    """:func:`strategy_formats` as text for the planner ("grads=bf16,grads:intra=bf16":
    ``state=`` the format across nodes, ``state:intra=`` inside a node), or "exact"."""
    if formats == "exact":
        return formats
    return ",".join(f"{state}={fmt['inter']},{state}:intra={fmt['intra']}" for state, fmt in formats.items())


# ----- building ----------------------------------------------------------------------------------
def _torch_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The torch runtimes' model states on this rank, read from the live tensors."""
    params = [p for p in model.parameters()]
    return {
        "params": sum(local_nbytes(p) for p in params),
        "grads": sum(local_nbytes(p.grad) for p in params),
        "optim": optimizer_state_bytes(optimizer),
    }


def _torch_built(
    trained: nn.Module,
    model: nn.Module,
    recorder: CommRecorder,
    microbatch_context: Callable[[int, int], contextlib.AbstractContextManager] | None = None,
    measured_from_step: int = 0,
) -> Built:
    """A torch-native strategy (FSDP2 family, DDP): AdamW and torch's clipping over the
    parameters of ``model``, trained through ``trained`` (the model or its wrapper)."""
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=True)
    return Built(
        trained, opt,
        clip=lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM),
        records=lambda: recorder.last_step,
        end_step=recorder.end_step,
        state_bytes=lambda: _torch_state_bytes(model, opt),
        microbatch_context=microbatch_context,
        measured_from_step=measured_from_step,
    )


class Strategies:
    """Builds each strategy on the same model; caches meshes so M=1 and M=4 share them,
    and builds Lins' meshes on the run's shared process groups (:class:`~.measure.SharedGroups`)."""

    def __init__(self, model_size: str, ranks: Ranks, groups: SharedGroups) -> None:
        self.model_size, self.world, self.rpn, self.groups = model_size, ranks.world, ranks.per_node, groups
        self._meshes: dict[tuple, LinsMesh | DeviceMesh] = {}

    def builder(self, key: str, plan: str | None, formats: str = "exact") -> Callable[[], Built]:
        """What builds the instance ``key``: a Lins plan (with its wire formats), or one of torch's runtimes."""
        if plan is not None:
            return functools.partial(self.lins, plan, formats)
        if key in DDP_STRATEGIES:
            return functools.partial(self.ddp, key)
        return functools.partial(self.fsdp2, key)

    def lins_mesh(self, plan: LinsPlan, formats: str) -> LinsMesh:
        """The mesh of a plan, on the shared groups: two Lins models on the same groups must
        not have collectives in flight at once (each would issue its chains in its own
        order, differently on different ranks), which the timing loop guarantees by
        settling every step before the next strategy's."""
        key = ("lins", str(plan), formats)
        if key not in self._meshes:
            self._meshes[key] = build_lins_mesh(plan, ranks_per_node=self.rpn, device_type="cpu", group_for=self.groups)
        return self._meshes[key]

    def device_mesh(self, shape: tuple, names: tuple | None) -> DeviceMesh:
        key = ("dm", shape)
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return self._meshes[key]

    # ----- Lins ---------------------------------------------------------------------------
    def lins(self, plan_text: str, formats: str = "exact") -> Built:
        plan = LinsPlan.parse(plan_text, self.world)
        mesh = self.lins_mesh(plan, formats)
        model = build_model(self.model_size)
        apply_lins(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32), comm_formats=formats)
        opt = lins_optimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.1, foreach=True)

        def context(mb: int, m_total: int) -> contextlib.AbstractContextManager:
            # The trainer tells Lins the step's micro-batch count, as torchtitan's
            # integration does, so the last one reduces during its backward.
            set_gradient_accumulation_steps(model, m_total)
            return contextlib.nullcontext()

        return Built(
            model, opt,
            clip=lambda: clip_grad_norm_(model, MAX_NORM),
            records=lambda: lins_stats(model).collectives,
            end_step=lambda: None,  # the Lins optimizer hook ends the recorder's step
            state_bytes=lambda: memory_bytes(model),
            microbatch_context=context,
            comm_time=lambda: lins_stats(model).comm_time(),
            settle=lambda: wait_for_updates(model),
        )

    # ----- FSDP2 family (torchtitan-style units) ------------------------------------------------
    def fsdp2(self, kind: str) -> Built:
        if kind in ("hsdp", "hsdp-deferred"):
            mesh = self.device_mesh((self.world // self.rpn, self.rpn), ("replicate", "shard"))
        else:
            mesh = self.device_mesh((self.world,), None)
        reshard = self.rpn if kind == "hpz" else True
        model = build_model(self.model_size)
        mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        recorder = CommRecorder(self.rpn)
        # The same units Lins shards (torchtitan's: embedding, each block, norm, output),
        # every one resharded after forward (torchtitan's "always" policy), then the root.
        units = [*default_units(model), model]
        for m in units:
            fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard if m is not model else True)
        for m in units:
            m.set_custom_all_gather(LinsAllGather(recorder))
            m.set_custom_reduce_scatter(LinsReduceScatter(recorder))
            # gloo has no AVG / PREMUL_SUM reductions: sum, then scale (same result).
            m.set_force_sum_reduction_for_comms(True)
            if kind in ("hsdp", "hsdp-deferred"):
                group = mesh.get_group("replicate")
                m.set_all_reduce_hook(lambda out, g=group: recorder.record(OPTIM_ALL_REDUCE, g, out))
        context = None
        if kind == "hsdp-deferred":
            @contextlib.contextmanager
            def context(mb: int, m_total: int) -> Iterator[None]:
                model.set_requires_all_reduce(mb == m_total - 1)
                yield

        return _torch_built(model, model, recorder, context)

    # ----- DDP ----------------------------------------------------------------------------------
    def ddp(self, kind: str) -> Built:
        """DDP with torch's communication hook for ``kind``, called as torch ships it, on a
        :class:`RecordingGroup` that records every all-reduce the hook issues."""
        model = build_model(self.model_size)
        recorder = CommRecorder(self.rpn)
        group = RecordingGroup(dist.group.WORLD, recorder)
        ddp = nn.parallel.DistributedDataParallel(model)
        measured_from_step = 0
        if kind == "ddp":
            ddp.register_comm_hook(group, default_hooks.allreduce_hook)
        elif kind == "ddp-bf16-hook":
            ddp.register_comm_hook(group, bf16_hook)
        else:
            state = PowerSGDState(process_group=group, matrix_approximation_rank=POWERSGD_RANK,
                                  start_powerSGD_iter=POWERSGD_START_ITER, use_error_feedback=True, warm_start=True)
            ddp.register_comm_hook(state, in_bucket_order(powerSGD_hook))
            measured_from_step = POWERSGD_START_ITER

        def context(mb: int, m_total: int) -> contextlib.AbstractContextManager:
            return ddp.no_sync() if mb < m_total - 1 else contextlib.nullcontext()

        return _torch_built(ddp, model, recorder, context, measured_from_step)


class RecordingGroup:
    """The process group a DDP communication hook is given: it records each all-reduce
    the hook issues through it, then issues it on ``group``.

    torch's hooks call ``dist.all_reduce(tensor, group=<this>)``, which calls
    ``group.allreduce``; they also ask the group's ``size()``. Recording here sees the
    messages as sent (bf16, PowerSGD's P and Q and its uncompressed 1-D tensors), also
    those PowerSGD issues from its future callbacks on gloo's threads, all before DDP's
    backward returns (it waits for every bucket's future)."""

    def __init__(self, group: dist.ProcessGroup, recorder: CommRecorder) -> None:
        self.group, self.recorder = group, recorder

    def size(self) -> int:
        return self.group.size()

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work:
        for t in tensors:
            self.recorder.record(OPTIM_ALL_REDUCE, self.group, t)
        return self.group.allreduce(tensors, opts)


# No annotations: DDP checks a hook's, and under postponed evaluation they are strings.
def bf16_hook(state, bucket):
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name unless
    CUDA with NCCL 2.10+ (or XPU with XCCL) is present, though gloo all-reduces bf16 on
    CPU ("BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+ or XPU and
    XCCL" on a CPU-only torch)."""
    return default_hooks.bf16_compress_hook(state, bucket)


def in_bucket_order(hook):
    """``hook`` with each bucket's collectives issued once the previous bucket's hook has
    finished: the order NCCL gives torch's ``powerSGD_hook``, which gloo does not.

    ``powerSGD_hook`` issues its P and Q all-reduces from the callbacks of the one
    before. On NCCL a collective's future completes as it is enqueued, so those
    callbacks run inside the hook, on the autograd thread, and bucket k's all-reduces
    are all issued before bucket k+1's. Gloo completes futures on its worker threads:
    bucket k's callbacks issue their all-reduces while the autograd thread issues
    bucket k+1's, ranks disagree on the order and gloo aborts ("Received data size
    doesn't match expected size", seen on the emulated cluster). Chaining each bucket on
    the previous one's future restores NCCL's order; the autograd thread never waits, so
    the communication still overlaps the backward pass. No annotations: DDP checks a
    hook's."""
    previous: torch.futures.Future | None = None  # this step's last bucket so far

    def bucket_ordered_hook(state, bucket):
        nonlocal previous
        done: torch.futures.Future = torch.futures.Future()

        def forward_result(fut: torch.futures.Future) -> None:
            try:
                done.set_result(fut.value())
            except Exception as error:  # the hook's own failure reaches DDP's wait
                done.set_exception(error)

        def start(before: torch.futures.Future | None) -> None:
            try:
                if before is not None:
                    before.value()  # a failed bucket fails this one too
                hook(state, bucket).add_done_callback(forward_result)
            except Exception as error:
                done.set_exception(error)

        if previous is None:
            start(None)
        else:
            previous.add_done_callback(start)  # runs now when it is already done
        # DDP waits for every bucket's future before backward returns: the next step's
        # first bucket starts at once, whatever this step's did.
        previous = None if bucket.is_last() else done
        return done

    bucket_ordered_hook.__name__ = f"bucket_ordered_{hook.__name__}"
    return bucket_ordered_hook


# ----- what the planner costs each strategy as ------------------------------------------------------
class Equivalent(NamedTuple):
    """The plan the planner costs for a strategy (same bytes on the same groups), and
    how that strategy issues its collectives differently from Lins."""

    plan: str
    extra_all_reduce: bool  # stock HSDP: an all-reduce on every micro-batch, not once per step
    fsdp_hooks: bool  # runs FSDP2's or Lins' per-unit hooks and copies (calibrated host time, local_copy_bytes)
    note: str
    fsdp2_reductions: bool = False  # the step reductions are FSDP2's (blocking on CPU), not Lins' chains
    # The wire formats the planner is to cost the plan with (:func:`formats_text`): "exact",
    # or e.g. "grads=bf16,grads:intra=bf16".
    formats: str = "exact"
    # Why the planner cannot cost this strategy at all (its model lacks what the
    # strategy does); None: it can.
    not_costed: str | None = None
    # A DDP hook that all-reduces its buckets cast to another dtype (torch's
    # bf16_compress_hook: gloo's or NCCL's own all-reduce of bf16 values, summed in bf16):
    # the bytes per value on the wire, costed as an exact all-reduce of that dtype plus
    # the cast of every gradient value down and back. None: ``formats`` as Lins runs them.
    cast_reduce_bytes: int | None = None
    # torch DDP: the step's all-reduce goes out per gradient bucket of DDP's default
    # sizes, each once all of its gradients are ready (planning.ddp_buckets).
    bucketed: bool = False


DDP_NOTE = ("Lins ddp without per-unit host time and copies (one all-reduce per step, in DDP's default gradient "
            "buckets: each overlaps the rest of the last backward, the last bucket nothing)")


def equivalent_plan(strategy: str, rpn: int, plan: str | None = None, formats: str = "exact") -> Equivalent:
    """The :class:`Equivalent` of ``strategy`` on nodes of ``rpn`` ranks (``plan`` and
    ``formats``: the Lins rows' own)."""
    if strategy in PLANNER_STRATEGIES or strategy == "lins-plan":
        note = "the planner's own plan" if strategy in PLANNER_STRATEGIES else "a Lins plan given on the command line"
        return Equivalent(plan, False, True, note + ("" if formats == "exact" else f" and formats {formats}"), formats=formats)
    return {
        "fsdp2": Equivalent("fsdp", False, True, "costed as Lins p=N,g=N,os=N (same collectives)"),
        "hsdp": Equivalent(f"hsdp:{rpn}", True, True, f"costed as hsdp:{rpn} with FSDP2's all-reduce, on every micro-batch", True),
        "hsdp-deferred": Equivalent(f"hsdp:{rpn}", False, True, f"costed as hsdp:{rpn} with FSDP2's all-reduce, last micro-batch only", True),
        "hpz": Equivalent(f"hpz:{rpn}", False, True, f"costed as hpz:{rpn}"),
        "ddp": Equivalent("ddp", False, False, "costed as " + DDP_NOTE, bucketed=True),
        "ddp-bf16-hook": Equivalent("ddp", False, False, DDP_NOTE + ", its gradients cast to bf16 and all-reduced as they are "
                                    "(2 bytes per value, no all-to-all), then cast back",
                                    formats=formats_text(strategy_formats("ddp-bf16-hook")), cast_reduce_bytes=2, bucketed=True),
        "ddp-powersgd": Equivalent("ddp", False, False, DDP_NOTE + f", its gradients sent as PowerSGD's rank-{POWERSGD_RANK} "
                                   "P and Q (1-D weights as they are)",
                                   formats=formats_text(strategy_formats("ddp-powersgd")), bucketed=True,
                                   not_costed="not costed: PowerSGD's low-rank compression (and its compute) is not in the planner's model"),
        "lins-fsdp": Equivalent("fsdp", False, True, ""),
        "lins-zero1": Equivalent("zero1", False, True, ""),
        "lins-zero2": Equivalent("zero2", False, True, ""),
    }[strategy]
