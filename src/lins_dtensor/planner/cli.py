"""``lins-plan``: choose a plan (default) or ``lins-plan profile``: measure bandwidth.

Every expected failure (bad preset, impossible cluster, nothing fits) is one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from lins_dtensor.errors import LinsConfigError, LinsError, LinsPlanError
from lins_dtensor.formats import parse_allowed
from lins_dtensor.planner.bandwidth import BandwidthTable
from lins_dtensor.planner.calibrate import run_calibrate
from lins_dtensor.planner.hardware import HARDWARE_PRESETS, ClusterSpec, GiB, hardware_preset, load_hardware
from lins_dtensor.planner.models import MODEL_PRESETS, ModelSpec, PlannerError, decoder_spec, model_from_text
from lins_dtensor.planner.profile import run_profile
from lins_dtensor.planner.report import to_json, to_text
from lins_dtensor.planner.search import Explanation, search
from lins_dtensor.planner.sweep import SWEEPABLE, SweepPoint, parse_sweep, plot_sweep, sweep_json, sweep_text
from lins_dtensor.planner.training import ActivationCheckpointing, TrainingSpec

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# --model custom: flag -> decoder_spec argument (--kv-heads may be left out: no GQA)
_SHAPE_FLAGS = {"--layers": "n_layers", "--dim": "dim", "--ffn-dim": "ffn_dim", "--heads": "n_heads", "--kv-heads": "n_kv_heads", "--vocab": "vocab_size"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block
        raise PlannerError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got '{text}'")
    return value


def plan_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="lins-plan", description="Choose Lins sharding factors (s_p, s_g, s_os) by predicted step time. "
                "'lins-plan profile --help' measures a bandwidth table.")
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(MODEL_PRESETS)}), a torchtitan model:flavor "
                   "(llama3:8B; needs torchtitan), a Hugging Face LlamaForCausalLM config.json, or custom with the shape flags")
    p.add_argument("--gpus", type=int, required=True, help="total ranks")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default: the hardware's)")
    p.add_argument("--tp", default="1", help="tensor-parallel degree inside the node (divides --gpus-per-node), or 'auto': "
                   "try every divisor of the node size and keep the fastest")
    p.add_argument("--hardware", default="a800", help=f"preset: {', '.join(HARDWARE_PRESETS)}")
    p.add_argument("--hardware-file", metavar="FILE", help="hardware from 'lins-plan calibrate', instead of --hardware's preset")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--global-batch-tokens", type=int, default=None, help="tokens per optimizer step (default: one micro-batch per rank)")
    p.add_argument("--activation-checkpointing", nargs="?", const="full", default="none", choices=typing.get_args(ActivationCheckpointing),
                   help="recompute in backward: none, selective (torchtitan's per-op policy) or full (the bare flag)")
    p.add_argument("--bandwidth", metavar="FILE", help="JSON table from 'lins-plan profile'")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="usable memory per rank (default: device memory less a reserve)")
    p.add_argument("--inter-node-gbit", type=float, default=None, help="override the hardware's inter-node bandwidth per node (Gbit/s)")
    p.add_argument("--reduce-dtype", choices=sorted(_DTYPE_BYTES), default="fp32", help="gradient reduce/accumulate dtype (runtime default fp32)")
    p.add_argument("--no-overlap", action="store_true", help="expose every collective (worst case)")
    p.add_argument("--overlap-fraction", type=float, default=0.8, help="share of a phase's compute that can hide FSDP2's per-micro-batch collectives")
    p.add_argument("--lins-overlap-fraction", type=float, default=0.8, help="share of the compute they overlap that Lins' asynchronous collectives hide behind")
    p.add_argument("--reduce-at-step", action="store_true", help="gradients reduced at optimizer.step(), not in the last backward (set_requires_gradient_sync(model, False))")
    p.add_argument("--gathers-exposed", action="store_true", help="update gathers not overlapped with the next forward (worst case of the runtime)")
    p.add_argument("--tie-tolerance", type=float, default=0.02, help="near-ties within this fraction go to the plan with the least inter-node traffic")
    p.add_argument("--allow-formats", metavar="KIND[:LEVEL]=F1|F2,...", default=None,
                   help="wire formats Lins' collectives may take (e.g. 'grads=int8|bf16,params=bf16'; default: exact only); "
                   "a lossy one is chosen only when it predicts a step shorter by more than --tie-tolerance")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...", help=f"plan at each value of {', '.join(SWEEPABLE)} (e.g. inter-node-gbit=25,50,100,200,400) "
                   "and show where the choice turns")
    p.add_argument("--plot", metavar="FILE.png", help="with --sweep: plot step times against the swept value (needs matplotlib)")
    shape = p.add_argument_group("--model custom", "the decoder's shape (all but --kv-heads and --tied-embeddings required)")
    for flag, dest in _SHAPE_FLAGS.items():
        shape.add_argument(flag, dest=dest, type=_positive_int, default=None)
    shape.add_argument("--tied-embeddings", action="store_true", help="the output projection reuses the embedding table")
    return p


def model_arg(args: argparse.Namespace) -> ModelSpec:
    """--model, or with --model custom the shape flags (which mean nothing otherwise)."""
    given = [flag for flag, dest in _SHAPE_FLAGS.items() if getattr(args, dest) is not None]
    if args.model != "custom":
        if given or args.tied_embeddings:
            raise PlannerError(f"{(given or ['--tied-embeddings'])[0]} describes a custom model; pass --model custom")
        return model_from_text(args.model)
    missing = [flag for flag, dest in _SHAPE_FLAGS.items() if getattr(args, dest) is None and flag != "--kv-heads"]
    if missing:
        raise PlannerError(f"--model custom needs {', '.join(missing)}")
    return decoder_spec("custom", tied_embeddings=args.tied_embeddings, **{dest: getattr(args, dest) for dest in _SHAPE_FLAGS.values()})


def build_inputs(args: argparse.Namespace) -> tuple:
    model = model_arg(args)
    hw = load_hardware(args.hardware_file) if args.hardware_file else hardware_preset(args.hardware)
    if args.inter_node_gbit is not None:
        if args.inter_node_gbit <= 0:
            raise PlannerError("--inter-node-gbit must be > 0")
        hw = dataclasses.replace(hw, inter_bw=args.inter_node_gbit * 1e9 / 8)
    table = BandwidthTable.load(args.bandwidth) if args.bandwidth else None
    budget = None
    if args.memory_budget_gib is not None:
        if args.memory_budget_gib <= 0:
            raise PlannerError("--memory-budget-gib must be > 0")
        budget = args.memory_budget_gib * GiB
    rpn = args.gpus_per_node if args.gpus_per_node is not None else min(hw.ranks_per_node, max(args.gpus, 1))
    cluster = ClusterSpec(args.gpus, rpn, hw, table, budget, _tp_degree(args.tp))
    training = TrainingSpec(
        seq_len=args.seq_len, micro_batch=args.micro_batch, global_batch_tokens=args.global_batch_tokens,
        activation_checkpointing=args.activation_checkpointing, reduce_bytes=_DTYPE_BYTES[args.reduce_dtype],
        overlap=not args.no_overlap, overlap_fraction=args.overlap_fraction, lins_overlap_fraction=args.lins_overlap_fraction,
        overlap_step=not args.gathers_exposed, reduce_in_backward=not args.reduce_at_step,
    )
    return model, cluster, training


def _tp_degree(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise PlannerError(f"--tp {text}: must be a positive integer or 'auto'")
    return int(text)


def search_tp(args: argparse.Namespace) -> tuple[Explanation, list[dict]]:
    """``--tp auto``: plan with every tensor-parallel degree that divides the node size
    (and the model's heads, kv heads, FFN and vocabulary), keep the fastest that fits.
    The global batch stays the same for every degree (default: one micro-batch per GPU),
    so a TP group of k GPUs runs k micro-batches per step where one GPU ran one."""
    rpn = build_inputs(argparse.Namespace(**{**vars(args), "tp": "1"}))[1].gpus_per_node
    if args.global_batch_tokens is None:
        args = argparse.Namespace(**{**vars(args), "global_batch_tokens": args.gpus * args.micro_batch * args.seq_len})
    tried: list[dict] = []
    best: Explanation | None = None
    for tp in (k for k in range(1, rpn + 1) if rpn % k == 0):
        try:
            model, cluster, training = build_inputs(argparse.Namespace(**{**vars(args), "tp": str(tp)}))
            ex = search(model, cluster, training, tie_tolerance=args.tie_tolerance, allowed_formats=args.allow_formats)
        except (PlannerError, LinsPlanError) as exc:
            tried.append({"tp": tp, "plan": None, "step_s": None, "note": exc.detail})
            continue
        tried.append({"tp": tp, "plan": str(ex.plan), "step_s": ex.cost.step_s, "note": ""})
        if best is None or ex.cost.step_s < best.cost.step_s:
            best = ex
    if best is None:
        raise PlannerError(f"no tensor-parallel degree fits: {tried[-1]['note']}")
    return best, tried


def tp_search_text(best: Explanation, tried: list[dict]) -> str:
    lines = [f"TP degree (--tp auto): every divisor of the node size, each with its best plan, "
             f"global batch {best.training.global_batch_tokens} tokens"]
    for t in tried:
        mark = "  CHOSEN" if t["tp"] == best.cluster.tp else "        "
        body = f"{t['plan']:<24} {t['step_s']:.3f} s" if t["plan"] else t["note"]
        lines.append(f"{mark} tp={t['tp']:<3} {body}")
    return "\n".join(lines) + "\n"


def run_sweep(args: argparse.Namespace) -> int:
    """One search per swept value, all else as given."""
    key, values = parse_sweep(args.sweep)
    dest = SWEEPABLE[key][0]
    if getattr(args, dest) is not None:
        raise PlannerError(f"--sweep {key} and --{key} both set it; give one")
    if args.bandwidth:
        raise PlannerError(f"--sweep {key} varies the alpha-beta model, which a --bandwidth table replaces; drop one")
    points = []
    for value in values:
        model, cluster, training = build_inputs(argparse.Namespace(**{**vars(args), dest: value}))
        points.append(SweepPoint(value, search(model, cluster, training, tie_tolerance=args.tie_tolerance, allowed_formats=args.allow_formats)))
    if args.plot:
        plot_sweep(key, points, args.plot)
    if args.json:
        print(json.dumps(sweep_json(key, points)))
    else:
        print(sweep_text(key, points) + (f"\nplot: {args.plot}" if args.plot else ""))
    return 0


def run_plan(argv: list[str]) -> int:
    args = plan_parser().parse_args(argv)
    if args.allow_formats is not None:  # a malformed list fails before any work
        try:
            parse_allowed(args.allow_formats)
        except LinsConfigError as exc:
            raise PlannerError(f"--allow-formats: {exc.detail}") from None
    if args.sweep:
        return run_sweep(args)
    if args.plot:
        raise PlannerError("--plot draws a sweep; add --sweep KEY=V1,V2,...")
    if args.tp == "auto":
        explanation, tried = search_tp(args)
    else:
        model, cluster, training = build_inputs(args)
        explanation, tried = search(model, cluster, training, tie_tolerance=args.tie_tolerance, allowed_formats=args.allow_formats), []
    if args.json:
        print(json.dumps({**to_json(explanation, args.top), **({"tp_search": tried} if tried else {})}))
    else:
        print((tp_search_text(explanation, tried) if tried else "") + to_text(explanation, args.top))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "profile":
            return run_profile(argv[1:])
        if argv and argv[0] == "calibrate":
            return run_calibrate(argv[1:])
        return run_plan(argv)
    except LinsError as exc:
        print(f"lins-plan: error: {exc.detail}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lins-plan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
