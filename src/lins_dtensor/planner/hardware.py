"""Devices and clusters: the numbers the cost model needs when no profile is given.

Bandwidths are *effective* (what a large collective achieves), not link ratings:
``intra_bw`` per rank inside a node, ``inter_bw`` per node across the network (all the
node's NICs together, shared by every group that leaves the node). ``alpha_*`` are the
per-step latencies of a ring collective.
"""

from __future__ import annotations

import dataclasses

from lins_dtensor.planner.models import PlannerError

GiB = 1 << 30
GB = 1e9


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    name: str
    ranks_per_node: int  # default node size for this hardware
    memory_bytes: float  # per rank (see memory_shared_by_world)
    peak_flops: float  # dense bf16 (or fp32 on CPU) per rank
    intra_bw: float  # bytes/s per rank inside a node
    inter_bw: float  # bytes/s per node between nodes
    hbm_bw: float  # bytes/s per rank, for the (memory-bound) optimizer step
    alpha_intra: float = 5e-6
    alpha_inter: float = 15e-6
    efficiency: float = 0.65  # fraction of peak FLOPs a well-tuned step reaches
    reserved_bytes: float = 2 * GiB  # context, allocator fragmentation, workspaces
    memory_shared_by_world: bool = False  # cpu-emulated: one host's memory for all ranks
    copy_bw: float | None = None  # bytes/s per rank read + written by local copies (None: hbm_bw)
    # Host time per unit and micro-batch (forward + backward) of FSDP2's hooks where P is
    # sharded, and of Lins' gradient hooks where it is replicated. A GPU hides it behind
    # queued kernels; on CPUs, where the host is the device, it adds up.
    unit_overhead_s: float = 0.0
    replicated_unit_overhead_s: float = 0.0

    @property
    def copy_bandwidth(self) -> float:
        return self.hbm_bw if self.copy_bw is None else self.copy_bw

    def rank_memory(self, world_size: int) -> float:
        return self.memory_bytes / world_size if self.memory_shared_by_world else self.memory_bytes


_A800 = HardwareSpec("a800", 8, 80 * GiB, 312e12, 200 * GB, 100 * GB, 1.9e12)
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a800": _A800,
    "a100": dataclasses.replace(_A800, name="a100", hbm_bw=2.0e12),
    # NVLink 4 (~450 GB/s per direction, ~360 effective); one 400 Gb/s NIC per GPU.
    "h100": HardwareSpec("h100", 8, 80 * GiB, 989e12, 360 * GB, 8 * 50 * GB, 3.35e12, alpha_intra=4e-6, alpha_inter=12e-6),
    "h200": HardwareSpec("h200", 8, 141 * GiB, 989e12, 360 * GB, 8 * 50 * GB, 4.8e12, alpha_intra=4e-6, alpha_inter=12e-6),
    # The benchmark's emulated cluster: gloo over loopback inside a "node", a tbf
    # rate-limited veth (default 400 Mbit/s) between nodes, all on one 24 GiB host.
    "cpu-emulated": HardwareSpec(
        "cpu-emulated", 2, 24 * GiB, 30e9, 0.35 * GB, 400e6 / 8, 10e9,
        alpha_intra=50e-6, alpha_inter=200e-6, efficiency=0.5, reserved_bytes=0.3 * GiB, memory_shared_by_world=True,
    ),
}


def hardware_preset(name: str) -> HardwareSpec:
    key = name.strip().lower().replace("_", "-")
    if key == "cpu":
        key = "cpu-emulated"
    if key not in HARDWARE_PRESETS:
        raise PlannerError(f"unknown hardware preset '{name}'; known: {', '.join(HARDWARE_PRESETS)}")
    return HARDWARE_PRESETS[key]


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """``gpus`` ranks in nodes of ``gpus_per_node`` (consecutive ranks share a node).

    ``bandwidth`` is a measured :class:`~lins_dtensor.planner.bandwidth.BandwidthTable`
    (or None: the alpha-beta model of ``hardware``); ``memory_budget_bytes`` overrides
    the device memory.
    """

    gpus: int
    gpus_per_node: int
    hardware: HardwareSpec
    bandwidth: object | None = None
    memory_budget_bytes: float | None = None

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise PlannerError(f"gpus={self.gpus} and gpus_per_node={self.gpus_per_node} must be >= 1")
        if self.gpus % self.gpus_per_node:
            raise PlannerError(f"gpus={self.gpus} is not divisible by gpus_per_node={self.gpus_per_node}")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def memory_budget(self) -> float:
        """Bytes a rank may use for training (device memory less the reserve)."""
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes
        return self.hardware.rank_memory(self.gpus) - self.hardware.reserved_bytes

    @classmethod
    def preset(cls, hardware: str, gpus: int, gpus_per_node: int | None = None, **kwargs) -> "ClusterSpec":
        hw = hardware_preset(hardware)
        return cls(gpus, gpus_per_node or min(hw.ranks_per_node, gpus), hw, **kwargs)
