"""Convergence of Lins' wire formats against exact (fp32) training (issue 20).

``run`` trains the debug LLaMA on 4 CPU ranks through torchtitan 0.2.2 (the
``lins_dtensor.train`` launcher, ``train_configs/llama3_debug_cpu_convergence.toml``)
and writes its per-step losses to ``bench/results/convergence/<name>.json``; ``report``
turns those files into ``docs/convergence.md`` and ``docs/convergence.png``.

Why the rule is what it is (the report states it too): every run sees the same batches
in the same order (the corpus is not shuffled; the seed only changes the initial
weights), so the exact runs' seeds spread only by their starting point and where it
leads. The band is the per-step [min, max] over the exact runs. Single-step losses jump
with the batch, so the decisive comparison is on a trailing mean over ``WINDOW`` steps,
with the raw band's gap reported next to it. A band of three seeds is narrow: a fourth
exact seed would leave it at some step, and a compressed run started from seed 0's
weights sits next to seed 0, which is an edge of the band wherever seed 0 is the highest
or lowest seed. So a format counts as inside when its smoothed gap is no larger than the
largest gap by which an exact seed leaves the band of the other exact seeds
(leave-one-out); the strict gap against all of them is reported as well.

Run ``python -m lins_dtensor.bench.convergence run --name fp32-seed0 --seed 0`` (extra
trainer arguments after ``--``, e.g. ``-- --lins.comm_formats grads=int8``) and
``python -m lins_dtensor.bench.convergence report``; ``scripts/convergence.sh`` wraps both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import tomllib

from lins_dtensor.formats import CommFormats

ROOT = Path.cwd()
"""The repository root: run from there (scripts/convergence.sh does)."""
CONFIG = "train_configs/llama3_debug_cpu_convergence.toml"
RESULTS = Path("bench/results/convergence")
WINDOW = 10
"""Steps in the trailing mean that smooths single-step losses (the decisive comparison)."""
LAST = 10
"""Final steps averaged for the reported final loss next to the last step's."""
CLUSTER = Path("bench/results/cluster.json")
"""The emulated-cluster benchmark whose step times turn steps to loss into seconds."""
HOOK_FORMATS = {"ddp-bf16-hook": "ddp bf16_compress_hook", "ddp-powersgd": "ddp powerSGD rank 4"}
"""The ``formats`` of the convergence runs of torch DDP's hooks, by benchmark strategy."""
TTL_STRATEGIES = ("lins-planner", "lins-planner-compressed", "ddp", "ddp-bf16-hook", "ddp-powersgd")
"""The benchmark rows given a time to loss: Lins' picks (exact, lossy) and DDP's hooks."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - root - INFO - step:\s*(\d+)\s+loss:\s*(\S+)")


# ---------------------------------------------------------------- band arithmetic


def smooth(losses: list[float], window: int = WINDOW) -> list[float]:
    """Trailing mean over ``window`` steps (fewer at the start, where fewer exist)."""
    out, total = [], 0.0
    for i, x in enumerate(losses):
        total += x
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


def band(curves: list[list[float]]) -> tuple[list[float], list[float]]:
    """Per-step (min, max) over ``curves``, which must have the same length."""
    if len({len(c) for c in curves}) != 1:
        raise ValueError(f"band: curves of different lengths {[len(c) for c in curves]}")
    return [min(xs) for xs in zip(*curves)], [max(xs) for xs in zip(*curves)]


def gap(curve: list[float], lo: list[float], hi: list[float]) -> tuple[float, int | None]:
    """Largest distance of ``curve`` outside [lo, hi] and its (1-based) step; (0, None)
    when it stays inside."""
    worst, at = 0.0, None
    for step, (x, a, b) in enumerate(zip(curve, lo, hi, strict=True), start=1):
        if math.isnan(x):
            return math.inf, step
        d = max(a - x, x - b)
        if d > worst:
            worst, at = d, step
    return worst, at


def leave_one_out_gap(curves: list[list[float]]) -> float:
    """Largest gap of one curve against the band of the others: how far an exact run
    leaves a band it is not part of (the tolerance of the decision)."""
    worst = 0.0
    for i, c in enumerate(curves):
        rest = curves[:i] + curves[i + 1:]
        worst = max(worst, gap(c, *band(rest))[0])
    return worst


def time_to_loss(curve: list[float], target: float) -> int | None:
    """First (1-based) step at which ``curve`` reaches ``target`` or below; None if never."""
    return next((step for step, x in enumerate(curve, start=1) if x <= target), None)


def run_formats(row: dict) -> str:
    """The convergence ``formats`` that trains like benchmark row ``row``: a DDP hook's,
    or the Lins formats as CommFormats text ("exact" for exact training of any kind)."""
    return HOOK_FORMATS.get(row["strategy"]) or str(CommFormats.from_json(row["formats"]))


def cluster_time_to_loss(a: dict, cluster: dict) -> list[dict]:
    """Per benchmark row of :data:`TTL_STRATEGIES`: the steps its training needs to reach
    the target (the seed-0 convergence run of its formats: seed 0 started every lossy
    run) times its median step time on the emulated cluster. ``steps`` is None when
    the run never reached the target and ``run`` None when no run trained that way."""
    def key(formats: str) -> str:
        return formats if formats in HOOK_FORMATS.values() else str(CommFormats.parse(formats))

    seed0 = {}
    for r in a["rows"]:  # the band's own seed-0 run first: exact training of any plan is one sum
        if r.seed == 0:
            seed0.setdefault(key(r.formats), r)
    out = []
    for row in cluster["strategies"]:
        if row["strategy"] not in TTL_STRATEGIES:
            continue
        formats = run_formats(row)
        trained = seed0.get(key(formats))
        median = row["step_time_s"]["median"]
        steps = None if trained is None else trained.ttl
        out.append({"microbatches": row["microbatches"], "strategy": row["strategy"], "plan": row["plan"],
                    "chosen_for": row.get("chosen_for"), "formats": formats, "median_s": median,
                    "run": None if trained is None else trained.name, "steps": steps,
                    "seconds": None if steps is None else steps * median})
    return out


# ---------------------------------------------------------------- running


def parse_log(text: str) -> tuple[list[float], list[float | None]]:
    """Rank 0's per-step losses and step wall times (from torchtitan's millisecond log
    timestamps; step 1 has none: nothing before it is a step)."""
    losses: dict[int, float] = {}
    stamps: dict[int, datetime] = {}
    for line in _ANSI.sub("", text).splitlines():
        m = _STEP.search(line)
        if m:
            step = int(m.group(2))
            losses[step] = float(m.group(3))
            stamps[step] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
    steps = sorted(losses)
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(f"log: steps {steps[:3]}...{steps[-3:]} are not 1..N")
    times: list[float | None] = [None] + [(stamps[s] - stamps[s - 1]).total_seconds() for s in steps[1:]]
    return [losses[s] for s in steps], times


def _arg(extra: list[str], key: str) -> str | None:
    """The value of ``--key value`` or ``--key=value`` in the trainer arguments."""
    for i, a in enumerate(extra):
        if a == key and i + 1 < len(extra):
            return extra[i + 1]
        if a.startswith(key + "="):
            return a.split("=", 1)[1]
    return None


def current_commit() -> str:
    """The checkout's commit, "+dirty" with uncommitted changes to tracked files."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout.strip()
    return head + ("+dirty" if dirty else "")


