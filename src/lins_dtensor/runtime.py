"""``apply_lins``: FSDP2 holds the parameters, Lins holds gradients and optimizer states.

FSDP2 (``fully_shard`` on the 1-D ``param_shard`` mesh) does what it does best: it
all-gathers each unit's parameters for forward and backward, prefetches, frees, and
reduce-scatters the gradients over the same s_p ranks. FSDP2 ties the gradient group
to the parameter group, so Lins takes over from there through FSDP2's extension
points: the all-reduce hook receives each unit's reduce-scattered fp32 gradient and
moves it into the unit's G buffer (sharded s_g ways), and the optimizer step reduces
G buffers into fp32 master weights sharded s_os ways and all-gathers the updated
values back into FSDP2's parameter shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lins_dtensor import collectives
from lins_dtensor.collectives import CommRecorder, LinsAllGather, LinsReduceScatter
from lins_dtensor.layout import ChunkLayout
from lins_dtensor.mesh import GRAD_SHARD, MESH_DIMS, OPTIM_REPLICA, OPTIM_SHARD, PARAM_SHARD, LinsMesh, mesh_shape, placements
from lins_dtensor.plan import LinsPlan, LinsPlanError
from lins_dtensor.schedule import (
    GRAD_SHARD_REDUCE_SCATTER,
    OPTIM_ALL_REDUCE,
    OPTIM_REDUCE_SCATTER,
    UPDATE_GATHER_GRAD,
    UPDATE_GATHER_OPTIM,
    CollectiveSpec,
    UnitGeometry,
    UnitSchedule,
)

_STATE_ATTR = "_lins_state"


class LinsUnit:
    """One FSDP unit's parameters in their three layouts, and the moves between them."""

    def __init__(self, module: FSDPModule, fqn_of: dict[int, str], state: "LinsState", is_root: bool) -> None:
        self.module = module
        self.state = state
        self.is_root = is_root
        # FSDP2 exposes no public list of a unit's parameters in reduce-buffer order;
        # the param group's FSDPParam list is that order.
        param_group = module._get_fsdp_state()._fsdp_param_group
        self.params: list[nn.Parameter] = [p.sharded_param for p in param_group.fsdp_params] if param_group else []
        self.fqns = [fqn_of[id(p)] for p in self.params]
        self.geometry = UnitGeometry.build([p.shape for p in self.params], state.plan, state.coords)
        self.grad_buffer = torch.zeros(self.geometry.grads.chunk_numel, dtype=state.reduce_dtype, device=state.device)
        # fp32 masters on the OS layout, twice over the same storage: as DTensors (what
        # checkpoints see) and as plain local tensors (what the optimizer steps; DTensor
        # dispatch on a 4-D mesh would only add per-op overhead to elementwise updates).
        self.masters: list[nn.Parameter] = []
        self.local_masters: list[nn.Parameter] = []
        self.grads_reduced = False  # this step's G buffer already reduced into the masters
        self._attach()

    def _attach(self) -> None:
        recorder, module = self.state.recorder, self.module
        module.set_custom_all_gather(LinsAllGather(recorder))
        module.set_custom_reduce_scatter(LinsReduceScatter(recorder))
        # Sum in the collectives (no AVG / PREMUL_SUM, which gloo lacks); Lins divides
        # once at the step, after the gradient has been summed over every rank. On a
        # one-rank group FSDP2 divides nothing by default, and setting a factor there
        # would only make it divide into a new tensor before its copy.
        if self.state.mesh.size(PARAM_SHARD) > 1:
            module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
        # Every parameter's gradient in every reduce, so the buffer layout is fixed.
        module.set_reduce_scatter_unused_params(True, recurse=False)
        module.set_all_reduce_hook(self.on_grads_reduced)
        for param in self.params:
            param.register_post_accumulate_grad_hook(_drop_grad)

    # ----- micro-batch: P-sharded gradient -> G buffer ---------------------------------
    @torch.no_grad()
    def on_grads_reduced(self, reduce_output: torch.Tensor) -> None:
        """FSDP2 all-reduce hook: add this micro-batch's gradient into the G buffer."""
        g = self.geometry
        if reduce_output.numel() != g.params.chunk_numel:
            raise RuntimeError(
                f"Lins expected a {g.params.chunk_numel}-element gradient shard from FSDP2, got "
                f"{reduce_output.numel()}; are some parameters unused without set_reduce_scatter_unused_params?"
            )
        p_rows = g.params.views(reduce_output, g.param_index)
        if g.grads.k == 1:  # G is sharded like P: accumulate in place, no staging copy
            torch._foreach_add_(g.grads.views(self.grad_buffer, 0), p_rows)
        else:
            self.grad_buffer.add_(self.state.reduce_level(g.grads, p_rows, GRAD_SHARD_REDUCE_SCATTER, GRAD_SHARD))
        self.grads_reduced = False
        if self.state.reduce_in_backward:
            # Last micro-batch: reduce to the OS layout now, in FSDP2's reduce stream,
            # so the cross-group traffic overlaps the rest of backward (paper's executor).
            self.reduce_to_masters()

    # ----- step: G buffer -> OS gradient, OS master -> P ---------------------------------
    def reduce_to_masters(self) -> None:
        """The whole G buffer (every micro-batch so far) -> the masters' gradients. Run
        again, it recomputes the same total, so extra calls cost traffic, never correctness."""
        g = self.geometry
        divide_factor = self.state.gradient_divide_factor
        g_rows = g.grads.views(self.grad_buffer, g.grad_index)
        os_grad = self.state.reduce_level(g.optim, g_rows, OPTIM_REDUCE_SCATTER, OPTIM_SHARD)
        if self.state.mesh.size(OPTIM_REPLICA) > 1:
            collectives.all_reduce(self.state.recorder, OPTIM_ALL_REDUCE, os_grad, self.state.mesh.group(OPTIM_REPLICA))
        if divide_factor != 1.0:
            os_grad.div_(divide_factor)
        for master, view, shape in zip(self.local_masters, g.optim.views(os_grad, g.optim_index), g.local_shapes("optim")):
            master.grad = view.view(shape).to(master.dtype)
        self.grads_reduced = True

    @torch.no_grad()
    def gather_from_masters(self) -> None:
        """All-gather the updated masters back into FSDP2's parameter shards."""
        g = self.geometry
        param_dtype = self.state.param_dtype
        os_rows = [m.to(param_dtype) for m in self.local_masters]
        g_rows = self.state.gather_level(g.optim, os_rows, UPDATE_GATHER_OPTIM, OPTIM_SHARD, param_dtype)
        p_rows = self.state.gather_level(g.grads, g_rows, UPDATE_GATHER_GRAD, GRAD_SHARD, param_dtype)
        for param, rows in zip(self.params, p_rows):
            local = param.to_local()
            local.copy_(rows.view(local.shape))

    @torch.no_grad()
    def load_masters(self, state_dict: dict, prefix: str) -> bool:
        """Copy checkpoint values for this unit into its masters; True if any were present."""
        found = False
        g = self.geometry
        for fqn, master, start, shape in zip(self.fqns, self.masters, g.row_starts("optim"), g.local_shapes("optim")):
            value = state_dict.get(prefix + fqn)
            if value is None:
                continue
            found = True
            if value is master:  # loaded in place, e.g. by torch.distributed.checkpoint
                continue
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if tuple(value.shape) != tuple(master.shape):
                raise LinsPlanError(f"checkpoint entry '{prefix + fqn}' has shape {tuple(value.shape)}, the model {tuple(master.shape)}")
            master.to_local().copy_(value.narrow(0, start, shape[0]))  # shared with local_masters
        return found

    @torch.no_grad()
    def init_masters(self, full_values: dict[str, torch.Tensor] | None) -> None:
        """fp32 masters on the OS layout: from the unsharded values if given, else from P."""
        g = self.geometry
        starts, local_shapes = g.row_starts("optim"), g.local_shapes("optim")
        p_starts = g.row_starts("params")
        masters, local_masters = [], []
        for fqn, param, start, shape, p_start in zip(self.fqns, self.params, starts, local_shapes, p_starts):
            if full_values is not None and fqn in full_values:
                source = full_values[fqn]
            else:
                source, start = param.to_local(), start - p_start
            local = source.detach().reshape(-1, *param.shape[1:]).narrow(0, start, shape[0]) if param.dim() else source.detach().reshape(())
            local = local.to(self.state.master_dtype, copy=True).contiguous()
            dtensor = DTensor.from_local(local, self.state.mesh.device_mesh, placements("optim"), run_check=False, shape=param.shape, stride=param.stride())
            masters.append(nn.Parameter(dtensor, requires_grad=param.requires_grad))
            local_masters.append(nn.Parameter(masters[-1].to_local(), requires_grad=param.requires_grad))
        self.masters, self.local_masters = masters, local_masters


