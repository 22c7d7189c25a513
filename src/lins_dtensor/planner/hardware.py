"""Devices and clusters: the numbers the cost model needs when no profile is given.

Bandwidths are *effective* (the bus bandwidth a large ring collective measures in
nccl-tests), not link ratings: ``intra_bw`` per rank inside a node, ``inter_bw`` per node
across the network (all the node's NICs together, shared by every group that leaves
the node). ``alpha_*`` are the per-step latencies of a ring collective; an all-reduce
across nodes may instead run NCCL's tree, whose latency grows with log2(nodes)
(``tree_alpha*``). The compute curve (:mod:`lins_dtensor.planner.compute`) takes its
shape from single-GPU kernel benchmarks and its scale, ``efficiency``, from published
single-node training runs (:mod:`lins_dtensor.planner.validation`; the test suite checks
these values against the fit):

* GEMM ceilings: the best bf16 matmul stas00/ml-engineering's mamf-finder measured
  (compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"):
  A100 SXM 267.9 of 312 TFLOPS (0.859), H100 SXM 792.1 of 989 (0.801).
* Attention (FlashAttention-2, what SDPA runs in torchtitan): on an A100, causal forward
  with 32 heads, 143.7 TFLOPS at sequence 1024 and 156.3-159.4 at 4096
  (github.com/liangan1/GPU_travel performance/flash-attn/README.md): s / (s + 138) of a
  163 TFLOPS ceiling (0.523); on an H100 FlashAttention-2 reaches 35 % of peak
  (FlashAttention-3, arXiv 2407.08608), taken with the same shape; its backward runs at
  0.66 of its forward's rate for 2.5x the FLOPs (apache/tvm tl_doc/flash_perf.md, causal,
  head dim 128: 151.19 forward, 99.23 backward TFLOPS): 3.8x the forward's time.
* Memory: A100 40 GB 1.555 TB/s, 80 GB 2.039 TB/s; H100 SXM 3.35 TB/s, PCIe 2.0 TB/s at
  756 TFLOPS; H200 4.8 TB/s (NVIDIA's datasheets).

Sources of the network numbers, each a published measurement:

* A100: NVLink 3 ring all-reduce bus bandwidth 232 GB/s on 8 GPUs, 192 GB/s across DGX
  A100 nodes with 8 x 200 Gb/s (NVIDIA GTC24 S62129); the A800 caps NVLink at 400 GB/s
  both ways (200 per direction), so its ring gets ~78 % of that as the A100 does of
  300: 156 GB/s; 4 x HDR per node (the Lins paper's cluster) measures 91 GB/s
  (nccl-tests issue 100, two HGX A100 nodes with four ConnectX-6 at 200 Gb/s).
* H100 / H200: all-gather and reduce-scatter ring bus bandwidth 361-370 GB/s on 8 GPUs
  (nccl-tests issue 212; an 8 x H200 node, stas00/ml-engineering network/README.md);
  NDR 400 Gb/s NICs give 46-48 GB/s each (nccl-tests issue 290): 8 x 46 per node.
* H100 HBM2e (torchtitan's Grand Teton hosts): 96 GB at 2.4 TB/s, 500 W, 400 Gb/s per GPU
  (torchtitan benchmarks/llama3_h100_202412_torchtitan.md).
* Latency: 8 x A100 all-reduce of 32 KiB takes 44 us, 14 ring steps (stas00's
  nccl-tests sweep): 3 us a step. All-reduce across 4 to 512 nodes, read off NCCL's
  published scaling plot (arXiv 2411.13055, reproduced in stas00/ml-engineering): the
  time beyond bandwidth is ~0.2 ms at 4 nodes and ~0.8 ms at 512, at 16 and 64 MiB
  alike: 54 us + 83 us per doubling of nodes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from lins_dtensor.formats import FORMATS
from lins_dtensor.planner.models import PlannerError, read_json

GiB = 1 << 30
GB = 1e9


# HBM bytes read plus written per value encoded or decoded by formats.WireFormat's
# eager PyTorch kernels, a GPU's codec rate without a profile (memory-bound elementwise
# work, each kernel a pass over its operands): bf16 is one cast each way (fp32 in, bf16
# out: 6 bytes; back: 6). int8 encodes through a zeroed fp32 copy (4 + 8), abs and the
# blocks' amax (8 + 4), a divide, round and clamp (8 each), the int8 cast (5) and the copy
# into the wire buffer (2): 55 bytes; it decodes with a cast (5) and a multiply by the
# scales (8): 13; 34 bytes a value on average.
CODEC_BYTES_PER_VALUE = {"bf16": 6.0, "int8": 34.0}


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    name: str
    ranks_per_node: int  # default node size for this hardware
    memory_bytes: float  # per rank (see memory_shared_by_world)
    peak_flops: float  # dense bf16 (or fp32 on CPU) per rank
    intra_bw: float  # bytes/s per rank inside a node
    inter_bw: float  # bytes/s per node between nodes
    hbm_bw: float  # bytes/s per rank: the optimizer step, elementwise work, small GEMMs
    alpha_intra: float = 3e-6
    alpha_inter: float = 15e-6
    tree_alpha: float = 54e-6  # all-reduce across nodes by tree: this ...
    tree_alpha_per_doubling: float = 83e-6  # ... plus this per doubling of the nodes
    efficiency: float = 0.6  # the compute curve's scale: fitted to training runs (1: the kernel benchmarks' rates)
    reserved_bytes: float = 2 * GiB  # context, allocator fragmentation, workspaces
    memory_shared_by_world: bool = False  # cpu-emulated: one host's memory for all ranks
    copy_bw: float | None = None  # bytes/s per rank read + written by local copies (None: hbm_bw)
    # Host time per unit and micro-batch (forward + backward) of FSDP2's hooks where P is
    # sharded, and of Lins' gradient hooks where it is replicated. A GPU hides it behind
    # queued kernels; on CPUs, where the host is the device, it adds up.
    unit_overhead_s: float = 0.0
    replicated_unit_overhead_s: float = 0.0
    # gloo reduce-scatters by all-reducing a copy of the whole buffer and keeping its
    # shard (ProcessGroupGloo::reduce_scatter_tensor_coalesced): an all-reduce's time.
    reduce_scatter_is_all_reduce: bool = False
    # Whether a collective inside a node can run behind compute. False on the emulated
    # cluster: gloo over loopback copies through the kernel on the very cores that
    # compute, so an intra-node collective is host work, which nothing hides; nor, as
    # measured there, an all-to-all with several ranks on a node (cost._can_hide).
    intra_comm_hides: bool = True
    # The compute curve (lins_dtensor.planner.compute): kernel rates as shares of
    # peak_flops, each scaled by ``efficiency``. The defaults run every FLOP at
    # efficiency x peak: a rate measured on whole steps (``whole_step_rate``).
    gemm_efficiency: float = 1.0  # large GEMMs' share of peak (a matmul benchmark's best)
    gemm_call_s: float = 0.0  # seconds per GEMM call beyond its work at that rate
    attention_efficiency: float = 1.0  # causal attention's forward on long sequences
    attention_half_seq: float = 0.0  # sequence length at which attention runs at half that
    attention_backward_ratio: float = 2.0  # attention's backward seconds per forward second
    attention_causal_work: float = 1.0  # share of the s x s scores causal attention computes (flash: 0.5)
    # True where peak_flops x efficiency was measured on whole steps (the benchmark's
    # probe on CPU): it covers the elementwise work and the GEMMs' memory traffic, which
    # are then not timed apart at hbm_bw.
    whole_step_rate: bool = True
    # Seconds per value encoded or decoded in each lossy wire format (lins_dtensor.formats),
    # as ``lins-plan profile`` measures them; a format not named here is timed as the
    # memory-bound work of CODEC_BYTES_PER_VALUE at hbm_bw (not hashed: a dict).
    codec_s_per_value: dict[str, float] = dataclasses.field(default_factory=dict, hash=False)

    @property
    def copy_bandwidth(self) -> float:
        return self.hbm_bw if self.copy_bw is None else self.copy_bw

    def codec_seconds(self, fmt: str) -> float:
        """Seconds to encode or decode one value in the wire format ``fmt``."""
        if fmt in self.codec_s_per_value:
            return self.codec_s_per_value[fmt]
        return CODEC_BYTES_PER_VALUE[fmt] / self.hbm_bw

    def rank_memory(self, world_size: int) -> float:
        return self.memory_bytes / world_size if self.memory_shared_by_world else self.memory_bytes


# The compute curves of NVIDIA's training GPUs under PyTorch eager (cuBLAS GEMMs,
# FlashAttention-2 through SDPA, see the module docstring), before the fitted scale.
_FLASH_ATTENTION_2 = dict(attention_half_seq=138.0, attention_backward_ratio=3.8, attention_causal_work=0.5, whole_step_rate=False)
_AMPERE = dict(peak_flops=312e12, gemm_efficiency=0.859, attention_efficiency=0.523, **_FLASH_ATTENTION_2)
_HOPPER = dict(peak_flops=989e12, gemm_efficiency=0.801, attention_efficiency=0.353, **_FLASH_ATTENTION_2)
# The scale fitted to torchtitan's 8 x H100 HBM2e run (validation.py); the SXM parts and
# the H100 PCIe, which have no published single-node run here, take the A100's: the same
# software stack's distance from its kernel benchmarks.
_A100_SCALE = 0.776
_H100_500W_SCALE = 0.607

_A100_80GB = HardwareSpec("a100-80gb", 8, 80 * GiB, intra_bw=232 * GB, inter_bw=192 * GB, hbm_bw=2.039e12, efficiency=_A100_SCALE, **_AMPERE)
_H100_SXM = HardwareSpec("h100-sxm", 8, 80 * GiB, intra_bw=365 * GB, inter_bw=8 * 46 * GB, hbm_bw=3.35e12, efficiency=_A100_SCALE, **_HOPPER)
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100-80gb": _A100_80GB,  # a DGX A100: 8 x 200 Gb/s per node
    "a100-40gb": dataclasses.replace(_A100_80GB, name="a100-40gb", memory_bytes=40 * GiB, hbm_bw=1.555e12),
    "a800": dataclasses.replace(_A100_80GB, name="a800", intra_bw=156 * GB, inter_bw=91 * GB),
    "h100-sxm": _H100_SXM,  # 700 W, 80 GB HBM3
    # torchtitan's H100s: 96 GB HBM2e (2.4 TB/s) at 500 W, below an SXM part's clocks
    # (its own scale); 400 Gb/s per GPU between nodes.
    "h100-hbm2e": dataclasses.replace(
        _H100_SXM, name="h100-hbm2e", memory_bytes=96 * GiB, hbm_bw=2.4e12, inter_bw=8 * 50 * GB, efficiency=_H100_500W_SCALE,
    ),
    # 350 W, 80 GB HBM2e; NVLink bridges pair the cards, so a node's ring runs over
    # PCIe Gen5 x16 (64 GB/s, taken at the A100 ring's 78 % of its link: not measured).
    "h100-pcie": dataclasses.replace(_H100_SXM, name="h100-pcie", peak_flops=756e12, hbm_bw=2.0e12, intra_bw=50 * GB),
    "h200": dataclasses.replace(_H100_SXM, name="h200", memory_bytes=141 * GiB, hbm_bw=4.8e12),
    # The benchmark's emulated cluster: gloo over loopback inside a "node", a tbf
    # rate-limited veth (default 400 Mbit/s) between nodes, all on one 24 GiB host;
    # gloo has no tree all-reduce and reduce-scatters by all-reducing.
    "cpu-emulated": HardwareSpec(
        "cpu-emulated", 2, 24 * GiB, 30e9, 0.35 * GB, 400e6 / 8, 10e9,
        alpha_intra=50e-6, alpha_inter=200e-6, tree_alpha=math.inf, efficiency=0.5, reserved_bytes=0.3 * GiB, memory_shared_by_world=True,
        reduce_scatter_is_all_reduce=True, intra_comm_hides=False,
        # measure_codec_rates on the benchmark host, one thread as each emulated rank runs
        # (medians of 7; the eager int8 kernels are compute-bound there, not at hbm_bw).
        codec_s_per_value={"bf16": 0.61e-9, "int8": 29e-9},
    ),
}
# Names that other presets went by: "a100" and "h100" are the 80 GB SXM parts most
# clusters run; "cpu" the emulated cluster.
PRESET_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h100-500w": "h100-hbm2e", "cpu": "cpu-emulated"}


def hardware_preset(name: str) -> HardwareSpec:
    key = name.strip().lower().replace("_", "-")
    key = PRESET_ALIASES.get(key, key)
    if key not in HARDWARE_PRESETS:
        raise PlannerError(f"unknown hardware preset '{name}'; known: {', '.join([*HARDWARE_PRESETS, *PRESET_ALIASES])}")
    return HARDWARE_PRESETS[key]


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """``gpus`` ranks in nodes of ``gpus_per_node`` (consecutive ranks share a node).

    ``bandwidth`` is a measured :class:`~lins_dtensor.planner.bandwidth.BandwidthTable`
    (or None: the alpha-beta model of ``hardware``); ``memory_budget_bytes`` overrides
    the device memory. ``tp``: tensor-parallel degree, groups of ``tp`` consecutive
    ranks inside a node; the Lins plan then factors the ``dp_ranks`` data-parallel
    ranks, ``dp_per_node`` of them in each node.
    """

    gpus: int
    gpus_per_node: int
    hardware: HardwareSpec
    bandwidth: object | None = None
    memory_budget_bytes: float | None = None
    tp: int = 1

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise PlannerError(f"gpus={self.gpus} and gpus_per_node={self.gpus_per_node} must be >= 1")
        if self.gpus % self.gpus_per_node:
            raise PlannerError(f"gpus={self.gpus} is not divisible by gpus_per_node={self.gpus_per_node}")
        if self.tp < 1 or self.gpus_per_node % self.tp:
            raise PlannerError(f"tp={self.tp} must divide gpus_per_node={self.gpus_per_node}: tensor parallelism stays inside a node")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def dp_ranks(self) -> int:
        """Data-parallel ranks: what a Lins plan's factors count."""
        return self.gpus // self.tp

    @property
    def dp_per_node(self) -> int:
        return self.gpus_per_node // self.tp

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