def run(name: str, seed: int, extra: list[str], config: str = CONFIG, nproc: int = 4, timeout_s: int = 3600) -> dict:
    """Train one run and write its JSON; the full rank-0 log goes to outputs/convergence/."""
    command = ["torchrun", "--standalone", "--nproc_per_node", str(nproc), "--local-ranks-filter", "0",
               "--role", "rank", "--tee", "3", "-m", "lins_dtensor.train", "--job.config_file", config,
               "--debug.seed", str(seed), *extra]
    log_path = ROOT / "outputs" / "convergence" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    started, commit = datetime.now(timezone.utc), current_commit()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                              check=False)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"convergence: {name} failed (exit {proc.returncode}); see {log_path}")
    losses, times = parse_log(log_path.read_text())
    with open(ROOT / config, "rb") as f:
        toml = tomllib.load(f)
    result = {
        "name": name,
        "seed": seed,
        "plan": _arg(extra, "--lins.plan") or toml["lins"]["plan"],
        "formats": _arg(extra, "--lins.comm_formats") or toml["lins"].get("comm_formats", "exact"),
        "config": config,
        "steps": len(losses),
        "losses": losses,
        "step_times_s": times,
        "wall_s": round(wall, 1),
        "started_utc": started.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": commit,
        "command": " ".join(shlex.quote(c) for c in command),
    }
    out = ROOT / RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"convergence: {name}: {len(losses)} steps, final loss {losses[-1]:.4f}, {wall:.0f} s -> {out.relative_to(ROOT)}")
    return result


