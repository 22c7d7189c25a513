"""One unit's parameters in their three layouts, and the chains that move them.

A unit is a group of parameters that is sharded, reduced and updated together (a
transformer block, the embedding, ...). Its P layout is held by one of two backends:

* :class:`ShardedParams` (s_p > 1): FSDP2 ``fully_shard`` on the param_shard mesh
  gathers and frees the parameters and reduce-scatters their gradients over the P
  group; its all-reduce hook hands Lins each micro-batch's P-sharded gradient.
* :class:`ReplicatedParams` (s_p = 1): plain parameters and no FSDP2, whose hooks,
  copies and casts would be pure overhead with nothing to gather. Post-accumulate-grad
  hooks collect the unit's gradients, which go on together once all have arrived (one
  bucket per unit, as DDP's reducer buckets gradients for its all-reduce).

From there on a :class:`LinsUnit` is the same for both. Every micro-batch its gradient
goes into the G buffer (reduce-scattered over grad_shard first when G is finer than
P); on the last micro-batch the G buffer goes on to the OS layout (reduce-scatter over
optim_shard, all-reduce over optim_replica), the optimizer's gradient; after the
optimizer step the updated masters are all-gathered back into P. Each of these moves
is a chain on the executor (:mod:`lins_dtensor.executor`); the collectives and copies
are those :mod:`lins_dtensor.schedule` describes.

Under tensor parallelism a parameter is a DTensor on the mesh's ``tp`` dim, and
everything above applies to this rank's TP slice of it (:class:`TensorParallelSlice`):
its shape is the geometry's, FSDP2 shards and gathers it (describing it on its
(param_shard, tp) mesh), replicated P reads it through ``to_local``; only the masters
are DTensors on the whole mesh, TP placement included.

Buffer lifetimes: the G buffer, the masters' flat buffer (the update gather's input)
and P are persistent. The OS-layout gradient lives from the reduction to the end of
the optimizer step (it is the G buffer itself when the layouts coincide). Packed
inputs and gathered outputs live inside their chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Placement

from lins_dtensor.collectives import (
    CommRecorder,
    CommStream,
    Flight,
    LinsAllGather,
    LinsReduceScatter,
    start_all_gather,
    start_all_reduce,
    start_all_to_all,
    start_reduce_scatter,
)
from lins_dtensor.compat import (
    cast_fsdp_params_,
    rearm_post_accumulate_grad_hooks,
    foreach_add_,
    foreach_copy_,
    fsdp_reduce_scatter_unused_params,
    fsdp_report_param_use,
    fsdp_unshard_async_op,
    map_floating_tensors,
)
from lins_dtensor.errors import LinsCheckpointError, LinsUsageError
from lins_dtensor.executor import Body, Chain, Executor, Request
from lins_dtensor.formats import CommFormats
from lins_dtensor.layout import ChunkLayout, chunk_rows, chunk_start
from lins_dtensor.mesh import (
    GRAD_SHARD,
    OPTIM_REPLICA,
    OPTIM_SHARD,
    TENSOR_PARALLEL,
    LinsMesh,
)
from lins_dtensor.plan import LinsPlan
from lins_dtensor.schedule import (
    GRAD_SHARD_REDUCE_SCATTER,
    LOSSY_CAPABLE,
    OPTIM_ALL_REDUCE,
    OPTIM_REDUCE_SCATTER,
    UPDATE_GATHER_GRAD,
    UPDATE_GATHER_OPTIM,
    CollectiveSpec,
    Encoded,
    UnitGeometry,
    chain_buffer_bytes,
    link_level,
    spec_format,
)

# Called with a unit's P-sharded gradient rows, the tensors they live in when the
# caller's current stream made those (autograd's gradients; a chain holds them: see
# lins_dtensor.executor) else nothing (the backend marked them for the side stream), and
# which parameters got a gradient in this backward (the others' rows are zeros).
GradientSink = Callable[[list[torch.Tensor], Sequence[torch.Tensor], Sequence[bool]], None]


@dataclasses.dataclass(frozen=True)
class TensorParallelSlice:
    """The part of a parameter this rank's TP group position holds, which Lins shards
    over the data-parallel ranks: its shape, and how TP places it (``None``: the whole
    parameter, as without TP or for a parameter that TP leaves a plain tensor)."""

    shape: torch.Size
    placement: Placement | None = None

    @classmethod
    def of(cls, param: torch.Tensor) -> "TensorParallelSlice":
        if isinstance(param, DTensor):
            return cls(param.to_local().shape, param.placements[0])
        return cls(param.shape)

    @property
    def tp_sharded(self) -> bool:
        """Whether TP ranks hold different parts (else each holds the same values)."""
        return self.placement is not None and self.placement.is_shard()

    def cut(self, whole: torch.Tensor, tp: int, index: int) -> torch.Tensor:
        """TP rank ``index``'s slice of the whole parameter, cut as DTensor's ``Shard``
        cuts it (torch.chunk geometry, the last slices possibly short or empty)."""
        if not self.tp_sharded:
            return whole
        dim = self.placement.dim % whole.dim()
        size = whole.size(dim)
        return whole.narrow(dim, chunk_start(size, tp, index), chunk_rows(size, tp, index))


def local_values(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's values on this rank: a DTensor's (TP's or FSDP2's) local part."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclasses.dataclass
class ShardContext:
    """What every unit of one model shares: plan, mesh, dtypes and the communication."""

    mesh: LinsMesh
    plan: LinsPlan
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    gradient_divide_factor: float
    device: torch.device
    recorder: CommRecorder
    stream: CommStream
    executor: Executor
    formats: CommFormats = CommFormats()  # the wire format of each kind of collective per link level

    def __post_init__(self) -> None:
        self.coords = {dim: self.mesh.coordinate(dim) for dim in self.mesh.device_mesh.mesh_dim_names}
        self.replicas = self.mesh.size(OPTIM_REPLICA)

    def group(self, dim: str):
        return self.mesh.group(dim)

    def empty(self, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype or self.reduce_dtype, device=self.device)

    def encoded(self, spec: CollectiveSpec, layout: ChunkLayout) -> Encoded | None:
        """How a collective of ``spec`` over ``layout`` runs in its lossy wire format, or
        None when it runs exact (the format of its group's link level; no collective
        for a group of one)."""
        if not self.formats.lossy or self.mesh.size(spec.mesh_dim) == 1:
            return None
        fmt = spec_format(spec, self.formats, link_level(self.mesh.nodes_spanned(spec.mesh_dim)))
        exact = self.param_dtype if spec.dtype == "param" else self.reduce_dtype
        return Encoded.of(spec, fmt, self.mesh.size(spec.mesh_dim), layout, exact.itemsize)


# ----- P backends ------------------------------------------------------------------------
class ParamBackend(Protocol):
    """What a :class:`LinsUnit` asks of the holder of its P layout (:class:`ShardedParams`
    or :class:`ReplicatedParams`): the unit's parameters, their gradients handed to a
    sink, and the hooks the unit calls around steps and forwards. ("Param": not a
    process-group backend such as gloo or NCCL.)"""

    module: nn.Module
    params: list[nn.Parameter]

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's part of each parameter (P), which the update gather writes in place."""

    def attach(self, ctx: ShardContext, sink: GradientSink, geometry: UnitGeometry) -> None:
        """Start handing each backward's P-sharded gradient rows to ``sink``."""

    def refresh(self) -> None:
        """Follow parameters the model replaced (``to_empty``, ``load_state_dict(assign=True)``)."""

    def cast_(self, dtype: torch.dtype) -> None:
        """Store the parameters in ``dtype`` (``param_dtype``), once the masters hold their values."""

    def before_forward(self, updated: object) -> None:
        """Make the streams that read P wait for the update event ``updated``."""

    def end_backward(self, forward_ran: bool = False) -> None:
        """At the end of a backward: hand over what it left unsent (parameters without a
        gradient), for a unit whose forward ran in it (``forward_ran``) even if none has one."""

    def reset(self) -> None:
        """Drop what a backward that did not finish (it raised) left half-collected."""

    def memory_bytes(self) -> int:
        """Persistent bytes of this rank's P."""


