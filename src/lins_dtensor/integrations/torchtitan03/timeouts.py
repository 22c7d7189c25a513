"""torchtitan 0.3's switch to the training timeout, on torch releases that lack its setter.

After the first step torchtitan 0.3 moves every process group to
``comm.train_timeout_seconds`` with ``torch.distributed.set_timeout``, which torch
2.13 does not have (the step would fail with AttributeError). :func:`install` replaces
``torchtitan.distributed.utils.set_pg_timeouts`` (called through that module) with
the same barrier-then-set sequence on Lins' own timeout setter
(:func:`lins_dtensor.compat.set_group_timeout`), and does nothing where torch has the
public function.
"""

from __future__ import annotations

import importlib
from datetime import timedelta

import torch.distributed as dist

from lins_dtensor.compat import set_group_timeout


def _set_pg_timeouts(timeout: timedelta, parallel_dims) -> None:
    """torchtitan's ``set_pg_timeouts``: wait for every rank (a fast rank must not
    start timing out a slow one still under the start-up timeout), then set the
    timeout of each mesh group and of the default group (None)."""
    dist.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in [*groups, None]:
        set_group_timeout(group, timeout)


def install() -> bool:
    """Patch when ``torch.distributed.set_timeout`` is missing; returns True if it did."""
    if hasattr(dist, "set_timeout"):
        return False
    importlib.import_module("torchtitan.distributed.utils").set_pg_timeouts = _set_pg_timeouts
    return True
