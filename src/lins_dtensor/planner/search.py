"""Search: cost every valid plan, drop what does not fit, rank by predicted step time.

The named systems are points of the same space (``LinsPlan.parse`` presets), costed by
the same model, so the comparison shows what the free choice of s_p, s_g, s_os buys.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from lins_dtensor.errors import LinsConfigError
from lins_dtensor.formats import CommFormats, format_choices, parse_allowed
from lins_dtensor.plan import LinsPlan, LinsPlanError, valid_plans
from lins_dtensor.planner.bandwidth import CollectiveTimer
from lins_dtensor.planner.cost import PlanCost, evaluate
from lins_dtensor.planner.hardware import ClusterSpec
from lins_dtensor.planner.memory import GiB, figure
from lins_dtensor.planner.models import ModelSpec, PlannerError, model_from_module, model_from_text
from lins_dtensor.planner.training import TrainingSpec
from lins_dtensor.schedule import carried_levels

# (display name, preset text; {k} is the node size)
BASELINES = (
    ("DDP", "ddp"),
    ("ZeRO-1", "zero1"),
    ("ZeRO-2", "zero2"),
    ("ZeRO-3/FSDP", "zero3"),
    ("HSDP/MiCS", "mics:{k}"),
    ("ZeRO++ hpZ", "hpz:{k}"),
)


_DTYPES = {2: torch.bfloat16, 4: torch.float32}  # what CommFormats.check reads of a dtype: its size
_FORMAT_KEYS = tuple(field.name for field in dataclasses.fields(CommFormats))


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
    exact: PlanCost | None = None  # with allowed formats: the plan chosen among exact ones alone

    @property
    def plan(self) -> LinsPlan:
        return self.cost.plan

    @property
    def formats(self) -> CommFormats:
        return self.cost.formats

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
    # Fastest first; on a tie, less memory, then fewer sharded states (simpler), then exact.
    p = cost.plan
    return (round(cost.step_s, 9), cost.memory.peak, p.params, p.grads, p.optim, cost.formats.lossy, str(cost.formats))


def allowed_choices(allowed_formats: str | dict | None) -> list[CommFormats]:
    """The :class:`CommFormats` the planner may choose from, exact first: ``None`` is exact
    only; text as ``formats.parse_allowed`` reads it (a one-line LinsConfigError when
    malformed), or its result (kind_level -> format names)."""
    if allowed_formats is None:
        return [CommFormats()]
    allowed = parse_allowed(allowed_formats) if isinstance(allowed_formats, str) else allowed_formats
    return list(format_choices({key: ("exact", *(n for n in names if n != "exact")) for key, names in allowed.items()}))


def effective_formats(formats: CommFormats, plan: LinsPlan, cluster: ClusterSpec, training: TrainingSpec) -> CommFormats | None:
    """``formats`` with each kind and link level where ``plan`` issues no collective
    set back to exact (the same records and cost as that choice), or None when the
    runtime would refuse them (``CommFormats.check``: bf16 gathers of bf16 parameters)."""
    try:
        formats.check(param_dtype=_DTYPES[training.param_bytes], reduce_dtype=_DTYPES[training.reduce_bytes])
    except LinsConfigError:
        return None
    used = carried_levels(plan, world_size=cluster.dp_ranks, ranks_per_node=cluster.dp_per_node)
    return dataclasses.replace(formats, **{key: "exact" for key in _FORMAT_KEYS if key not in used})


def fastest_fitting_baseline(baselines: list[Baseline]) -> Baseline | None:
    """The fastest named baseline that fits in memory (None when none does)."""
    fitting = [b for b in baselines if b.cost is not None and b.cost.fits]
    return min(fitting, key=lambda b: b.cost.step_s, default=None)  # type: ignore[union-attr]


def explain_winner(win: PlanCost, baselines: list[Baseline]) -> str:
    """One line: what the winner saves, on which link, against the fastest baseline that fits."""
    best = fastest_fitting_baseline(baselines)
    if best is None:
        return f"{win.plan} fits in memory ({figure(win.memory.peak / GiB)} GiB) where none of the named baselines does"
    if best.plan == win.plan and not win.formats.lossy:
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
    the one sending the fewest inter-node bytes wins, then the one with the fewest lossy
    wire formats, then the fewest intra-node bytes: the model is least sure about
    communication (how much of it hides, how links are shared), most of all on the slow
    shared network, so a near-tie is settled in favour of communicating less across the
    nodes; a lossy format that neither saves inter-node bytes nor predicts a shorter step
    buys nothing for its rounding (an encoded gather inside the node moves fewer bytes,
    but where intra-node traffic cannot hide it is timed at its exact bytes and its
    codec besides). Memory, then time, settle what is left."""
    limit = ranked[0].step_s * (1 + tie_tolerance)
    near = [c for c in ranked if c.step_s <= limit]
    return min(near, key=lambda c: _tie_key(c) + (c.memory.peak, c.step_s))


def _tie_key(cost: PlanCost) -> tuple[int, int, int]:
    """What settles a near-tie, in order: inter-node MB, lossy settings, intra-node MB."""
    return round(cost.link_bytes("inter") / 1e6), cost.formats.lossy_settings, round(cost.link_bytes("intra") / 1e6)


