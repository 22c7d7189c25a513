"""``apply_lins``: shard a model's P, G and OS under a plan, and run its communication.

Each unit of the model (:func:`default_units`, then the root) gets a P backend: FSDP2
``fully_shard`` on the param_shard mesh where parameters are sharded (s_p > 1), plain
parameters where they are replicated (:mod:`lins_dtensor.units`). Lins owns the rest
of the schedule: :class:`LinsState` receives each unit's gradient from its backend,
reduces it into the G buffer, on the step's last micro-batch sends it on to the OS
layout while backward continues, hands the masters their gradients at
``optimizer.step()``, and afterwards starts gathering the updated values back into P,
each unit waited for in its next forward. All of it runs as chains on one
:class:`~lins_dtensor.executor.Executor` per model.

Which micro-batch is the last? Lins counts backward passes between optimizer steps.
The step's last one reduces to the OS layout during backward when Lins knows the
count: told (:func:`set_gradient_accumulation_steps`; the torchtitan integration does
it) or learned (the count of the previous step). Until it knows (the first step), and
when a step has fewer passes than expected, the reduction runs at the optimizer step
instead; with more, each pass after the expected last adds its gradient with one more
reduction (the same sum in another order: it warns once). :func:`set_requires_gradient_sync`
overrides the count for the next passes, FSDP2-style. Otherwise results are bitwise the
same whichever way the count is known.

Parameters that take no part keep PyTorch's semantics. One that got no gradient on a
rank adds zeros there (the sum over the ranks that used it, as DDP gives); one that got
none on any rank in the whole step gets no optimizer update (its master's ``grad`` stays
None, which torch.optim skips): the hosts agree on which took part with one small
all-reduce per step (``schedule.USED_PARAMS_ALL_REDUCE``). Every unit's forward must run
on every rank, as under FSDP2.

A step that raises between its first forward and the end of ``optimizer.step()`` is
forgotten by the next ``optimizer.zero_grad()`` (:func:`reset_step`): per-step state
lives in :class:`StepProgress` and each unit's :class:`~lins_dtensor.units.StepGradient`,
both with ``reset()``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lins_dtensor.collectives import CommRecorder, CommStream, HostAllReduce
from lins_dtensor.compat import (
    fsdp_forward_prefetch_modules,
    fsdp_reset_iter_state,
    fsdp_unit_params,
    gradient_held_elsewhere,
    queue_backward_callback,
)
from lins_dtensor.errors import LinsCheckpointError, LinsUsageError
from lins_dtensor.executor import Executor
from lins_dtensor.formats import CommFormats
from lins_dtensor.mesh import TENSOR_PARALLEL, LinsMesh, mesh_layout
from lins_dtensor.plan import LinsPlan
from lins_dtensor.schedule import USED_PARAMS_ALL_REDUCE, UnitSchedule, default_max_inflight_bytes
from lins_dtensor.units import LinsUnit, ParamBackend, ReplicatedParams, ShardContext, ShardedParams, TensorParallelSlice

_STATE_ATTR = "_lins_state"
_GRADIENT_HELD_MESSAGE = (
    "lins: a Lins model's parameter gradients are in Lins' G buffers, not in .grad (they are reduced at "
    "optimizer.step()): clip with lins_dtensor.clip_grad_norm_(model, max_norm), which returns the total norm"
)


class _Arrival(NamedTuple):
    """A unit's gradient from one backward, waiting for its turn (LinsState._hand_on):
    :meth:`LinsUnit.accumulate`'s arguments."""

    rows: list[torch.Tensor]
    sync: bool
    inputs: Sequence[torch.Tensor]
    used: Sequence[bool]


@dataclasses.dataclass
class StepProgress:
    """Where the running optimizer step is, from its first forward to the end of
    ``optimizer.step()``; :meth:`reset` ends it (after the step, or after a step that
    raised: :meth:`LinsState.discard_step`). Written and read on the host, in program
    order (no chain touches it)."""

    forward_running: bool = False  # a root forward began and has not returned
    backward_index: int = 0  # backward passes since the last optimizer step
    in_backward: bool = False
    sync: bool = False  # the running backward reduces to the OS layout
    # The running backward hands the units' gradients on in one order on every rank
    # (LinsState._hand_on): the units in it, the next one's index, and those that arrived early.
    backward_order: list[LinsUnit] = dataclasses.field(default_factory=list)
    positions: dict[int, int] = dataclasses.field(default_factory=dict)
    handed_on: int = 0
    waiting: dict[int, _Arrival] = dataclasses.field(default_factory=dict)
    # Units whose gradient arrived in the running backward, and the parameters given a
    # gradient that refuses to be read (_mark_gradients_held) until the step or the next forward.
    with_gradient: dict[int, LinsUnit] = dataclasses.field(default_factory=dict)
    marked: list[nn.Parameter] = dataclasses.field(default_factory=list)
    # The ranks' agreement on which parameters took part (USED_PARAMS_ALL_REDUCE), started
    # at the end of the step's last backward; stale once another backward has run.
    used: HostAllReduce | None = None
    used_stale: bool = False

    @property
    def started(self) -> bool:
        return self.forward_running or self.in_backward or self.backward_index > 0

    def clear_marks(self) -> None:
        """The parameters' gradients that refuse to be read go (autograd must not
        accumulate into them, and the step consumed what they stood for)."""
        for param in self.marked:
            param.grad = None
        self.marked = []

    def reset(self) -> None:
        if self.used is not None:
            self.used.result()  # every rank started it: finish it everywhere
        self.clear_marks()
        fresh = StepProgress()
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(fresh, field.name))


