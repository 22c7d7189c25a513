"""Search: cost every valid plan, drop what does not fit, rank by predicted step time.

The named systems are points of the same space (``LinsPlan.parse`` presets), costed by
the same model, so the comparison shows what the free choice of s_p, s_g, s_os buys.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from lins_dtensor.plan import LinsPlan, LinsPlanError, valid_plans
from lins_dtensor.planner.bandwidth import CollectiveTimer
from lins_dtensor.planner.cost import PlanCost, evaluate
from lins_dtensor.planner.hardware import ClusterSpec
from lins_dtensor.planner.memory import GiB, figure
from lins_dtensor.planner.models import ModelSpec, PlannerError, model_from_module, model_from_text
from lins_dtensor.planner.training import TrainingSpec

# (display name, preset text; {k} is the node size)
BASELINES = (
    ("DDP", "ddp"),
    ("ZeRO-1", "zero1"),
    ("ZeRO-2", "zero2"),
    ("ZeRO-3/FSDP", "zero3"),
    ("HSDP/MiCS", "mics:{k}"),
    ("ZeRO++ hpZ", "hpz:{k}"),
)


@dataclasses.dataclass
class Baseline:
    name: str
    plan: LinsPlan | None
    cost: PlanCost | None
    note: str = ""  # why there is no cost (not expressible on this cluster)


@dataclasses.dataclass
class Explanation:
    """Why the planner chose its plan: the ranking, what was dropped, the baselines."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    cost: PlanCost  # the winner
    ranked: list[PlanCost]  # every plan that fits, fastest first
    dropped: list[PlanCost]  # plans that do not fit, least over budget first
    baselines: list[Baseline]
    reason: str
    table_fallbacks: list[tuple[str, int, int]]  # shapes timed by alpha-beta though a table was given

    @property
    def plan(self) -> LinsPlan:
        return self.cost.plan

    @property
    def microbatches(self) -> int:
        return self.cost.microbatches


