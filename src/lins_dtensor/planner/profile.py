"""``lins-plan profile``: measure this cluster's collectives and this device's compute
curve for the planner.

Collectives (``--out``): run under torchrun (every rank runs it; gloo on CPU works). For
every group shape the search can need on this world size, all groups of that shape run
the collective at once, as the mesh dims do in training, so NIC sharing is measured, not
assumed. A point's time is the median over ``rounds`` of the slowest rank's mean over
``iters`` calls after a warm-up call; each round measures every point once, so a slow
spell of a shared host lands in one round of many points rather than in every call of a
few (on the 2-core emulated cluster single rounds of the intra-node points differed up to
3x between runs, enough to move the planner's picks).

Compute (``--hardware-out``, one process, or rank 0 under torchrun): bf16 GEMMs of a
transformer block's shapes and causal ``scaled_dot_product_attention`` forward and
backward at several sequence lengths, timed with CUDA events after warm-up (on CPU:
fp32, small shapes, host timers), to which the ceilings of the curve in
:mod:`lins_dtensor.planner.compute` are fitted: the GEMM ceiling, attention's ceiling and
half-rate sequence length, and its backward/forward time ratio. They are kernel rates,
so the scale ``efficiency`` (the distance of a training step from them) stays the
preset's until ``lins-plan calibrate`` fits it to a run. The same file gets the lossy
wire formats' encode and decode rates on this device (:func:`measure_codec_rates`,
``codec_s_per_value``), at which the planner times their codec work.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lins_dtensor.compat import all_gather_single, reduce_scatter_single
from lins_dtensor.formats import FORMATS
from lins_dtensor.plan import valid_plans
from lins_dtensor.planner.bandwidth import BandwidthTable, monotone
from lins_dtensor.planner.compute import attention, gemm
from lins_dtensor.planner.hardware import HardwareSpec, hardware_preset, save_hardware
from lins_dtensor.planner.models import PlannerError
from lins_dtensor.schedule import ALL_SPECS, LOSSY_CAPABLE, Op, group_size, group_stride, nodes_spanned

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise PlannerError(f"size '{text}' is not like 64KiB, 4MiB or 1024")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def message_sizes(smallest: int, largest: int, factor: int = 4) -> list[int]:
    if smallest < 1 or largest < smallest or factor < 2:
        raise PlannerError(f"need 1 <= min ({smallest}) <= max ({largest}) and factor >= 2")
    sizes, s = [], smallest
    while s < largest:
        sizes.append(s)
        s *= factor
    return sizes + [largest]


def needed_shapes(world_size: int, ranks_per_node: int) -> list[tuple[str, int, int]]:
    """(op, group ranks per node, nodes) of every collective any valid plan issues, in
    any wire format (a lossy reduction is an all-to-all, see ``schedule.Encoded``)."""
    shapes: set[tuple[str, int, int]] = set()
    for plan in valid_plans(world_size, ranks_per_node, with_hpz=True):
        groups = [(spec.op.value, group_size(plan, world_size, spec.mesh_dim), group_stride(plan, spec.mesh_dim)) for spec in ALL_SPECS]
        groups += [(Op.ALL_TO_ALL.value, group_size(plan, world_size, spec.mesh_dim), group_stride(plan, spec.mesh_dim))
                   for spec in LOSSY_CAPABLE if spec.op is not Op.ALL_GATHER]
        if not isinstance(plan.reshard_after_forward, bool):
            groups.append(("all_gather", plan.reshard_after_forward, 1))
        for op, size, stride in groups:
            if size > 1:
                nodes = nodes_spanned(size, stride, ranks_per_node)
                shapes.add((op, size // nodes, nodes))
    return sorted(shapes)


def shape_groups(world_size: int, ranks_per_node: int, r: int, nodes: int) -> list[list[int]]:
    """A partition of the world into groups with ``r`` ranks on each of ``nodes`` nodes."""
    stride = 1 if nodes == 1 or r == ranks_per_node else ranks_per_node // r
    size = r * nodes
    span = size * stride
    return [[hi * span + k * stride + lo for k in range(size)] for hi in range(world_size // span) for lo in range(stride)]


def profile_bandwidth(
    sizes: list[int], *, ranks_per_node: int, iters: int = 5, rounds: int = 3,
    shapes: list[tuple[str, int, int]] | None = None, dtype=None,
) -> BandwidthTable:
    """Measure every needed shape at every message size (a collective: all ranks call it)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ranks_per_node:
        raise PlannerError(f"world size {world} is not divisible by ranks_per_node={ranks_per_node}")
    if rounds < 1 or iters < 1:
        raise PlannerError(f"profile: --rounds ({rounds}) and --iters ({iters}) must be at least 1")
    dtype = dtype or torch.float32
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    elem = torch.empty((), dtype=dtype).element_size()
    shapes = needed_shapes(world, ranks_per_node) if shapes is None else shapes
    groups_by_shape = {}
    for _, r, m in shapes:
        if (r, m) not in groups_by_shape:
            # Every rank creates every group, in the same order.
            mine, _ = dist.new_subgroups_by_enumeration(shape_groups(world, ranks_per_node, r, m))
            groups_by_shape[(r, m)] = mine
    by_round: dict[tuple[str, int, int], list[list[tuple[float, float]]]] = {shape: [] for shape in shapes}
    for _ in range(rounds):
        for op, r, m in shapes:
            group, n = groups_by_shape[(r, m)], r * m
            points = []
            for nbytes in sizes:
                numel = message_numel(nbytes, elem, n)
                points.append((float(numel * elem), time_collective(op, group, n, numel, dtype, device, iters)))
            by_round[(op, r, m)].append(points)
    entries = {shape: monotone(median_over_rounds(rounds_)) for shape, rounds_ in by_round.items()}
    spread = max(max(times) / min(times) for rounds_ in by_round.values() for _, times in _times_by_size(rounds_))
    meta = {"world_size": world, "backend": dist.get_backend(), "dtype": str(dtype), "iters": iters, "rounds": rounds,
            "largest_round_spread": round(spread, 3), "rank": rank}
    return BandwidthTable(ranks_per_node, entries, meta)