@dataclasses.dataclass
class LinsState:
    """Everything ``apply_lins`` attaches to a model (``model._lins_state``)."""

    ctx: ShardContext
    units: list[LinsUnit] = dataclasses.field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None  # set by lins_optimizer
    fsdp_root: nn.Module | None = None  # the model, where P is sharded (FSDP2's root)
    # What else discard_step undoes: the param groups of the model's Lins optimizer (set by lins_optimizer).
    discard_optimizer_step: Callable[[], None] | None = None
    # Which backward is the step's last (module docstring).
    requires_gradient_sync: bool | None = None  # set_requires_gradient_sync
    accumulation_steps: int | None = None  # set_gradient_accumulation_steps
    learned_steps: int | None = None  # backward passes in the previous step
    warned_extra_backward: bool = False
    warned_held_back: bool = False
    progress: StepProgress = dataclasses.field(default_factory=StepProgress)
    # The order units run forward in, for the update gathers (seen on each forward).
    forward_order: list[LinsUnit] = dataclasses.field(default_factory=list)
    _seen: dict[int, LinsUnit] = dataclasses.field(default_factory=dict)

    @property
    def mesh(self) -> LinsMesh:
        return self.ctx.mesh

    @property
    def plan(self) -> LinsPlan:
        return self.ctx.plan

    @property
    def recorder(self) -> CommRecorder:
        return self.ctx.recorder

    @property
    def executor(self) -> Executor:
        return self.ctx.executor

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    def materialize(self) -> None:
        """Make the masters of a model sharded on the meta device (torchtitan's way), which
        has meta masters from apply time, once its parameters have been materialised and
        initialised; follow parameters the model replaced. Idempotent."""
        for unit in self.units:
            unit.materialize()

    def masters(self) -> dict[str, nn.Parameter]:
        """The masters (``master_dtype``) by FQN, as they are: meta until :meth:`materialize`."""
        return {fqn: m for unit in self.units for fqn, m in zip(unit.fqns, unit.masters)}

    def schedule(self) -> list[UnitSchedule]:
        return [UnitSchedule(unit.geometry, unit.is_root) for unit in self.units]

    # ----- backward: gradients in, reductions out ---------------------------------------
    def on_gradient(self, unit: LinsUnit, rows: list[torch.Tensor], inputs: Sequence[torch.Tensor], used: Sequence[bool]) -> None:
        """A unit's backend hands over one backward pass's P-sharded gradient."""
        progress = self.progress
        if not progress.in_backward:
            self._begin_backward()
        progress.with_gradient.setdefault(id(unit), unit)
        arrival = _Arrival(rows, progress.sync, inputs, used)
        if progress.positions.get(id(unit), len(progress.backward_order)) < progress.handed_on:
            # A second gradient in this backward (a unit run twice, a reentrant
            # backward) after its turn: it goes on at once, as it arrives on every rank.
            unit.accumulate(*arrival)
        else:
            if id(unit) in progress.waiting:  # a second one before its turn: the first goes on now
                unit.accumulate(*progress.waiting.pop(id(unit)))
            progress.waiting[id(unit)] = arrival
            self._hand_on()
        self.executor.pump()

    def _hand_on(self, end: bool = False) -> None:
        """Accumulate the gradients that arrived, in the backward order, which is the same
        on every rank: their chains then issue their collectives in the same order
        everywhere. Arrival order alone is not: a replicated unit's gradients go on once
        all of its parameters have one, and one that a rank did not use in this backward
        completes only at the backward's end (``end``), with zeros for it.

        The backward order is the last forward's, reversed (units seen in no forward
        last), which is the order gradients arrive in when every parameter takes part, so
        nothing waits then. A replicated unit with a parameter that got no gradient on
        this rank holds the units after it (their autograd gradients in memory) until the
        backward's end (:meth:`_warn_if_held_back`)."""
        progress = self.progress
        order = progress.backward_order
        while progress.handed_on < len(order):
            unit = order[progress.handed_on]
            if id(unit) in progress.waiting:
                unit.accumulate(*progress.waiting.pop(id(unit)))
            elif not end:
                return
            progress.handed_on += 1

    def _warn_if_held_back(self) -> None:
        """Once: a unit still incomplete at the backward's end (a replicated unit with a
        parameter that got no gradient on this rank) held the gradients of the units after
        it in memory, and their reductions back, until now."""
        progress = self.progress
        order = progress.backward_order
        if self.warned_held_back or progress.handed_on >= len(order):
            return
        held = sum(id(u) in progress.waiting for u in order[progress.handed_on + 1:])
        if held:
            self.warned_held_back = True
            warnings.warn(
                f"lins: unit '{order[progress.handed_on].name}' had parameters without a gradient on this rank, so "
                f"the gradients of the {held} units after it waited for the end of backward (memory, no overlap): "
                "Lins issues the units' collectives in one order on every rank; keep rarely used parameters in "
                "units of their own (units=) or make P sharded", stacklevel=2,
            )

    def _begin_backward(self) -> None:
        progress = self.progress
        progress.in_backward = True
        progress.used_stale = progress.used is not None
        progress.sync = self._is_last_backward()
        seen = set(map(id, self.forward_order))
        progress.backward_order = list(reversed(self.forward_order)) + [u for u in self.units if id(u) not in seen]
        progress.positions = {id(u): i for i, u in enumerate(progress.backward_order)}
        progress.handed_on, progress.waiting = 0, {}
        queue_backward_callback(self._end_backward)

    def _is_last_backward(self) -> bool:
        if self.requires_gradient_sync is not None:
            return self.requires_gradient_sync
        steps = self.accumulation_steps or self.learned_steps
        if steps is None:
            return False  # not known yet: reduce at the optimizer step
        index = self.progress.backward_index
        if self.accumulation_steps and index >= steps and not self.warned_extra_backward:
            self.warned_extra_backward = True
            warnings.warn(
                f"lins: backward pass {index + 1} before optimizer.step() with "
                f"set_gradient_accumulation_steps({steps}): every extra pass reduces its gradient across "
                "G groups once more; tell Lins the real count", stacklevel=2,
            )
        return index + 1 >= steps

    def _end_backward(self) -> None:
        progress = self.progress
        self._warn_if_held_back()
        for unit in self.units:
            unit.backend.end_backward(forward_ran=id(unit) in self._seen)
        self._hand_on(end=True)
        progress.in_backward = False
        progress.backward_index += 1
        self._mark_gradients_held()
        if progress.sync:  # the step's last backward: agree on what took part while the reductions run
            self._start_used_agreement()
        self.executor.pump()

    def _mark_gradients_held(self) -> None:
        """Code written for FSDP2 or DDP reads ``p.grad`` after backward:
        ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would find None everywhere
        and clip nothing, silently. The parameters that had a gradient get one that
        raises, naming what to call instead, until the step (or the next forward)."""
        progress = self.progress
        for unit in progress.with_gradient.values():
            for param, used in zip(unit.params, unit.grad_state.used):
                if used:
                    param.grad = gradient_held_elsewhere(param, _GRADIENT_HELD_MESSAGE)
                    progress.marked.append(param)
        progress.with_gradient = {}

    # ----- which parameters took part --------------------------------------------------------------
    def _start_used_agreement(self) -> None:
        """Start the ranks' agreement on which parameters got a gradient in this step
        (one byte each, MAX over every rank): PyTorch leaves a parameter that took part
        nowhere untouched by the optimizer, and DDP gives one that took part on some
        ranks the sum of theirs, which the G buffers' zeros already make."""
        progress = self.progress
        if progress.used is not None:
            progress.used.result()  # an earlier one, stale: every rank started it too
        flags = torch.tensor([u for unit in self.units for u in unit.grad_state.used], dtype=torch.uint8)
        progress.used = HostAllReduce(self.recorder, USED_PARAMS_ALL_REDUCE, flags, self.mesh.host_group, op=dist.ReduceOp.MAX)
        progress.used_stale = False

    def _used_anywhere(self) -> list[list[bool]]:
        """Per unit, which parameters took part in this step on some rank."""
        progress = self.progress
        if progress.used is None or progress.used_stale:
            self._start_used_agreement()
        flags = progress.used.result().tolist()
        per_unit, start = [], 0
        for unit in self.units:
            per_unit.append([bool(f) for f in flags[start:start + len(unit.params)]])
            start += len(unit.params)
        return per_unit

    # ----- the optimizer step ---------------------------------------------------------------
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Hand the masters this step's gradients: start the reductions that did not run
        in backward, then wait for all (clipping calls it before the step).

        The step writes the masters, which the last step's update gathers read: a unit
        whose forward did not run since (a skipped branch) still has its gather pending,
        and the step must not write before that gather has read them."""
        for unit in self.units:
            if unit.update_pending():
                unit.wait_update()
        for unit in self.units:
            unit.start_reduction()
        for unit, used in zip(self.units, self._used_anywhere()):
            unit.finalize_grads(used)
        self.executor.release_inputs()

    @torch.no_grad()
    def finish_step(self) -> None:
        """After the optimizer: consume the gradients and start spreading the new
        values to P, in the order the units run forward."""
        for unit in self.units:
            unit.end_step()
        if self.progress.backward_index:
            self.learned_steps = self.progress.backward_index
        self.progress.reset()  # the step consumed the gradients, as zero_grad() would
        for unit in self._update_order():
            unit.start_update()
        self.recorder.end_step()

    @torch.no_grad()
    def discard_step(self) -> None:
        """Forget a step that raised between its first forward and the end of
        ``optimizer.step()`` (:func:`reset_step`). Its chains in flight are waited for
        (every rank that reached them issued them; where ranks disagree, the mesh's
        timeout ends the job naming the collective), FSDP2 is reset, the G buffers count
        as empty, the backward count starts again, the step's records are dropped, and
        the optimizer's param groups hold the parameters again. The last step's update
        gathers are kept. Nothing happens when no step is under way."""
        if not self.progress.started:
            return
        self.executor.wait_all()
        if self.fsdp_root is not None:
            fsdp_reset_iter_state(self.fsdp_root)
        for unit in self.units:
            unit.end_step()
            unit.reset_feedback()
        self.progress.reset()
        self.recorder.discard_running_step()
        if self.discard_optimizer_step is not None:
            self.discard_optimizer_step()

    def _update_order(self) -> list[LinsUnit]:
        seen = set(map(id, self.forward_order))
        unseen = [u for u in self.units if id(u) not in seen]
        unseen.sort(key=lambda u: not u.is_root)  # the root's forward starts first
        return unseen + self.forward_order

    # ----- forward: wait for the update where it is needed -------------------------------------
    def before_root_forward(self) -> None:
        self._seen = {}
        self.progress.forward_running = True
        self.progress.clear_marks()  # autograd must not accumulate into them
        self.materialize()
        # A unit whose forward did not run last time (its parameters are read by other
        # modules) is waited for here, before anything can read it.
        if self.forward_order:
            seen = set(map(id, self.forward_order))
            for unit in self.units:
                if id(unit) not in seen:
                    unit.wait_update()

    def before_unit_forward(self, unit: LinsUnit) -> None:
        self._seen.setdefault(id(unit), unit)
        unit.wait_update()
        # FSDP2 forward prefetch (set_modules_to_forward_prefetch) starts gathering the
        # listed units from this unit's pre-forward, which runs after this hook: their
        # parameters must hold the update by then.
        for target in self._forward_prefetch_targets(unit):
            target.before_prefetch()
        self.executor.pump()

    def _forward_prefetch_targets(self, unit: LinsUnit) -> list[LinsUnit]:
        if not isinstance(unit.backend, ShardedParams):
            return []
        by_module = self._sharded_units_by_module
        return [by_module[id(m)] for m in fsdp_forward_prefetch_modules(unit.backend.module) if id(m) in by_module]

    @functools.cached_property
    def _sharded_units_by_module(self) -> dict[int, LinsUnit]:
        """The FSDP2 units by their module (first read in forward, after apply_lins
        has made every unit)."""
        return {id(u.backend.module): u for u in self.units if isinstance(u.backend, ShardedParams)}

    def after_root_forward(self) -> None:
        self.progress.forward_running = False
        if torch.is_grad_enabled() or not self.forward_order:
            self.forward_order = list(self._seen.values())

    def updates_in_flight(self) -> bool:
        """Whether the last step's update gathers may still run: some unit's forward has
        not yet waited for its update (checked without blocking)."""
        return any(unit.update_pending() for unit in self.units)

    def wait_for_updates(self) -> None:
        """Wait for everything in flight; afterwards P holds the last step's values."""
        self.executor.wait_all()
        for unit in self.units:
            unit.wait_update()

    def unit_memory_bytes(self) -> dict[str, int]:
        """Persistent bytes the units hold per state (P, G, masters), measured on the live
        tensors, and with lossy formats the error-feedback residuals ("feedback");
        :func:`lins_dtensor.stats.memory_bytes` adds the optimizer's states."""
        total = {"params": 0, "grads": 0, "optim": 0, **({"feedback": 0} if self.ctx.formats.lossy else {})}
        for unit in self.units:
            for state, nbytes in unit.memory_bytes().items():
                total[state] += nbytes
        return total


