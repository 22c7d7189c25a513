"""N data-parallel ranks of one plan simulated in one process, to test a LinsUnit's
chains without forking.

Each simulated rank has its own :class:`~lins_dtensor.units.LinsUnit`,
:class:`~lins_dtensor.units.ShardContext` and :class:`~lins_dtensor.executor.Executor`,
exactly as ``apply_lins`` builds them; only the mesh and the four ``start_*``
collectives are stand-ins (:meth:`SimWorld.install` patches them into
:mod:`lins_dtensor.units`). A collective completes once every member of its group has
issued it, and then computes what gloo would (sum, scatter, gather) over the members'
tensors, so the chains run their real packing, reduce-scatters, all-reduces and
all-gathers over real group geometry (uneven and empty chunks included). Each rank's
executor advances its chains as on a real rank; a rank blocked on a collective drives
the other ranks' executors (one thread, cooperatively) until its peers have issued it,
and a wait that no peer can satisfy raises instead of hanging. Every completed
collective is checked to be the same spec on every member, i.e. the executor's
issue-order rule.

P sharded over several ranks (s_p > 1) is FSDP2's job at run time, which cannot run
over simulated ranks; :class:`RowShards` stands in for it with this rank's rows of
each parameter (FSDP2's local shard), so the unit's own code is the same for every
plan. With s_p = 1 the real :class:`~lins_dtensor.units.ReplicatedParams` is used.

The masters are DTensors, which need a DeviceMesh: :func:`world1_device_mesh` makes
a world-1 gloo group in this process and a mesh with Lins' dims, each one rank wide,
which only labels them (no collective ever runs on it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Placement

from lins_dtensor import units
from lins_dtensor.collectives import CommRecorder, CommStream, CommTiming
from lins_dtensor.executor import Executor
from lins_dtensor.formats import CommFormats
from lins_dtensor.layout import chunk_rows, chunk_start
from lins_dtensor.mesh import MESH_DIMS, LinsMesh, mesh_shape
from lins_dtensor.plan import LinsPlan
from lins_dtensor.schedule import CollectiveSpec
from lins_dtensor.units import (
    LinsUnit,
    ReplicatedParams,
    ShardContext,
    TensorParallelSlice,
)


def world1_device_mesh() -> DeviceMesh:
    """A DeviceMesh with Lins' four dims, each of size 1, on a world-1 gloo group
    (initialised here if this process has none)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh("cpu", (1,) * len(MESH_DIMS), mesh_dim_names=MESH_DIMS)


@dataclasses.dataclass(frozen=True)
class SimGroup:
    """One rank's handle on a process group of simulated ranks: what
    ``ShardContext.group`` returns, and what the fake collectives receive."""

    world: SimWorld
    rank: int
    dim: str
    members: tuple[int, ...]  # global ranks, in group-rank order


@dataclasses.dataclass(frozen=True)
class Issued:
    """One rank's call of a collective, as the recorder would count it."""

    rank: int
    spec: CollectiveSpec
    group_size: int
    message_numel: int  # reduce-scatter input, all-gather output, all-reduce tensor


class _Collective:
    """One collective of one group: the members' tensors until all have issued it."""

    def __init__(self, kind: str, members: tuple[int, ...]) -> None:
        self.kind = kind
        self.members = members
        self.calls: dict[int, tuple[CollectiveSpec, tuple[torch.Tensor, ...]]] = {}
        self.done = False

    def add(self, rank: int, spec: CollectiveSpec, tensors: tuple[torch.Tensor, ...]) -> None:
        self.calls[rank] = (spec, tensors)
        if len(self.calls) == len(self.members):
            self._complete()

    def _complete(self) -> None:
        specs = {spec for spec, _ in self.calls.values()}
        if len(specs) != 1:  # the executor's issue-order rule, seen from the group
            raise AssertionError(f"ranks {self.members} issued different collectives together: {sorted(s.name for s in specs)}")
        tensors = [self.calls[r][1] for r in self.members]  # group-rank order, as gloo sums
        if self.kind == "reduce_scatter":  # (output, input)
            total = torch.stack([inp.view(len(self.members), -1) for _, inp in tensors]).sum(0)
            for j, (out, _) in enumerate(tensors):
                out.copy_(total[j])
        elif self.kind == "all_gather":  # (output, input)
            full = torch.cat([inp for _, inp in tensors])
            for out, _ in tensors:
                out.copy_(full)
        elif self.kind == "all_to_all":  # (output, input): member j gets chunk j of every input
            for j, (out, _) in enumerate(tensors):
                out.copy_(torch.cat([inp.view(len(self.members), -1)[j] for _, inp in tensors]))
        else:  # all_reduce: (tensor,)
            total = torch.stack([t for (t,) in tensors]).sum(0)
            for (t,) in tensors:
                t.copy_(total)
        self.done = True