HARDWARE_FORMAT = "lins-hardware/1"
_OPTIONAL_FLOATS = {"copy_bw"}  # None has a meaning (see HardwareSpec)
_MAY_BE_ZERO = {"unit_overhead_s", "replicated_unit_overhead_s", "gemm_call_s", "attention_half_seq"}
_SHARES = ("efficiency", "gemm_efficiency", "attention_efficiency", "attention_causal_work")  # in (0, 1]


def hardware_to_json(hw: HardwareSpec) -> dict:
    """A hardware file's content; infinities (no tree all-reduce) are written "inf",
    which strict JSON readers accept, unlike Infinity."""
    data: dict = {"format": HARDWARE_FORMAT}
    for key, value in dataclasses.asdict(hw).items():
        data[key] = "inf" if isinstance(value, float) and math.isinf(value) else value
    return data


def hardware_from_json(data: object, where: str = "hardware file") -> HardwareSpec:
    """The inverse of :func:`hardware_to_json`; every malformed field is a one-line PlannerError."""
    if not isinstance(data, dict) or data.get("format") != HARDWARE_FORMAT:
        raise PlannerError(f"{where} is not a '{HARDWARE_FORMAT}' JSON object (write one with 'lins-plan calibrate')")
    fields = {f.name: f for f in dataclasses.fields(HardwareSpec)}
    unknown = sorted(set(data) - set(fields) - {"format"})
    if unknown:
        raise PlannerError(f"{where}: unknown field '{unknown[0]}'")
    missing = [name for name, f in fields.items()
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in data]
    if missing:
        raise PlannerError(f"{where}: missing field '{missing[0]}'")
    kwargs: dict = {}
    for key, value in data.items():
        if key == "format":
            continue
        default = fields[key].default
        try:
            if key == "name":
                kwargs[key] = str(value)
            elif key == "codec_s_per_value":
                kwargs[key] = _codec_rates(value)
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ValueError
                kwargs[key] = value
            elif key == "ranks_per_node":
                if isinstance(value, bool) or int(value) != value or value < 1:
                    raise ValueError
                kwargs[key] = int(value)
            elif value is None and key in _OPTIONAL_FLOATS:
                kwargs[key] = None
            else:
                if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                    raise ValueError
                number = float(value)
                if not number >= 0 or (number == 0 and key not in _MAY_BE_ZERO):
                    raise ValueError
                kwargs[key] = number
        except (TypeError, ValueError):
            raise PlannerError(f"{where}: '{key}' = {value!r} is not valid") from None
    for key in _SHARES:
        if kwargs.get(key, 0) > 1:
            raise PlannerError(f"{where}: '{key}' = {kwargs[key]} must be in (0, 1]")
    return HardwareSpec(**kwargs)


def _codec_rates(value: object) -> dict[str, float]:
    """A hardware file's ``codec_s_per_value``: positive seconds per lossy format's name."""
    if not isinstance(value, dict):
        raise ValueError
    rates = {}
    for name, rate in value.items():
        if name not in FORMATS or not FORMATS[name].lossy or isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError
        rates[name] = float(rate)
    return rates


def save_hardware(hw: HardwareSpec, path: str | Path) -> None:
    Path(path).write_text(json.dumps(hardware_to_json(hw), indent=1) + "\n")


def load_hardware(path: str | Path) -> HardwareSpec:
    """A hardware file (from ``lins-plan calibrate``), used instead of a preset."""
    return hardware_from_json(read_json(path, "hardware file"), f"hardware file '{path}'")