# ----- controls ----------------------------------------------------------------------------------
def lins_state(model: nn.Module) -> LinsState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise LinsUsageError("this model has no Lins state: call apply_lins(model, mesh, plan) first")
    return state


def set_gradient_accumulation_steps(model: nn.Module, steps: int | None) -> None:
    """Tell Lins how many backward passes (micro-batches) each optimizer step
    accumulates, so that the last one reduces its gradients to the optimizer layout
    during backward, overlapped with it.

    Args:
        model (nn.Module): a model :func:`apply_lins` has sharded.
        steps (int | None): backward passes per optimizer step; ``None``: learn it from
            the previous step (the default; the first step then reduces at
            ``optimizer.step()``).
    """
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise LinsUsageError(f"gradient_accumulation_steps={steps!r} must be a positive integer or None")
    state = lins_state(model)
    state.accumulation_steps = steps
    state.warned_extra_backward = False


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool | None) -> None:
    """FSDP2's convention for the following backward passes. Results are the same
    either way.

    Args:
        model (nn.Module): a model :func:`apply_lins` has sharded.
        requires_gradient_sync (bool | None): ``False`` keeps their gradients inside
            the G group (the optimizer step reduces them), ``True`` reduces them to the
            optimizer layout during backward; ``None`` returns to counting
            (:func:`set_gradient_accumulation_steps`).
    """
    if requires_gradient_sync is not None and not isinstance(requires_gradient_sync, bool):
        raise LinsUsageError(f"requires_gradient_sync={requires_gradient_sync!r} must be True, False or None")
    lins_state(model).requires_gradient_sync = requires_gradient_sync