# ---------------------------------------------------------------- report


@dataclass
class Row:
    """One run's line in the report."""

    name: str
    plan: str
    formats: str
    seed: int
    in_band: bool
    final: float
    final_mean: float
    raw_gap: float
    raw_gap_step: int | None
    smooth_gap: float
    smooth_gap_step: int | None
    ttl: int | None
    vs_seed: float | None
    """Largest |smoothed difference| from the exact run of the same seed, of the same plan
    if there is one, else the band's (None: none)."""
    median_step_s: float | None
    wall_s: float
    commit: str
    band_plan: str  # the plan of the exact seeds whose band this run is judged against
    tolerance: float  # that band's


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else None


def band_runs(runs: list[dict]) -> list[dict]:
    """The exact runs of the plan with the most exact runs (on a tie, the plan of the
    earliest): the seeds that make the main band. An exact run of another plan (e.g. ddp
    next to p=1,g=2,os=4) is the same training summed in another order, so it is compared
    with the band, not part of it."""
    exact = sorted((r for r in runs if r["formats"] == "exact"), key=lambda r: r["started_utc"])
    counts = Counter(r["plan"] for r in exact)
    if not counts or max(counts.values()) < 2:
        raise ValueError(f"report: the band needs at least 2 exact seeds of one plan (exact runs: "
                         f"{[(r['name'], r['plan']) for r in exact]})")
    plan = next(r["plan"] for r in exact if counts[r["plan"]] == max(counts.values()))
    return [r for r in exact if r["plan"] == plan]


def _band_of(seeds: list[dict]) -> dict:
    """The smoothed and raw band of exact ``seeds``, their tolerance and their target."""
    raw = [r["losses"] for r in seeds]
    sm = [smooth(c) for c in raw]
    raw_lo, raw_hi = band(raw)
    lo, hi = band(sm)
    return {"plan": seeds[0]["plan"], "seeds": [r["name"] for r in seeds], "lo": lo, "hi": hi, "raw_lo": raw_lo,
            "raw_hi": raw_hi, "target": sum(c[-1] for c in sm) / len(sm), "mean": [sum(xs) / len(xs) for xs in zip(*sm)],
            "tolerance": leave_one_out_gap(sm), "raw_tolerance": leave_one_out_gap(raw),
            "width": _median([b - a for a, b in zip(lo, hi)])}


