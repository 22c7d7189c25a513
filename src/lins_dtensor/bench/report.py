"""Results of the cluster benchmark: derived numbers, the markdown table and the plot."""

from __future__ import annotations

import math

MiB = 1 << 20

METHODS = {
    "step_time": "wall time of one optimizer step (all micro-batches, clipping, optimizer), the slowest rank's; "
                 "ranks start each step together after a barrier; timed steps of all strategies are interleaved "
                 "(one step each per round, order rotated every round)",
    "tokens_per_s": "world x M x batch x seq tokens per step / median step time",
    "peak_memory": "from /proc/self/status, per rank (max and mean over ranks): resident growth while the strategy "
                   "is built (VmRSS after - before, after gc and malloc_trim) plus the peak of its warm-up steps at this M, "
                   "run alone (VmHWM, reset through /proc/self/clear_refs just before, minus VmRSS then). Whole-process "
                   "RSS: it includes the unsharded model built before sharding (freed pages may stay resident), "
                   "activations, gathered parameters, communication buffers and allocator slack",
    "model_state_bytes": "persistent bytes of parameters, gradients and optimizer states on the live tensors "
                         "(Lins: lins_stats(model).memory_bytes; others: local parameter / gradient shards + AdamW states), "
                         "after the optimizer step of the last warm-up step (timed steps do no accounting)",
    "bytes": "per rank, over the last step, counted when issued: Lins by its recorder (lins_stats); FSDP2/HSDP/hpZ by "
             "LinsAllGather/LinsReduceScatter via set_custom_all_gather/set_custom_reduce_scatter and HSDP's all-reduce "
             "via set_all_reduce_hook; DDP by a recording comm hook. 'message' = collective message sizes on groups "
             "spanning nodes (inter) or inside a node (intra); 'NIC' = ring-algorithm bytes per rank through its "
             "node's link (planner.cost.network_bytes). Scalar gradient-norm all-reduces of torch's clip_grad_norm_ "
             "are not counted (8 bytes)",
    "predicted": "planner.evaluate with the bandwidth table profiled on this emulated cluster and the compute, optimizer "
                 "and copy rates and FSDP2's host time per unit calibrated at start-up (every rank working at once, no "
                 "communication); with the run's overlap fraction (default 0: on CPU nothing overlaps, FSDP2 and Lins "
                 "overlap through CUDA streams) and with a reference one (default 0.8, the planner's GPU default); non-Lins strategies are costed as the Lins plan with the same collectives",
    "fits": "the planner's predicted peak per-rank memory for the strategy (model states + activations + buffers) <= budget",
}