class ShardedParams:
    """P sharded s_p ways by FSDP2 ``fully_shard`` on the param_shard mesh."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        self.module = module
        self.params = params
        self._stream: CommStream | None = None  # set by attach
        self._used: list[bool] = [True] * len(params)  # reported by FSDP2's post-backward, read in its reduce

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's rows of each parameter, written in place by the update."""
        return [p.to_local() for p in self.params]

    def attach(self, ctx: ShardContext, sink: GradientSink, geometry: UnitGeometry) -> None:
        module = self.module
        self._stream = ctx.stream
        module.set_custom_all_gather(LinsAllGather(ctx.recorder, ctx.formats))
        module.set_custom_reduce_scatter(LinsReduceScatter(ctx.recorder))
        # Sum in the collectives (no AVG / PREMUL_SUM, which gloo lacks); Lins divides
        # once at the step, after the gradient has been summed over the data-parallel ranks.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
        # Every parameter's gradient in every reduce, so the buffer layout is fixed; which
        # of them were zeros for want of a gradient is reported first.
        fsdp_reduce_scatter_unused_params(module)
        fsdp_report_param_use(module, self._report_use)

        def on_reduced(reduce_output: torch.Tensor) -> None:
            # FSDP2 runs this on its all-reduce stream with the P-sharded gradient it
            # allocated on its reduce-scatter stream. It would keep that buffer alive
            # through the parameters' .grad views, which Lins drops: mark it used here
            # and on the side stream (its stream is FSDP2's, so no Lins stream can be
            # made to wait before it is reused, as for autograd's gradients).
            if reduce_output.numel() != geometry.params.chunk_numel:
                raise RuntimeError(
                    f"lins: expected a {geometry.params.chunk_numel}-element gradient shard from FSDP2, got "
                    f"{reduce_output.numel()}; are some parameters unused without set_reduce_scatter_unused_params?"
                )
            ctx.stream.use_on_current(reduce_output)
            ctx.stream.use_on_side(reduce_output)
            sink(geometry.params.views(reduce_output, geometry.param_index), (), self._used)

        module.set_all_reduce_hook(on_reduced)
        for param in self.params:
            param.register_post_accumulate_grad_hook(_drop_grad)

    def _report_use(self, used: list[bool]) -> None:
        self._used = used

    def refresh(self) -> None:
        """FSDP2 keeps its sharded parameters itself (across to_empty too)."""

    def cast_(self, dtype: torch.dtype) -> None:
        cast_fsdp_params_(self.module, self.params, dtype)

    def before_forward(self, updated: object) -> None:
        """FSDP2's all-gather streams must see the update Lins wrote (accelerators)."""
        self._stream.fsdp_waits(self.module, updated)

    def gathers_on_current_stream(self) -> bool:
        """Whether FSDP2 copies in and all-gathers on the caller's stream (its
        asynchronous unshard) rather than on its own streams."""
        return fsdp_unshard_async_op(self.module)

    def end_backward(self, forward_ran: bool = False) -> None:
        """FSDP2 reduces every unit whose forward ran (zeros for parameters without a
        gradient); nothing is left over."""

    def reset(self) -> None:
        """FSDP2 recovers from a step that raised as a whole, at its root (LinsState)."""

    def memory_bytes(self) -> int:
        return sum(p.to_local().untyped_storage().nbytes() for p in self.params)


