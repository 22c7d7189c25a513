"""Turn an :class:`Explanation` into the table people read or the JSON tools read.

The JSON is documented field by field in docs/planner-json.md (a test checks every
emitted key against it); ``FORMAT`` changes when a field is renamed, removed or
changes meaning.
"""

from __future__ import annotations

from lins_dtensor.planner.compute import ComputeTerm
from lins_dtensor.planner.cost import PlanCost
from lins_dtensor.planner.memory import GiB, figure
from lins_dtensor.planner.search import Explanation

FORMAT = "lins-plan/1"


def plan_record(cost: PlanCost, ranks_per_node: int) -> dict:
    """One plan's factors, their (in-node, nodes) split, predicted time, MFU and memory."""
    plan = cost.plan
    split = plan.split(ranks_per_node)
    return {
        "plan": str(plan),
        "formats": cost.formats.as_json(),
        "params": plan.params,
        "grads": plan.grads,
        "optim": plan.optim,
        "reshard_after_forward": plan.reshard_after_forward,
        "split": {state: list(v) for state, v in split.items()},
        "step_time_s": round(cost.step_s, 6),
        "mfu": round(cost.mfu, 4),
        "hfu": round(cost.hfu, 4),
        "tokens_per_s": round(cost.tokens_per_s, 1),
        "fits": cost.fits,
        "memory_gib": cost.memory.gib(),
        "over_budget_gib": round(max(0.0, cost.over_bytes) / GiB, 3),
        "compute_s": {k: round(v, 6) for k, v in cost.compute_s.items()},
        "compute_terms": [term.record() for term in cost.kernels.terms],
        "codec_s": {k: round(v, 6) for k, v in cost.codec_s.items()},
        "comm_s": {k: round(v, 6) for k, v in cost.comm_s.items()},
        "exposed_comm_s": {k: round(v, 6) for k, v in cost.exposed_s.items()},
        "network_gb_per_rank": {link: round(cost.link_bytes(link) / 1e9, 4) for link in ("intra", "inter")},
    }


def baseline_records(ex: Explanation) -> list[dict]:
    """Each named baseline: its plan record and how much slower it is than the chosen plan."""
    out = []
    for b in ex.baselines:
        entry = {"name": b.name, "note": b.note}
        if b.cost is not None:
            entry.update(plan_record(b.cost, ex.cluster.dp_per_node))
            entry["speedup_of_chosen"] = round(b.cost.step_s / ex.cost.step_s, 4)
        out.append(entry)
    return out


def setting_record(ex: Explanation) -> dict:
    """What was planned for: the model, the cluster and how it trains."""
    m = ex.model
    return {
        "model": {
            "name": m.name, "params": m.num_params, "dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads,
            "kv_heads": m.kv_heads, "ffn_dim": m.ffn_dim, "vocab_size": m.vocab_size, "tied_embeddings": m.tied_embeddings,
        },
        "cluster": {
            "gpus": ex.cluster.gpus, "gpus_per_node": ex.cluster.gpus_per_node, "nodes": ex.cluster.nodes, "tp": ex.cluster.tp,
            "hardware": ex.cluster.hardware.name, "memory_budget_gib": round(ex.cluster.memory_budget / GiB, 3),
            "bandwidth": "table" if ex.cluster.bandwidth is not None else "alpha-beta",
        },
        "training": {
            "seq_len": ex.training.seq_len, "micro_batch": ex.training.micro_batch,
            "global_batch_tokens": ex.training.global_batch_tokens, "microbatches": ex.microbatches,
            "activation_checkpointing": ex.training.activation_checkpointing, "overlap": ex.training.overlap,
            "overlap_fraction": ex.training.overlap_fraction, "lins_overlap_fraction": ex.training.lins_overlap_fraction,
            "reduce_in_backward": ex.training.reduce_in_backward, "overlap_step": ex.training.overlap_step,
            "reduce_bytes": ex.training.reduce_bytes,
        },
    }


def to_json(ex: Explanation, top: int = 10) -> dict:
    rpn = ex.cluster.dp_per_node
    return {
        "format": FORMAT,
        "mode": "plan",
        **setting_record(ex),
        "chosen": plan_record(ex.cost, rpn),
        "reason": ex.reason,
        "baselines": baseline_records(ex),
        "top": [plan_record(c, rpn) for c in ex.ranked[:top]],
        "evaluated": len(ex.ranked) + len(ex.dropped),
        "dropped": {
            "count": len(ex.dropped),
            "closest": plan_record(ex.dropped[0], rpn) if ex.dropped else None,
        },
        "table_fallbacks": [list(s) for s in ex.table_fallbacks],
    }


def plan_text(cost: PlanCost) -> str:
    """The plan, and its wire formats when any is lossy."""
    return f"{cost.plan} {cost.formats}" if cost.formats.lossy else str(cost.plan)


def split_text(cost: PlanCost, rpn: int) -> str:
    split = cost.plan.split(rpn)
    return " | ".join(f"{a}x{b}" for a, b in split.values())


