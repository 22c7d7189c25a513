"""torch DDP with torch's communication hooks inside torchtitan 0.2.2's trainer (issue 20).

The convergence runs (time to loss) of ``bf16_compress_hook`` and ``powerSGD_hook`` next
to Lins': the same trainer, config file, model init, data, loss, optimizer, LR schedule
and clipping, with data parallelism done by ``torch.nn.parallel.DistributedDataParallel``
and a communication hook chosen by the environment variable ``LINS_BENCH_DDP_HOOK``:

- ``allreduce``: torch's ``default_hooks.allreduce_hook`` (plain fp32 all-reduce, the
  validation against exact Lins),
- ``bf16``: torch's ``default_hooks.bf16_compress_hook``,
- ``powersgd``: torch's ``powerSGD_hook`` with the benchmark's settings
  (:data:`lins_dtensor.bench.strategies.POWERSGD_RANK` = 4, ``start_powerSGD_iter`` =
  :data:`~lins_dtensor.bench.strategies.POWERSGD_START_ITER` = 2, error feedback, warm start).

Use: ``LINS_BENCH_DDP_HOOK=bf16 torchrun ... -m lins_dtensor.train --job.config_file
train_configs/llama3_debug_cpu_convergence.toml --lins.no-enable --model.name ddp_llama3
--experimental.custom_import lins_dtensor.bench.ddp_hooks_titan`` (``run`` below does
this and writes the JSON; ``scripts/convergence_ddp.sh`` wraps it). Importing this
module registers the ``ddp_llama3`` TrainSpec: torchtitan's llama3 spec whose
``parallelize_fn`` wraps the model in DDP; everything else is torchtitan's (its
optimizer container, metrics, loss) plus the Lins package's CPU shims, tokenizer and
``python_stdlib`` dataset. ``[parallelism] data_parallel_shard_degree = -1`` stays as
in the config, so torchtitan's data sharding, token count and loss logging are those of
the Lins runs; the model is not sharded (``ddp_llama3`` does not call ``fully_shard``).

Two points where DDP differs from torchtitan's FSDP path, and what is done about them:

1. **Gradient scale.** torchtitan's loss is ``local loss sum / global token count`` and
   its FSDP sums gradients over the ranks (``disable_fsdp_gradient_division``), as Lins
   does. torch's hooks average (they divide by the world size). Each hook is therefore
   called on the bucket multiplied by the world size (4, a power of two: exact in fp32),
   so that it sees each rank's gradient of its own mean loss, as in ordinary DDP use,
   and its average is the trainer's sum. Clipping (``max_norm``) then sees the same
   gradients as under Lins / FSDP.
2. **Construction after init.** torchtitan builds the model on the meta device, calls
   ``parallelize_fn``, then ``to_empty`` and ``init_weights`` on what it returned; DDP
   needs real parameters (it broadcasts rank 0's). :class:`DDPAfterInit` is returned
   instead: it forwards ``to_empty`` / ``init_weights`` to the model and builds the DDP
   wrapper (and registers the hook) right after ``init_weights``, with the RNG where the
   trainer left it. ``parameters()`` are the model's, so torchtitan's optimizer,
   clipping and metrics see them as usual. Checkpoints are off in the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch.distributed as dist
from torch import nn

from lins_dtensor.bench.convergence import CONFIG, HOOK_FORMATS, RESULTS, current_commit, parse_log, split_trainer_args

ENV = "LINS_BENCH_DDP_HOOK"
HOOKS = ("allreduce", "bf16", "powersgd")
SPEC_NAME = "ddp_llama3"
FORMATS = {"allreduce": "exact", "bf16": HOOK_FORMATS["ddp-bf16-hook"], "powersgd": HOOK_FORMATS["ddp-powersgd"]}
"""The JSON's ``formats``: the plain all-reduce is exact fp32 training (plan ``ddp``)."""

# torchtitan's overrides that turn the Lins convergence config into the DDP run.
OVERRIDES = ["--lins.no-enable", "--model.name", SPEC_NAME,
             "--experimental.custom_import", "lins_dtensor.bench.ddp_hooks_titan"]


