"""The compressed-collective targets over several recorded runs of the same code.

``python -m lins_dtensor.bench.targets DIR [DIR ...]`` (directories holding a run's
``cluster.json``).

One run times each row 5 times. On the 2-core emulation a row moved up to 1.2x between
runs of the same code an hour apart, and one row's [min, max] in a run spans up to
1.5x: more than the margins the targets ask for, so one run meets or misses a target by
noise. Several runs decide it. For each target (the planner's pick with lossy formats
allowed against the fastest exact strategy that fits its budget, and against DDP with
torch's bf16 hook where that fits; :data:`~.report.COMPRESSED_TARGETS`), each run gives
its ratio of medians (what ``cluster.md`` reports) and one ratio per timed round: the
two rows' steps of the same round, which run within a minute or two of each other in
the rotated order, so that a slow spell of the shared host lands on both. The verdict
is the pooled rounds' median with a bootstrap interval that resamples runs, then rounds
within each (runs differ by more than rounds do): **met** where the interval lies above
the target, **missed** where it lies below, **undecided** where it holds the target.

The emulation shares 2 cores between 8 ranks and whatever else runs on the host, while
its links are a fixed ``tc`` rate: on a busy host the compute is slower, the network a
smaller share of each step, and compression buys less. Each run records its host's
speed as the start-up forward+backward per micro-batch; ``--max-forward-backward S``
pools only the runs whose host was at least that fast, so that a pool by host speed
is chosen by a measurement, not by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path

from lins_dtensor.bench.report import COMPRESSED_TARGETS, exact_target

COMPRESSED = "lins-planner-compressed"
RESAMPLES = 4000
LEVEL = 0.9  # two-sided: the interval leaves 5 % of the resampled medians on each side


@dataclasses.dataclass(frozen=True)
class RunRatio:
    """One run's measurement of one target: the lossy pick against its comparator."""

    run: str
    pick: str  # plan and formats
    comparator: str  # strategy (plan)
    of_medians: float
    per_round: tuple[float, ...]


def _row(rows: list[dict], m: int, name: str) -> dict | None:
    """The row of M = ``m`` that cluster.md names "strategy (plan)" (plan "-" when none)."""
    strategy, plan = name.removesuffix(")").split(" (", 1)
    found = [r for r in rows if r["microbatches"] == m and r["strategy"] == strategy and (r["plan"] or "-") == plan]
    return found[0] if found else None


def run_ratios(run_dir: str | Path) -> dict[tuple[int, str, str], RunRatio]:
    """Every target one run measured, keyed by (M, budget, "exact" or "ddp-bf16-hook"),
    read from its comparisons (the same choice of comparator as its ``cluster.md``)."""
    run_dir = Path(run_dir)
    result = json.loads((run_dir / "cluster.json").read_text())
    rows = result["strategies"]
    out = {}
    for m_key, comparisons in result["comparisons"].items():
        m = int(m_key.removeprefix("M="))
        for r in rows:
            if r["microbatches"] != m or r["strategy"] != COMPRESSED:
                continue
            entry = comparisons[r["label"]]
            versus = {"exact": entry.get("fastest_exact_same_memory")}
            if "speedup_vs_ddp_bf16_hook" in entry:
                versus["ddp-bf16-hook"] = "ddp-bf16-hook (-)"
            for kind, name in versus.items():
                other = _row(rows, m, name) if name else None
                if other is None:
                    continue
                mine, theirs = r["step_time_s"]["samples"], other["step_time_s"]["samples"]
                ratio = RunRatio(run_dir.name, f"{r['plan']} {r['predicted'].get('formats', '')}".strip(), name,
                                 other["step_time_s"]["median"] / r["step_time_s"]["median"],
                                 tuple(t / s for s, t in zip(mine, theirs)))
                out[(m, entry["budget"], kind)] = ratio  # the budget the run compared it under
    return out


def target_of(m: int, kind: str) -> float:
    """The speed-up a target asks for."""
    return COMPRESSED_TARGETS["ddp_bf16_hook"] if kind == "ddp-bf16-hook" else exact_target(m)