@dataclasses.dataclass
class LinsState:
    """Everything ``apply_lins`` attaches to a model (``model._lins_state``)."""

    mesh: LinsMesh
    plan: LinsPlan
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    gradient_divide_factor: float
    device: torch.device
    recorder: CommRecorder
    units: list[LinsUnit] = dataclasses.field(default_factory=list)
    reduce_in_backward: bool = False  # see set_reduce_in_backward
    optimizer: torch.optim.Optimizer | None = None  # set by lins_optimizer

    @property
    def coords(self) -> dict[str, int]:
        return {dim: self.mesh.coordinate(dim) for dim in MESH_DIMS}

    def masters(self) -> dict[str, nn.Parameter]:
        """The fp32 masters by FQN. A model sharded on the meta device (torchtitan's way)
        gets meta masters at apply time; they are made from the parameters here, once
        those have been materialised and initialised."""
        for unit in self.units:
            if unit.masters and unit.masters[0].is_meta and not unit.params[0].is_meta:
                unit.init_masters(None)
        return {fqn: m for unit in self.units for fqn, m in zip(unit.fqns, unit.masters)}

    def schedule(self) -> list[UnitSchedule]:
        return [UnitSchedule(unit.geometry, unit.is_root) for unit in self.units]

    # ----- one level of the P -> G -> OS hierarchy --------------------------------------
    def reduce_level(self, layout: ChunkLayout, rows: list[torch.Tensor], spec: CollectiveSpec, dim: str) -> torch.Tensor:
        """Sum ``rows`` (this rank's shard at the coarser level) over ``dim``, keeping
        this rank's chunk: a reduce-scatter of the packed buffer (a copy when k=1)."""
        packed = layout.pack(rows, torch.empty(layout.total_numel, dtype=self.reduce_dtype, device=self.device))
        if layout.k == 1:
            return packed
        out = torch.empty(layout.chunk_numel, dtype=self.reduce_dtype, device=self.device)
        collectives.reduce_scatter(self.recorder, spec, out, packed, self.mesh.group(dim))
        return out

    def gather_level(self, layout: ChunkLayout, rows: list[torch.Tensor], spec: CollectiveSpec, dim: str, dtype: torch.dtype) -> list[torch.Tensor]:
        """Inverse of :meth:`reduce_level`: all-gather this rank's chunk over ``dim``."""
        if layout.k == 1:
            return rows
        index = self.mesh.coordinate(dim)
        chunk = torch.zeros(layout.chunk_numel, dtype=dtype, device=self.device)
        for view, row in zip(layout.views(chunk, index), rows):
            view.copy_(row.reshape(view.shape))
        full = torch.empty(layout.total_numel, dtype=dtype, device=self.device)
        collectives.all_gather(self.recorder, spec, full, chunk, self.mesh.group(dim))
        return layout.unpack(full)

    # ----- the optimizer step --------------------------------------------------------------
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """G buffers -> gradients of the OS masters, for units not reduced yet this step
        (clipping calls it before the step; a backward with reduce_in_backward may have
        done it already)."""
        for unit in self.units:
            if not unit.grads_reduced:
                unit.reduce_to_masters()

    @torch.no_grad()
    def finish_step(self) -> None:
        """After the optimizer: spread the new values to P, consume the gradients."""
        for unit in self.units:
            unit.gather_from_masters()
            unit.grad_buffer.zero_()
            unit.grads_reduced = False
            for master in unit.local_masters:
                master.grad = None
        self.recorder.end_step()

    def memory_bytes(self) -> dict[str, int]:
        """Persistent bytes this rank holds per state, measured on the live tensors."""
        from lins_dtensor.optimizer import optimizer_state_bytes

        params = sum(p._local_tensor.untyped_storage().nbytes() for unit in self.units for p in unit.params)
        grads = sum(unit.grad_buffer.numel() * unit.grad_buffer.element_size() for unit in self.units)
        masters = [m for unit in self.units for m in unit.local_masters]
        optim = sum(m.numel() * m.element_size() for m in masters) + optimizer_state_bytes(self.optimizer)
        return {"params": params, "grads": grads, "optim": optim}


