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

import importlib

import torch
from torch.distributed.fsdp import FSDPModule

from lins_dtensor.integrations.titan_common.cpu_device import CpuDevice

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


def _force_sum_fsdp() -> None:
    """torchtitan sets FSDP's gradient divide factor to 1.0, which FSDP2 implements with
    PREMUL_SUM; gloo lacks it. A plain SUM gives the same result (factor 1)."""
    fsdp = importlib.import_module("torchtitan.distributed.fsdp")
    original = fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division_with_sum


def needed() -> bool:
    return not torch.cuda.is_available()


def install() -> bool:
    """Patch torchtitan 0.3 for CPU/gloo when there is no GPU; returns True if it did."""
    global _INSTALLED
    if _INSTALLED or not needed():
        return _INSTALLED
    device = CpuDevice()
    for name in _DEVICE_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device
    _force_sum_fsdp()
    _INSTALLED = True
    return True
