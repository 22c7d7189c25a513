"""One Lins plan's step on the cluster, collective by collective: where its time goes.

``bash scripts/bench_cluster.sh --run timeline -- --plan p=1,g=1,os=4 --formats grads=int8 --microbatches 4``

The benchmark gives a row's step time and its exposed and hidden seconds per state; this
gives their order. For each of ``--steps`` steps, every rank's CPU seconds (so the share
of the host's cores the step kept busy), its host marks (each
micro-batch's forward and backward, the clip, which waits for the step's gradient
reductions, the optimizer step, the end) and each collective of the step
(``lins_stats``: its start, end and exposed seconds on this rank), all in seconds from
the step's start. The model, its build and its step are the benchmark's Lins rows'
(:meth:`~.strategies.Strategies.lins`, :meth:`~.measure.Instance.step`): warm-up steps
after a barrier, then steps that start with the last one's update gathers in flight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch.distributed as dist

from lins_dtensor.bench.cluster import lins_strategy
from lins_dtensor.bench.measure import Instance, Ranks, SharedGroups, run_in_job
from lins_dtensor.bench.model import MODEL_SIZES
from lins_dtensor.bench.strategies import Strategies
from lins_dtensor.stats import lins_stats


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lins_dtensor.bench.timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", required=True, help="a Lins plan, as lins-plan prints it (p=1,g=1,os=4) or a preset")
    p.add_argument("--formats", default="exact", help="its wire formats (grads=int8,params=bf16)")
    p.add_argument("--model", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: the launcher's LOCAL_WORLD_SIZE")
    p.add_argument("--show-ranks", default="0", help="comma list of the ranks whose last step is printed")
    p.add_argument("--json", default=None, help="write every rank's steps here")
    args = p.parse_args(argv)
    args.formats = lins_strategy(f"lins:{args.plan}|{args.formats}")[1]
    if args.steps < 1 or args.warmup < 1 or args.microbatches < 1:
        p.error("need --steps, --warmup and --microbatches >= 1")
    return args


def record(args: argparse.Namespace, ranks: Ranks) -> list[dict]:
    """This rank's timed steps: wall time, CPU seconds of the process (all its threads),
    host marks and collectives, from each step's start."""
    strategies = Strategies(args.model, ranks, SharedGroups())
    instance = Instance(f"lins:{args.plan}|{args.formats}", lambda: strategies.lins(args.plan, args.formats), args, ranks.rank)
    for _ in range(args.warmup):
        instance.step(args.microbatches)
    steps = []
    for i in range(args.steps):
        marks: list[tuple[str, float]] = []
        cpu = time.process_time()
        wall = instance.step(args.microbatches, barrier=i == 0, marks=marks)
        cpu = time.process_time() - cpu
        start = marks[0][1]
        stats = lins_stats(instance.built.model)
        steps.append({
            "wall_s": wall, "cpu_s": cpu, "marks": [(what, t - start) for what, t in marks],
            "collectives": [{"name": c.name, "state": c.state, "link": c.link, "format": c.format, "bytes": c.message_bytes,
                             "start_s": t.started_at - start, "end_s": None if t.finished_at is None else t.finished_at - start,
                             "exposed_s": t.exposed} for c, t in zip(stats.collectives, stats.timings)],
        })
    return steps


def cpu_seconds(every: list[list[dict]]) -> list[float]:
    """Per step, the CPU seconds of all ranks together."""
    return [sum(steps[i]["cpu_s"] for steps in every) for i in range(len(every[0]))]


def cores_busy(every: list[list[dict]], cores: int) -> list[float]:
    """Per step, the share of the host's cores that all ranks kept busy: their CPU
    seconds (every thread, gloo's included) over ``cores`` x the step's wall time. Near
    1, the step is bound by the cores: on the emulated cluster the ranks' compute,
    their loopback copies and the codecs share them, so no reordering of collectives
    can shorten it, only less work on the cores."""
    return [cpu / (cores * step["wall_s"]) for cpu, step in zip(cpu_seconds(every), every[0])]


def cores_text(every: list[list[dict]], cores: int) -> str:
    busy = ", ".join(f"{b:.2f}" for b in cores_busy(every, cores))
    cpu = ", ".join(f"{c:.2f}" for c in cpu_seconds(every))
    return f"all {len(every)} ranks: CPU seconds per step {cpu}; share of the {cores} cores busy {busy}"


def text(rank: int, steps: list[dict]) -> str:
    last = steps[-1]
    walls = ", ".join(f"{s['wall_s']:.3f}" for s in steps)
    lines = [f"rank {rank}: step walls {walls} s; the last one, from its start:",
             "  " + "  ".join(f"{what} {t:.3f}" for what, t in last["marks"])]
    for c in last["collectives"]:
        end = "-" if c["end_s"] is None else f"{c['end_s']:7.3f}"
        took = "-" if c["end_s"] is None else f"{c['end_s'] - c['start_s']:6.3f}"
        exposed = "-" if c["exposed_s"] is None else f"{c['exposed_s']:.3f}"
        lines.append(f"  {c['name']:28s} {c['link']:5s} {c['format']:5s} {c['bytes'] / 1e6:7.2f} MB  start {c['start_s']:7.3f}"
                     f"  end {end}  took {took}  exposed {exposed}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Record every rank's steps; rank 0 prints and writes them."""
    job = Ranks.of_job()
    ranks = Ranks(job.rank, job.world, args.ranks_per_node or job.per_node)
    steps = record(args, ranks)
    every = [None] * ranks.world
    dist.all_gather_object(every, steps)
    if ranks.rank == 0:
        print(cores_text(every, len(os.sched_getaffinity(0))), flush=True)
        for r in (int(x) for x in args.show_ranks.split(",") if x.strip()):
            print(text(r, every[r]), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "ranks": every}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_in_job(run, parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