class ReplicatedParams:
    """P replicated (s_p = 1): the model's own parameters, no FSDP2."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], mp_policy: MixedPrecisionPolicy) -> None:
        self.module = module
        self.params = params
        # Where the model keeps each parameter (module, attribute), to follow it when the
        # model swaps in a new Parameter (to_empty after meta-device init does).
        where = {id(p): (m, name) for m in reversed(list(module.modules())) for name, p in m._parameters.items() if p is not None}
        self._slots = [where[id(p)] for p in params]
        # This backward's gradients so far (autograd's), how many have arrived, and
        # whether a bucket went on in this backward.
        self._pending: list[torch.Tensor | None] = [None] * len(params)
        self._arrived = 0
        self._sent = False
        self._sink: GradientSink | None = None
        self._rows: list[tuple[int, int]] = []
        self._install_casts(module, mp_policy)

    def local_shards(self) -> list[torch.Tensor]:
        return [local_values(p.detach()) for p in self.params]

    def attach(self, ctx: ShardContext, sink: GradientSink, geometry: UnitGeometry) -> None:
        self._sink = sink
        self._rows = list(zip(geometry.params.rows, geometry.params.row_numels))
        self._hook(range(len(self.params)))

    def _hook(self, indices) -> None:
        for index in indices:
            self.params[index].register_post_accumulate_grad_hook(lambda p, i=index: self._arrive(i, p))

    def refresh(self) -> None:
        """Follow parameters the model has replaced, and keep the gradient hooks armed.

        A replaced Parameter (``load_state_dict(assign=True)``, ``to_empty`` on plain
        tensors) is hooked anew. ``to_empty`` on a DTensor (TP) parameter swaps its
        contents in place (``torch.utils.swap_tensors``), which keeps the hooks on the
        object but disconnects them from autograd: every kept parameter's hooks are
        re-armed (no-op when nothing was swapped)."""
        replaced = [i for i, ((m, name), p) in enumerate(zip(self._slots, self.params)) if m._parameters.get(name) is not p]
        for i in replaced:
            m, name = self._slots[i]
            new = m._parameters[name]
            if new.shape != self.params[i].shape or new.dtype != self.params[i].dtype or type(new) is not type(self.params[i]):
                raise LinsUsageError(
                    f"parameter '{name}' of {type(m).__name__} was replaced by a {type(new).__name__} of shape {tuple(new.shape)} "
                    f"and dtype {new.dtype}, Lins holds a {type(self.params[i]).__name__} of {tuple(self.params[i].shape)} "
                    f"{self.params[i].dtype}; replace values in place"
                )
            self.params[i] = new
        if self._sink is None:
            return
        self._hook(replaced)
        for i, param in enumerate(self.params):
            if i not in replaced:
                rearm_post_accumulate_grad_hooks(param)

    @torch.no_grad()
    def cast_(self, dtype: torch.dtype) -> None:
        for param in self.params:
            if isinstance(param, DTensor):
                # ``param.data = ...`` would retype the DTensor but not its local tensor.
                local = param.to_local().to(dtype)
                cast = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                          stride=param.stride())
                torch.utils.swap_tensors(param, nn.Parameter(cast, requires_grad=param.requires_grad))
                rearm_post_accumulate_grad_hooks(param)  # hooked already when cast after to_empty
            else:
                param.data = param.data.to(dtype)

    def _arrive(self, index: int, param: nn.Parameter) -> None:
        # autograd's gradient, taken as it is (no copy); the parameter keeps none.
        grad, param.grad = param.grad, None
        if isinstance(grad, DTensor):
            # A TP parameter's gradient in its own layout: a replicated one (a
            # sequence-parallel norm's weight) arrives Partial over the TP group and is
            # summed there first, as FSDP2 does for the parameters it shards.
            grad = grad.redistribute(placements=param.placements).to_local()
        if self._pending[index] is None:
            self._arrived += 1
            self._pending[index] = grad
        else:  # a second gradient for it in the same backward (a reentrant backward)
            self._pending[index] = self._pending[index] + grad
        if self._arrived == len(self.params):
            self._release()

    def end_backward(self, forward_ran: bool = False) -> None:
        """Send a bucket that some parameters never reached in this backward (unused
        parameters): their gradient is zero. Also when none did but the unit's forward
        ran: the other ranks, whose parameters may have a gradient, reduce the bucket
        (as FSDP2 reduces every unit whose forward ran)."""
        if self._arrived or (forward_ran and not self._sent):
            used = [g is not None for g in self._pending]
            for index, param in enumerate(self.params):
                if self._pending[index] is None:
                    self._pending[index] = torch.zeros_like(local_values(param.detach()))
            self._release(used)
        self._sent = False

    def _release(self, used: Sequence[bool] | None = None) -> None:
        rows = [g.reshape(r, n) for g, (r, n) in zip(self._pending, self._rows)]
        inputs = tuple(self._pending)  # autograd's gradients, made on the current stream
        self.reset()
        self._sent = True
        self._sink(rows, inputs, [True] * len(self.params) if used is None else used)

    def reset(self) -> None:
        """Drop the gradients of a backward that did not finish (it raised)."""
        self._pending = [None] * len(self.params)
        self._arrived = 0
        self._sent = False

    def before_forward(self, updated: object) -> None:
        """Parameters are read on the current stream, which the executor made wait."""

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.local_shards())

    @staticmethod
    def _install_casts(module: nn.Module, mp: MixedPrecisionPolicy) -> None:
        """The input and output casts FSDP2 would apply under ``mp`` (its other job,
        storing and computing in ``param_dtype``, the parameters already do)."""
        if mp.cast_forward_inputs and mp.param_dtype is not None:
            dtype = mp.param_dtype
            module.register_forward_pre_hook(
                lambda m, args, kwargs: map_floating_tensors(lambda t: t.to(dtype), (args, kwargs)), with_kwargs=True
            )
        if mp.output_dtype is not None:
            out_dtype = mp.output_dtype
            module.register_forward_hook(lambda m, args, output: map_floating_tensors(lambda t: t.to(out_dtype), output))


def _drop_grad(param: torch.Tensor) -> None:
    # FSDP2 ran the all-reduce hook, which took the gradient into the G buffer, before
    # it assigned .grad; the P-sharded copy is not kept.
    param.grad = None



@dataclasses.dataclass
class StepGradient:
    """A unit's gradient in the running optimizer step, from its first micro-batch to
    the end of ``optimizer.step()``. :meth:`reset` ends it: after the step, or after a
    step that raised (once nothing of it is in flight).

    The wait rule: the fields marked (chain) are written by chain bodies, which the
    executor runs after their submission, possibly much later; read or write them only
    after ``executor.wait(chain)``."""

    used: list[bool]  # which parameters got a gradient on this rank in this step
    g_has_data: bool = False  # (chain) the G buffer holds gradient not yet reduced to the OS layout
    os_grad: torch.Tensor | None = None  # (chain) the reduced OS-layout gradient, summed over the ranks
    os_grad_is_g: bool = False  # (chain) ... which is the G buffer itself
    chain: Chain | None = None  # the last chain that reads or writes the G buffer or os_grad
    grads_ready: bool = False  # divided and handed to the masters' .grad

    def reset(self) -> None:
        self.used = [False] * len(self.used)
        self.g_has_data = self.os_grad_is_g = self.grads_ready = False
        self.os_grad = self.chain = None


# ----- the unit ----------------------------------------------------------------------------
class LinsUnit:
    """One unit's P (through its backend), G buffer and masters (``master_dtype``), and the chains
    that move its gradient to the OS layout and its update back to P."""

    def __init__(
        self, ctx: ShardContext, backend: ParamBackend, name: str, fqns: list[str], is_root: bool, slices: list[TensorParallelSlice]
    ) -> None:
        self.ctx = ctx
        self.backend = backend
        self.params = backend.params
        self.name = name
        self.fqns = fqns
        self.is_root = is_root
        self.slices = slices  # what of each parameter this rank's TP position holds
        self.geometry = UnitGeometry.build([s.shape for s in slices], ctx.plan, ctx.coords)
        g = self.geometry
        # Lins' collectives that run in a lossy wire format, by spec name (None: exact).
        self.encoded = {spec.name: ctx.encoded(spec, g.layout(spec.layout)) for spec in LOSSY_CAPABLE}
        self.buffer_bytes = chain_buffer_bytes(
            g, param_bytes=ctx.param_dtype.itemsize, reduce_bytes=ctx.reduce_dtype.itemsize, master_bytes=ctx.master_dtype.itemsize,
            encoded=[e for e in self.encoded.values() if e is not None],
        )
        # Error-feedback residuals (fp32) of the lossy gradient reductions, by spec name:
        # what this rank's encoding lost, added to its next input. Persistent from the
        # first use; zeroed after a step that raised (reset_feedback).
        self.residuals: dict[str, list[torch.Tensor]] = {}
        self.grad_buffer = torch.zeros(g.grads.chunk_numel, dtype=ctx.reduce_dtype, device=ctx.device)
        # Masters (master_dtype) on the OS layout: one flat buffer (the update gather's input),
        # seen as DTensors (what checkpoints hold) and as plain local tensors (what the
        # optimizer steps; DTensor dispatch on a 4- or 5-D mesh would only add per-op
        # overhead to elementwise updates), all views of the same storage.
        self.master_flat: torch.Tensor | None = None
        self.masters: list[nn.Parameter] = []
        self.local_masters: list[nn.Parameter] = []
        self.grad_state = StepGradient([False] * len(self.params))
        self.update: Chain | None = None  # the gather of the last optimizer step's values into P

    # ----- every micro-batch: P-sharded gradient -> G buffer (-> OS layout) ----------------
    @torch.no_grad()
    def accumulate(self, p_rows: list[torch.Tensor], sync: bool, inputs: Sequence[torch.Tensor] = (),
                   used: Sequence[bool] | None = None) -> None:
        """Add one micro-batch's gradient (this rank's P rows, any float dtype) into the
        G buffer; with ``sync`` (the step's last micro-batch) go on to the OS layout.
        ``inputs`` and ``used``: as :data:`GradientSink` has them (default: all used)."""
        ctx, g, state = self.ctx, self.geometry, self.grad_state
        state.used = [a or b for a, b in zip(state.used, [True] * len(self.params) if used is None else used)]
        ctx.executor.wait(state.chain)
        if state.os_grad_is_g:
            # More micro-batches after this step's reduction (more than announced): the
            # reduced gradient moves out of the G buffer, and a second reduction adds to it.
            state.os_grad, state.os_grad_is_g = state.os_grad.clone(), False
        if g.grads.k == 1:
            views = g.grads.views(self.grad_buffer, 0)
            (foreach_add_ if state.g_has_data else foreach_copy_)(views, p_rows)
            state.g_has_data = True
            if sync:
                self.start_reduction()
            return
        dims = (GRAD_SHARD, *self._reduction_dims()) if sync else (GRAD_SHARD,)
        held = self.buffer_bytes["grads"] + (self.buffer_bytes["optim"] if sync else 0)
        body = self._grad_body(p_rows, sync, ctx.recorder.step)
        state.chain = ctx.executor.submit(Chain(f"{self.name}:grads", dims, body, held, inputs=inputs))

    def _grad_body(self, p_rows: list[torch.Tensor], sync: bool, step: int) -> Body:
        ctx, g = self.ctx, self.geometry
        packed = g.grads.pack(p_rows, ctx.empty(g.grads.total_numel))
        del p_rows  # the chain holds what they live in until its input stream may reuse it
        first = not self.grad_state.g_has_data
        out = self.grad_buffer if first else ctx.empty(g.grads.chunk_numel)
        self.grad_state.g_has_data = True
        yield from self._reduce_scatter(GRAD_SHARD_REDUCE_SCATTER, step, out, packed)
        del packed
        if not first:
            self.grad_buffer.add_(out)
        if sync:
            yield from self._reduction_body(step)

    def _reduction_dims(self) -> tuple[str, ...]:
        """The dims of the reduction's collectives, in order (an encoded all-reduce is two)."""
        replica = (OPTIM_REPLICA,) * (1 if self.encoded[OPTIM_ALL_REDUCE.name] is None else 2)
        return (OPTIM_SHARD,) * (self.geometry.optim.k > 1) + replica * (self.ctx.replicas > 1)

    def start_reduction(self) -> None:
        """The G buffer -> the OS layout, summed over the data-parallel ranks (asynchronously)."""
        self.ctx.executor.wait(self.grad_state.chain)
        if not self.grad_state.g_has_data:
            return
        dims = self._reduction_dims()
        if dims:
            body = self._reduction_body(self.ctx.recorder.step)
            self.grad_state.chain = self.ctx.executor.submit(Chain(f"{self.name}:optim", dims, body, self.buffer_bytes["optim"]))
        else:
            _run_local(self._reduction_body(self.ctx.recorder.step))

    def _reduction_body(self, step: int) -> Body:
        ctx, g, state = self.ctx, self.geometry, self.grad_state
        g_rows = g.grads.views(self.grad_buffer, g.grad_index)
        state.g_has_data = False
        out_is_g = False
        if g.optim.k > 1:
            packed = g.optim.pack(g_rows, ctx.empty(g.optim.total_numel))
            out = ctx.empty(g.optim.chunk_numel)
            yield from self._reduce_scatter(OPTIM_REDUCE_SCATTER, step, out, packed)
            del packed
        elif g.os_is_g_chunk and state.os_grad is None:
            out, out_is_g = self.grad_buffer, True
        else:
            # (zeros: an encoded all-reduce scales blocks by their largest value, padding included)
            out = g.optim.pack(g_rows, (ctx.empty if self.encoded[OPTIM_ALL_REDUCE.name] is None else self._zeros)(g.optim.chunk_numel))
        if ctx.replicas > 1:
            encoded = self.encoded[OPTIM_ALL_REDUCE.name]
            if encoded is None:
                yield _request(ctx, OPTIM_ALL_REDUCE, step, start_all_reduce, out)
            else:
                yield from self._encoded_all_reduce(encoded, step, out)
        if state.os_grad is None:
            state.os_grad, state.os_grad_is_g = out, out_is_g
        else:
            state.os_grad.add_(out)

    # ----- collectives in a lossy wire format (schedule.Encoded) ------------------------------
    def _zeros(self, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype or self.ctx.reduce_dtype, device=self.ctx.device)

    def _residuals(self, encoded: Encoded) -> list[torch.Tensor]:
        """This collective's error-feedback residuals (fp32, zero at first use)."""
        name = encoded.spec.name
        if name not in self.residuals:
            self.residuals[name] = [self._zeros(n, torch.float32) for n in encoded.residual_numels]
        return self.residuals[name]

    def reset_feedback(self) -> None:
        """Zero the error-feedback residuals: a step that raised may have folded part of
        its gradient into them (the compensation of earlier steps is dropped with it)."""
        for residuals in self.residuals.values():
            for residual in residuals:
                residual.zero_()

    def _encode(self, encoded: Encoded, values: torch.Tensor, chunks: int, residual: torch.Tensor | None) -> torch.Tensor:
        """``values`` (``chunks`` rows) in the wire format; with a residual, error feedback:
        the residual is added first and then holds what the encoding lost."""
        if residual is not None:
            values = residual.add_(values)
        sent = encoded.fmt.encode(values, chunks, self.ctx.empty(chunks * encoded.chunk_bytes, torch.uint8))
        if residual is not None:
            residual.sub_(encoded.fmt.decode(sent, chunks, encoded.chunk_numel).reshape(-1))
        return sent

    def _reduce_scatter(self, spec: CollectiveSpec, step: int, out: torch.Tensor, packed: torch.Tensor) -> Body:
        """``out`` = this rank's chunk of ``packed`` summed over the group of ``spec``:
        a reduce-scatter, or in a lossy format an all-to-all of the encoded chunks and a
        sum of the decoded rows in fp32."""
        encoded = self.encoded[spec.name]
        if encoded is None:
            yield _request(self.ctx, spec, step, start_reduce_scatter, out, packed)
            return
        residual = self._residuals(encoded)[0] if encoded.feedback else None
        sent = self._encode(encoded, packed, encoded.chunks, residual)
        received = torch.empty_like(sent)
        yield _request(self.ctx, spec, step, start_all_to_all, received, sent, **_wire(encoded))
        out.copy_(encoded.fmt.decode(received, encoded.chunks, encoded.chunk_numel).sum(dim=0))

    def _encoded_all_reduce(self, encoded: Encoded, step: int, tensor: torch.Tensor) -> Body:
        """``tensor`` summed over the group in a lossy format: each rank sums one slice
        (all-to-all, fp32 sum), encodes its sum, and every rank, itself included, takes
        the decoded sums of the all-gather, so that every replica holds the same values."""
        ctx, fmt, chunks, numel = self.ctx, encoded.fmt, encoded.chunks, encoded.chunk_numel
        spec = encoded.spec
        residuals = self._residuals(encoded) if encoded.feedback else [None, None]
        values = self._zeros(chunks * numel, torch.float32)
        values[: tensor.numel()].copy_(tensor)
        sent = self._encode(encoded, values, chunks, residuals[0])
        received = torch.empty_like(sent)
        yield _request(ctx, spec, step, start_all_to_all, received, sent, **_wire(encoded))
        own = self._encode(encoded, fmt.decode(received, chunks, numel).sum(dim=0), 1, residuals[1])
        gathered = ctx.empty(chunks * encoded.chunk_bytes, torch.uint8)
        yield _request(ctx, spec, step, start_all_gather, gathered, own, **_wire(encoded))
        tensor.copy_(fmt.decode(gathered, chunks, numel).reshape(-1)[: tensor.numel()])

    def _gather(self, spec: CollectiveSpec, step: int, out: torch.Tensor, chunk: torch.Tensor) -> Body:
        """All-gather every rank's ``chunk`` into ``out``; in a lossy format every rank,
        the chunk's owner included, takes the decoded values."""
        encoded = self.encoded[spec.name]
        if encoded is None:
            yield _request(self.ctx, spec, step, start_all_gather, out, chunk)
            return
        own = self._encode(encoded, chunk, 1, None)
        gathered = self.ctx.empty(encoded.message_bytes, torch.uint8)
        yield _request(self.ctx, spec, step, start_all_gather, gathered, own, **_wire(encoded))
        out.view(encoded.chunks, -1).copy_(encoded.fmt.decode(gathered, encoded.chunks, encoded.chunk_numel))

    # ----- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def finalize_grads(self, used_anywhere: Sequence[bool]) -> None:
        """Wait for this step's reduction and hand the masters their gradients: those of
        parameters that took part on some rank (``used_anywhere``); the others keep
        ``grad`` None, so that the optimizer leaves them as torch.optim does."""
        state = self.grad_state
        if state.grads_ready:
            return
        ctx, g = self.ctx, self.geometry
        ctx.executor.wait(state.chain)
        state.grads_ready = True
        if state.os_grad is None:  # no gradient reached this unit in this step
            return
        ctx.stream.use_on_current(state.os_grad)
        if ctx.gradient_divide_factor != 1.0:
            state.os_grad.div_(ctx.gradient_divide_factor)
        views = g.grads.views(state.os_grad, g.grad_index) if state.os_grad_is_g else g.optim.views(state.os_grad, g.optim_index)
        for master, view, shape, used in zip(self.local_masters, views, g.local_shapes("optim"), used_anywhere):
            if used:
                grad = view.view(shape)
                master.grad = grad if grad.dtype == master.dtype else grad.to(master.dtype)

    def end_step(self) -> None:
        """After the optimizer, or instead of it after a step that raised (nothing of
        the step in flight any more): the step's gradient is gone."""
        for master in self.local_masters:
            master.grad = None
        self.grad_state.reset()
        self.backend.reset()

    # ----- after the step: masters -> P ---------------------------------------------------------
    def _update_dims(self) -> tuple[str, ...]:
        g = self.geometry
        return tuple(dim for dim, k in ((OPTIM_SHARD, g.optim.k), (GRAD_SHARD, g.grads.k)) if k > 1)

    @torch.no_grad()
    def start_update(self) -> None:
        """All-gather the updated masters back into P (asynchronously; the unit's next
        forward waits for it)."""
        self.ctx.executor.wait(self.update)
        dims = self._update_dims()
        if dims:
            body = self._update_body(self.ctx.recorder.step)
            self.update = self.ctx.executor.submit(Chain(f"{self.name}:update", dims, body, self.buffer_bytes["update"]))
        else:
            _run_local(self._update_body(self.ctx.recorder.step))
            self.update = None

    def _update_body(self, step: int) -> Body:
        ctx, g = self.ctx, self.geometry
        dtype = ctx.param_dtype
        lossy = self.encoded[UPDATE_GATHER_OPTIM.name] is not None, self.encoded[UPDATE_GATHER_GRAD.name] is not None
        # A lossy gather encodes the masters themselves (no rounding to param_dtype first).
        src = self.master_flat if dtype == self.master_flat.dtype or lossy[0] else self.master_flat.to(dtype)
        p_dests = self.backend.local_shards()
        if g.optim.k > 1:
            gathered = ctx.empty(g.optim.total_numel, dtype)
            yield from self._gather(UPDATE_GATHER_OPTIM, step, gathered, src)
        if g.grads.k > 1:
            if g.os_is_g_chunk:
                chunk = self.master_flat if lossy[1] else src
            else:
                # (zeros: a lossy gather scales blocks by their largest value, padding included)
                chunk = (self._zeros if lossy[1] else ctx.empty)(g.grads.chunk_numel, dtype)
                dests = g.grads.views(chunk, g.grad_index)
                if g.optim.k > 1:
                    g.optim.unpack_into(gathered, dests)
                    del gathered
                else:
                    foreach_copy_(dests, g.optim.views(src, g.optim_index))
            full = ctx.empty(g.grads.total_numel, dtype)
            yield from self._gather(UPDATE_GATHER_GRAD, step, full, chunk)
            g.grads.unpack_into(full, p_dests)
        elif g.optim.k > 1:
            g.optim.unpack_into(gathered, p_dests)
        else:
            rows = g.optim.views(src, g.optim_index)
            foreach_copy_([d.view(r.shape) for d, r in zip(p_dests, rows)], rows)

    def update_pending(self) -> bool:
        """Whether P has not yet been made to wait for the last step's values."""
        return self.update is not None

    def wait_update(self) -> None:
        """Make the caller wait until P holds the last optimizer step's values."""
        if self.update is not None:
            self.ctx.executor.wait(self.update)
            self.backend.before_forward(self.update.end_event)
            self.update = None

    def before_prefetch(self) -> None:
        """FSDP2 is about to gather P from another unit's pre-forward (forward prefetch).
        On an accelerator only the streams that gather wait for the update (FSDP2's
        all-gather streams, or the current stream when it gathers asynchronously on it);
        the update stays pending, so this unit's own forward still makes its compute wait
        there, not earlier. On CPU the host waits."""
        if self.update is None:
            return
        if self.ctx.stream.on_device and not self.backend.gathers_on_current_stream():
            self.backend.before_forward(self.update.end_event)
        else:
            self.wait_update()

    # ----- masters ----------------------------------------------------------------------------------
    @torch.no_grad()
    def make_masters(self) -> None:
        """Masters on the OS layout from P's values, then P stored in ``param_dtype``.

        P keeps the model's own dtype until here, so the masters hold exactly what the
        model was built or initialised with (not its bf16 rounding). A model still on the
        meta device gets meta masters; :meth:`materialize` makes them once it is not."""
        ctx, g = self.ctx, self.geometry
        meta = any(p.is_meta for p in self.params)
        flat = torch.zeros(g.optim.chunk_numel, dtype=ctx.master_dtype, device="meta" if meta else ctx.device)
        views = g.optim.views(flat, g.optim_index)
        masters, local_masters = [], []
        shards = self.backend.local_shards()
        for param, tp_slice, shard, view, start, shape, p_start in zip(
            self.params, self.slices, shards, views, g.row_starts("optim"), g.local_shapes("optim"), g.row_starts("params")
        ):
            # P's group nests in the OS group: this rank's OS rows lie inside its P rows.
            if not meta:
                view.copy_(shard.detach().reshape(-1, *shape[1:]).narrow(0, start - p_start, shape[0]).reshape(view.shape))
            local = view.view(shape)
            mesh, layout = ctx.mesh.device_mesh, ctx.mesh.placements("optim", tp_slice.placement)
            dtensor = DTensor.from_local(local, mesh, layout, run_check=False, shape=param.shape, stride=param.stride())
            masters.append(nn.Parameter(dtensor, requires_grad=param.requires_grad))
            local_masters.append(nn.Parameter(local, requires_grad=param.requires_grad))
        self.master_flat, self.masters, self.local_masters = flat, masters, local_masters
        if not meta:
            self.backend.cast_(ctx.param_dtype)

    def materialize(self) -> None:
        """Make the masters of a model that was sharded on the meta device, once its
        parameters have been materialised and initialised (torchtitan's to_empty and
        init_weights); nothing otherwise."""
        self.backend.refresh()
        if self.masters[0].is_meta and not any(p.is_meta for p in self.params):
            self.make_masters()

    @torch.no_grad()
    def load_masters(self, state_dict: dict, prefix: str) -> bool:
        """Copy checkpoint values for this unit into its masters; True if any were present."""
        found = False
        g, mesh = self.geometry, self.ctx.mesh
        tp_index = self.ctx.coords.get(TENSOR_PARALLEL, 0)
        for fqn, master, tp_slice, start, shape in zip(self.fqns, self.masters, self.slices, g.row_starts("optim"), g.local_shapes("optim")):
            value = state_dict.get(prefix + fqn)
            if value is None:
                continue
            found = True
            if value is master:  # loaded in place, e.g. by torch.distributed.checkpoint
                continue
            if tuple(value.shape) != tuple(master.shape):  # before any collective (full_tensor)
                raise LinsCheckpointError(
                    f"checkpoint entry '{prefix + fqn}' has shape {tuple(value.shape)}, the model's parameter "
                    f"{tuple(master.shape)}: a checkpoint of another model?"
                )
            if isinstance(value, DTensor):
                value = value.full_tensor()
            # Each rank cuts its own shard out of the whole value where it lies (no
            # communication); only the shard moves to the device.
            rows = tp_slice.cut(value, mesh.tp, tp_index).narrow(0, start, shape[0])
            master.to_local().copy_(rows)  # shared with local_masters
        return found

    def memory_bytes(self) -> dict[str, int]:
        """Persistent bytes of this unit's P, G and masters (optimizer states apart), and
        its error-feedback residuals once made ("feedback")."""
        masters = 0 if self.master_flat is None else self.master_flat.numel() * self.master_flat.element_size()
        out = {"params": self.backend.memory_bytes(), "grads": self.grad_buffer.numel() * self.grad_buffer.element_size(), "optim": masters}
        if self.residuals:
            out["feedback"] = sum(r.numel() * r.element_size() for residuals in self.residuals.values() for r in residuals)
        return out


def _request(ctx: ShardContext, spec: CollectiveSpec, step: int, start: Callable[..., Flight], *tensors: torch.Tensor, **kwargs) -> Request:
    """A chain's request for one collective of ``spec``, on the mesh dim the spec names."""
    return Request(spec.mesh_dim, lambda: start(ctx.recorder, ctx.stream, spec, *tensors, ctx.group(spec.mesh_dim), step, **kwargs))



def _wire(encoded: Encoded) -> dict:
    """How an encoded collective is recorded: its format, and the bytes it stands for."""
    return {"fmt": encoded.fmt.name, "exact_bytes": encoded.exact_message_bytes}


def _run_local(body: Body) -> None:
    """Run a chain body that issues no collective (its levels are all one rank wide)."""
    for request in body:
        raise RuntimeError(f"lins: a local-only move asked for a collective on {request.dim}")