def analyse(runs: list[dict]) -> dict:
    """The main band (its tolerance, target) and one Row per run (the band's seeds
    first) from run dicts of one length. A plan with exact runs of 2 seeds or more besides
    the main band's has its own band ("plan_bands"): its compressed runs are judged against
    it (where P is sharded torchtitan initialises the sharded weights, from other values
    than the unsharded plans' for the same seed); exact runs of other plans are judged
    against the main band."""
    seeds = band_runs(runs)
    main = _band_of(seeds)
    exact_by_plan: dict[str, list[dict]] = {}
    for r in runs:
        if r["formats"] == "exact":
            exact_by_plan.setdefault(r["plan"], []).append(r)
    plan_bands = {plan: _band_of(rs) for plan, rs in exact_by_plan.items()
                  if plan != main["plan"] and len({r["seed"] for r in rs}) >= 2}
    by_seed = {r["seed"]: smooth(r["losses"]) for r in seeds}
    exact = {(r["plan"], r["seed"]): smooth(r["losses"]) for r in runs if r["formats"] == "exact"}
    rows, twins = [], {}
    for r in sorted(runs, key=lambda r: (r not in seeds, r["plan"], r["formats"] != "exact", r["formats"], r["seed"])):
        own = plan_bands.get(r["plan"]) if r["formats"] != "exact" else None
        b = own or main
        losses = r["losses"]
        s = smooth(losses)
        rg, rs = gap(losses, b["raw_lo"], b["raw_hi"])
        sg, ss = gap(s, b["lo"], b["hi"])
        twin = by_seed.get(r["seed"])
        if r["formats"] != "exact":
            twin = exact.get((r["plan"], r["seed"]), twin)
        vs_seed = None if twin is None else max(abs(x - y) for x, y in zip(s, twin, strict=True))
        if twin is not None and r not in seeds:
            twins[r["name"]] = twin
        rows.append(Row(r["name"], r["plan"], r["formats"], r["seed"], r in seeds, losses[-1],
                        sum(losses[-LAST:]) / LAST, rg, rs, sg, ss, time_to_loss(s, b["target"]), vs_seed,
                        _median([t for t in r["step_times_s"] if t is not None]), r["wall_s"], r["commit"],
                        b["plan"], b["tolerance"]))
    return {**main, "rows": rows, "twins": twins, "plan_bands": plan_bands}


def _fmt(x: float, digits: int = 4) -> str:
    return "inf (nan loss)" if math.isinf(x) else f"{x:.{digits}f}"


