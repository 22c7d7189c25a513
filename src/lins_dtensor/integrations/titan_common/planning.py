"""The bridge to the planner, and the start-up table rank 0 prints.

``plan = "auto"`` asks ``lins_dtensor.planner.choose_plan`` for the plan. For every plan, auto or explicit, the planner's cost model predicts the
chosen plan's memory and step time and those of the named baselines (DDP, ZeRO-1/2/3,
HSDP/MiCS, hpZ) on the same cluster; that is the table rank 0 prints at start-up and
writes to TensorBoard. If the planner fails for an explicit plan, the plan still runs
and the table shows model-state bytes from the plan alone. The prediction also carries
the run's description (model, cluster, training, plan) that ``lins-plan calibrate``
needs, so calibration reuses this start-up prediction's inputs rather than guessing them.
"""

from __future__ import annotations

import dataclasses

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from lins_dtensor.integrations.titan_common.job import TitanJob
from lins_dtensor.errors import LinsConfigError, LinsError
from lins_dtensor.formats import CommFormats
from lins_dtensor.plan import LinsPlan
from lins_dtensor.planner import Baseline, BandwidthTable, ClusterSpec, TrainingSpec, choose_plan, evaluate, model_from_module
from lins_dtensor.planner.calibrate import CalibrationRun, run_to_json
from lins_dtensor.planner.hardware import load_hardware
from lins_dtensor.planner.models import PlannerError, architecture_only, shapes_numel
from lins_dtensor.planner.search import baseline_plans
from lins_dtensor.planner.training import RECOMPUTED_FORWARD

MiB = float(1 << 20)


@dataclasses.dataclass
class Prediction:
    """What the planner predicts for the chosen plan and the baselines."""

    chosen: object  # lins_dtensor.planner.PlanCost
    baselines: list  # lins_dtensor.planner.Baseline
    explanation: object | None = None  # lins_dtensor.planner.Explanation, when auto
    cluster_text: str = ""
    run_description: dict | None = None  # lins-calibration/1 JSON without measurements

    @property
    def formats(self) -> CommFormats:
        """The wire formats the prediction is for (auto: the planner's choice)."""
        return self.chosen.formats

    @property
    def step_seconds(self) -> float:
        return float(self.chosen.step_s)


def _hardware_name(job: TitanJob) -> str:
    if job.lins.hardware:
        return job.lins.hardware
    if not torch.cuda.is_available():
        return "cpu-emulated"
    name = torch.cuda.get_device_name().upper()
    for key in ("H200", "H100", "A800", "A100"):
        if key in name:
            return key.lower()
    return "h100"


def _cluster(job: TitanJob, world: int, rpn: int):
    bandwidth = BandwidthTable.load(job.lins.bandwidth_file) if job.lins.bandwidth_file else None
    if job.lins.hardware_file:
        return ClusterSpec(world, rpn, load_hardware(job.lins.hardware_file), bandwidth, tp=job.tp)
    return ClusterSpec.preset(_hardware_name(job), world, rpn, bandwidth=bandwidth, tp=job.tp)


def _training(job: TitanJob, dp_world: int):
    """The planner's TrainingSpec from torchtitan's training settings (the default
    global batch is one local batch per data-parallel rank)."""
    global_batch = job.global_batch_size if job.global_batch_size > 0 else job.local_batch_size * dp_world
    return TrainingSpec(
        seq_len=job.seq_len,
        micro_batch=job.local_batch_size,
        global_batch_tokens=global_batch * job.seq_len,
        # memory_budget (torch.compile's) recomputes a budget-dependent share: costed as selective.
        activation_checkpointing=job.activation_checkpoint if job.activation_checkpoint in RECOMPUTED_FORWARD else "selective",
        param_bytes=TORCH_DTYPE_MAP[job.param_dtype].itemsize,
        reduce_bytes=TORCH_DTYPE_MAP[job.grad_dtype].itemsize,
        activation_bytes=TORCH_DTYPE_MAP[job.param_dtype].itemsize,
        clip_grad_norm=job.max_norm > 0,
    )


def _run_description(spec, cluster: ClusterSpec, training: TrainingSpec, plan: LinsPlan, formats: CommFormats) -> dict:
    """What ``lins-plan calibrate`` needs to know of this run, measured rows aside."""
    return run_to_json(CalibrationRun(spec, cluster, training, [], str(plan), str(formats) if formats.lossy else None))


def _model_spec(model, tp: int):
    """The planner's description of torchtitan's (not yet parallelised) model. Under TP
    the planner splits it by torchtitan's LLaMA plan, from the architecture numbers,
    after checking that the module's shapes are that layout. The head counts are read
    from the attention modules (0.3's model has no ``model_args`` to read them from)."""
    ffn = next((m.feed_forward.w1.weight.shape[0] for m in model.modules() if hasattr(m, "feed_forward")), None)
    attention = next((m for m in model.modules() if hasattr(m, "n_heads") and hasattr(m, "n_kv_heads")), None)
    heads = {} if attention is None else {"n_heads": attention.n_heads}
    if attention is not None and attention.n_kv_heads != attention.n_heads:  # equal: stored as None (plain MHA)
        heads["n_kv_heads"] = attention.n_kv_heads
    spec = model_from_module(model, ffn_dim=ffn, **heads)
    return _architecture(spec) if tp > 1 else spec