def resolve_model(model, **module_hints) -> ModelSpec:
    """A ModelSpec from a ModelSpec, a name (preset, ``model:flavor``, config.json) or an ``nn.Module``."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return model_from_text(model)
    if isinstance(model, nn.Module):
        return model_from_module(model, **module_hints)
    raise PlannerError(f"model must be a ModelSpec, a name or an nn.Module, got {type(model).__name__}")


def baseline_plans(world: int, ranks_per_node: int, tp: int = 1) -> list[tuple[str, LinsPlan | None, str]]:
    """(label, plan or None, why not) for each named baseline on this cluster (``world``
    and ``ranks_per_node`` count data-parallel ranks, next to TP of degree ``tp``)."""
    out: list[tuple[str, LinsPlan | None, str]] = []
    for name, template in BASELINES:
        text = template.format(k=ranks_per_node)
        label = f"{name} k={ranks_per_node}" if "{k}" in template else name
        try:
            plan = LinsPlan.parse(text, world)
            plan.validate(world, ranks_per_node, tp)
        except LinsPlanError as exc:
            out.append((label, None, f"n/a on this cluster: {exc.detail}"))
            continue
        out.append((label, plan, ""))
    return out


def _sort_key(cost: PlanCost) -> tuple:
    # Fastest first; on a tie, less memory, then fewer sharded states (simpler).
    p = cost.plan
    return (round(cost.step_s, 9), cost.memory.peak, p.params, p.grads, p.optim)


def fastest_fitting_baseline(baselines: list[Baseline]) -> Baseline | None:
    """The fastest named baseline that fits in memory (None when none does)."""
    fitting = [b for b in baselines if b.cost is not None and b.cost.fits]
    return min(fitting, key=lambda b: b.cost.step_s, default=None)  # type: ignore[union-attr]


def explain_winner(win: PlanCost, baselines: list[Baseline]) -> str:
    """One line: what the winner saves, on which link, against the fastest baseline that fits."""
    best = fastest_fitting_baseline(baselines)
    if best is None:
        return f"{win.plan} fits in memory ({figure(win.memory.peak / GiB)} GiB) where none of the named baselines does"
    if best.plan == win.plan:
        return f"the fastest plan is {best.name} itself ({win.plan}); no other sharding of P, G, OS predicts a shorter step"
    w, b = win.by_link(exposed=True), best.cost.by_link(exposed=True)  # type: ignore[union-attr]
    keys = set(w) | set(b)
    zero = {"wire_bytes": 0.0, "link_bytes": 0.0, "seconds": 0.0}
    state, link = max(keys, key=lambda k: b.get(k, zero)["seconds"] - w.get(k, zero)["seconds"])
    bs, ws = b.get((state, link), zero), w.get((state, link), zero)
    speedup = best.cost.step_s / win.step_s  # type: ignore[union-attr]
    if speedup < 1.02:
        return (
            f"{win.plan} ties with {best.name} ({best.plan}), the fastest baseline that fits "
            f"({speedup:.3f}x), and needs {figure(win.memory.peak / GiB)} GiB per rank vs "
            f"{figure(best.cost.memory.peak / GiB)} with {figure(win.link_bytes('inter') / 1e9, 2)} vs "  # type: ignore[union-attr]
            f"{figure(best.cost.link_bytes('inter') / 1e9, 2)} GB per rank through the inter-node NICs"  # type: ignore[union-attr]
        )
    what = {"params": "parameter gathers", "grads": "gradient reductions", "optim": "optimizer-step collectives"}[state]
    return (
        f"{win.plan} is {speedup:.2f}x faster than {best.name} ({best.plan}), the fastest baseline that fits: "
        f"exposed {what} on {link}-node links drop from {bs['seconds']:.3f} s to {ws['seconds']:.3f} s per step "
        f"({figure(bs['link_bytes'] / 1e9, 2)} -> {figure(ws['link_bytes'] / 1e9, 2)} GB per rank on that link), "
        f"at {figure(win.memory.peak / GiB)} GiB per rank"
    )


def pick_winner(ranked: list[PlanCost], tie_tolerance: float) -> PlanCost:
    """The fastest plan, except that among plans predicted within ``tie_tolerance`` of it
    the one sending the fewest inter-node bytes wins, then the fewest intra-node bytes:
    the model is least sure about communication (how much of it hides, how links are
    shared), most of all on the slow shared network, so a near-tie is settled in favour
    of communicating less. Memory, then time, settle what is left."""
    limit = ranked[0].step_s * (1 + tie_tolerance)
    near = [c for c in ranked if c.step_s <= limit]
    return min(near, key=lambda c: (round(c.link_bytes("inter") / 1e6), round(c.link_bytes("intra") / 1e6), c.memory.peak, c.step_s))


def search(model, cluster: ClusterSpec, training: TrainingSpec | None = None, *, tie_tolerance: float = 0.02, **module_hints) -> Explanation:
    """Cost every valid plan (hpZ variants included); raise PlannerError if none fits."""
    spec = resolve_model(model, **module_hints)
    training = training or TrainingSpec()
    training.microbatches(cluster.dp_ranks)  # fail early on an impossible batch
    timer = CollectiveTimer(cluster.hardware, cluster.gpus_per_node, cluster.bandwidth)  # type: ignore[arg-type]
    costs: dict[LinsPlan, PlanCost] = {}
    for plan in valid_plans(cluster.dp_ranks, cluster.dp_per_node, with_hpz=True, tp=cluster.tp):
        costs[plan] = evaluate(plan, spec, cluster, training, timer)
    baselines = []
    for name, plan, note in baseline_plans(cluster.dp_ranks, cluster.dp_per_node, cluster.tp):
        cost = None if plan is None else costs.get(plan) or evaluate(plan, spec, cluster, training, timer)
        baselines.append(Baseline(name, plan, cost, note))
    ranked = sorted((c for c in costs.values() if c.fits), key=_sort_key)
    dropped = sorted((c for c in costs.values() if not c.fits), key=lambda c: c.over_bytes)
    if not ranked:
        least = dropped[0]
        raise PlannerError(
            f"{spec.name} fits no plan on {cluster.gpus} x {cluster.hardware.name}: even {least.plan} needs "
            f"{figure(least.memory.peak / GiB)} GiB per rank, {figure(least.over_bytes / GiB)} GiB over the "
            f"{figure(cluster.memory_budget / GiB)} GiB budget"
        )
    win = pick_winner(ranked, tie_tolerance)
    reason = explain_winner(win, baselines)
    if win is not ranked[0]:
        reason += (
            f"; the fastest prediction, {ranked[0].plan}, is only {win.step_s / ranked[0].step_s - 1:.1%} faster "
            f"but sends {figure(ranked[0].link_bytes('inter') / 1e9)} GB per rank across nodes vs {figure(win.link_bytes('inter') / 1e9)}"
        )
    return Explanation(spec, cluster, training, win, ranked, dropped, baselines, reason, sorted(timer.fallbacks))


def choose_plan(model, cluster: ClusterSpec, training: TrainingSpec | None = None, *, tie_tolerance: float = 0.02, **module_hints) -> tuple[LinsPlan, Explanation]:
    """The fastest plan that fits, and why.

    ``model``: a :class:`ModelSpec`, a preset name, a torchtitan ``model:flavor``, a
    Hugging Face config.json path, or an ``nn.Module`` (its parameter
    shapes are read; pass ``n_layers=``, ``dim=``, ``n_heads=``, ``vocab_size=`` when the
    module does not tell them). Plans within ``tie_tolerance`` of the fastest are
    settled by fewest inter-node bytes (see :func:`pick_winner`). Raises :class:`PlannerError` when nothing fits.
    """
    explanation = search(model, cluster, training, tie_tolerance=tie_tolerance, **module_hints)
    return explanation.plan, explanation