def compute_term_text(term: ComputeTerm) -> str:
    """One kernel kind's seconds and the efficiency (or bandwidth) it ran at."""
    rate = (f"efficiency {term.efficiency:.3f} of peak" if term.efficiency is not None
            else f"memory-bound, {term.bytes / 1e9:.1f} GB at {term.bandwidth / 1e9:.0f} GB/s")
    return f"{term.kernel:<11} {term.pass_:<9} {term.seconds:8.3f} s  {rate}"


def _row(label: str, cost: PlanCost | None, rpn: int, win: PlanCost, note: str = "") -> str:
    if cost is None:
        return f"  {label:<16} {note}"
    mem = f"{cost.memory.peak / GiB:6.1f}" + ("" if cost.fits else f" (OOM +{cost.over_bytes / GiB:.1f})")
    speed = f"{cost.step_s / win.step_s:6.2f}x"
    return (
        f"  {label:<16} {plan_text(cost):<26} {split_text(cost, rpn):<20} {cost.step_s:8.3f} {cost.mfu * 100:5.1f}% "
        f"{mem:<16} {cost.link_bytes('inter') / 1e9:8.2f} {speed}"
    )


def setting_text(ex: Explanation) -> str:
    """The model, cluster and training knobs, on one line."""
    t = ex.training
    return (
        f"{ex.model.name} ({ex.model.num_params / 1e9:.2f} B params) on {ex.cluster.gpus} x "
        f"{ex.cluster.hardware.name} ({ex.cluster.nodes} nodes x {ex.cluster.gpus_per_node})"
        + (f", TP {ex.cluster.tp} inside the node: the plan factors {ex.cluster.dp_ranks} data-parallel ranks" if ex.cluster.tp > 1 else "")
        + f", seq {t.seq_len}, micro-batch {t.micro_batch}, "
        f"M={ex.microbatches} micro-batches/step"
        + ("" if t.activation_checkpointing == "none" else f", {t.activation_checkpointing} activation checkpointing")
        + (", overlap off" if not t.overlap else f", overlap FSDP2 {t.overlap_fraction:g} / Lins {t.lins_overlap_fraction:g}")
        + ("" if t.reduce_in_backward else ", reductions at the step")
        + ("" if t.overlap_step else ", update gathers exposed")
    )


def to_text(ex: Explanation, top: int = 10) -> str:
    rpn = ex.cluster.dp_per_node
    win = ex.cost
    lines = [
        f"Lins planner: {setting_text(ex)}",
        f"bandwidth: {'measured table' if ex.cluster.bandwidth is not None else 'alpha-beta model of ' + ex.cluster.hardware.name}"
        + (f" (alpha-beta for {len(ex.table_fallbacks)} unmeasured shapes)" if ex.table_fallbacks else "")
        + f"; memory budget {figure(ex.cluster.memory_budget / GiB)} GiB per rank",
        f"{len(ex.ranked) + len(ex.dropped)} valid plans, {len(ex.dropped)} dropped for memory"
        + (
            f" (closest miss {ex.dropped[0].plan}: {figure(ex.dropped[0].memory.peak / GiB)} GiB, "
            f"{figure(ex.dropped[0].over_bytes / GiB)} GiB over)" if ex.dropped else ""
        ),
        "",
        f"  {'':<16} {'plan':<26} {'split P | G | OS':<20} {'step s':>8} {'MFU':>6} {'mem GiB':<16} {'inter GB':>8} {'vs best':>7}",
        _row("CHOSEN", win, rpn, win),
    ]
    m = win.memory.gib()
    lines.append(
        f"  {'':<16} memory GiB: P {m['params']:.2f}  G {m['grads']:.2f}  OS {m['optim']:.2f}  "
        f"activations {m['activations']:.2f}  buffers {m['buffers']:.2f}  step {m['step_buffers']:.2f}"
        + (f"  error feedback {m['error_feedback']:.2f}" if win.memory.error_feedback else "")
    )
    if win.formats.lossy:
        codec = ", ".join(f"{phase} {t:.3g} s" for phase, t in win.codec_s.items() if t)
        lines.append(f"  {'':<16} wire formats {win.formats}: encode/decode {codec or '0 s'} per step (in compute)")
    lines += ["", "Compute of the chosen plan per step (the efficiency is the share of peak FLOP/s each kind of kernel ran at):"]
    lines += [f"  {'':<16} {compute_term_text(t)}" for t in win.kernels.terms]
    lines += ["", "Baselines:"]
    lines += [_row(b.name, b.cost, rpn, win, b.note) for b in ex.baselines]
    lines += ["", f"Top {min(top, len(ex.ranked))} by predicted step time:"]
    lines += [_row(f"#{i + 1}" + (" *" if c is win else ""), c, rpn, win) for i, c in enumerate(ex.ranked[:top])]
    lines += ["", f"Why: {ex.reason}"]
    return "\n".join(lines)