def set_reduce_in_backward(model: nn.Module, enabled: bool) -> None:
    """Deprecated: Lins knows the last micro-batch by itself now. Same as
    ``set_requires_gradient_sync(model, enabled)``."""
    warnings.warn(
        "lins: set_reduce_in_backward is deprecated: Lins finds the last micro-batch itself "
        "(set_gradient_accumulation_steps(model, M) tells it up front); "
        "set_requires_gradient_sync(model, enabled) is the direct replacement",
        FutureWarning, stacklevel=2,
    )
    set_requires_gradient_sync(model, enabled)


def reset_step(model: nn.Module) -> None:
    """Forget a step that raised anywhere between its first forward and the end of
    ``optimizer.step()`` (an out-of-memory error caught to retry with a smaller batch, a
    non-finite loss, an interrupt), where every rank raised at the same point: the next
    step runs as if the failed one never began, unless the optimizer itself had begun
    to update (what it updated stays, as in PyTorch). ``optimizer.zero_grad()`` of a
    Lins optimizer calls it (in PyTorch it discards the failed micro-batches'
    gradients); it does nothing while no step is under way. FSDP2's counterpart is
    ``FSDPModule.reset_iter_state``."""
    lins_state(model).discard_step()


def wait_for_updates(model: nn.Module) -> None:
    """Wait until the model's parameters hold the last optimizer step's values (the host
    waits on CPU; on an accelerator the caller's stream does, and the host goes on).

    Lins spreads the updated values to the parameters asynchronously after
    ``optimizer.step()``; each unit's forward waits for its own, so training needs no
    call. Call it before reading parameters outside forward (``lins_stats``,
    ``state_dict`` and checkpoint loading do), and at the end of a function that
    ``torch.multiprocessing`` runs: its processes skip the :mod:`atexit` hook that
    issues and waits for Lins' last collectives (:mod:`lins_dtensor.executor`).

    Args:
        model (nn.Module): a model :func:`apply_lins` has sharded.
    """
    lins_state(model).wait_for_updates()