class SimFlight:
    """A simulated collective in flight on one rank (the executor's Flight contract)."""

    def __init__(self, world: SimWorld, rank: int, collective: _Collective, spec: CollectiveSpec) -> None:
        self.world, self.rank, self.collective = world, rank, collective
        self.timing = CommTiming(spec.name, spec.state, 0.0)

    def completed(self) -> bool:
        return self.collective.done

    def join(self) -> None:
        self.world.drive_until(self.collective, self.rank)


class SimMesh:
    """The LinsMesh methods ShardContext and LinsUnit use, for simulated rank ``rank``
    of ``plan`` over ``world_size`` ranks (the rank layout of ``build_lins_mesh``)."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        self.world, self.rank = world, rank
        self.device_mesh = world.device_mesh  # labels the masters' DTensors only

    def size(self, dim: str) -> int:
        return self.world.sizes[dim]

    def coordinate(self, dim: str) -> int:
        return self.world.coordinates[self.rank][dim]

    def group(self, dim: str) -> SimGroup:
        return SimGroup(self.world, self.rank, dim, self.world.members(self.rank, dim))

    def nodes_spanned(self, dim: str) -> int:
        return len({r // self.world.ranks_per_node for r in self.world.members(self.rank, dim)})

    tp = 1  # no tensor parallelism: LinsMesh.placements reads it

    def placements(self, state: str, tp_placement: Placement | None = None) -> tuple[Placement, ...]:
        return LinsMesh.placements(self, state, tp_placement)


class RowShards:
    """Stands in for FSDP2 (:class:`~lins_dtensor.units.ShardedParams`) where P is
    sharded: this rank's rows of each parameter, in the torch.chunk geometry FSDP2 uses,
    which the update writes in place."""

    def __init__(self, params: list[nn.Parameter], plan: LinsPlan, param_index: int) -> None:
        self.params = params
        self.rows = [p.detach()[chunk_start(len(p), plan.params, param_index):][: chunk_rows(len(p), plan.params, param_index)].clone()
                     for p in params]

    def local_shards(self) -> list[torch.Tensor]:
        return self.rows

    def cast_(self, dtype: torch.dtype) -> None:
        self.rows = [r.to(dtype) for r in self.rows]

    def before_forward(self, updated: object) -> None:
        """Nothing to make wait: no FSDP2 streams."""

    def reset(self) -> None:
        """No per-step state."""

    def refresh(self) -> None:
        """Parameters are never replaced here."""


class SimWorld:
    """``world_size`` simulated ranks of ``plan``, one LinsUnit each over the same
    parameter shapes; :meth:`install` must be called (with pytest's monkeypatch) before
    any chain runs."""

    def __init__(self, plan: LinsPlan, world_size: int, device_mesh: DeviceMesh, shapes: Sequence[tuple[int, ...]],
                 param_dtype: torch.dtype = torch.float32, formats: CommFormats = CommFormats(), ranks_per_node: int | None = None) -> None:
        self.plan, self.world_size, self.device_mesh = plan, world_size, device_mesh
        self.ranks_per_node = ranks_per_node or world_size  # the link level of wire formats
        r, p, g, o = mesh_shape(plan, world_size)
        self.sizes = dict(zip(MESH_DIMS, (r, p, g, o)))
        # build_lins_mesh's layout: ranks in (replica, optim, grad, param) order, the
        # dims listed as MESH_DIMS.
        self.grid = torch.arange(world_size).view(r, o, g, p).permute(0, 3, 2, 1)
        self.coordinates = [dict(zip(MESH_DIMS, (int(i) for i in (self.grid == rank).nonzero()[0]))) for rank in range(world_size)]
        self.issued: list[Issued] = []
        self._pending: dict[tuple[str, tuple[int, ...], int], _Collective] = {}
        self._calls: dict[tuple[int, str], int] = {}  # collectives each rank issued on each of its groups
        # Small integers: every sum the chains form is exact, in any order and in bf16.
        self.initial = [torch.randint(-4, 5, s, generator=torch.Generator().manual_seed(i)).float() for i, s in enumerate(shapes)]
        self.units: list[LinsUnit] = []
        for rank in range(world_size):
            stream = CommStream(torch.device("cpu"))
            ctx = ShardContext(SimMesh(self, rank), plan, param_dtype, torch.float32, torch.float32, float(world_size),
                               torch.device("cpu"), CommRecorder(world_size), stream, Executor(stream, 1 << 30), formats)
            params = [nn.Parameter(t.clone()) for t in self.initial]
            # P replicated: the real backend. P sharded is FSDP2's: RowShards stands in.
            backend = ReplicatedParams(nn.ParameterList(params), params, MixedPrecisionPolicy()) if plan.params == 1 \
                else RowShards(params, plan, ctx.coords["param_shard"])
            unit = LinsUnit(ctx, backend, "unit", [f"w{i}" for i in range(len(params))], True,
                            [TensorParallelSlice(p.shape) for p in params])
            unit.make_masters()
            self.units.append(unit)

    # ----- the process groups ---------------------------------------------------------
    def members(self, rank: int, dim: str) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dim``, in group-rank order."""
        axis = MESH_DIMS.index(dim)
        index = [self.coordinates[rank][d] for d in MESH_DIMS]
        index[axis] = slice(None)
        return tuple(int(r) for r in self.grid[tuple(index)])

    def install(self, monkeypatch) -> None:
        """Route the units' collectives to this world."""
        for kind in ("reduce_scatter", "all_gather", "all_reduce", "all_to_all"):
            monkeypatch.setattr(units, f"start_{kind}", self._starter(kind))

    def _starter(self, kind: str) -> Callable[..., SimFlight]:
        def start(recorder: CommRecorder, stream: CommStream, spec: CollectiveSpec, *args, **_wire) -> SimFlight:
            *tensors, group, _step = args  # every collective here belongs to the step under test
            message = tensors[1] if kind in ("reduce_scatter", "all_to_all") else tensors[0]
            self.issued.append(Issued(group.rank, spec, len(group.members), message.numel()))
            key = (group.dim, group.members)
            n = self._calls.get((group.rank, group.dim), 0)
            self._calls[(group.rank, group.dim)] = n + 1
            collective = self._pending.setdefault((*key, n), _Collective(kind, group.members))
            collective.add(group.rank, spec, tuple(tensors))
            return SimFlight(self, group.rank, collective, spec)

        return start

    def drive_until(self, collective: _Collective, waiting: int) -> None:
        """Advance the other ranks' executors until ``collective`` completes; raise if
        they cannot (a peer has not submitted its chain: a hang on real ranks)."""
        while not collective.done:
            before = len(self.issued)
            for rank, unit in enumerate(self.units):
                if rank != waiting:
                    unit.ctx.executor.pump()
            if len(self.issued) == before and not collective.done:
                missing = sorted(set(collective.members) - set(collective.calls))
                raise RuntimeError(f"rank {waiting} waits for a collective ranks {missing} never issue")

    # ----- driving the units ------------------------------------------------------------
    def handed_on(self, rank: int, per_rank: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """What rank ``rank``'s backend hands the unit for one micro-batch in which each
        rank ``r`` computed the whole-parameter gradients ``per_rank[r]``: its P rows of
        their sum over its P group (FSDP2's reduce-scatter; s_p = 1: its own)."""
        group = self.members(rank, "param_shard")
        return self.p_rows(rank, [sum(per_rank[r][i] for r in group) for i in range(len(per_rank[rank]))])

    def p_rows(self, rank: int, full: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Rank ``rank``'s P rows of whole-parameter tensors, as the backend hands a
        gradient on (rows x row elements)."""
        g = self.units[rank].geometry
        return [t.reshape(len(t), -1).narrow(0, start, shape[0])
                for t, start, shape in zip(full, g.row_starts("params"), g.local_shapes("params"))]

    def optim_rows(self, rank: int, full: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Rank ``rank``'s OS rows of whole-parameter tensors, shaped as its masters."""
        g = self.units[rank].geometry
        return [t.reshape(-1, *s[1:]).narrow(0, start, s[0]) for t, start, s in
                zip(full, g.row_starts("optim"), g.local_shapes("optim"))]