def set_reduce_in_backward(model: nn.Module, enabled: bool) -> None:
    """Reduce gradients all the way to the optimizer layout during the following
    backward passes, unit by unit, instead of at ``optimizer.step()``.

    Turn it on for the last micro-batch of each step (always, when there is one micro-
    batch per step): the reduction across G groups then overlaps the rest of backward
    on CUDA streams, as the Lins paper's executor does. Leave it off for the other
    micro-batches, whose gradients then stay inside their G group. Results are the same
    either way.
    """
    lins_state(model).reduce_in_backward = enabled


def lins_state(model: nn.Module) -> LinsState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise LinsPlanError("this model has no Lins state: call apply_lins(model, mesh, plan) first")
    return state


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard as units, torchtitan-style: every child of the root that has
    parameters, with ``nn.ModuleList`` / ``nn.ModuleDict`` children expanded into their
    blocks. The root becomes a unit of whatever parameters are left."""
    units: list[nn.Module] = []
    for child in model.children():
        members = list(child.children()) if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
        units.extend(m for m in members if any(True for _ in m.parameters()))
    return units


def _check_model(model: nn.Module) -> None:
    if hasattr(model, _STATE_ATTR):
        raise LinsPlanError("apply_lins was already applied to this model; apply it once")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise LinsPlanError("the model is wrapped in DistributedDataParallel; pass the bare module to apply_lins")
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise LinsPlanError(f"module '{name or '<root>'}' is already sharded by FSDP; apply_lins replaces fully_shard, do not combine them")
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            raise LinsPlanError(f"parameter '{name}' is already a DTensor; Lins does not compose with tensor parallelism yet")
        if param.dim() == 0:
            raise LinsPlanError(f"parameter '{name}' is 0-dimensional; FSDP2 shards dim 0, reshape it to (1,)")


def apply_lins(
    model: nn.Module,
    mesh: LinsMesh,
    plan: LinsPlan | None = None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    gradient_divide_factor: float | None = None,
    units: Iterable[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``model`` in place under ``plan`` and return it.

    ``mp_policy.param_dtype`` is the dtype parameters are stored (P) and computed in,
    ``reduce_dtype`` the dtype gradients are reduced and accumulated in (G, default
    fp32); masters keep the model's original dtype. Gradients are averaged over all
    ranks (``gradient_divide_factor`` = world size) unless another factor is given,
    e.g. 1.0 to sum them. ``units`` are the modules to shard separately (default:
    :func:`default_units`); the model itself is always the root unit.
    """
    if not isinstance(mesh, LinsMesh):
        raise LinsPlanError("mesh must come from build_lins_mesh(plan, ...), not a plain DeviceMesh")
    plan = mesh.plan if plan is None else plan
    if plan != mesh.plan:
        raise LinsPlanError(f"the mesh was built for plan '{mesh.plan}' but apply_lins got plan '{plan}'")
    expected = mesh_shape(plan, mesh.world_size)
    if tuple(mesh.device_mesh.shape) != expected or mesh.device_mesh.mesh_dim_names != MESH_DIMS:
        raise LinsPlanError(f"mesh shape {tuple(mesh.device_mesh.shape)} does not match plan '{plan}' (expected {expected})")
    _check_model(model)
    mp_policy = mp_policy or MixedPrecisionPolicy()
    params = dict(model.named_parameters())
    master_dtype = next(iter(params.values())).dtype if params else torch.float32
    param_dtype = mp_policy.param_dtype or master_dtype
    reduce_dtype = mp_policy.reduce_dtype or torch.float32
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)

    # Keep the unsharded full-precision values (when materialised) to seed the masters
    # before the parameters are cast to the compute dtype.
    full_values = None
    if param_dtype != master_dtype and not any(p.is_meta for p in params.values()):
        full_values = {fqn: p.detach().clone() for fqn, p in params.items() if p.requires_grad}
    frozen = {p for p in params.values() if not p.requires_grad}
    with torch.no_grad():
        for p in params.values():
            p.data = p.data.to(param_dtype)

    recorder = CommRecorder(mesh.ranks_per_node)
    state = LinsState(
        mesh, plan, param_dtype, reduce_dtype, master_dtype,
        float(mesh.world_size if gradient_divide_factor is None else gradient_divide_factor), device, recorder,
    )
    fsdp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=mp_policy.output_dtype, cast_forward_inputs=mp_policy.cast_forward_inputs)
    unit_modules = list(default_units(model) if units is None else units) + [model]
    for module in unit_modules:
        fully_shard(module, mesh=mesh.param_mesh(), reshard_after_forward=plan.reshard_after_forward, mp_policy=fsdp_policy, ignored_params=frozen)
        # fully_shard swaps in new Parameter objects: look the names up afterwards.
        fqn_of = {id(p): _clean_fqn(n) for n, p in model.named_parameters()}
        unit = LinsUnit(module, fqn_of, state, is_root=module is model)
        if unit.params:
            unit.init_masters(full_values)
            state.units.append(unit)
    setattr(model, _STATE_ATTR, state)
    _install_state_dict_hooks(model, state)
    return model