# ----- apply ---------------------------------------------------------------------------------------
def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard as units, the way FSDP users wrap by block: each block of a
    container (:func:`_is_container`) wherever it sits (torchtitan's ``layers``, a
    Hugging Face ``transformer.h``, nanoGPT's ``transformer.h`` inside its
    ``transformer`` ModuleDict), containers inside containers walked in turn, and each
    other module with parameters on the way down to them (embeddings, final norm,
    output head). A container is never a unit itself: it has no forward for FSDP2 to
    hook. Modules that share a parameter (tied input and output embeddings) are left
    out: their parameters go to the root unit, which takes whatever no unit holds."""
    units: list[nn.Module] = []

    def visit(module: nn.Module, in_container: bool) -> None:
        for child in module.children():
            if _is_container(child):
                visit(child, in_container=True)
            elif not in_container and any(_is_container(m) for m in child.modules()):
                visit(child, in_container=False)
            elif _has_params(child):
                units.append(child)

    visit(model, in_container=False)
    tied = {id(m) for pair in _tied_pairs(units) for m in pair}
    return [unit for unit in units if id(unit) not in tied]


def _is_container(module: nn.Module) -> bool:
    """A module that holds blocks rather than being one: an ``nn.ModuleList`` or
    ``nn.ModuleDict``, or an ``nn.Sequential`` of repeated blocks (two or more children
    of one class that has submodules itself, as ``nn.Sequential(*blocks)`` or a ResNet
    stage; an ``nn.Sequential(Linear, GELU, Linear)`` is one layer stack, not blocks)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return True
    if type(module) is not nn.Sequential:
        return False
    classes = Counter(type(child) for child in module.children() if next(child.children(), None) is not None)
    return any(count >= 2 for count in classes.values())


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _nested(a: nn.Module, b: nn.Module) -> bool:
    return any(m is b for m in a.modules()) or any(m is a for m in b.modules())


