"""torchtitan 0.3's tensor parallelism on the Lins mesh's ``tp`` dim.

0.3 declares TP per module (each module config's ``sharding_config``) and applies it
with ``model.parallelize(parallel_dims)``, which asks ``parallel_dims`` for the mesh
of the axes a module declares: under ``partial_dtensor`` only ``tp`` (and ``ep``),
looked up in its table of one-axis meshes. Lins needs the TP DTensors on its own
mesh's ``tp`` dim (so that FSDP2 and the masters describe a parameter's TP and
data-parallel sharding on one mesh); the groups are the same ranks (consecutive
ones inside a node, torchtitan's innermost axis, which :func:`parallelize_tp`
checks). So the model is parallelised with a shallow copy of ``parallel_dims`` whose
``tp`` entry is the Lins ``tp`` mesh. Private: ``ParallelDims._single_axis_meshes``.
Waits for: a way to hand ``Module.parallelize`` a mesh per axis.
"""

from __future__ import annotations

import copy

from torch import nn

from lins_dtensor.integrations.titan_common.settings import LinsConfigError
from lins_dtensor.mesh import LinsMesh


def parallelize_tp(model: nn.Module, parallel_dims, mesh: LinsMesh) -> None:
    titan_tp, lins_tp = parallel_dims.get_mesh("tp"), mesh.tp_mesh()
    if titan_tp.mesh.tolist() != lins_tp.mesh.tolist():
        raise LinsConfigError(
            f"parallelism.tensor_parallel_degree = {lins_tp.size()}: torchtitan's TP group {titan_tp.mesh.tolist()} "
            f"is not Lins' {lins_tp.mesh.tolist()} on this rank"
        )
    bridged = copy.copy(parallel_dims)
    bridged._single_axis_meshes = {**parallel_dims._single_axis_meshes, "tp": lins_tp}
    bridged._multi_axis_meshes = {}
    model.parallelize(bridged)
