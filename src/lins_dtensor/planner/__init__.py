"""The Lins planner: pick s_p, s_g, s_os for a model on a cluster by predicted step time.

``choose_plan(model, cluster, training) -> (LinsPlan, Explanation)``; the console
script ``lins-plan`` (and ``python -m lins_dtensor.planner``) wraps it, and
``lins-plan profile`` measures the bandwidth table it can use.
"""

from lins_dtensor.planner.bandwidth import BandwidthTable, CollectiveTimer, alpha_beta_seconds
from lins_dtensor.planner.compute import model_flops_per_token
from lins_dtensor.planner.cost import PlanCost, evaluate
from lins_dtensor.planner.hardware import HARDWARE_PRESETS, ClusterSpec, HardwareSpec, hardware_preset
from lins_dtensor.planner.memory import MemoryBreakdown, activation_bytes, memory_breakdown, rank0_units
from lins_dtensor.planner.models import MODEL_PRESETS, ModelSpec, PlannerError, model_from_module, model_preset
from lins_dtensor.planner.search import Baseline, Explanation, choose_plan, search
from lins_dtensor.planner.training import TrainingSpec

__all__ = [
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "BandwidthTable",
    "Baseline",
    "ClusterSpec",
    "CollectiveTimer",
    "Explanation",
    "HardwareSpec",
    "MemoryBreakdown",
    "ModelSpec",
    "PlanCost",
    "PlannerError",
    "TrainingSpec",
    "activation_bytes",
    "alpha_beta_seconds",
    "choose_plan",
    "evaluate",
    "hardware_preset",
    "memory_breakdown",
    "model_flops_per_token",
    "model_from_module",
    "model_preset",
    "rank0_units",
    "search",
]