def _tied_pairs(units: list[nn.Module]) -> list[tuple[nn.Module, nn.Module]]:
    """Pairs of units, neither inside the other, that hold the same parameter."""
    owner: dict[int, nn.Module] = {}
    pairs = []
    for unit in units:
        for p in unit.parameters():
            other = owner.setdefault(id(p), unit)
            if other is not unit and not _nested(other, unit):
                pairs.append((other, unit))
    return pairs


def resolve_units(model: nn.Module, units: Iterable[nn.Module] | type | tuple[type, ...] | None) -> list[nn.Module]:
    """The unit modules ``apply_lins`` shards, the root excluded: :func:`default_units`,
    the given modules, or every outermost module of the given block class(es)."""
    if units is None:
        return default_units(model)
    if isinstance(units, type) or (isinstance(units, tuple) and units and all(isinstance(u, type) for u in units)):
        chosen: list[nn.Module] = []
        for m in model.modules():
            if m is not model and isinstance(m, units) and not any(_nested(c, m) for c in chosen):
                chosen.append(m)
        if not chosen:
            raise LinsUsageError(f"units={units!r}: the model has no module of that class")
        return chosen
    chosen = list(units)
    names = {id(m): n for n, m in model.named_modules()}
    if any(id(unit) not in names or unit is model for unit in chosen):
        raise LinsUsageError("units= must list submodules of the model (the root is always a unit)")
    for first, second in _tied_pairs(chosen)[:1]:
        raise LinsUsageError(
            f"units=: '{names[id(first)]}' and '{names[id(second)]}' share a parameter (tied weights); "
            "leave both out of units= so that the root unit holds it"
        )
    return chosen


def _check_model(model: nn.Module, mesh: LinsMesh) -> None:
    if hasattr(model, _STATE_ATTR):
        raise LinsUsageError("apply_lins was already applied to this model; apply it once")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise LinsUsageError("the model is wrapped in DistributedDataParallel; pass the bare module to apply_lins")
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise LinsUsageError(f"module '{name or '<root>'}' is already sharded by FSDP; apply_lins replaces fully_shard, do not combine them")
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            if mesh.tp == 1:
                raise LinsUsageError(
                    f"parameter '{name}' is a DTensor (tensor parallelism?) but the Lins mesh has no TP dim: "
                    "build it with build_lins_mesh(plan, ..., tp=k) and parallelise the model on mesh.tp_mesh()"
                )
            if param.device_mesh != mesh.tp_mesh():
                raise LinsUsageError(
                    f"parameter '{name}' is a DTensor on {param.device_mesh}, not on the Lins mesh's '{TENSOR_PARALLEL}' "
                    "dim: parallelise the model on mesh.tp_mesh() before apply_lins"
                )
            if param.placements[0].is_partial():
                raise LinsUsageError(f"parameter '{name}' is a Partial DTensor; tensor parallelism must shard or replicate parameters")
            param = param.to_local()
        if type(param) not in (nn.Parameter, torch.Tensor):
            raise LinsUsageError(
                f"parameter '{name}' is a {type(param).__name__} tensor subclass (float8 training, torchtitan's "
                "[model] converters?); Lins shards plain tensors only: train it without the conversion"
            )
        if param.dim() == 0:
            raise LinsUsageError(f"parameter '{name}' is 0-dimensional; FSDP2 shards dim 0, reshape it to (1,)")


