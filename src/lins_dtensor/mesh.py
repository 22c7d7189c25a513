"""The Lins DeviceMesh: one mesh on which P, G and OS are standard DTensor placements.

Ranks are decomposed as ``rank = r*s_os + a_os*s_g + a_g*s_p + c_p`` so that every
group is a run of consecutive ranks (inside a node first). The mesh lists the dims in
the order *replica, param, grad, optim* rather than in rank order: DTensor chunks
``Shard(0)`` on several mesh dims left to right, so this order makes a rank's OS shard
a sub-chunk of its G shard, itself a sub-chunk of its P shard. Each state then moves
between layouts with one reduce-scatter / all-gather over one mesh dim, no data
shuffling. Along every single dim ranks increase, so each dim's process group has the
rank order DTensor expects.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from lins_dtensor.compat import set_group_timeout
from lins_dtensor.plan import LinsPlan, LinsPlanError

OPTIM_REPLICA = "optim_replica"  # N / s_os copies of each OS shard
PARAM_SHARD = "param_shard"  # s_p ranks holding one parameter each
GRAD_SHARD = "grad_shard"  # s_g / s_p: how much finer G is than P
OPTIM_SHARD = "optim_shard"  # s_os / s_g: how much finer OS is than G
MESH_DIMS = (OPTIM_REPLICA, PARAM_SHARD, GRAD_SHARD, OPTIM_SHARD)


@dataclasses.dataclass(frozen=True)
class LinsMesh:
    """A 4-D DeviceMesh for one plan, plus the node size used to tell links apart."""

    device_mesh: DeviceMesh
    plan: LinsPlan
    ranks_per_node: int

    @property
    def world_size(self) -> int:
        return self.device_mesh.size()

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    def size(self, dim: str) -> int:
        return self.device_mesh.size(MESH_DIMS.index(dim))

    def coordinate(self, dim: str) -> int:
        """This rank's index along ``dim``."""
        coords = self.device_mesh.get_coordinate()
        assert coords is not None, "this rank is not part of the Lins mesh"
        return coords[MESH_DIMS.index(dim)]

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(dim)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """How long a collective on any of the mesh's groups (Lins' and FSDP2's) waits
        for a peer before it fails: a stopped or dead rank then ends the job with an
        error that names the collective instead of hanging."""
        _check_timeout(timeout)
        for dim in MESH_DIMS:
            set_group_timeout(self.group(dim), timeout)

    def param_mesh(self) -> DeviceMesh:
        """The 1-D mesh FSDP2 shards parameters on."""
        return self.device_mesh[PARAM_SHARD]


def _check_timeout(timeout: object) -> None:
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise LinsPlanError(f"timeout={timeout!r} must be a positive datetime.timedelta")


def placements(state: str) -> tuple[Placement, ...]:
    """The DTensor placements of ``state`` ("params", "grads" or "optim") on the mesh."""
    sharded_dims = {"params": 1, "grads": 2, "optim": 3}[state]
    return tuple(Shard(0) if 0 < i <= sharded_dims else Replicate() for i in range(len(MESH_DIMS)))


def mesh_shape(plan: LinsPlan, world_size: int) -> tuple[int, ...]:
    """Sizes of the MESH_DIMS for ``plan``."""
    return (world_size // plan.optim, plan.params, plan.grads // plan.params, plan.optim // plan.grads)


def build_lins_mesh(
    plan: LinsPlan,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    device_type: str | None = None,
    timeout: datetime.timedelta | None = None,
) -> LinsMesh:
    """Validate ``plan`` and build its mesh (a collective: every rank must call it).

    ``ranks_per_node`` defaults to ``LOCAL_WORLD_SIZE`` (set by torchrun), else the
    world size; ``device_type`` to "cuda" when available, else "cpu". ``timeout``: how
    long the mesh's collectives wait for a peer (:meth:`LinsMesh.set_timeout`; default:
    the process groups' own, 30 minutes for gloo and NCCL).
    """
    if timeout is not None:
        _check_timeout(timeout)  # before the mesh's collectives
    if not dist.is_initialized():
        raise LinsPlanError("build_lins_mesh needs torch.distributed to be initialised first")
    actual_world = dist.get_world_size()
    world_size = actual_world if world_size is None else world_size
    if ranks_per_node is None:
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    plan.validate(world_size, ranks_per_node)
    if world_size != actual_world:
        raise LinsPlanError(
            f"world_size={world_size} does not match the {actual_world} ranks of the process group"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    r, p, g, o = mesh_shape(plan, world_size)
    # Rank order is (replica, optim, grad, param) outermost first; the mesh lists the
    # dims as (replica, param, grad, optim) so that Shard(0) nests OS in G in P.
    ranks = torch.arange(world_size).view(r, o, g, p).permute(0, 3, 2, 1).contiguous()
    # Every dim gets process groups of its own. DeviceMesh would reuse the default group
    # for a dim that spans the world, and Lins' chains issue on their groups when earlier
    # collectives complete, a moment that differs between ranks: sharing a group with
    # the program's own collectives (a loss all-reduce on the default group) would let
    # ranks issue them in different orders and hang. Naming the backend opts out.
    backend = dist.get_backend()
    device_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=MESH_DIMS, backend_override=((backend, None),) * len(MESH_DIMS))
    mesh = LinsMesh(device_mesh, plan, ranks_per_node)
    if timeout is not None:
        mesh.set_timeout(timeout)
    return mesh