def _architecture(spec):
    """``spec`` by its architecture numbers (what the planner splits for TP). torchtitan
    0.3 fuses ``wq``/``wk``/``wv`` into one ``wqkv`` weight, whose shape
    ``architecture_only`` does not recognise: the same parameters per unit in other
    shapes (which TP splits by the same heads) are accepted too."""
    try:
        return architecture_only(spec)
    except PlannerError:
        plain = dataclasses.replace(spec, units=None, embedding_params=None)
        if [shapes_numel(u) for u in plain.unit_shapes()] != [shapes_numel(u) for u in spec.units]:
            raise
        return plain


def choose(job: TitanJob, model, world: int, rpn: int, allowed_formats: str | None = None) -> tuple[LinsPlan, Prediction]:
    """``plan = "auto"``: the planner's plan for the data-parallel ranks next to the
    job's tensor parallelism, or a one-line LinsConfigError. ``allowed_formats`` (text
    as ``formats.parse_allowed`` reads it; None: exact only) lets it choose the wire
    formats too: ``Prediction.formats``, what ``apply_lins(comm_formats=)`` must get."""
    try:
        cluster, training = _cluster(job, world, rpn), _training(job, world // job.tp)
        plan, explanation = choose_plan(_model_spec(model, job.tp), cluster, training, allowed_formats=allowed_formats)
    except Exception as exc:  # the planner's own error (nothing fits, bad batch), one line
        raise LinsConfigError(f"{job.key('lins', 'plan')} = 'auto': {_first_line(exc)}") from None
    run = _run_description(explanation.model, explanation.cluster, explanation.training, plan, explanation.formats)
    return plan, Prediction(explanation.cost, explanation.baselines, explanation, _cluster_text(explanation.cluster), run)


def predict(job: TitanJob, model, plan: LinsPlan, world: int, rpn: int, formats: str | CommFormats | None = None) -> Prediction | None:
    """The planner's prediction for an explicit plan in the wire ``formats`` (None:
    exact) and the baselines; None if unavailable."""
    try:
        cluster, training = _cluster(job, world, rpn), _training(job, world // job.tp)
        spec = _model_spec(model, job.tp)
        baselines = [
            Baseline(name, p, None if p is None else evaluate(p, spec, cluster, training), note)
            for name, p, note in baseline_plans(cluster.dp_ranks, cluster.dp_per_node, cluster.tp)
        ]
        chosen = evaluate(plan, spec, cluster, training, formats=CommFormats.parse(formats))
        run = _run_description(spec, cluster, training, plan, chosen.formats)
        return Prediction(chosen, baselines, None, _cluster_text(cluster), run)
    except Exception as exc:  # noqa: BLE001 - the table is informative only; training goes on
        logger.warning(f"lins: no planner prediction for plan {plan}: {_first_line(exc)}")
        return None


def _first_line(exc: Exception) -> str:
    """The error's first line, without the ``lins:`` prefix when it is a Lins error (the
    caller's message has its own)."""
    text = exc.detail if isinstance(exc, LinsError) else str(exc)
    return (text.strip().splitlines() or [type(exc).__name__])[0]


def _cluster_text(cluster) -> str:
    source = "measured bandwidth table" if cluster.bandwidth is not None else f"{cluster.hardware.name} model"
    return f"{cluster.gpus} x {cluster.hardware.name} ({cluster.nodes} nodes x {cluster.gpus_per_node}), {source}"


def _state_bytes(plan: LinsPlan, num_params: int, param_bytes: int, grad_bytes: int, tp: int) -> float:
    return num_params / tp * (param_bytes / plan.params + grad_bytes / plan.grads + 12 / plan.optim)


def table(plan: LinsPlan, prediction: Prediction | None, world: int, rpn: int, num_params: int, param_bytes: int, grad_bytes: int,
          tp: int = 1, plan_key: str = "[lins] plan") -> str:
    """The compact start-up report: chosen plan, why, predictions and baselines (all
    with the job's tensor parallelism: the plans are over its data-parallel ranks).
    ``plan_key`` names the plan setting as the job's torchtitan release spells it."""
    head = f"  {'':<14} {'plan':<18} {'states MiB':>10} {'peak MiB':>9} {'step s':>8} {'vs chosen':>9}"
    layout = f"{world} ranks ({rpn} per node)"
    if tp > 1:
        layout += f" = tensor parallel {tp} x {world // tp} data-parallel ranks"
    lines = [f"Lins: plan {plan} on {layout}, {num_params:,} parameters"]
    if prediction is not None and prediction.formats.lossy:
        lines[0] += f", wire formats {prediction.formats}"
    if prediction is None:
        lines += [head.replace(" peak MiB", "         ").rstrip(), f"  {'CHOSEN':<14} {str(plan):<18} {_state_bytes(plan, num_params, param_bytes, grad_bytes, tp) / MiB:10.1f}"]
        lines.append(f"why: plan given in {plan_key} (no planner prediction available)")
        return "\n".join(lines)
    chosen = prediction.chosen
    lines[0] += f"; predicted on {prediction.cluster_text}"

    def row(label, cost, note=""):
        if cost is None:
            return f"  {label:<14} {note}"
        ratio = cost.step_s / chosen.step_s if chosen.step_s else float("nan")
        fits = "" if cost.fits else "  (does not fit)"
        return (
            f"  {label:<14} {str(cost.plan):<18} {cost.memory.states / MiB:10.1f} {cost.memory.peak / MiB:9.1f} "
            f"{cost.step_s:8.4f} {ratio:8.2f}x{fits}"
        )

    lines += [head, row("CHOSEN", chosen)]
    lines += [row(b.name, b.cost, b.note) for b in prediction.baselines]
    if prediction.explanation is not None:
        lines.append(f"why: {prediction.explanation.reason}")
    else:
        lines.append(f"why: plan given in {plan_key} (set plan = \"auto\" to let the planner choose)")
    return "\n".join(lines)