def apply_lins(
    model: nn.Module,
    mesh: LinsMesh,
    plan: LinsPlan | None = None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    gradient_divide_factor: float | None = None,
    units: Iterable[nn.Module] | type | tuple[type, ...] | None = None,
    max_inflight_bytes: int | None = None,
    master_dtype: torch.dtype | None = None,
    comm_formats: str | CommFormats | None = None,
) -> nn.Module:
    """Shard ``model`` in place under ``plan`` and return it.

    Each unit's parameters (P) are sharded s_p ways (FSDP2 ``fully_shard`` when s_p > 1),
    its gradients (G) s_g ways and its masters and optimizer states (OS) s_os ways; Lins
    runs the reductions and the update gathers between them (module docstring).

    Tensor parallelism: with a mesh built with ``tp=k``, first parallelise the model on
    ``mesh.tp_mesh()`` (torchtitan's TP plan or any ``parallelize_module`` plan); Lins
    then shards each rank's TP slice of every DTensor parameter under the plan. Plain
    parameters of such a model must be computed identically on the TP ranks (as FSDP2
    assumes): their gradients are not summed over the TP group.

    Args:
        model (nn.Module): the model, not yet wrapped by FSDP or DDP; it may be on the
            meta device (its masters are made once it is materialised).
        mesh (LinsMesh): from :func:`~lins_dtensor.build_lins_mesh`, built for ``plan``.
        plan (LinsPlan | None): the sharding factors; ``None`` takes the mesh's.
        mp_policy (MixedPrecisionPolicy | None): ``param_dtype`` is the dtype P is stored
            and computed in (default: the model's), ``reduce_dtype`` the dtype gradients
            are reduced and accumulated in (G, default fp32); ``output_dtype`` and
            ``cast_forward_inputs`` act as in FSDP2.
        gradient_divide_factor (float | None): what the summed gradients are divided by;
            ``None``: the number of data-parallel ranks (the world size without TP), an
            average; 1.0 sums them.
        units (Iterable[nn.Module] | type | tuple[type, ...] | None): the modules to shard
            separately: a list of submodules, a block class (or tuple of classes: every
            outermost module of it), or ``None`` for :func:`default_units`. The model is
            always the root unit, holding the parameters no unit does (tied weights
            among them).
        max_inflight_bytes (int | None): bound on the transient buffers of Lins'
            collectives in flight; ``None``: twice the largest chain's (``schedule.default_max_inflight_bytes``).
        master_dtype (torch.dtype | None): the dtype of the masters the optimizer steps;
            ``None``: the model's dtype, or fp32 for a model built in bf16 / fp16 (an
            optimizer in half precision loses updates smaller than its rounding).
        comm_formats (str | CommFormats | None): the wire format of Lins' gradient
            reductions ("grads") and update gathers ("params") per link level, e.g.
            ``"grads=int8,params=bf16"`` (groups that span nodes) or
            ``"grads:intra=bf16"``; ``None`` or ``"exact"``: every collective exact, as
            without formats (:mod:`lins_dtensor.formats`). Lossy formats sum in fp32 and
            keep the masters exact; every rank computes with the same parameters.

    Returns:
        nn.Module: ``model`` itself, sharded.

    Raises:
        LinsUsageError: a mesh not built for ``plan``, a model Lins cannot shard
            (already FSDP or DDP, a tensor subclass, ...), or an invalid argument.
    """
    if not isinstance(mesh, LinsMesh):
        raise LinsUsageError("mesh must come from build_lins_mesh(plan, ...), not a plain DeviceMesh")
    plan = mesh.plan if plan is None else plan
    if plan != mesh.plan:
        raise LinsUsageError(f"the mesh was built for plan '{mesh.plan}' but apply_lins got plan '{plan}'")
    dims, expected = mesh_layout(plan, mesh.dp_world_size, mesh.tp)
    if tuple(mesh.device_mesh.shape) != expected or mesh.device_mesh.mesh_dim_names != dims:
        raise LinsUsageError(f"mesh shape {tuple(mesh.device_mesh.shape)} does not match plan '{plan}' (expected {expected})")
    if master_dtype is not None and not (isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point):
        raise LinsUsageError(f"master_dtype={master_dtype!r} must be a floating-point torch.dtype or None")
    if max_inflight_bytes is not None and (isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 0):
        raise LinsUsageError(f"max_inflight_bytes={max_inflight_bytes!r} must be a non-negative integer or None")
    _check_model(model, mesh)
    unit_list = resolve_units(model, units)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    params = dict(model.named_parameters())
    model_dtype = next(iter(params.values())).dtype if params else torch.float32
    if master_dtype is None:
        master_dtype = torch.float32 if model_dtype in (torch.bfloat16, torch.float16) else model_dtype
    param_dtype = mp_policy.param_dtype or model_dtype
    reduce_dtype = mp_policy.reduce_dtype or torch.float32
    formats = CommFormats.parse(comm_formats)
    formats.check(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)

    # Trainable parameters keep the model's dtype until their masters are made from them
    # (LinsUnit.make_masters), frozen ones take param_dtype now.
    frozen = {p for p in params.values() if not p.requires_grad}
    with torch.no_grad():
        for p in params.values():
            if p in frozen:
                p.data = p.data.to(param_dtype)
            if plan.params == 1 and not p.is_meta and p.device != device:
                p.data = p.data.to(device)  # FSDP2 would move them; with no FSDP2, Lins does

    stream = CommStream(device)
    ctx = ShardContext(
        mesh, plan, param_dtype, reduce_dtype, master_dtype,
        float(mesh.dp_world_size if gradient_divide_factor is None else gradient_divide_factor), device,
        CommRecorder(mesh.ranks_per_node, mesh.groups.values()), stream, Executor(stream, max_inflight_bytes or 0), formats,
    )
    state = LinsState(ctx, fsdp_root=model if plan.params > 1 else None)
    ctx.executor.drain_at_exit = lambda: not state.progress.started
    unit_modules = unit_list + [model]
    names = {id(m): n for n, m in model.named_modules()}
    slices = {name: TensorParallelSlice.of(p) for name, p in params.items()}  # before FSDP2 swaps them
    claimed: set[int] = set()
    for module in unit_modules:
        backend = _make_backend(module, mesh, mp_policy, param_dtype, reduce_dtype, frozen, claimed, module is model)
        if not backend.params:
            continue
        # fully_shard swaps in new Parameter objects: look the names up afterwards.
        name_of = {id(p): n for n, p in model.named_parameters()}
        unit_names = [name_of[id(p)] for p in backend.params]
        unit = LinsUnit(
            ctx, backend, _clean_fqn(names[id(module)]) or "<root>", [_clean_fqn(n) for n in unit_names], module is model,
            [slices[n] for n in unit_names],
        )
        unit.make_masters()
        backend.attach(ctx, lambda rows, inputs, used, u=unit: state.on_gradient(u, rows, inputs, used), unit.geometry)
        module.register_forward_pre_hook(lambda m, args, u=unit: state.before_unit_forward(u), prepend=True)
        if isinstance(backend, ShardedParams):
            _gather_updated_on_unshard(module, unit)
        state.units.append(unit)
    if max_inflight_bytes is None:
        ctx.executor.max_inflight_bytes = default_max_inflight_bytes(u.buffer_bytes for u in state.units)
    model.register_forward_pre_hook(lambda m, args: state.before_root_forward(), prepend=True)
    model.register_forward_hook(lambda m, args, output: state.after_root_forward())
    setattr(model, _STATE_ATTR, state)
    _install_state_dict_hooks(model, state)
    return model