def median_over_rounds(rounds: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Each message size's median time over rounds (each round: (bytes, seconds) per size)."""
    return [(size, statistics.median(times)) for size, times in _times_by_size(rounds)]


def _times_by_size(rounds: list[list[tuple[float, float]]]) -> list[tuple[float, list[float]]]:
    return [(points[0][0], [seconds for _, seconds in points]) for points in zip(*rounds)]


def message_numel(nbytes: int, element_bytes: int, n: int) -> int:
    """The values of a profiled message of about ``nbytes`` over ``n`` ranks (the
    all-gather's output, the reduce-scatter's and all-to-all's input, the all-reduce's
    tensor): a multiple of ``n``, at least one value per rank."""
    return max(n, (nbytes // element_bytes) // n * n)


def time_collective(op: str, group, n: int, numel: int, dtype: torch.dtype, device: torch.device, iters: int) -> float:
    """The slowest rank's mean seconds per call of ``op`` on ``numel`` values over ``n``
    ranks, after a warm-up call and a barrier (a collective over the default group: every
    rank calls it). The bandwidth table's points, and the benchmark's in-run probe of the
    collectives inside a node, which is compared with them."""
    big = torch.ones(numel, dtype=dtype, device=device)
    small = torch.ones(numel // n, dtype=dtype, device=device)
    if op == "all_gather":
        call = lambda: all_gather_single(big, small, group=group)  # noqa: E731
    elif op == "reduce_scatter":
        call = lambda: reduce_scatter_single(small, big, group=group)  # noqa: E731
    elif op == "all_to_all":
        out = torch.empty_like(big)
        call = lambda: dist.all_to_all_single(out, big, group=group)  # noqa: E731
    else:
        call = lambda: dist.all_reduce(big, group=group)  # noqa: E731
    call()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass(frozen=True)
class KernelShapes:
    """What the compute profile times: GEMMs (M tokens, N, K) and causal attention of
    ``heads`` x ``head_dim`` at each of ``seq_lens``, ``tokens`` per call (batch =
    tokens / seq_len)."""

    gemms: tuple[tuple[int, int, int], ...]
    heads: int
    head_dim: int
    seq_lens: tuple[int, ...]
    tokens: int


# A Llama 3 8B block at 4096 tokens per micro-batch (d x d, d -> ffn, ffn -> d) and a
# large square GEMM; attention as its 32 heads of 128 from 512 to 8192 tokens.
GPU_SHAPES = KernelShapes(((4096, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 14336), (8192, 8192, 8192)), 32, 128, (512, 1024, 2048, 4096, 8192), 16384)
# The same code path in CI: shapes that take a few milliseconds on a CPU core (attention
# over 2048 tokens: at 256 a busy core timed its backward as free).
CPU_SHAPES = KernelShapes(((128, 256, 256), (256, 512, 256), (256, 256, 512)), 4, 32, (64, 128, 256), 2048)


@dataclasses.dataclass(frozen=True)
class GemmTiming:
    m: int
    n: int
    k: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class AttentionTiming:
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    forward_s: float
    backward_s: float


def _seconds(call: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Seconds of ``call`` after ``warmup`` calls: on a GPU the mean, from CUDA events
    around the queued calls (device time: the host queues kernels this large faster than
    they run); on CPU the median of each call's host time (a call the scheduler preempted
    does not move it)."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    times = []
    for _ in range(iters):
        start_s = time.perf_counter()
        call()
        times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def measure_kernels(shapes: KernelShapes, device: torch.device, dtype: torch.dtype, iters: int) -> tuple[list[GemmTiming], list[AttentionTiming]]:
    """Time every GEMM and attention shape on ``device``."""
    gemms = []
    for m, n, k in shapes.gemms:
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        gemms.append(GemmTiming(m, n, k, _seconds(lambda: torch.mm(a, b), device, iters)))
    attentions = []
    for seq in shapes.seq_lens:
        batch = max(1, shapes.tokens // seq)
        q, k, v = (torch.randn(batch, shapes.heads, seq, shapes.head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(batch, shapes.heads, seq, shapes.head_dim, device=device, dtype=dtype)

        def forward() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        forward_s = _seconds(forward, device, iters)  # as in training: saving what backward needs
        both_s = _seconds(lambda: torch.autograd.grad(forward(), (q, k, v), grad), device, iters)
        if both_s <= forward_s:
            raise PlannerError(f"attention at sequence {seq}: forward + backward timed no slower than forward alone; rerun with more --iters")
        attentions.append(AttentionTiming(batch, shapes.heads, seq, shapes.head_dim, forward_s, both_s - forward_s))
    return gemms, attentions


CODEC_VALUES = 1 << 22  # 4M values: each kernel a pass over a buffer far beyond the caches


def measure_codec_rates(device: torch.device, numel: int = CODEC_VALUES, iters: int = 5) -> dict[str, float]:
    """Seconds per value encoded or decoded by each lossy wire format's own kernels
    (:mod:`lins_dtensor.formats`) on ``device``: fp32 values cut into one row, as
    :func:`lins_dtensor.schedule.codec_values` counts values (each encode and each
    decode of a value once), so the rate is the mean of the two passes. (The emulated
    cluster's benchmark times the same kernels in its start-up rounds instead, beside
    the same work on every rank: ``lins_dtensor.bench.measure.calibrate``.)"""
    values = torch.randn(numel, device=device)
    rates = {}
    for name, fmt in FORMATS.items():
        if not fmt.lossy:
            continue
        out = torch.empty(fmt.chunk_bytes(numel, 4), dtype=torch.uint8, device=device)
        encode_s = _seconds(lambda: fmt.encode(values, 1, out), device, iters)
        decode_s = _seconds(lambda: fmt.decode(out, 1, numel), device, iters)
        rates[name] = (encode_s + decode_s) / (2 * numel)
    return rates


def _minimize(f: Callable[[float], float], lo: float, hi: float, points: int = 25, iters: int = 60) -> float:
    """The minimum of a one-dimensional loss on [lo, hi]: the best of a grid, refined by
    golden-section search between its neighbours."""
    grid = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
    best = min(range(points), key=lambda i: f(grid[i]))
    a, b = grid[max(best - 1, 0)], grid[min(best + 1, points - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(iters):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def fit_compute_curve(base: HardwareSpec, gemms: list[GemmTiming], attentions: list[AttentionTiming], element_bytes: int) -> HardwareSpec:
    """``base`` with its compute curve's ceilings fitted to kernel timings by least
    squares of log(predicted / measured) time, each prediction from
    :mod:`lins_dtensor.planner.compute` at ``efficiency`` 1 (kernel rates). A device that
    beats ``base``'s peak raises the peak to its fastest ceiling (shares stay <= 1)."""
    if not gemms or len({t.seq_len for t in attentions}) < 2:
        raise PlannerError("the compute fit needs GEMM timings and attention at two sequence lengths or more")
    kernel_rates = dataclasses.replace(base, efficiency=1.0)

    def gemm_loss(log_ceiling: float) -> float:
        hw = dataclasses.replace(kernel_rates, gemm_efficiency=math.exp(log_ceiling))
        return sum(math.log(gemm(hw, t.m, t.n, t.k, element_bytes).seconds / t.seconds) ** 2 for t in gemms)

    gemm_ceiling = math.exp(_minimize(gemm_loss, math.log(1e-3), math.log(1e3)))

    def attention_fit(half_seq: float) -> tuple[float, float]:
        """The best attention ceiling at this half-rate sequence, and its loss: time goes
        as 1 / ceiling, so the best is the geometric mean of predicted / measured."""
        hw = dataclasses.replace(kernel_rates, attention_efficiency=1.0, attention_half_seq=half_seq)
        logs = [math.log(attention(hw, t.batch, t.heads, t.seq_len, t.head_dim).seconds / t.forward_s) for t in attentions]
        mean = sum(logs) / len(logs)
        return math.exp(mean), sum((x - mean) ** 2 for x in logs)

    half_seq = _minimize(lambda h: attention_fit(h)[1], 0.0, 4.0 * max(t.seq_len for t in attentions))
    attention_ceiling = attention_fit(half_seq)[0]
    backward_ratio = math.exp(sum(math.log(t.backward_s / t.forward_s) for t in attentions) / len(attentions))
    peak = base.peak_flops * max(1.0, gemm_ceiling, attention_ceiling)
    shares = base.peak_flops / peak
    # The fastest ceiling's share is 1 up to rounding (x * (p / (p * x)) can be 1 + 2e-16,
    # which a hardware file may not hold): capped.
    return dataclasses.replace(
        base, name=f"{base.name} (profiled)", peak_flops=peak, gemm_efficiency=min(1.0, gemm_ceiling * shares),
        attention_efficiency=min(1.0, attention_ceiling * shares), attention_half_seq=half_seq, attention_backward_ratio=backward_ratio,
    )


def profile_compute(base: HardwareSpec, device: torch.device, iters: int = 5) -> tuple[HardwareSpec, str]:
    """Measure this device's kernels (bf16 on a GPU, fp32 on CPU, as the presets' peaks
    count) and fit ``base``'s curve to them; the fitted spec and a report of each
    measured rate next to the fitted curve's."""
    shapes, dtype = (GPU_SHAPES, torch.bfloat16) if device.type == "cuda" else (CPU_SHAPES, torch.float32)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    gemms, attentions = measure_kernels(shapes, device, dtype, iters)
    codec = measure_codec_rates(device, iters=iters)
    hw = dataclasses.replace(fit_compute_curve(base, gemms, attentions, element_bytes), codec_s_per_value=codec)
    kernel_rates = dataclasses.replace(hw, efficiency=1.0)
    raised = f", raised to {hw.peak_flops / 1e12:.4g}: this device beats it" if hw.peak_flops > base.peak_flops else ""
    lines = [f"compute curve of {device} ({dtype}) as shares of {base.name}'s peak {base.peak_flops / 1e12:.4g} TFLOP/s{raised}:",
             f"  GEMM ceiling {hw.gemm_efficiency:.3f}, attention ceiling {hw.attention_efficiency:.3f} at half rate below "
             f"{hw.attention_half_seq:.0f} tokens, backward {hw.attention_backward_ratio:.2f}x forward; efficiency {hw.efficiency:.3f} "
             "kept (the training scale: 'lins-plan calibrate' fits it to a run)",
             f"  {'kernel':<30} {'measured TFLOP/s':>17} {'curve TFLOP/s':>14}"]
    for t in gemms:
        k = gemm(kernel_rates, t.m, t.n, t.k, element_bytes)
        lines.append(f"  {f'GEMM {t.m}x{t.n}x{t.k}':<30} {k.flops / t.seconds / 1e12:17.4g} {k.flops / k.seconds / 1e12:14.4g}")
    for t in attentions:
        k = attention(kernel_rates, t.batch, t.heads, t.seq_len, t.head_dim)
        lines.append(f"  {f'attention fwd seq {t.seq_len} x{t.batch}':<30} {k.flops / t.forward_s / 1e12:17.4g} {k.flops / k.seconds / 1e12:14.4g}")
    lines.append("  wire formats' encode/decode (codec_s_per_value), ns per value: "
                 + ", ".join(f"{name} {rate * 1e9:.3g} (preset {base.codec_seconds(name) * 1e9:.3g})" for name, rate in codec.items()))
    return hw, "\n".join(lines)


def _write_compute_profile(preset: str, out: str, iters: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    hw, text = profile_compute(hardware_preset(preset), device, iters)
    try:
        save_hardware(hw, out)
    except OSError as exc:
        raise PlannerError(f"cannot write '{out}': {exc.strerror}") from None
    print(f"{text}\nlins-plan profile: wrote {out}: use it with 'lins-plan --hardware-file {out}'")


def run_profile(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lins-plan profile", description="Measure all_gather / reduce_scatter / all_reduce / all_to_all times "
                                "for every group shape the planner needs (--out; run under torchrun), and/or this device's GEMM and "
                                "attention rates and wire formats' encode/decode rates (--hardware-out; no torchrun needed).")
    p.add_argument("--out", help="bandwidth table JSON to write (rank 0)")
    p.add_argument("--hardware-out", metavar="FILE", help="fit --hardware's compute curve to this device's kernels and write a "
                   "hardware file for --hardware-file (under torchrun: rank 0's device)")
    p.add_argument("--hardware", help="preset the hardware file starts from (peak FLOP/s, memory, network); required with --hardware-out")
    p.add_argument("--min-size", default="64KiB")
    p.add_argument("--max-size", default="256MiB")
    p.add_argument("--factor", type=int, default=4, help="ratio between consecutive message sizes")
    p.add_argument("--iters", type=int, default=5, help="calls per point and round (their mean is the round's time)")
    p.add_argument("--rounds", type=int, default=3, help="times every point is measured; the table keeps each point's median")
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE (set by torchrun)")
    p.add_argument("--backend", default=None, help="default: nccl with CUDA, else gloo")
    args = p.parse_args(argv)
    if not args.out and not args.hardware_out:
        raise PlannerError("profile: give --out (collectives, under torchrun) and/or --hardware-out (this device's compute)")
    if args.hardware_out and not args.hardware:
        raise PlannerError("profile: --hardware-out needs --hardware PRESET, the part whose peak, memory and network it keeps")
    if not args.out:
        hardware_preset(args.hardware)  # a bad name fails before the measurement
        _write_compute_profile(args.hardware, args.hardware_out, args.iters)
        return 0
    sizes = message_sizes(parse_size(args.min_size), parse_size(args.max_size), args.factor)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise PlannerError("lins-plan profile --out must run under torchrun (RANK / WORLD_SIZE are not set)")
    if args.hardware_out:
        hardware_preset(args.hardware)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        rpn = args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        table = profile_bandwidth(sizes, ranks_per_node=rpn, iters=args.iters, rounds=args.rounds)
        if dist.get_rank() == 0:
            table.save(args.out)
            print(f"lins-plan profile: {len(table.entries)} shapes x {len(sizes)} sizes -> {args.out}")
            if args.hardware_out:
                _write_compute_profile(args.hardware, args.hardware_out, args.iters)
    finally:
        dist.destroy_process_group()
    return 0
