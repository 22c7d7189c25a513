"""Run torchtitan's unchanged trainer on a machine without a GPU (CPU tensors, gloo).

torchtitan 0.2.2 assumes an accelerator: it reads ``device_type`` / ``device_module``
once at import (``torch.cuda`` when no accelerator is found), calls CUDA-only memory
APIs, gives the profiler a ``None`` activity, and its FSDP setup asks for a
PREMUL_SUM reduction that gloo does not implement. :func:`install` patches exactly
these points, in torchtitan's module namespaces only, and does nothing when a GPU is
present. Everything else (trainer loop, checkpointing, metrics) runs as shipped.
"""

from __future__ import annotations

import importlib
import types

import torch
from torch.distributed.fsdp import FSDPModule

from lins_dtensor.integrations.titan_common.cpu_device import CpuDevice

_INSTALLED = False

# torchtitan modules that copied ``device_type`` / ``device_module`` at import time.
_DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.components.metrics",
    "torchtitan.tools.profiling",
)


def _profiler_namespace() -> types.SimpleNamespace:
    """``torch`` as torchtitan's profiling module sees it, minus the ``None`` activity."""

    def profile(*args, activities=None, **kwargs):
        if activities is not None:
            activities = [a for a in activities if a is not None]
        return torch.profiler.profile(*args, activities=activities, **kwargs)

    profiler = types.SimpleNamespace(**{k: getattr(torch.profiler, k) for k in dir(torch.profiler) if not k.startswith("__")})
    profiler.profile = profile

    class _Torch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    proxy = _Torch("torch")
    proxy.profiler = profiler
    return proxy


def _force_sum_fsdp() -> None:
    """torchtitan sets FSDP's gradient divide factor to 1.0, which FSDP2 implements with
    PREMUL_SUM; gloo lacks it. A plain SUM gives the same result (factor 1)."""
    parallelize = importlib.import_module("torchtitan.models.llama3.infra.parallelize")
    original = parallelize.disable_fsdp_gradient_division

    def disable_division_with_sum(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    parallelize.disable_fsdp_gradient_division = disable_division_with_sum


def needed() -> bool:
    return not torch.cuda.is_available()


def install() -> bool:
    """Patch torchtitan for CPU/gloo when there is no GPU; returns True if it did."""
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
    importlib.import_module("torchtitan.tools.profiling").torch = _profiler_namespace()
    _force_sum_fsdp()
    _INSTALLED = True
    return True
