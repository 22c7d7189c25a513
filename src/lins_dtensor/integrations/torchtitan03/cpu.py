"""Run torchtitan 0.3's unchanged trainer on a machine without a GPU (CPU tensors, gloo).

torchtitan 0.3 reads ``device_type`` / ``device_module`` once at import and falls back
to ``"cuda"`` / ``torch.cuda`` when no accelerator is found; several modules copy them.
Its FSDP setup asks for a PREMUL_SUM reduction that gloo does not implement.
:func:`install` patches exactly these points, in torchtitan's module namespaces only,
and does nothing when a GPU is present (the device stand-in is the one 0.2.2's shims
use). Two more CPU obstacles are the job's to avoid, and the Lins
configs (:mod:`.config_registry`) do: FlexAttention has no CPU backward (``sdpa``
attention), and ``spmd_types`` needs every parameter a DTensor on torchtitan's full
mesh (``partial_dtensor``).
"""

from __future__ import annotations

import torch

from lins_dtensor.integrations.titan_common.cpu_device import force_sum_fsdp, use_cpu_device

_INSTALLED = False

# torchtitan 0.3 modules that copied ``device_type`` / ``device_module`` at import time.
_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.tools.profiler",
)


def needed() -> bool:
    return not torch.cuda.is_available()


def install() -> bool:
    """Patch torchtitan 0.3 for CPU/gloo when there is no GPU; returns True if it did."""
    global _INSTALLED
    if _INSTALLED or not needed():
        return _INSTALLED
    use_cpu_device(_DEVICE_MODULES)
    force_sum_fsdp("torchtitan.distributed.fsdp")
    _INSTALLED = True
    return True