FSDP_FAMILY = ("fsdp2", "hsdp", "hsdp-deferred", "hpz")


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties)."""
    n = len(xs)
    if n < 3:
        return None

    def ranks(v):
        order = sorted(range(n), key=lambda i: v[i])
        r = [0.0] * n
        i = 0
        while i < n:
            j = i
            while j + 1 < n and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else None


def _accuracy(rows: list[dict], errors: bool = True) -> dict:
    """Spearman rank correlation (and mean |error|) of both predictions against the medians."""
    measured = [r["step_time_s"]["median"] for r in rows]
    out: dict = {"n": len(rows)}
    for suffix in ("", "_reference"):
        out["spearman" + suffix] = spearman([r["predicted"]["step_s" + suffix] for r in rows], measured)
        if errors:
            out["mean_abs_error" + suffix] = sum(abs(r["prediction_error" + suffix]) for r in rows) / len(rows) if rows else None
    return out


def assemble(meta: dict, rows: list[dict]) -> dict:
    for r in rows:
        measured = r["step_time_s"]["median"]
        for suffix in ("", "_reference"):
            r["prediction_error" + suffix] = (r["predicted"]["step_s" + suffix] - measured) / measured
    ms = sorted({r["microbatches"] for r in rows})
    correlation, comparisons = {}, {}
    for m in ms:
        correlation[f"M={m}"] = _accuracy([r for r in rows if r["microbatches"] == m and not r["reused_measurement"]])
        comparisons[f"M={m}"] = compare([r for r in rows if r["microbatches"] == m])
    correlation["all"] = _accuracy([r for r in rows if not r["reused_measurement"]], errors=False)
    return {"meta": meta, "strategies": rows, "rank_correlation": correlation, "comparisons": comparisons}


def _median(rows, strategy) -> float | None:
    found = [r for r in rows if r["strategy"] == strategy]
    return found[0]["step_time_s"]["median"] if found else None


def _plan_budget(row: dict) -> str | None:
    """The memory budget a planner row was chosen under (None: chosen without one; a run
    has at most one budget)."""
    limited = [lb for lb in row.get("chosen_for", []) if lb in row["fits"] and lb != "unlimited"]
    return limited[0] if limited else None


def compare(rows: list[dict]) -> dict:
    out: dict = {}
    lins_fsdp = _median(rows, "lins-fsdp")
    stock = _median(rows, "fsdp2")
    if lins_fsdp and stock:
        out["lins_fsdp_over_fsdp2"] = lins_fsdp / stock
        out["lins_fsdp_within_3pct"] = abs(lins_fsdp / stock - 1) <= 0.03
    planner = [r for r in rows if r["strategy"] == "lins-planner"]
    family = [r for r in rows if r["strategy"] in FSDP_FAMILY]
    for r in planner:
        key = r["label"]
        entry = {"plan": r["plan"], "median_s": r["step_time_s"]["median"]}
        if stock:
            entry["speedup_vs_fsdp2"] = stock / r["step_time_s"]["median"]
            entry["target_2x_vs_fsdp2_met"] = entry["speedup_vs_fsdp2"] >= 2.0
        if family:
            best = min(family, key=lambda x: x["step_time_s"]["median"])
            entry["best_fsdp2_variant"] = best["strategy"]
            entry["speedup_vs_best_fsdp2_variant"] = best["step_time_s"]["median"] / r["step_time_s"]["median"]
            # The target compares against the variants that fit the memory the plan was
            # chosen for (all of them when it was chosen without a budget).
            budget = _plan_budget(r)
            fitting = [x for x in family if budget is None or x["fits"].get(budget)]
            entry["budget"] = budget or "unlimited"
            if fitting:
                best = min(fitting, key=lambda x: x["step_time_s"]["median"])
                entry["best_variant_same_memory"] = best["strategy"]
                entry["speedup_vs_best_variant_same_memory"] = best["step_time_s"]["median"] / r["step_time_s"]["median"]
                entry["target_1.3x_vs_best_variant_met"] = entry["speedup_vs_best_variant_same_memory"] >= 1.3
        fastest = min(rows, key=lambda x: x["step_time_s"]["median"])
        entry["fastest_measured"] = f"{fastest['strategy']} ({fastest['plan'] or fastest['label']})"
        out[key] = entry
    return out


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def markdown(result: dict) -> str:
    meta = result["meta"]
    model = meta["model"]
    lines = [
        "# Cluster benchmark results",
        "",
        f"{meta['nodes']} emulated nodes x {meta['ranks_per_node']} gloo ranks (world {meta['world_size']}), "
        f"inter-node links {meta['link_rate'] or '?'} (tbf, each direction), ranks in a node over loopback; "
        f"{meta['cpu_count']} CPU cores shared by all ranks. Model: LLaMA-style, {model['params'] / 1e6:.2f} M parameters "
        f"(dim {model['dim']}, {model['n_layers']} layers, {model['n_heads']} heads, ffn {model['ffn_dim']}, vocab {model['vocab_size']}), "
        f"{meta['dtype']}; micro-batch {meta['batch_size']} x {meta['seq_len']} tokens per rank; "
        f"{meta['warmup_steps']} warm-up + {meta['timed_steps']} timed steps per row. Run took {meta['elapsed_s']:.0f} s.",
        "",
        f"Calibration (all ranks computing at once): {meta['calibration']['forward_backward_s']:.3f} s forward+backward per "
        f"micro-batch = {meta['calibration']['flops_per_s'] / 1e9:.2f} GFLOP/s per rank; AdamW over the whole model "
        f"{meta['calibration']['optimizer_step_s']:.3f} s; a model-sized copy {meta['calibration']['copy_s']:.3f} s "
        f"({meta['calibration']['copy_bytes_per_s'] / 1e9:.2f} GB/s read + written); forward+backward under apply_lins with "
        f"the ddp plan (no communication before the step) {meta['calibration']['lins_forward_backward_s']:.3f} s, i.e. "
        f"{meta['calibration']['unit_overhead_s'] * 1e3:.1f} ms of host time per unit and micro-batch beyond its copies.",
        "",
        "Planner choices:",
        "",
    ]
    for c in meta["planner"]:
        if c.get("plan"):
            lines.append(f"- M={c['microbatches']}, budget {c['budget']}: **{c['plan']}** (predicted {c['predicted_step_s']:.2f} s, "
                         f"{c['dropped_for_memory']} of {c['valid_plans']} plans dropped for memory) - {c['reason']}")
        else:
            lines.append(f"- M={c['microbatches']}, budget {c['budget']}: no plan ({c.get('error')})")
    ov, ref = meta["overlap_fraction"], meta["reference_overlap_fraction"]
    budget_cols = [k for k in result["strategies"][0]["fits"] if k != "unlimited"] if result["strategies"] else []
    head = ("| M | strategy | plan | step s median [min, max] | tokens/s | peak RSS delta MiB (max rank) | model states MiB | "
            f"inter-node MB/rank msg (NIC) | intra-node MB/rank msg | predicted s, overlap {ov:g} (error) | "
            f"predicted s, overlap {ref:g} (error) |" + "".join(f" fits {b} |" for b in budget_cols))
    lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["strategies"]:
        t, b, pm = r["step_time_s"], r["bytes_per_rank"], r["peak_memory"]
        fits = "".join(f" {'yes' if r['fits'][k] else '**does not fit**'} |" for k in budget_cols)
        lines.append(
            f"| {r['microbatches']} | {r['label']} | {r['plan'] or '-'} | {t['median']:.3f} [{t['min']:.3f}, {t['max']:.3f}] | "
            f"{r['tokens_per_s']:.0f} | {_mib(pm['rss_delta_max_bytes'])} | {_mib(pm['model_state_bytes_max'])} | "
            f"{_mb(b['inter_message_bytes'])} ({_mb(b['inter_nic_bytes'])}) | {_mb(b['intra_message_bytes'])} | "
            f"{r['predicted']['step_s']:.2f} ({r['prediction_error']:+.0%}) | "
            f"{r['predicted']['step_s_reference']:.2f} ({r['prediction_error_reference']:+.0%}) |{fits}"
        )
    lines += ["", "Rank correlation of predicted vs measured step time (Spearman, distinct measurements), "
              f"planner with overlap fraction {ov:g} (this run's) / {ref:g} (reference):", ""]

    def fmt(x, pct=False):
        return "n/a" if x is None else (f"{x:.0%}" if pct else f"{x:.2f}")

    for k, v in result["rank_correlation"].items():
        extra = (f"; mean |error| {fmt(v['mean_abs_error'], True)} / {fmt(v['mean_abs_error_reference'], True)}"
                 if "mean_abs_error" in v else "")
        lines.append(f"- {k}: rho = {fmt(v['spearman'])} / {fmt(v['spearman_reference'])} over {v['n']} strategies{extra}")
    lines += ["", "Comparisons:", ""]
    for m, comp in result["comparisons"].items():
        if "lins_fsdp_over_fsdp2" in comp:
            lines.append(f"- {m}: Lins fsdp preset / stock FSDP2 step time = {comp['lins_fsdp_over_fsdp2']:.3f} "
                         f"({'within' if comp['lins_fsdp_within_3pct'] else 'outside'} 3 %)")
        for key, e in comp.items():
            if isinstance(e, dict):
                parts = [f"{e['plan']} {e['median_s']:.3f} s"]
                if "speedup_vs_fsdp2" in e:
                    parts.append(f"{e['speedup_vs_fsdp2']:.2f}x vs stock FSDP2 (target 2x: {'met' if e['target_2x_vs_fsdp2_met'] else 'not met'})")
                if "speedup_vs_best_variant_same_memory" in e:
                    parts.append(f"{e['speedup_vs_best_variant_same_memory']:.2f}x vs the best FSDP2 variant that fits {e['budget']}, "
                                 f"{e['best_variant_same_memory']} (target 1.3x: {'met' if e['target_1.3x_vs_best_variant_met'] else 'not met'})")
                if e.get("best_fsdp2_variant") and e["best_fsdp2_variant"] != e.get("best_variant_same_memory"):
                    parts.append(f"{e['speedup_vs_best_fsdp2_variant']:.2f}x vs the best FSDP2 variant in any memory, {e['best_fsdp2_variant']}")
                parts.append(f"fastest measured: {e['fastest_measured']}")
                lines.append(f"- {m}, {key}: " + "; ".join(parts))
    lines += ["", "How each number is measured:", ""]
    lines += [f"- {k}: {v}" for k, v in meta["methods"].items()]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["strategies"] if not r["reused_measurement"]]
    ms = sorted({r["microbatches"] for r in rows})
    fig, axes = plt.subplots(1, len(ms), figsize=(7 * len(ms), 5), squeeze=False)
    for ax, m in zip(axes[0], ms):
        sel = [r for r in rows if r["microbatches"] == m]
        xs = range(len(sel))
        med = [r["step_time_s"]["median"] for r in sel]
        lo = [r["step_time_s"]["median"] - r["step_time_s"]["min"] for r in sel]
        hi = [r["step_time_s"]["max"] - r["step_time_s"]["median"] for r in sel]
        pred = [r["predicted"]["step_s"] for r in sel]
        pred0 = [r["predicted"]["step_s_reference"] for r in sel]
        ax.bar([x - 0.27 for x in xs], med, 0.27, yerr=[lo, hi], capsize=3, label="measured (median, min-max)")
        meta = result["meta"]
        ax.bar(list(xs), pred, 0.27, label=f"planner predicted (overlap {meta['overlap_fraction']:g})")
        ax.bar([x + 0.27 for x in xs], pred0, 0.27, label=f"planner predicted (overlap {meta['reference_overlap_fraction']:g})")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['strategy']}\n{r['plan'] or ''}" for r in sel], rotation=60, ha="right", fontsize=7)
        rho = result["rank_correlation"].get(f"M={m}", {}).get("spearman")
        ax.set_title(f"M = {m} micro-batches" + (f" (Spearman {rho:.2f})" if rho is not None else ""))
        ax.set_ylabel("step time (s)")
        ax.legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"{meta['nodes']} nodes x {meta['ranks_per_node']} ranks, {meta['link_rate']} links, "
                 f"{meta['model']['params'] / 1e6:.2f} M-param LLaMA: measured vs predicted step time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