# ---------------------------------------------------------------- the hooks


def hook_kind() -> str:
    kind = os.environ.get(ENV, "")
    if kind not in HOOKS:
        raise ValueError(f"{ENV}={kind!r}: set it to one of {', '.join(HOOKS)}")
    return kind


def summing(hook, world_size: int):
    """``hook`` called on the bucket times ``world_size``: torch's hooks average, the
    trainer's loss (sum over the rank's tokens / global tokens) wants the sum. No
    annotations: DDP checks a hook's (and refuses ``bf16_compress_hook`` by name on a
    CPU-only torch, though gloo all-reduces bf16)."""

    def sum_over_ranks_hook(state, bucket):
        bucket.buffer().mul_(world_size)
        return hook(state, bucket)

    sum_over_ranks_hook.__name__ = f"sum_over_ranks_{hook.__name__.replace('bf16_compress_hook', 'bf16_compress')}"
    return sum_over_ranks_hook


def register_hook(ddp: nn.parallel.DistributedDataParallel, kind: str) -> None:
    """torch's hook for ``kind`` on the default (world) group, as the benchmark sets it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        PowerSGDState,
        powerSGD_hook,
    )

    from lins_dtensor.bench.strategies import POWERSGD_RANK, POWERSGD_START_ITER, in_bucket_order

    n = dist.get_world_size()
    if kind == "allreduce":
        ddp.register_comm_hook(None, summing(default_hooks.allreduce_hook, n))
    elif kind == "bf16":
        ddp.register_comm_hook(None, summing(default_hooks.bf16_compress_hook, n))
    else:
        state = PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                              start_powerSGD_iter=POWERSGD_START_ITER, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, summing(in_bucket_order(powerSGD_hook), n))


# ---------------------------------------------------------------- the TrainSpec


class DDPAfterInit(nn.Module):
    """The model as torchtitan's trainer sees it; DDP is built after ``init_weights``."""

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.model = model
        self.kind = kind
        self._ddp: nn.parallel.DistributedDataParallel | None = None

    def init_weights(self, *args, **kwargs) -> None:
        self.model.init_weights(*args, **kwargs)
        # Not a submodule: parameters() stay the model's (named model.*), once.
        ddp = nn.parallel.DistributedDataParallel(self.model)
        register_hook(ddp, self.kind)
        ddp.train(self.training)
        object.__setattr__(self, "_ddp", ddp)

    def train(self, mode: bool = True):
        super().train(mode)
        if self._ddp is not None:
            self._ddp.train(mode)
        return self

    def forward(self, *args, **kwargs):
        if self._ddp is None:
            raise RuntimeError("DDPAfterInit: forward before init_weights")
        return self._ddp(*args, **kwargs)


def parallelize_ddp(model: nn.Module, parallel_dims, job_config):
    """``parallelize_fn``: no TP / PP / CP / AC / compile (the convergence config has
    none); the model wrapped for DDP with the hook from ``LINS_BENCH_DDP_HOOK``."""
    if parallel_dims.tp_enabled or parallel_dims.pp_enabled or parallel_dims.cp_enabled:
        raise ValueError(f"{SPEC_NAME}: data parallelism only (tp, pp, cp must be 1)")
    if job_config.activation_checkpoint.mode != "none" or job_config.compile.enable:
        raise ValueError(f"{SPEC_NAME}: activation checkpointing and compile are not wired")
    kind = hook_kind()
    from torchtitan.tools.logging import logger

    logger.info(f"{SPEC_NAME}: torch DDP over {dist.get_world_size()} ranks, comm hook {kind}")
    return DDPAfterInit(model, kind)


def register() -> None:
    from torchtitan.models.llama3 import get_train_spec
    from torchtitan.protocols.train_spec import register_train_spec

    import lins_dtensor.integrations.torchtitan  # noqa: F401  (CPU shims, dataset, tokenizer)
    from lins_dtensor.integrations.torchtitan import lins_train_spec

    lins = lins_train_spec()
    spec = dataclasses.replace(get_train_spec(), parallelize_fn=parallelize_ddp, pipelining_fn=None,
                               build_tokenizer_fn=lins.build_tokenizer_fn)
    try:
        register_train_spec(SPEC_NAME, spec)
    except ValueError:  # already registered
        pass


