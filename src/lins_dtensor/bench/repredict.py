"""Re-predict a recorded benchmark run with today's planner.

``python -m lins_dtensor.bench.repredict bench/results`` (a directory holding a run's
``cluster.json`` and ``bandwidth.json``).

A run's predictions are a function of what it recorded: the calibration, the bandwidth
table, the model and batch shape. Costing its rows again with the current planner shows
what a change to the cost model does to every row's prediction error, and to the
planner's picks, without a 25-minute benchmark run. The measurements do not change: a
pick the run did not measure has no measured time, and the table says so.

Each row also gets its prediction with every collective that spans nodes taking no time
(``Planning.without_cross_node_time``): the floor below which no wire format, nor a
faster network, can take that plan on this emulation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lins_dtensor.bench.measure import Ranks
from lins_dtensor.bench.planning import Overlap, Planning, bench_model_spec, budget_label, calibrated_hardware
from lins_dtensor.bench.strategies import FORMAT_STRATEGIES, equivalent_plan
from lins_dtensor.planner import BandwidthTable

PREDICTION_TOLERANCE = 0.2  # the benchmark's bar for a row's prediction (docs/benchmark.md)


def planning_of_run(run_dir: str | Path) -> tuple[Planning, dict]:
    """The planner as the run at ``run_dir`` set it up (rank 0's view), and its results."""
    run_dir = Path(run_dir)
    result = json.loads((run_dir / "cluster.json").read_text())
    meta = result["meta"]
    ranks = Ranks(0, meta["world_size"], meta["ranks_per_node"])
    args = argparse.Namespace(seq_len=meta["seq_len"], batch_size=meta["batch_size"], microbatches=meta["microbatches"])
    reference = meta["reference_overlap_fraction"]
    planning = Planning(
        bench_model_spec(meta["model"]["size"]), calibrated_hardware(meta["calibration"], ranks.per_node),
        BandwidthTable.load(run_dir / "bandwidth.json"), ranks, args,
        Overlap(meta["overlap_fraction"], meta["lins_overlap_fraction"]), Overlap(reference, reference),
    )
    return planning, result


def repredict(run_dir: str | Path) -> dict:
    """Every costed row's measured median, recorded prediction and today's, with both
    errors (and today's with the run's in-run calibration, where it has one, and with no
    time across the nodes, ``no_cross_node_s``); per M the
    mean |error| of each and the rows beyond :data:`PREDICTION_TOLERANCE`; and
    each planner strategy's pick then and now (with the run's measured median of the
    pick now, where the run measured that plan in those formats at that M)."""
    planning, result = planning_of_run(run_dir)
    free = planning.without_cross_node_time()
    in_run = {int(m.removeprefix("M=")): planning.in_run(c["slowdown"], c.get("intra_node_slowdown", 1.0))
              for m, c in result["meta"].get("in_run_calibration", {}).items()}
    rows, measured = [], {}
    for r in result["strategies"]:
        median, recorded = r["step_time_s"]["median"], r.get("predicted") or {}
        if recorded.get("plan") and recorded.get("formats"):
            measured.setdefault((r["microbatches"], recorded["plan"], recorded["formats"]), median)
        if median is None or recorded.get("step_s") is None:
            continue
        eq = equivalent_plan(r["strategy"], planning.ranks.per_node, recorded["plan"], recorded["formats"])
        now = planning.predict(r["microbatches"], eq)["step_s"]
        row = {
            "strategy": r["strategy"], "microbatches": r["microbatches"], "plan": recorded["plan"], "formats": recorded["formats"],
            "measured_s": median, "recorded_s": recorded["step_s"], "predicted_s": now,
            "recorded_error": recorded["step_s"] / median - 1, "error": now / median - 1,
            "no_cross_node_s": free.predict(r["microbatches"], eq)["step_s"],
        }
        if r["microbatches"] in in_run:
            row["in_run_s"] = in_run[r["microbatches"]].predict(r["microbatches"], eq)["step_s"]
            row["in_run_error"] = row["in_run_s"] / median - 1
        rows.append(row)
    summary = {}
    for m in result["meta"]["microbatches"]:
        errors = [abs(row["error"]) for row in rows if row["microbatches"] == m]
        summary[f"M={m}"] = {"rows": len(errors), "mean_abs_error": sum(errors) / max(1, len(errors)),
                             "beyond_tolerance": sum(e > PREDICTION_TOLERANCE for e in errors)}
        in_run_errors = [abs(row["in_run_error"]) for row in rows if row["microbatches"] == m and "in_run_error" in row]
        if in_run_errors:
            summary[f"M={m}"].update(in_run_mean_abs_error=sum(in_run_errors) / len(in_run_errors),
                                     in_run_beyond_tolerance=sum(e > PREDICTION_TOLERANCE for e in in_run_errors))
    picks = []
    budget = result["meta"].get("memory_budget_gib")
    recorded_picks = {(c.get("strategy", "lins-planner"), c["microbatches"], c["budget"]): c
                      for c in result["meta"]["planner"] + result["meta"].get("planner_compressed", [])}
    for strategy in ("lins-planner", *FORMAT_STRATEGIES):
        for m in result["meta"]["microbatches"]:
            for b in (None, budget) if budget else (None,):
                then = recorded_picks.get((strategy, m, budget_label(b)))
                if then is None:
                    continue
                now = planning.local_choice(m, b, planning.run_overlap, FORMAT_STRATEGIES.get(strategy))
                picks.append({
                    "strategy": strategy, "microbatches": m, "budget": budget_label(b),
                    "recorded": f"{then['plan']} {then['formats']}", "now": f"{now['plan']} {now.get('formats')}",
                    "predicted_s": now.get("predicted_step_s"), "measured_s": measured.get((m, now["plan"], now.get("formats"))),
                })
    return {"rows": rows, "summary": summary, "picks": picks}


def _text(out: dict) -> str:
    lines = ["strategy                 M  plan            formats                        measured  recorded (err)    now (err)"
             "  no cross-node time"]
    for r in out["rows"]:
        mark = "  <- beyond 20 %" if abs(r["error"]) > PREDICTION_TOLERANCE else ""
        in_run = f"  in-run {r['in_run_s']:6.3f} ({r['in_run_error']:+.2f})" if "in_run_s" in r else ""
        lines.append(f"{r['strategy']:24s} {r['microbatches']:<2d} {r['plan']:15s} {r['formats'][:30]:30s} {r['measured_s']:8.3f}  "
                     f"{r['recorded_s']:6.3f} ({r['recorded_error']:+.2f})  {r['predicted_s']:6.3f} ({r['error']:+.2f})"
                     f"  {r['no_cross_node_s']:6.3f}{in_run}{mark}")
    for m, s in out["summary"].items():
        in_run = (f"; in-run calibration: mean |error| {s['in_run_mean_abs_error']:.3f}, {s['in_run_beyond_tolerance']} beyond 20 %"
                  if "in_run_mean_abs_error" in s else "")
        lines.append(f"{m}: {s['rows']} costed rows, mean |error| {s['mean_abs_error']:.3f}, {s['beyond_tolerance']} beyond 20 %{in_run}")
    for p in out["picks"]:
        measured = "not measured in this run" if p["measured_s"] is None else f"measured {p['measured_s']:.3f} s"
        change = "unchanged" if p["recorded"] == p["now"] else f"was {p['recorded']}"
        lines.append(f"pick {p['strategy']} M={p['microbatches']} {p['budget']}: {p['now']} predicted {p['predicted_s']:.3f} s, "
                     f"{measured} ({change})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lins_dtensor.bench.repredict", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a directory with a run's cluster.json and bandwidth.json")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    out = repredict(args.run_dir)
    print(json.dumps(out, indent=1) if args.json else _text(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
