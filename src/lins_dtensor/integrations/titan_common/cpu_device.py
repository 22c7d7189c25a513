"""A stand-in for ``torch.cuda`` that answers for the host, for torchtitan on CPU.

Every torchtitan release so far copies ``device_module`` (``torch.cuda`` when no
accelerator is found) into several of its modules at import and calls these few
functions on it; each integration's ``cpu`` module puts :class:`CpuDevice` there
(:func:`use_cpu_device`) and makes FSDP sum without PREMUL_SUM (:func:`force_sum_fsdp`).
"""

from __future__ import annotations

import importlib
import os
import resource
import types
from collections.abc import Iterable

import torch
from torch.distributed.fsdp import FSDPModule


class CpuDevice(types.SimpleNamespace):
    """The subset of the ``torch.cuda`` API torchtitan calls, answered for the host."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 1 << 34
        return types.SimpleNamespace(total_memory=total, name="cpu")

    @staticmethod
    def memory_stats(device=None) -> dict:
        # Host memory: the process's peak resident set (it cannot be reset).
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    def __getattr__(self, name):  # anything else falls through to torch.cpu
        return getattr(torch.cpu, name)


def use_cpu_device(module_names: Iterable[str]) -> None:
    """Point the ``device_type`` / ``device_module`` that these torchtitan modules copied
    at import to the host."""
    device = CpuDevice()
    for name in module_names:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device


def force_sum_fsdp(module_name: str) -> None:
    """torchtitan sets FSDP's gradient divide factor to 1.0 (its
    ``disable_fsdp_gradient_division``, in ``module_name``), which FSDP2 implements with
    PREMUL_SUM; gloo lacks it. A plain SUM gives the same result (factor 1)."""
    module = importlib.import_module(module_name)
    original = module.disable_fsdp_gradient_division

    def disable_division_with_sum(model: torch.nn.Module) -> None:
        original(model)
        for submodule in model.modules():
            if isinstance(submodule, FSDPModule):
                submodule.set_force_sum_reduction_for_comms(True)

    module.disable_fsdp_gradient_division = disable_division_with_sum
