"""The Lins DeviceMesh: one mesh on which P, G and OS are standard DTensor placements.

Ranks are decomposed as ``rank = r*s_os + a_os*s_g + a_g*s_p + c_p`` so that every
group is a run of consecutive ranks (inside a node first). The mesh lists the dims in
the order *replica, param, grad, optim* rather than in rank order: DTensor chunks
``Shard(0)`` on several mesh dims left to right, so this order makes a rank's OS shard
a sub-chunk of its G shard, itself a sub-chunk of its P shard. Each state then moves
between layouts with one reduce-scatter / all-gather over one mesh dim, no data
shuffling. Along every single dim ranks increase, so each dim's process group has the
rank order DTensor expects.

With tensor parallelism of degree k (``tp=k``) the mesh gains a ``tp`` dim: TP groups
are k consecutive ranks (inside a node), ``rank = dp_rank*k + t``, and the four dims
above decompose ``dp_rank`` as before, so Lins' groups are made of the data-parallel
ranks that hold the same TP slice and still fill a node before they span nodes. ``tp``
comes *first* in the mesh's dim order (it is innermost in rank order): a parameter
that TP shards on dim 0 (a column-parallel weight) is then chunked by TP first and its
TP slice chunked by P, G and OS, which is how each rank holds it, and plain
``Shard`` placements on this mesh describe that nesting exactly, uneven sizes included.
FSDP2 describes the same layout on its own (param_shard, tp) mesh with
``_StridedShard``; Lins' masters need no strided placement this way.

    world 8 = 2 nodes x 4 ranks, tp=2, plan p=2,g=2,os=4 (4 data-parallel ranks):
      rank       0 1 | 2 3 | 4 5 | 6 7     (node 0: ranks 0-3, node 1: ranks 4-7)
      tp slice   0 1 | 0 1 | 0 1 | 0 1
      dp_rank     0  |  1  |  2  |  3
      P shard     0  |  1  |  0  |  1      (of the TP slice; P group inside a node)
      OS shard   0.0 | 1.0 | 0.1 | 1.1     (half of the P shard; OS group spans the nodes)
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from lins_dtensor.compat import set_group_timeout
from lins_dtensor.errors import LinsPlanError, LinsUsageError
from lins_dtensor.plan import LinsPlan

OPTIM_REPLICA = "optim_replica"  # N / s_os copies of each OS shard
PARAM_SHARD = "param_shard"  # s_p ranks holding one parameter each
GRAD_SHARD = "grad_shard"  # s_g / s_p: how much finer G is than P
OPTIM_SHARD = "optim_shard"  # s_os / s_g: how much finer OS is than G
MESH_DIMS = (OPTIM_REPLICA, PARAM_SHARD, GRAD_SHARD, OPTIM_SHARD)
TENSOR_PARALLEL = "tp"  # the TP group: k consecutive ranks; first in the dim order when k > 1


@dataclasses.dataclass(frozen=True)
class LinsMesh:
    """The DeviceMesh of one plan (build it with :func:`build_lins_mesh`).

    Attributes:
        device_mesh (DeviceMesh): the four data-parallel dims (``MESH_DIMS``), led by a
            ``tp`` dim under tensor parallelism; every dim has process groups of its own.
        plan (LinsPlan): the plan the mesh was built for.
        ranks_per_node (int): ranks of the job per node (TP ranks included), which tells
            intra-node links from inter-node ones.
        groups (dict[str, ProcessGroup]): each dim's process group of this rank.
    """

    device_mesh: DeviceMesh
    plan: LinsPlan
    ranks_per_node: int
    # Every rank of the job, on gloo: what the hosts agree on without a device round
    # trip (which parameters took part in a step); one per job (_host_group).
    host_group: dist.ProcessGroup
    # Each dim's group, resolved once: DeviceMesh.get_group looks it up by name in
    # torch's registry, which destroy_process_group empties while Lins may still run its
    # last chains at exit (executor.py).
    groups: dict[str, dist.ProcessGroup] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = self.device_mesh.mesh_dim_names or ()
        object.__setattr__(self, "groups", {dim: self.device_mesh.get_group(dim) for dim in names})

    @property
    def world_size(self) -> int:
        """Every rank of the job, TP ranks included."""
        return self.device_mesh.size()

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1: no TP dim)."""
        names = self.device_mesh.mesh_dim_names or ()
        return self.device_mesh.size(names.index(TENSOR_PARALLEL)) if TENSOR_PARALLEL in names else 1

    @property
    def dp_world_size(self) -> int:
        """The data-parallel ranks, which the plan's factors count."""
        return self.world_size // self.tp

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    def size(self, dim: str) -> int:
        return self.device_mesh.size(self.device_mesh.mesh_dim_names.index(dim))

    def coordinate(self, dim: str) -> int:
        """This rank's index along ``dim``."""
        coords = self.device_mesh.get_coordinate()
        assert coords is not None, "this rank is not part of the Lins mesh"
        return coords[self.device_mesh.mesh_dim_names.index(dim)]

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.groups[dim]

    def nodes_spanned(self, dim: str) -> int:
        """Nodes this rank's group along ``dim`` covers (> 1: its collectives cross the
        network, the "inter" link level of wire formats)."""
        return len({rank // self.ranks_per_node for rank in dist.get_process_group_ranks(self.group(dim))})

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """How long a collective on any of the mesh's groups (Lins' and FSDP2's) waits
        for a peer before it fails: a stopped or dead rank then ends the job with an
        error that names the collective instead of hanging."""
        _check_timeout(timeout)
        for dim in self.device_mesh.mesh_dim_names:
            set_group_timeout(self.group(dim), timeout)
        set_group_timeout(self.host_group, timeout)

    def param_mesh(self) -> DeviceMesh:
        """The 1-D mesh FSDP2 shards parameters on."""
        return self.device_mesh[PARAM_SHARD]

    def tp_mesh(self) -> DeviceMesh:
        """The 1-D mesh to tensor-parallelise the model on (``parallelize_module``)
        before ``apply_lins``: a sub-mesh of this mesh, so that FSDP2 and the masters
        can describe a parameter's TP and data-parallel sharding together."""
        if self.tp == 1:
            raise LinsUsageError("this Lins mesh has no tensor-parallel dim: build it with build_lins_mesh(..., tp=k)")
        return self.device_mesh[TENSOR_PARALLEL]

    def placements(self, state: str, tp_placement: Placement | None = None) -> tuple[Placement, ...]:
        """The DTensor placements of ``state`` ("params", "grads" or "optim") of a
        parameter on this mesh; ``tp_placement``: how TP shards it (None: replicated)."""
        dp = _dp_placements(state)
        return ((tp_placement or Replicate()), *dp) if self.tp > 1 else dp


def _check_timeout(timeout: object) -> None:
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise LinsUsageError(f"timeout={timeout!r} must be a positive datetime.timedelta")


def _dp_placements(state: str) -> tuple[Placement, ...]:
    """The placements of ``state`` ("params", "grads" or "optim") on the four
    data-parallel dims (:meth:`LinsMesh.placements` adds the TP dim)."""
    sharded_dims = {"params": 1, "grads": 2, "optim": 3}[state]
    return tuple(Shard(0) if 0 < i <= sharded_dims else Replicate() for i in range(len(MESH_DIMS)))


def mesh_shape(plan: LinsPlan, world_size: int) -> tuple[int, ...]:
    """Sizes of the MESH_DIMS for ``plan`` over ``world_size`` data-parallel ranks."""
    return (world_size // plan.optim, plan.params, plan.grads // plan.params, plan.optim // plan.grads)


def mesh_layout(plan: LinsPlan, dp_world_size: int, tp: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The names and sizes of the mesh's dims: a leading ``tp`` dim when tp > 1."""
    if tp == 1:
        return MESH_DIMS, mesh_shape(plan, dp_world_size)
    return (TENSOR_PARALLEL, *MESH_DIMS), (tp, *mesh_shape(plan, dp_world_size))


# The job's default group and the host group made for it (_host_group).
_HOST_GROUP: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None


def _host_group() -> dist.ProcessGroup:
    """Every rank of the job on gloo, for what the hosts agree on: Lins' own for the
    reason given in :func:`build_lins_mesh` (gloo, so that no device is waited for; NCCL
    takes device tensors only). One per job, shared by the meshes built in it: the hosts
    issue their agreements in program order, the same on every rank, so models can
    share it, and each new gloo group would open connections between all ranks. Made
    by the first mesh, which every rank builds (a collective)."""
    global _HOST_GROUP
    world = dist.group.WORLD
    if _HOST_GROUP is None or _HOST_GROUP[0] is not world:
        _HOST_GROUP = (world, dist.new_group(backend="gloo"))
    return _HOST_GROUP[1]


def _mesh_from_groups(
    ranks: torch.Tensor, names: tuple[str, ...], device_type: str, group_for: Callable[[tuple[int, ...]], dist.ProcessGroup]
) -> DeviceMesh:
    """A DeviceMesh over ``ranks`` whose dims use ``group_for``'s groups: every group of
    every dim is asked for on every rank in one order (creating a group is collective),
    and this rank's group of each dim goes to ``DeviceMesh.from_group``."""
    me = dist.get_rank()
    mine = []
    for dim in range(ranks.dim()):
        groups = ranks.movedim(dim, -1).reshape(-1, ranks.size(dim)).tolist()
        found = [group_for(tuple(members)) for members in groups]
        mine.append(next(g for members, g in zip(groups, found) if me in members))
    return DeviceMesh.from_group(mine, device_type, mesh=ranks, mesh_dim_names=names)


def build_lins_mesh(
    plan: LinsPlan,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    device_type: str | None = None,
    timeout: datetime.timedelta | None = None,
    tp: int = 1,
    group_for: Callable[[tuple[int, ...]], dist.ProcessGroup] | None = None,
) -> LinsMesh:
    """Validate ``plan`` and build its mesh (a collective: every rank must call it).

    Args:
        plan (LinsPlan): the sharding factors, over the ``world_size / tp`` data-parallel ranks.
        world_size (int | None): all ranks of the job; ``None``: the process group's.
        ranks_per_node (int | None): ranks of one node; ``None``: ``LOCAL_WORLD_SIZE``
            (set by torchrun), else the world size.
        device_type (str | None): ``None``: "cuda" when available, else "cpu".
        timeout (datetime.timedelta | None): how long the mesh's collectives wait for a
            peer (:meth:`LinsMesh.set_timeout`); ``None``: the process groups' own, 30
            minutes for gloo and NCCL.
        tp (int): the tensor-parallel degree; TP groups are ``tp`` consecutive ranks
            inside a node, and :meth:`LinsMesh.tp_mesh` is the mesh to parallelise the
            model on.
        group_for (Callable | None): ``None``: the mesh opens process groups of its own
            for every dim. Else the group of a tuple of global ranks, called on every rank
            for every group of every dim, in the same order (so it may create groups):
            meshes built with one cache of groups share them. Only for models that never
            have collectives in flight at once (each settled with
            :func:`~lins_dtensor.wait_for_updates` before the other steps): two models'
            chains on one group would be issued in different orders on different ranks.
            Each gloo group keeps a thread that wakes every 10 ms; a benchmark that holds
            many models alive shares them to keep those threads few.

    Returns:
        LinsMesh: the mesh to pass to :func:`~lins_dtensor.apply_lins`.

    Raises:
        LinsPlanError: ``plan`` breaks a rule for this cluster shape.
        LinsUsageError: torch.distributed is not initialised, or ``tp`` or ``timeout``
            is invalid.
    """
    if timeout is not None:
        _check_timeout(timeout)  # before the mesh's collectives
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise LinsUsageError(f"tp={tp!r} must be a positive integer (the tensor-parallel degree)")
    if not dist.is_initialized():
        raise LinsUsageError("build_lins_mesh needs torch.distributed to be initialised first")
    actual_world = dist.get_world_size()
    world_size = actual_world if world_size is None else world_size
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if ranks_per_node >= 1 and ranks_per_node % tp:  # (< 1: plan.validate names it)
        raise LinsPlanError(f"tp={tp} must divide ranks_per_node={ranks_per_node}: a tensor-parallel group stays inside a node")
    plan.validate(world_size // tp, ranks_per_node // tp, tp)
    if world_size != actual_world:
        raise LinsPlanError(
            f"world_size={world_size} does not match the {actual_world} ranks of the process group"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    r, p, g, o = mesh_shape(plan, world_size // tp)
    # Rank order is (replica, optim, grad, param, tp) outermost first; the mesh lists the
    # dims as ([tp,] replica, param, grad, optim) so that Shard(0) nests OS in G in P in
    # the TP slice.
    names, shape = mesh_layout(plan, world_size // tp, tp)
    # A fresh row-major copy: DeviceMesh takes its layout from the tensor's strides, and
    # ``contiguous()`` can keep the permuted stride of a size-1 dim, which torch 2.11 and
    # 2.12 reject when DTensor slices the mesh (redistributing over several dims).
    ranks = torch.arange(world_size).view(r, o, g, p, tp).permute(4, 0, 3, 2, 1).reshape(shape).clone(memory_format=torch.contiguous_format)
    # Every dim gets process groups of its own. DeviceMesh would reuse the default group
    # for a dim that spans the world, and Lins' chains issue on their groups when earlier
    # collectives complete, a moment that differs between ranks: sharing a group with
    # the program's own collectives (a loss all-reduce on the default group) would let
    # ranks issue them in different orders and hang. Naming the backend opts out.
    if group_for is None:
        backend = dist.get_backend()
        device_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=names, backend_override=((backend, None),) * len(names))
    else:
        device_mesh = _mesh_from_groups(ranks, names, device_type, group_for)
    mesh = LinsMesh(device_mesh, plan, ranks_per_node, _host_group())
    if timeout is not None:
        mesh.set_timeout(timeout)
    return mesh
