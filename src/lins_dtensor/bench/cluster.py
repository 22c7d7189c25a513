"""Cluster benchmark: Lins (planner's plan and presets) vs FSDP2, HSDP, hpZ and DDP (plain,
bf16 and PowerSGD communication hooks).

Run under a launcher that sets RANK / WORLD_SIZE / LOCAL_WORLD_SIZE (torchrun), on
gloo; ``scripts/bench_cluster.sh`` runs it on an emulated multi-node cluster (network
namespaces, rate-limited links) after profiling the planner's bandwidth table there.

Every strategy is built once (a LLaMA-style model, :mod:`.model`) and trained through
every M. For each micro-batch count M: each strategy runs ``--warmup`` untimed steps
alone (its memory is measured there), then ``--steps`` timed rounds run one step of
every strategy each, in an order rotated every round, so that load drifting on the
shared CPUs hits all strategies alike. It records:

* step time (slowest rank of each step; median, min, max, quartiles) and tokens/s;
* peak memory per rank from ``/proc/self/status``: resident growth while the strategy
  is built (VmRSS after - before) plus the peak of its warm-up steps (VmHWM, reset via
  ``/proc/self/clear_refs`` just before, minus VmRSS then); plus the persistent
  model-state bytes read from the live tensors;
* bytes per rank on inter-node and intra-node groups, counted as they are issued:
  Lins by its own recorder (``lins_stats``); FSDP2 / HSDP / hpZ with the same
  recording comm objects installed through ``set_custom_all_gather`` /
  ``set_custom_reduce_scatter`` and HSDP's all-reduce through ``set_all_reduce_hook``;
  DDP (each of torch's hooks) through a recording process group given to the hook;
* the planner's prediction for the same strategy (its cost model with the measured
  bandwidth table and a compute rate calibrated on this cluster at start-up), and the
  same with the in-run calibration (:class:`~.measure.InRunProbe`, at the start of every
  timed round): the start-up's plain forward + backward, timed again, scales every rate
  measured on the cores (:func:`~.planning.scaled_hardware`), and the profile's
  collectives inside a node, timed again, scale the table's entries for them
  (:meth:`~.planning.Planning.in_run`); the calibration's all-reduce across the nodes
  is timed there too, and recorded.

Rank 0 writes ``cluster.json``, ``cluster.md`` and ``cluster.png`` into ``--out-dir``.

The pieces, each read top to bottom: :mod:`.measure` (the job's ranks, timing, memory,
bytes per link, the calibration), :mod:`.strategies` (building each strategy, and the
plan the planner costs it as), :mod:`.planning` (the planner's choices and predictions)
and :mod:`.report` (the rows and the result files).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch.distributed as dist

from lins_dtensor import LinsPlan
from lins_dtensor.bench.measure import Instance, InRunProbe, Ranks, SharedGroups, calibrate, log, run_in_job, summarize_times
from lins_dtensor.bench.model import MODEL_SIZES
from lins_dtensor.bench.planning import Overlap, Planning, bench_model_spec, calibrated_hardware
from lins_dtensor.bench.report import RowSpec, make_row, run_meta, write_results
from lins_dtensor.bench.strategies import DESCRIPTIONS, PLANNER_STRATEGIES, STRATEGIES, Strategies, equivalent_plan
from lins_dtensor.formats import CommFormats
from lins_dtensor.planner import BandwidthTable


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The run's options; rejects unknown strategies and counts below one."""
    p = argparse.ArgumentParser(prog="python -m lins_dtensor.bench.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--microbatches", default="1,4", help="comma list of M (micro-batches per step)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed steps per strategy and M")
    p.add_argument("--strategies", default="all", help=f"comma list of {','.join(STRATEGIES)} or 'all'; 'lins:<plan>' "
                   "adds a Lins plan of your choice (separate with ';' when a plan has commas)")
    p.add_argument("--memory-budget-gib", type=float, default=0.0625,
                   help="per-rank budget the planner must respect (the run also plans with no budget); 0: only unlimited")
    p.add_argument("--bandwidth", required=True, help="table from 'python -m lins_dtensor.planner profile'")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--link-rate", default="", help="the emulated link rate (recorded in the results)")
    p.add_argument("--overlap-fraction", type=float, default=0.0,
                   help="the planner's overlap_fraction (FSDP2's collectives) for its plans and predictions; 0 (nothing "
                        "hides) is how FSDP2 runs on CPU, where it blocks on its collectives")
    p.add_argument("--lins-overlap-fraction", type=float, default=None,
                   help="the planner's lins_overlap_fraction (Lins' asynchronous collectives); default: measured at start-up")
    p.add_argument("--reference-overlap-fraction", type=float, default=0.8,
                   help="a second overlap model, for FSDP2's and Lins' collectives alike (default: the planner's GPU "
                        "default); every row gets its prediction, and its unlimited-memory pick is measured too")
    p.add_argument("--skip-reference-plan", action="store_true",
                   help="do not measure the plan picked under --reference-overlap-fraction")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.microbatches = [int(x) for x in str(args.microbatches).split(",") if x.strip()]
    args.strategies = list(STRATEGIES) if args.strategies == "all" else split_strategies(args.strategies)
    unknown = [s for s in args.strategies if s not in STRATEGIES and not s.startswith("lins:")]
    if unknown:
        p.error(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    for s in args.strategies:
        if s.startswith("lins:"):
            try:
                lins_strategy(s)
            except ValueError as e:
                p.error(f"--strategies {s}: {e}")
    if args.steps < 1 or args.warmup < 1 or not args.microbatches or min(args.microbatches) < 1:
        p.error("need --steps >= 1, --warmup >= 1 (it measures memory) and micro-batch counts >= 1")
    return args


def lins_strategy(text: str) -> tuple[str, str]:
    """The plan text and wire formats ("exact" when none) of a 'lins:<plan>[|<formats>]'
    strategy; a bad format raises (the plan is parsed where the world size is known)."""
    plan, _, formats = text[len("lins:"):].partition("|")
    return plan, str(CommFormats.parse(formats)) if formats else "exact"


def split_strategies(text: str) -> list[str]:
    """The strategies of ``--strategies``: split at ';' where there is one, else at ','
    but for the commas inside a 'lins:<plan>[|<formats>]' ("lins:p=1,g=4,os=8,ddp")."""
    if ";" in text:
        return [s.strip() for s in text.split(";") if s.strip()]
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if out and out[-1].startswith("lins:") and part not in STRATEGIES and not part.startswith("lins:"):
            out[-1] += "," + part
        elif part:
            out.append(part)
    return out


def main(argv: list[str] | None = None) -> int:
    return run_in_job(run, parse_args(sys.argv[1:] if argv is None else argv))


def run(args: argparse.Namespace) -> int:
    """Calibrate, plan, build every strategy once, then measure M by M, rewriting the
    results after each M."""
    ranks = Ranks.of_job()
    rank = ranks.rank
    t_start = time.time()
    ma = MODEL_SIZES[args.model]
    log(rank, f"world {ranks.world} = {ranks.nodes} nodes x {ranks.per_node}; model {args.model} ({ma.num_params() / 1e6:.2f} M params), "
        f"seq {args.seq_len} x {args.batch_size} per micro-batch, M in {args.microbatches}")

    groups = SharedGroups()
    table = BandwidthTable.load(args.bandwidth)
    probe = InRunProbe(args, ranks, groups, table)
    calib = calibrate(args, ranks, probe, groups)
    log(rank, f"calibration: fwd+bwd {calib['forward_backward_s']:.3f} s/micro-batch -> {calib['flops_per_s'] / 1e9:.2f} GFLOP/s per rank; "
        f"AdamW step {calib['optimizer_step_s']:.3f} s; copies {calib['copy_bytes_per_s'] / 1e9:.2f} GB/s; "
        f"host time per unit and micro-batch: FSDP2 {calib['unit_overhead_s'] * 1e3:.1f} ms, Lins with P replicated "
        f"{calib['replicated_unit_overhead_s'] * 1e3:.1f} ms; async collectives hide behind {calib['lins_overlap_fraction']:.2f} "
        f"of the compute they overlap")
    hw = calibrated_hardware(calib, ranks.per_node)
    spec = bench_model_spec(args.model)
    lins_overlap = calib["lins_overlap_fraction"] if args.lins_overlap_fraction is None else args.lins_overlap_fraction
    run_overlap = Overlap(args.overlap_fraction, lins_overlap)
    reference_overlap = Overlap(args.reference_overlap_fraction, args.reference_overlap_fraction)
    planning = Planning(spec, hw, table, ranks, args, run_overlap, reference_overlap)
    no_cross_node = planning.without_cross_node_time()
    budgets = [None] + ([args.memory_budget_gib] if args.memory_budget_gib else [])
    choices = planning.choose_all(budgets, with_reference=not args.skip_reference_plan, strategies=args.strategies)

    wanted = rows_to_measure(args, choices, ranks)
    strategies = Strategies(args.model, ranks, groups)
    instances: dict[str, Instance] = {}
    meta = run_meta(args, ranks, spec, calib, hw, choices, run_overlap)
    rows: list[dict] = []
    done: list[int] = []
    for i, m in enumerate(args.microbatches):
        build_instances(wanted[m], instances, strategies, args, ranks)
        results = measure(m, wanted[m], instances, args, rank, probe)
        in_run = probe.take()
        in_run["slowdown"] = in_run["forward_backward_s"] / calib["forward_backward_s"]
        # Recorded, not used by the predictions: the links between nodes are the bandwidth table's.
        in_run["link_slowdown"] = in_run["all_reduce_s"] / calib["overlap_probe"]["all_reduce_s"]
        # Against the table itself: the profile ran before the start-up, in its own job.
        if "intra_node_s" in in_run:
            in_run["intra_node_profiled_s"] = probe.intra_node_profiled_s
            in_run["intra_node_slowdown"] = in_run["intra_node_s"] / probe.intra_node_profiled_s
        else:
            in_run["intra_node_slowdown"] = 1.0
        meta["in_run_calibration"][f"M={m}"] = in_run
        in_run_planning = planning.in_run(in_run["slowdown"], in_run["intra_node_slowdown"])
        log(rank, f"M={m}: in-run calibration: forward+backward {in_run['forward_backward_s']:.3f} s "
            f"({in_run['slowdown']:.2f}x the start-up's), all-reduce across the nodes {in_run['all_reduce_s']:.3f} s "
            f"({in_run['link_slowdown']:.2f}x), collectives inside a node {in_run['intra_node_slowdown']:.2f}x the profile's")
        release_instances(instances, [row for later in args.microbatches[i + 1:] for row in wanted[later]])
        for row in wanted[m]:
            result = results[row.instance]
            per_rank = [None] * ranks.world
            dist.all_gather_object(per_rank, {"peak": result["peak_delta_bytes"], "persistent": result["persistent_bytes"],
                                              "transient": result["transient_bytes"], "states": result["state_bytes"],
                                              "comm_time": result["comm_time"]})
            if rank == 0:
                eq = equivalent_plan(row.strategy, ranks.per_node, row.plan, row.formats)
                rows.append(make_row(
                    row, measured=result, per_rank=per_rank,
                    reused=any(r["microbatches"] == m and r["instance"] == row.instance for r in rows),
                    predicted={**planning.predict(m, eq), "step_s_in_run": in_run_planning.predict(m, eq)["step_s"],
                               "step_s_no_cross_node": no_cross_node.predict(m, eq)["step_s"], "note": eq.note},
                    tokens_per_step=ranks.world * m * args.batch_size * args.seq_len, budgets_gib=budgets,
                    link_rate=args.link_rate, ranks_per_node=ranks.per_node,
                ))
            times = summarize_times(result["times"])
            log(rank, f"M={m} {row.label:60.60s} {row.plan or '':22s} median {times['median']:.3f} s [{times['min']:.3f}, {times['max']:.3f}]")
        done.append(m)
        if rank == 0:  # after every M, so that a run cut short keeps what it measured
            write_results(args.out_dir, meta, rows, elapsed_s=time.time() - t_start, completed_microbatches=done, with_plot=not args.no_plot)
            log(rank, f"wrote {args.out_dir}/cluster.json, cluster.md{'' if args.no_plot else ', cluster.png'} ({time.time() - t_start:.0f} s)")

    dist.barrier()
    return 0


PLANNER_LABELS = {"lins-planner": "Lins planner", "lins-planner-compressed": "Lins planner, lossy formats",
                  "lins-bf16": "Lins planner, bf16 allowed", "lins-int8": "Lins planner, int8 allowed"}


def lins_instance(plan: str, formats: str = "exact") -> str:
    """The instance that runs a Lins plan with its wire formats (rows with both alike share it)."""
    return f"lins:{plan}" if formats == "exact" else f"lins:{plan}|{formats}"


def rows_to_measure(args: argparse.Namespace, choices: dict[str, dict[tuple[int, str], dict]], ranks: Ranks) -> dict[int, list[RowSpec]]:
    """The rows of each M: each planner strategy's distinct (plan, formats) picks (each
    labelled with every budget it was chosen under), then the strategies asked for, in
    their order."""
    wanted = {}
    for m in args.microbatches:
        rows = []
        for strategy in PLANNER_STRATEGIES:
            if strategy not in args.strategies:
                continue
            picks = choices[strategy]
            labels = [lb for mm, lb in picks if mm == m]
            seen = set()
            for lb in labels:
                pick = picks[(m, lb)]
                key = (pick["plan"], pick.get("formats", "exact"))
                if key[0] and key not in seen:
                    seen.add(key)
                    chosen_for = tuple(other for other in labels if (picks[(m, other)]["plan"], picks[(m, other)].get("formats", "exact")) == key)
                    label = f"{PLANNER_LABELS[strategy]} [{', '.join(chosen_for)}]"
                    rows.append(RowSpec(strategy, label, key[0], m, lins_instance(*key), chosen_for, key[1]))
        for s in args.strategies:
            if s in PLANNER_STRATEGIES or (s == "hsdp-deferred" and m == 1):
                continue  # hsdp-deferred is hsdp itself with one micro-batch
            if s.startswith("lins:"):
                spec, formats = lins_strategy(s)
                plan = str(LinsPlan.parse(spec, ranks.world))
                label = f"Lins, plan {plan}" + ("" if formats == "exact" else f", formats {formats}")
                rows.append(RowSpec("lins-plan", label, plan, m, lins_instance(plan, formats), formats=formats))
            elif s.startswith("lins-"):
                plan = str(LinsPlan.parse(equivalent_plan(s, ranks.per_node).plan, ranks.world))
                rows.append(RowSpec(s, DESCRIPTIONS[s], plan, m, lins_instance(plan)))
            else:
                rows.append(RowSpec(s, DESCRIPTIONS[s], None, m, s))
        wanted[m] = rows
    return wanted


def build_instances(rows: list[RowSpec], instances: dict[str, Instance], strategies: Strategies, args: argparse.Namespace, ranks: Ranks) -> None:
    """Build each instance ``rows`` name that ``instances`` lacks, in the order they are
    first named (Lins rows with the same plan and formats share one)."""
    for row in rows:
        if row.instance not in instances:
            t0 = time.time()
            instances[row.instance] = Instance(row.instance, strategies.builder(row.instance, row.plan, row.formats), args, ranks.rank)
            log(ranks.rank, f"built {row.instance} ({time.time() - t0:.0f} s)")


def release_instances(instances: dict[str, Instance], later_rows: list[RowSpec]) -> None:
    """Drop the instances no later M measures, so that each M runs beside its own
    strategies only. With every instance of every M alive at once (24 in the default
    run, 1.7 GB per rank), the M = 1 step times on the 2-core emulation came out 19-75 %
    above those of the same rows in a run of 12 instances (the lossy Lins rows the most);
    runs of 12 and of 5 instances agreed within 10 %. Their process groups are the run's
    shared ones (:class:`~.measure.SharedGroups`) and stay."""
    keep = {row.instance for row in later_rows}
    for key in [k for k in instances if k not in keep]:
        del instances[key]
    gc.collect()


def measure(m: int, rows: list[RowSpec], instances: dict[str, Instance], args: argparse.Namespace, rank: int,
            probe: InRunProbe) -> dict[str, dict]:
    """Each instance of ``rows`` at M: warm-up steps alone (they give its memory), then
    ``--steps`` rounds of one timed step each, interleaved with the order rotated every
    round, so that load drifting on the shared CPUs hits every strategy alike; each round
    starts with a sample of ``probe`` (the in-run calibration)."""
    active = list(dict.fromkeys(row.instance for row in rows))
    for key in active:
        log(rank, f"M={m}: warming up {key}")
        instances[key].warmup(m, args.warmup)
    log(rank, f"M={m}: warmed up {len(active)} strategies; {args.steps} timed rounds")
    for r in range(args.steps):
        shift = r % len(active)
        probe.sample()
        for key in active[shift:] + active[:shift]:
            instances[key].timed(m)
    return {key: instances[key].finish(m) for key in active}


if __name__ == "__main__":
    sys.exit(main())
