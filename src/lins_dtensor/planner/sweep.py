"""``lins-plan --sweep``: plan again at each value of one input, to show where the choice turns.

The best sharding depends on the network: when bandwidth between nodes is scarce it can
pay to shard P (s_p) wider, or to keep it replicated and shard only G and OS, and P
leaving the node (s_p > data-parallel ranks per node) puts its gathers on the slow links every
micro-batch. A sweep prints the chosen plan and the baselines at each value and marks
those turns. The callers (``lins-plan``) build one :class:`Explanation` per value.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lins_dtensor.planner.cost import PlanCost
from lins_dtensor.planner.memory import GiB
from lins_dtensor.planner.models import PlannerError
from lins_dtensor.planner.report import FORMAT, baseline_records, plan_record, plan_text, setting_record, setting_text, split_text
from lins_dtensor.planner.search import Baseline, Explanation, fastest_fitting_baseline

# --sweep KEY -> (the lins-plan option it sets, unit, axis label)
SWEEPABLE = {"inter-node-gbit": ("inter_node_gbit", "Gbit/s", "inter-node bandwidth per node (Gbit/s)")}


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``KEY=v1,v2,...`` -> (KEY, the values ascending, without repeats)."""
    key, sep, values = text.partition("=")
    if key not in SWEEPABLE:
        raise PlannerError(f"--sweep '{text}': can sweep {', '.join(SWEEPABLE)}, as KEY=v1,v2,...")
    try:
        numbers = sorted({float(v) for v in values.split(",")}) if sep else []
    except ValueError:
        raise PlannerError(f"--sweep '{text}': the values must be numbers separated by commas") from None
    if not numbers:
        raise PlannerError(f"--sweep '{text}': no values; write {key}=v1,v2,...")
    return key, numbers


def _fitting_step_s(b: Baseline) -> float | None:
    return b.cost.step_s if b.cost is not None and b.cost.fits else None


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    value: float
    explanation: Explanation

    @property
    def p_leaves_node(self) -> bool:
        return self.explanation.plan.params > self.explanation.cluster.dp_per_node

    @property
    def best_baseline(self) -> Baseline | None:
        return fastest_fitting_baseline(self.explanation.baselines)


def changes(points: list[SweepPoint]) -> list[tuple[SweepPoint, SweepPoint]]:
    """Neighbouring values between which the chosen plan or its wire formats differ."""
    return [(a, b) for a, b in zip(points, points[1:]) if _choice(a.explanation.cost) != _choice(b.explanation.cost)]


def _choice(cost: PlanCost) -> tuple:
    return cost.plan, cost.formats


def _value(v: float) -> str:
    return f"{v:g}"


def _is_hpz(point: SweepPoint) -> bool:
    return not isinstance(point.explanation.plan.reshard_after_forward, bool)


def _p_text(point: SweepPoint) -> str:
    inside, nodes = point.explanation.plan.split(point.explanation.cluster.dp_per_node)["params"]
    if point.p_leaves_node:
        hpz = ", gathered from an in-node copy (hpZ)" if _is_hpz(point) else ""
        return f"P {inside}x{nodes}, across {nodes} nodes{hpz}"
    return "P replicated" if inside == 1 else f"P {inside}x1, in a node"


def _head_to_head(here: SweepPoint, other: SweepPoint) -> str:
    """At ``here``'s value, its plan against the plan chosen at ``other``'s."""
    ex, rival = here.explanation, _choice(other.explanation.cost)
    cost = next(c for c in [*ex.ranked, *ex.dropped] if _choice(c) == rival)
    theirs = f"{cost.step_s:.3f} s" if cost.fits else f"does not fit ({cost.memory.peak / GiB:.1f} GiB)"
    tie = ""
    if cost.fits and cost.step_s < ex.cost.step_s:
        tie = (" (lossy, not faster by more than the tie tolerance)" if cost.formats.lossy and not ex.cost.formats.lossy
               else " (a near-tie, settled by inter-node bytes)")
    return f"at {_value(here.value)}: {plan_text(ex.cost)} {ex.cost.step_s:.3f} s, {plan_text(cost)} {theirs}{tie}"