def _make_backend(
    module: nn.Module, mesh: LinsMesh, mp_policy: MixedPrecisionPolicy, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
    frozen: set, claimed: set[int], is_root: bool,
) -> ParamBackend:
    """FSDP2 where P is sharded; where it is replicated, the module's parameters as they
    are (those no earlier unit took, as FSDP2 leaves nested units' parameters to them)."""
    plan = mesh.plan
    if plan.params > 1:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=mp_policy.output_dtype, cast_forward_inputs=mp_policy.cast_forward_inputs)
        # The root keeps its parameters from forward to backward (FSDP2's default for
        # the root, None; the schedule counts no re-gather for it): its backward starts
        # right after its forward ends. It holds the tied embedding / head, if any.
        reshard = None if is_root else plan.reshard_after_forward
        fully_shard(module, mesh=mesh.param_mesh(), reshard_after_forward=reshard, mp_policy=policy, ignored_params=frozen)
        return ShardedParams(module, fsdp_unit_params(module))
    own = [p for p in module.parameters() if id(p) not in claimed and p not in frozen]
    claimed.update(id(p) for p in module.parameters())
    return ReplicatedParams(module, own, mp_policy)


def _gather_updated_on_unshard(module: FSDPModule, unit: LinsUnit) -> None:
    """A user's explicit ``module.unshard()`` (prefetching by hand ahead of forward) would
    gather P as it stands: it first waits for the unit's update, as its forward does
    (outside forward FSDP2 copies in on the caller's stream, which that wait covers, and
    the unit's all-gather streams are made to wait too)."""
    unshard = module.unshard

    def unshard_updated(async_op: bool = False) -> object:
        unit.wait_update()
        return unshard(async_op=async_op)

    module.unshard = unshard_updated


# Module wrappers that insert a level into parameter names but strip it from their
# state-dict keys (activation checkpointing's CheckpointWrapper): Lins names each
# parameter by its key in model.state_dict(). (torch.compile's "_orig_mod." stays in
# state-dict keys; torch.distributed.checkpoint.state_dict removes it itself.)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)


def _clean_fqn(name: str) -> str:
    for wrapper in _WRAPPER_PREFIXES:
        name = name.replace(wrapper, "")
    return name


def _install_state_dict_hooks(model: nn.Module, state: LinsState) -> None:
    # A tied parameter has one master under its first name; its other names (the output
    # head's weight tied to the embedding's) carry the same master in state dicts.
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(_clean_fqn(name))
    aliases = {group[0]: group[1:] for group in names.values() if len(group) > 1}

    def save_masters(module, state_dict, prefix, local_metadata):
        # Checkpoints hold the full-precision masters on the OS layout, the source of
        # truth; P is derived from them on load.
        state.wait_for_updates()
        state.materialize()
        for fqn, master in state.masters().items():
            for key in (fqn, *aliases.get(fqn, ())):
                state_dict[prefix + key] = master

    def load_masters(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        if strict:  # one line naming the first missing key, before anything is loaded
            missing = next((fqn for unit in state.units for fqn in unit.fqns if prefix + fqn not in state_dict), None)
            if missing is not None:
                raise LinsCheckpointError(f"the state dict has no entry '{prefix + missing}' (strict load): a checkpoint of another model?")
        state.wait_for_updates()
        state.materialize()  # meta masters are made before loading into them
        loaded = False
        for unit in state.units:
            loaded |= unit.load_masters(state_dict, prefix)
        if loaded:
            for unit in state.units:
                unit.start_update()
            state.wait_for_updates()
        for unit in state.units:
            for fqn, param in zip(unit.fqns, unit.params):
                for key in (fqn, *aliases.get(fqn, ())):
                    if prefix + key in state_dict:
                        state_dict[prefix + key] = param  # P already holds it: the copy is a no-op

    model.register_state_dict_post_hook(save_masters)
    model.register_load_state_dict_pre_hook(load_masters)
