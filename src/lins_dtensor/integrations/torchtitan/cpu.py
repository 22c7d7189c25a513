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

from lins_dtensor.integrations.titan_common.cpu_device import force_sum_fsdp, use_cpu_device

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


def needed() -> bool:
    return not torch.cuda.is_available()


def install() -> bool:
    """Patch torchtitan for CPU/gloo when there is no GPU; returns True if it did."""
    global _INSTALLED
    if _INSTALLED or not needed():
        return _INSTALLED
    use_cpu_device(_DEVICE_MODULES)
    importlib.import_module("torchtitan.tools.profiling").torch = _profiler_namespace()
    force_sum_fsdp("torchtitan.models.llama3.infra.parallelize")
    _INSTALLED = True
    return True