# Module wrappers that insert a level into parameter names but strip it from their
# state-dict keys (activation checkpointing's CheckpointWrapper): Lins names each
# parameter by its key in model.state_dict(). (torch.compile's "_orig_mod." stays in
# state-dict keys; torch.distributed.checkpoint.state_dict removes it itself.)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)


def _clean_fqn(name: str) -> str:
    for wrapper in _WRAPPER_PREFIXES:
        name = name.replace(wrapper, "")
    return name


def _drop_grad(param: torch.Tensor) -> None:
    # The gradient already went into the G buffer (all-reduce hook, which FSDP2 runs
    # before it casts and assigns .grad); the P-sharded copy is not kept.
    param.grad = None


def _install_state_dict_hooks(model: nn.Module, state: LinsState) -> None:
    def save_masters(module, state_dict, prefix, local_metadata):
        # Checkpoints hold the full-precision masters on the OS layout, the source of
        # truth; P is derived from them on load.
        for fqn, master in state.masters().items():
            state_dict[prefix + fqn] = master

    def load_masters(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        state.masters()  # materialise meta masters before loading into them
        loaded = False
        for unit in state.units:
            loaded |= unit.load_masters(state_dict, prefix)
        if loaded:
            for unit in state.units:
                unit.gather_from_masters()
        for unit in state.units:
            for fqn, param in zip(unit.fqns, unit.params):
                if prefix + fqn in state_dict:
                    state_dict[prefix + fqn] = param

    model.register_state_dict_post_hook(save_masters)
    model.register_load_state_dict_pre_hook(load_masters)