def pooled_interval(runs: list[tuple[float, ...]], resamples: int = RESAMPLES, level: float = LEVEL,
                    seed: int = 0) -> tuple[float, float, float]:
    """The median of every run's per-round ratios pooled, and the ``level`` bootstrap
    interval of it: each resample draws the runs with replacement, then each drawn run's
    rounds with replacement."""
    rng = random.Random(seed)
    medians = []
    for _ in range(resamples):
        pooled = [x for run in rng.choices(runs, k=len(runs)) for x in rng.choices(run, k=len(run))]
        medians.append(statistics.median(pooled))
    medians.sort()
    tail = (1 - level) / 2
    low, high = medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]
    return statistics.median([x for run in runs for x in run]), low, high


def verdict(low: float, high: float, target: float) -> str:
    return "met" if low >= target else "missed" if high < target else "undecided"


def host_forward_backward_s(run_dir: str | Path) -> float:
    """The start-up forward+backward seconds per micro-batch a run measured: its host's speed."""
    result = json.loads((Path(run_dir) / "cluster.json").read_text())
    return result["meta"]["calibration"]["forward_backward_s"]


def pool(run_dirs: list[str | Path]) -> list[dict]:
    """Each target any of the runs measured, pooled over the runs that measured it."""
    per_run = [run_ratios(d) for d in run_dirs]
    out = []
    for key in sorted({k for ratios in per_run for k in ratios}, key=lambda k: (k[0], k[1] != "unlimited", k[2] != "exact")):
        m, budget, kind = key
        measured = [ratios[key] for ratios in per_run if key in ratios]
        median, low, high = pooled_interval([r.per_round for r in measured])
        target = target_of(m, kind)
        out.append({
            "microbatches": m, "budget": budget, "versus": kind, "target": target, "runs": len(measured),
            "rounds": sum(len(r.per_round) for r in measured), "met_in_runs": sum(r.of_medians >= target for r in measured),
            "of_medians": [round(r.of_medians, 3) for r in measured], "pooled_median": median, "interval": (low, high),
            "verdict": verdict(low, high, target), "picks": sorted({r.pick for r in measured}),
            "comparators": sorted({r.comparator for r in measured}),
        })
    return out


def markdown(pooled: list[dict]) -> str:
    lines = [f"| M | budget | versus | target | runs (met by medians) | each run's ratio of medians | per-round ratios pooled: median [{LEVEL:.0%} interval] | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for t in pooled:
        versus = "fastest exact that fits" if t["versus"] == "exact" else "DDP + bf16 hook"
        low, high = t["interval"]
        lines.append(f"| {t['microbatches']} | {t['budget']} | {versus} | {t['target']}x | {t['runs']} ({t['met_in_runs']}) | "
                     f"{', '.join(f'{x:.2f}' for x in t['of_medians'])} | {t['pooled_median']:.2f} [{low:.2f}, {high:.2f}] | "
                     f"**{t['verdict']}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lins_dtensor.bench.targets", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run directories, each with a cluster.json")
    p.add_argument("--json", action="store_true", help="print the pooled targets as JSON")
    p.add_argument("--max-forward-backward", type=float, metavar="S",
                   help="pool only the runs whose start-up forward+backward took at most S seconds per micro-batch")
    args = p.parse_args(argv)
    if args.max_forward_backward is not None and args.max_forward_backward <= 0:
        p.error(f"--max-forward-backward {args.max_forward_backward}: must be > 0 seconds per micro-batch")
    speeds = {run: host_forward_backward_s(run) for run in args.runs}
    runs = [run for run in args.runs if args.max_forward_backward is None or speeds[run] <= args.max_forward_backward]
    if not runs:
        p.error(f"--max-forward-backward {args.max_forward_backward}: no run was that fast "
                f"(fastest {min(speeds.values()):.3f} s per micro-batch)")
    pooled = pool(runs)
    if args.json:
        print(json.dumps(pooled, indent=1))
        return 0
    for run in args.runs:
        print(f"{run}: start-up forward+backward {speeds[run]:.3f} s per micro-batch{'' if run in runs else ' (left out)'}")
    print(markdown(pooled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