def explain_tie(win: PlanCost, fastest: PlanCost) -> str:
    """Why ``win`` and not the faster ``fastest``, within the tie tolerance: the first
    field of :func:`_tie_key` where ``win`` is ahead, else memory."""
    inter, lossy, intra = (w < f for w, f in zip(_tie_key(win), _tie_key(fastest)))
    if inter:
        because = f"sends {figure(fastest.link_bytes('inter') / 1e9)} GB per rank across nodes vs {figure(win.link_bytes('inter') / 1e9)}"
    elif lossy:
        because = f"has lossy formats {fastest.formats} where {win.plan} has {win.formats}"
    elif intra:
        because = f"moves {figure(fastest.link_bytes('intra') / 1e9)} GB per rank inside nodes vs {figure(win.link_bytes('intra') / 1e9)}"
    else:
        because = f"needs {figure(fastest.memory.peak / GiB)} GiB per rank vs {figure(win.memory.peak / GiB)}"
    return f"; the fastest prediction, {fastest.plan}, is only {win.step_s / fastest.step_s - 1:.1%} faster but {because}"


def explain_formats(win: PlanCost, exact: PlanCost) -> str:
    """What lossy formats bought: the step time and inter-node bytes against the plan
    chosen among exact ones."""
    return (
        f"lossy formats {win.formats} save {exact.step_s - win.step_s:.3g} s per step over the fastest exact plan {exact.plan} "
        f"(inter-node bytes {figure(exact.link_bytes('inter') / 1e6)} -> {figure(win.link_bytes('inter') / 1e6)} MB per rank)"
    )


def search(model, cluster: ClusterSpec, training: TrainingSpec | None = None, *, tie_tolerance: float = 0.02,
           allowed_formats: str | dict | None = None, **module_hints) -> Explanation:
    """Cost every valid plan (hpZ variants included), with each wire format of Lins'
    collectives that ``allowed_formats`` permits (:func:`allowed_choices`; None: exact
    only); raise PlannerError if none fits.

    Lossy formats cost accuracy the model does not see, so one is chosen only when it
    predicts a step shorter than the plan chosen among exact ones by more than
    ``tie_tolerance`` (the model's own uncertainty); otherwise the exact choice stands."""
    choices = allowed_choices(allowed_formats)  # a bad text fails before any costing
    spec = resolve_model(model, **module_hints)
    training = training or TrainingSpec()
    training.microbatches(cluster.dp_ranks)  # fail early on an impossible batch
    timer = CollectiveTimer(cluster.hardware, cluster.gpus_per_node, cluster.bandwidth)  # type: ignore[arg-type]
    costs: dict[tuple[LinsPlan, CommFormats], PlanCost] = {}
    for plan in valid_plans(cluster.dp_ranks, cluster.dp_per_node, with_hpz=True, tp=cluster.tp):
        for formats in choices:
            applied = effective_formats(formats, plan, cluster, training) if formats.lossy else formats
            if applied is not None and (plan, applied) not in costs:
                costs[(plan, applied)] = evaluate(plan, spec, cluster, training, timer, formats=applied)
    baselines = []
    for name, plan, note in baseline_plans(cluster.dp_ranks, cluster.dp_per_node, cluster.tp):
        cost = None if plan is None else costs.get((plan, CommFormats())) or evaluate(plan, spec, cluster, training, timer)
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
    exact_ranked = [c for c in ranked if not c.formats.lossy]
    exact = pick_winner(exact_ranked, tie_tolerance) if exact_ranked else None
    lossy = [c for c in ranked if c.formats.lossy and (exact is None or c.step_s * (1 + tie_tolerance) < exact.step_s)]
    pool = lossy or exact_ranked
    win = pick_winner(pool, tie_tolerance)
    reason = explain_winner(win, baselines)
    if win is not pool[0]:
        reason += explain_tie(win, pool[0])
    if win.formats.lossy and exact is not None:
        reason += "; " + explain_formats(win, exact)
    return Explanation(spec, cluster, training, win, ranked, dropped, baselines, reason, sorted(timer.fallbacks),
                       exact if allowed_formats is not None else None)


def choose_plan(model, cluster: ClusterSpec, training: TrainingSpec | None = None, *, tie_tolerance: float = 0.02,
                allowed_formats: str | dict | None = None, **module_hints) -> tuple[LinsPlan, Explanation]:
    """The fastest plan that fits, and why; with ``allowed_formats`` (see :func:`search`)
    the wire formats it runs with are ``explanation.formats``.

    ``model``: a :class:`ModelSpec`, a preset name, a torchtitan ``model:flavor``, a
    Hugging Face config.json path, or an ``nn.Module`` (its parameter
    shapes are read; pass ``n_layers=``, ``dim=``, ``n_heads=``, ``vocab_size=`` when the
    module does not tell them). Plans within ``tie_tolerance`` of the fastest are
    settled by fewest inter-node bytes (see :func:`pick_winner`). Raises :class:`PlannerError` when nothing fits.
    """
    explanation = search(model, cluster, training, tie_tolerance=tie_tolerance, allowed_formats=allowed_formats, **module_hints)
    return explanation.plan, explanation