def markdown(runs: list[dict], a: dict, plot: str) -> str:
    """docs/convergence.md: setup, rule, the tables and every run's provenance."""
    first = runs[0]
    seeds = [r for r in a["rows"] if r.in_band]
    others = [r for r in a["rows"] if not r.in_band]
    lines = [
        "# Convergence of Lins' wire formats",
        "",
        "Generated by `python -m lins_dtensor.bench.convergence report` (`scripts/convergence.sh report`) "
        f"from `{RESULTS}/*.json`; each run by `scripts/convergence.sh run` (its command below).",
        "",
        "## Setup",
        "",
        f"torchtitan 0.2.2, LLaMA-3 debug model, the offline `python_stdlib` corpus, 4 CPU ranks (gloo) as "
        f"2 emulated nodes x 2 ranks (`ranks_per_node = 2`), {first['steps']} steps, config `{first['config']}`: "
        "AdamW with torchtitan's defaults (lr 8e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1), gradient "
        "clipping at norm 1.0, torchtitan's default schedule (200 warmup steps of 10000, linear decay to 0) "
        "scaled to 300 steps: 6 warmup steps, then linear decay to 0; local batch 2 x 256 tokens per rank, "
        "fp32 parameters and reductions, no activation checkpointing, no checkpoints. The seed "
        "(`--debug.seed`) sets the initial weights; the batches are the same for every run. "
        f"Plan `{a['plan']}`: gradients reduced inside each node, then across the nodes to the optimizer's "
        "4 shards; the updated parameters gathered back across the nodes. A run of another plan (`ddp`: one "
        "all-reduce of the gradients over the 4 ranks, across the nodes) is compared with the same band: exact "
        "training under either plan is the same sum in another order.",
        "",
        "## Rule",
        "",
        f"- **Band**: per step, the [min, max] of the {len(seeds)} exact (fp32) seeds' losses (plan "
        f"`{a['plan']}`). The decisive curves are **smoothed** by a trailing mean over {WINDOW} steps (fewer "
        "for the first steps); the raw per-step band is reported too.",
        "- **Gap**: the largest distance by which a run's curve leaves the band, over all steps (0 inside).",
        "- **From its seed**: the largest distance, smoothed, from the exact run of the same seed (same initial "
        "weights, same batches), of the same plan where there is one: what the format alone changes.",
        f"- **Tolerance**: {_fmt(a['tolerance'])} (smoothed; raw {_fmt(a['raw_tolerance'])}), the largest "
        "gap of one exact seed against the band of the other exact seeds. A band of few seeds is narrow, "
        "and a compressed run started from seed 0 sits next to seed 0, an edge of the band wherever seed 0 is "
        "the highest or lowest seed: a run is **inside** when its smoothed gap is at most this tolerance, "
        "i.e. it leaves the band by no more than exact training from another seed does. Formats that are "
        "not inside are not offered by the planner.",
        "- **Band of its plan**: a compressed run of a plan with 2 exact seeds or more of its own is judged "
        "against that plan's band, its tolerance and its target (column 'band'): where P is sharded, "
        "torchtitan initialises the sharded weights, and for the same seed they are not the unsharded plans' "
        "(exact training from them is another curve; tests/test_torchtitan.py checks Lins against torchtitan's "
        "own HSDP from that initialisation). Exact runs of other plans are compared with the main band.",
        f"- **Final loss**: the last step's loss, and the mean of the last {LAST} steps.",
        f"- **Time to loss**: the first step at which the run's smoothed loss reaches {a['target']:.4f}, the "
        f"exact seeds' mean smoothed loss at step {first['steps']} (multiply by a benchmark's step time for "
        f"seconds). Median width of the smoothed band: {_fmt(a['width'])}.",
        "",
        "## Reading it",
        "",
        "- The corpus' batches differ in difficulty far more than the runs differ from each other: the smoothed "
        "loss is not monotonic, and where it dips below its final value time to loss is the first crossing of "
        f"that dip (the exact seeds: steps {', '.join(str(r.ttl) for r in seeds)}). It compares runs fairly (the "
        "same batches at the same steps), but a run a little worse can miss a dip and cross much later: read it "
        "next to the gap.",
        "- Step and wall times were measured on a 2-core machine shared with other work (4 ranks on 2 cores): "
        "they show the runs finished, not what a format costs or saves; the benchmark's step times are for that.",
        "- Each run's commit is the one it started at (a `+dirty` suffix: with uncommitted changes).",
        "",
        "## Exact (fp32) seeds",
        "",
        f"| run | seed | final loss | mean last {LAST} | time to loss (step) | median step (s) | wall (s) | commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in seeds:
        lines.append(f"| {r.name} | {r.seed} | {r.final:.4f} | {r.final_mean:.4f} | {r.ttl or 'not reached'} | "
                     f"{r.median_step_s:.2f} | {r.wall_s:.0f} | {r.commit} |")
    for plan, b in a["plan_bands"].items():
        lines += ["", f"Band of plan `{plan}` ({', '.join(b['seeds'])}): tolerance {_fmt(b['tolerance'])} (smoothed; raw "
                  f"{_fmt(b['raw_tolerance'])}), target {b['target']:.4f}, median width {_fmt(b['width'])}; the main "
                  f"band's mean smoothed loss at the last step is {a['target']:.4f}."]
    lines += ["", "## Against the band", ""]
    if not others:
        lines.append("No compressed run yet.")
    else:
        lines += [
            f"| run | plan | formats | seed | band | final loss | mean last {LAST} | gap, smoothed (step) | "
            "gap, raw (step) | from its seed | time to loss (step) | inside | median step (s) | wall (s) | commit |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in others:
            inside = "yes" if r.smooth_gap <= r.tolerance else "**no**"
            lines.append(
                f"| {r.name} | `{r.plan}` | `{r.formats}` | {r.seed} | `{r.band_plan}` | {_fmt(r.final)} | {_fmt(r.final_mean)} | "
                f"{_fmt(r.smooth_gap, 5)} ({r.smooth_gap_step or '-'}) | {_fmt(r.raw_gap, 5)} ({r.raw_gap_step or '-'}) | "
                f"{'-' if r.vs_seed is None else _fmt(r.vs_seed, 5)} | {r.ttl or 'not reached'} | {inside} | {r.median_step_s:.2f} | {r.wall_s:.0f} | {r.commit} |")
    lines += ["", f"![loss curves and band]({plot})", "",
              "Top: smoothed losses and the exact seeds' band. Middle: each run's smoothed loss minus the exact "
              "seeds' mean, with the band around it. Bottom: each run minus the exact run of its seed (of its plan "
              "where there is one), the 'from its seed' column, on its own scale.", "", "## Runs", ""]
    for r in runs:
        note = f" Note: {r['note']}" if "note" in r else ""
        lines.append(f"- `{r['name']}` ({r['started_utc']} UTC, {r['wall_s']:.0f} s, commit {r['commit']}): "
                     f"`{r['command']}`{note}")
    return "\n".join(lines) + "\n"


def cluster_markdown(a: dict, cluster: dict, steps: int, source: Path = CLUSTER,
                     heading: str = "## Time to loss on the emulated cluster") -> str:
    """docs/convergence.md's section on wall time to loss (:func:`cluster_time_to_loss`) for
    the benchmark run ``cluster``, read from ``source``."""
    meta = cluster["meta"]
    lines = [
        "", heading, "",
        f"Steps to loss (above; the seed-0 run trained as the row trains) times the median step time of the "
        f"benchmark row (`{source}`: {meta['nodes']} nodes x {meta['ranks_per_node']} ranks, {meta['link_rate']} "
        f"links, model {meta['model']['size']}, {meta['model']['params'] / 1e6:.2f} M parameters). The two come from different setups (the debug LLaMA on 4 ranks here, the "
        "benchmark's model on 8 ranks there): the product says how a format's effect on the steps needed and on "
        "the step time combine, not how long either model takes. A run that never reached the loss in "
        f"{steps} steps is shown as more than {steps} steps.", "",
        "| M | strategy | chosen for | plan | formats | convergence run | steps to loss | median step (s) | "
        "time to loss (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in cluster_time_to_loss(a, cluster):
        if e["run"] is None:
            steps_text, seconds = "no run", "-"
        elif e["steps"] is None:
            steps_text, seconds = f"> {steps}", f"> {steps * e['median_s']:.0f}"
        else:
            steps_text, seconds = str(e["steps"]), f"{e['seconds']:.0f}"
        lines.append(f"| {e['microbatches']} | {e['strategy']} | {', '.join(e['chosen_for'] or []) or '-'} | "
                     f"`{e['plan'] or '-'}` | `{e['formats']}` | {e['run'] or '-'} | {steps_text} | "
                     f"{e['median_s']:.3f} | {seconds} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], a: dict, path: Path) -> None:
    """Smoothed curves with the band, and their differences from the exact mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mean = a["mean"]
    steps = list(range(1, len(mean) + 1))
    fig, (top, bottom, paired) = plt.subplots(3, 1, figsize=(9, 10), sharex=True, height_ratios=[3, 2, 2])
    top.fill_between(steps, a["lo"], a["hi"], color="0.8", label="exact seeds' band")
    bottom.fill_between(steps, [x - m for x, m in zip(a["lo"], mean)], [x - m for x, m in zip(a["hi"], mean)],
                        color="0.8")
    in_band = {r.name for r in a["rows"] if r.in_band}
    for r in sorted(runs, key=lambda r: r["name"] not in in_band):
        s = smooth(r["losses"])
        if r["name"] in in_band:
            style, label = {"color": "0.35", "lw": 0.8, "ls": "--"}, f"exact, seed {r['seed']}"
        else:
            plan = "" if r["plan"] == a["plan"] else f"{r['plan']}, "
            style, label = {"lw": 1.3}, f"{plan}{r['formats']} (seed {r['seed']})"
        top.plot(steps, s, label=label, **style)
        bottom.plot(steps, [x - m for x, m in zip(s, mean)], **style)
        if r["name"] in a["twins"]:
            paired.plot(steps, [x - y for x, y in zip(s, a["twins"][r["name"]])], label=label, **style)
    top.set_ylabel(f"loss (trailing mean of {WINDOW})")
    top.set_title(f"Debug LLaMA, 4 CPU ranks (2 nodes x 2), plan {a['plan']}")
    top.legend(fontsize=8)
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set_ylabel("minus exact mean")
    paired.axhline(0, color="k", lw=0.5)
    paired.set_yscale("symlog", linthresh=1e-4)  # a format's 1e-4 next to a baseline's 0.5
    paired.set_ylabel("minus exact, same seed (symlog)")
    paired.set_xlabel("step")
    lim = max(abs(x - m) for c in [a["lo"], a["hi"]] for x, m in zip(c[WINDOW:], mean[WINDOW:]))
    bottom.set_ylim(-4 * lim, 4 * lim)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: Path = ROOT / RESULTS, doc: Path = ROOT / "docs" / "convergence.md",
           cluster: Path = ROOT / CLUSTER, more_clusters: Sequence[Path] = ()) -> None:
    """Write the table and the plot from every JSON in ``results`` (one length and config),
    with the times to loss on the emulated cluster where ``cluster`` exists, and after it
    those of each benchmark run in ``more_clusters`` (other runs, of this or earlier runtime code)."""
    runs = [json.loads(p.read_text()) for p in sorted(results.glob("*.json"))]
    if not runs:
        raise SystemExit(f"convergence: no runs in {results}")
    kinds = {(r["steps"], r["config"]) for r in runs}
    if len(kinds) != 1:
        raise SystemExit(f"convergence: runs of different lengths or configs {sorted(kinds)}: one band needs one")
    a = analyse(runs)
    png = doc.with_suffix(".png")
    plot(runs, a, png)
    text = markdown(runs, a, png.name)
    if cluster.exists():
        text += cluster_markdown(a, json.loads(cluster.read_text()), runs[0]["steps"], _shown(cluster))
    for path in more_clusters:
        text += cluster_markdown(a, json.loads(path.read_text()), runs[0]["steps"], _shown(path),
                                 heading=f"### Time to loss in the run {path.parent.name}")
    doc.write_text(text)
    for r in a["rows"]:
        print(f"{r.name:24s} {r.plan:14s} {r.formats:22s} final {_fmt(r.final)} (last {LAST}: {_fmt(r.final_mean)}) "
              f"gap {_fmt(r.smooth_gap)} raw {_fmt(r.raw_gap)} time-to-loss {r.ttl}")
    print(f"tolerance {_fmt(a['tolerance'])}; wrote {doc} and {png}")


def _shown(path: Path) -> Path:
    """``path`` as the docs name it: relative to the checkout where it lies inside it."""
    return path.relative_to(ROOT) if path.is_absolute() and path.is_relative_to(ROOT) else path


def split_trainer_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """This command's arguments and the trainer's (after ``--``)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def main(argv: list[str] | None = None) -> None:
    argv, extra = split_trainer_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m lins_dtensor.bench.convergence", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="train one run and write its JSON (trainer arguments after --)")
    p.add_argument("--name", required=True)
    p.add_argument("--seed", type=int, required=True, help="torchtitan 0.2.2's --debug.seed (initial weights)")
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--nproc", type=int, default=4)
    p = sub.add_parser("report", help="docs/convergence.md and .png from the JSON files")
    p.add_argument("--also-cluster", type=Path, nargs="*", default=[], metavar="CLUSTER_JSON",
                   help=f"further benchmark runs whose times to loss follow {CLUSTER}'s")
    args = parser.parse_args(argv)
    if args.cmd == "run":
        run(args.name, args.seed, extra, args.config, args.nproc)
    else:
        report(more_clusters=args.also_cluster)


if __name__ == "__main__":
    main()