# ---------------------------------------------------------------- running

def _logged_steps(log_path: Path) -> int:
    try:
        return len(parse_log(log_path.read_text())[0])
    except ValueError:
        return 0


def run(name: str, hook: str, seed: int, stop_after: int | None, extra: list[str], config: str = CONFIG,
        nproc: int = 4) -> dict:
    """Train one DDP run; write bench/results/convergence/<name>.json (the Lins runs'
    fields) and the rank-0 log to outputs/convergence/<name>.log. ``stop_after``: end
    the run (SIGTERM to its process group) once that step is logged, keeping the
    config's step count and hence its LR schedule (a shorter ``--training.steps`` would
    decay the LR faster)."""
    root = Path.cwd()
    command = ["torchrun", "--standalone", "--nproc_per_node", str(nproc), "--local-ranks-filter", "0",
               "--role", "rank", "--tee", "3", "-m", "lins_dtensor.train", "--job.config_file", config,
               "--debug.seed", str(seed), *OVERRIDES, *extra]
    log_path = root / "outputs" / "convergence" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **{ENV: hook})
    started, commit = datetime.now(timezone.utc), current_commit()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stopped = False
        while proc.poll() is None:
            time.sleep(2)
            if stop_after and not stopped and _logged_steps(log_path) >= stop_after:
                os.killpg(proc.pid, signal.SIGTERM)
                stopped = True
        returncode = proc.wait()
    wall = time.monotonic() - t0
    if returncode != 0 and not stopped:
        raise SystemExit(f"convergence_ddp: {name} failed (exit {returncode}); see {log_path}")
    losses, times = parse_log(log_path.read_text())
    if stopped:
        losses, times = losses[:stop_after], times[:stop_after]
    result = {
        "name": name,
        "seed": seed,
        "plan": "ddp",
        "formats": FORMATS[hook],
        "config": config,
        "steps": len(losses),
        "losses": losses,
        "step_times_s": times,
        "wall_s": round(wall, 1),
        "started_utc": started.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": commit,
        "command": f"{ENV}={hook} " + " ".join(shlex.quote(c) for c in command)
                   + (f"  (stopped after step {stop_after})" if stopped else ""),
    }
    out = root / RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"convergence_ddp: {name}: {len(losses)} steps, final loss {losses[-1]:.4f}, {wall:.0f} s -> {out}")
    return result


def compare(a: str, b: str, steps: int) -> None:
    """Per-step losses of two result files over their first ``steps`` steps."""
    la, lb = (json.loads(Path(p).read_text())["losses"] for p in (a, b))
    n = min(steps, len(la), len(lb))
    print(f"{'step':>4} {Path(a).stem:>14} {Path(b).stem:>14} {'diff':>10}")
    for i in range(n):
        print(f"{i + 1:4d} {la[i]:14.5f} {lb[i]:14.5f} {lb[i] - la[i]:+10.2e}")
    print(f"max |diff| over steps 1-{n}: {max(abs(x - y) for x, y in zip(la[:n], lb[:n])):.2e}")


def main(argv: list[str] | None = None) -> None:
    argv, extra = split_trainer_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m lins_dtensor.bench.ddp_hooks_titan",
                                     description="DDP + torch comm hooks in torchtitan's trainer (issue 20)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="train one run and write its JSON (trainer arguments after --)")
    p.add_argument("--name", required=True)
    p.add_argument("--hook", required=True, choices=HOOKS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-after", type=int, default=None,
                   help="end the run once this step is logged (the config's steps and LR schedule kept)")
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--nproc", type=int, default=4)
    c = sub.add_parser("compare", help="per-step losses of two result files")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        run(args.name, args.hook, args.seed, args.stop_after, extra, args.config, args.nproc)
    else:
        compare(args.a, args.b, args.steps)


if __name__ == "__main__":
    main()
else:  # imported by torchtitan's trainer ([experimental] custom_import)
    register()