def sweep_text(key: str, points: list[SweepPoint]) -> str:
    _, unit, _ = SWEEPABLE[key]
    first = points[0].explanation
    rpn = first.cluster.dp_per_node
    lines = [
        f"Lins planner sweep of --{key} ({unit}): {setting_text(first)}",
        "",
        f"  {unit:>8}  {'chosen':<26} {'split P | G | OS':<20} {'step s':>8} {'MFU':>6}  {'P leaves node':<14} best baseline (step s, its time / chosen's)",
    ]
    for pt in points:
        cost, best = pt.explanation.cost, pt.best_baseline
        versus = "none fits" if best is None else f"{best.name} ({best.cost.step_s:.3f} s, {best.cost.step_s / cost.step_s:.2f}x)"  # type: ignore[union-attr]
        leaves = ("YES, hpZ" if _is_hpz(pt) else "YES") if pt.p_leaves_node else "no"
        lines.append(
            f"  {_value(pt.value):>8}  {plan_text(cost):<26} {split_text(cost, rpn):<20} {cost.step_s:8.3f} {cost.mfu * 100:5.1f}%  {leaves:<14} {versus}"
        )
    names = [b.name for b in first.baselines]
    lines += ["", "Baselines, step s (OOM: does not fit; -: not expressible on this cluster):"]
    lines.append(f"  {unit:>8}  " + " ".join(f"{n:>15}" for n in names))
    for pt in points:
        cells = ["-" if b.cost is None else "OOM" if _fitting_step_s(b) is None else f"{b.cost.step_s:.3f}" for b in pt.explanation.baselines]
        lines.append(f"  {_value(pt.value):>8}  " + " ".join(f"{c:>15}" for c in cells))
    leaving = [_value(pt.value) for pt in points if pt.p_leaves_node]
    lines += ["", "Crossover:"]
    lines.append(
        f"  P leaves the node (s_p > {rpn}) at {', '.join(leaving)} {unit}" if leaving
        else f"  P stays within a node (s_p <= {rpn}) at every value"
    )
    turns = changes(points)
    for a, b in turns:
        lines.append(
            f"  {_value(a.value)} -> {_value(b.value)} {unit}: {plan_text(a.explanation.cost)} -> {plan_text(b.explanation.cost)} "
            f"({_p_text(a)} -> {_p_text(b)})"
        )
        lines.append(f"    {_head_to_head(a, b)}; {_head_to_head(b, a)}")
    if not turns:
        lines.append(f"  the chosen plan is the same at every value: {first.plan}")
    return "\n".join(lines)


def sweep_json(key: str, points: list[SweepPoint]) -> dict:
    _, unit, _ = SWEEPABLE[key]
    first = points[0].explanation
    return {
        "format": FORMAT,
        "mode": "sweep",
        "sweep": {"parameter": key, "unit": unit, "values": [pt.value for pt in points]},
        **setting_record(first),
        "points": [
            {
                "value": pt.value,
                "chosen": plan_record(pt.explanation.cost, first.cluster.dp_per_node),
                "p_leaves_node": pt.p_leaves_node,
                "best_baseline": None if pt.best_baseline is None else pt.best_baseline.name,
                "reason": pt.explanation.reason,
                "baselines": baseline_records(pt.explanation),
            }
            for pt in points
        ],
        "changes": [
            {"from": a.value, "to": b.value, "plan_from": str(a.explanation.plan), "plan_to": str(b.explanation.plan),
             "p_leaves_node_from": a.p_leaves_node, "p_leaves_node_to": b.p_leaves_node}
            for a, b in changes(points)
        ],
    }


def plot_sweep(key: str, points: list[SweepPoint], path: str | Path) -> None:
    """Step time of the chosen plan and of each baseline (where it fits) against the swept value.

    matplotlib is optional, so it is imported here; Figure without pyplot leaves no
    global backend state behind.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise PlannerError("--plot needs matplotlib (pip install matplotlib)") from None
    _, _, label = SWEEPABLE[key]
    first = points[0].explanation
    xs = [pt.value for pt in points]
    fig = Figure(figsize=(9, 5.5))
    ax = fig.add_subplot()
    for i, name in enumerate(b.name for b in first.baselines):
        steps = [(pt.value, _fitting_step_s(pt.explanation.baselines[i])) for pt in points]
        series = [(x, y) for x, y in steps if y is not None]
        if series:
            ax.plot(*zip(*series), marker="o", linewidth=1.2, label=name)
    ax.plot(xs, [pt.explanation.cost.step_s for pt in points], marker="o", color="black", linewidth=2.5, label="Lins-auto (chosen)")
    leaving = [(pt.value, pt.explanation.cost.step_s) for pt in points if pt.p_leaves_node]
    if leaving:
        ax.plot(*zip(*leaving), linestyle="none", marker="o", markersize=14, markerfacecolor="none", color="red",
                label=f"P leaves the node (s_p > {first.cluster.dp_per_node})")
    for pt in points:
        ax.annotate(split_text(pt.explanation.cost, first.cluster.dp_per_node), (pt.value, pt.explanation.cost.step_s),
                    textcoords="offset points", xytext=(0, -18), ha="center", fontsize=7,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.8))
    for a, b in changes(points):
        ax.axvline((a.value * b.value) ** 0.5, color="gray", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [_value(x) for x in xs])
    ax.margins(x=0.08, y=0.08)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel(label)
    ax.set_ylabel("predicted step time (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{setting_text(first)}\nchosen plan's split P | G | OS under each point, dotted: the chosen plan changes; "
                 "baselines that do not fit omitted", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise PlannerError(f"cannot write plot '{path}': {exc.strerror}") from None
