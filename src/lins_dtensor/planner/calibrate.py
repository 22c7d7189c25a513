"""Calibration from the user's own run: fit the device efficiency and the inter- and
intra-node bandwidths to measured step times, and write a hardware file used instead
of a preset.

The efficiency is the scale of the device's compute curve
(:mod:`lins_dtensor.planner.compute`): every kernel's rate moves with it, while the
curve's shape (how small GEMMs and short-sequence attention fall below their ceilings,
from kernel benchmarks) is kept, since one run's step times cannot tell it apart.

Only these are fitted because they are what a preset gets wrong on someone else's
cluster (kernels, clocks and power caps; the real network and node interconnect, their
contention and stack), all keep their physical meaning for every other plan, and a
handful of measurements cannot pin down more numbers without fitting noise.

A run is described by a ``lins-calibration/1`` JSON object: the model, the cluster (a
hardware preset or hardware object, ranks, an optional bandwidth table), the training
and measured rows ``{"plan", "step_s"[, "microbatches"][, "comm_exposed_s"]}``. The
torchtitan integration writes it (without rows) as ``lins_run.json`` next to its
TensorBoard events; the rows then come from the ``lins/step_s_measured`` and
``lins/comm/exposed_s/*`` scalars.

The fit minimises the squared log ratio (relative error) of predicted to measured step
times and, where given, exposed communication seconds (in total, or per state as Lins
measures them; 5 % of the step is added to each before the logarithm, so that noise-level
seconds do not dominate). A parameter is fitted only when the measurements determine it:
a bandwidth needs observations that depend on it and move in a way the parameters
already fitted cannot mimic. One step time alone can be matched by any mix of slower
compute and a slower network, so a single plan without its exposed communication fits
the efficiency only (the preset's bandwidths are kept); its exposed communication per
state separates them, and the intra-node bandwidth needs a plan with traffic inside a
node (e.g. P or G sharded within it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from lins_dtensor.errors import LinsConfigError
from lins_dtensor.formats import CommFormats
from lins_dtensor.plan import LinsPlan, LinsPlanError
from lins_dtensor.planner.bandwidth import BandwidthTable
from lins_dtensor.planner.cost import PlanCost, evaluate
from lins_dtensor.planner.hardware import ClusterSpec, HardwareSpec, hardware_from_json, hardware_preset, hardware_to_json, save_hardware
from lins_dtensor.planner.models import ModelSpec, PlannerError, model_from_text, read_json
from lins_dtensor.planner.training import TrainingSpec

FORMAT = "lins-calibration/1"
RUN_FILE = "lins_run.json"  # the torchtitan integration's run description, next to its events
MEASURED_TAG = "lins/step_s_measured"
PREDICTED_TAG = "lins/step_s_predicted"
EXPOSED_PREFIX = "lins/comm/exposed_s/"
WARMUP_STEPS = 1  # the first step compiles, allocates and builds buckets: not the steady state
EFFICIENCY_RANGE = (1e-3, 1.0)
BANDWIDTH_RANGE = 1e3  # the inter-node bandwidth is searched within this factor of the start
MIN_SEPARATION = 0.1  # sine of the angle the two parameters' sensitivities must make


@dataclasses.dataclass(frozen=True)
class Measurement:
    plan: str
    step_s: float
    microbatches: int | None = None  # None: the training's
    comm_exposed_s: float | dict[str, float] | None = None  # Lins' measured exposed communication per step: total, or per state
    formats: str | None = None  # the wire formats it ran with (CommFormats text; None: exact)


@dataclasses.dataclass
class CalibrationRun:
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    measurements: list[Measurement]
    plan: str | None = None  # the plan the run trained with (torchtitan's description)
    formats: str | None = None  # and its wire formats (None: exact)


@dataclasses.dataclass
class Calibration:
    hardware: HardwareSpec
    fitted: list[str]  # names of the HardwareSpec fields fitted
    note: str  # why each bandwidth was or was not fitted
    before: list[float]  # predicted step seconds per measurement, start hardware
    after: list[float]  # the same with the fitted hardware


# ----- JSON ----------------------------------------------------------------------------
def run_to_json(run: CalibrationRun) -> dict:
    model = dataclasses.asdict(run.model)
    data = {
        "format": FORMAT,
        "model": model,
        "hardware": hardware_to_json(run.cluster.hardware),
        "gpus": run.cluster.gpus,
        "gpus_per_node": run.cluster.gpus_per_node,
        "training": dataclasses.asdict(run.training),
        "measurements": [{k: v for k, v in dataclasses.asdict(m).items() if v is not None} for m in run.measurements],
    }
    if isinstance(run.cluster.bandwidth, BandwidthTable):
        data["bandwidth"] = run.cluster.bandwidth.to_json()
    if run.plan is not None:
        data["plan"] = run.plan
    if run.formats is not None:
        data["formats"] = run.formats
    return data


def _model(value: object, where: str) -> ModelSpec:
    if isinstance(value, str):
        return model_from_text(value)
    if not isinstance(value, dict):
        raise PlannerError(f"{where}: 'model' must be a model name or an object of ModelSpec fields")
    fields = dict(value)
    if fields.get("units") is not None:
        fields["units"] = tuple(tuple(tuple(shape) for shape in unit) for unit in fields["units"])
    try:
        return ModelSpec(**fields)
    except TypeError as exc:
        raise PlannerError(f"{where}: bad 'model': {exc}") from None


def _formats(value: object, where: str) -> str | None:
    """A run's or row's wire formats, checked (None: exact)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise PlannerError(f"{where}: 'formats' = {value!r} must be a string like 'grads=int8'")
    try:
        return str(CommFormats.parse(value))
    except LinsConfigError as exc:
        raise PlannerError(f"{where}: 'formats': {exc.detail}") from None


def _measurement(row: object, default_plan: str | None, default_formats: str | None, where: str) -> Measurement:
    if not isinstance(row, dict):
        raise PlannerError(f"{where}: each measurement must be an object with 'plan' and 'step_s'")
    formats = _formats(row.get("formats", default_formats), where)
    plan = row.get("plan", default_plan)
    step_s, m, comm = row.get("step_s"), row.get("microbatches"), row.get("comm_exposed_s")
    if not isinstance(plan, str):
        raise PlannerError(f"{where}: a measurement has no 'plan'")
    if isinstance(step_s, bool) or not isinstance(step_s, (int, float)) or not step_s > 0:
        raise PlannerError(f"{where}: measurement of {plan}: 'step_s' = {step_s!r} must be a positive number")
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise PlannerError(f"{where}: measurement of {plan}: 'microbatches' = {m!r} must be a positive integer")
    values = comm.values() if isinstance(comm, dict) else [] if comm is None else [comm]
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in values) or comm == {}:
        raise PlannerError(f"{where}: measurement of {plan}: 'comm_exposed_s' = {comm!r} must be a number >= 0 or an object of them per state")
    if isinstance(comm, dict):
        return Measurement(plan, float(step_s), m, {str(k): float(v) for k, v in comm.items()}, formats)
    return Measurement(plan, float(step_s), m, None if comm is None else float(comm), formats)


def run_from_json(data: object, where: str = "calibration file") -> CalibrationRun:
    """Check and read a ``lins-calibration/1`` object; every fault is one PlannerError line."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlannerError(f"{where} is not a '{FORMAT}' JSON object")
    for key in ("model", "hardware", "gpus", "training"):
        if key not in data:
            raise PlannerError(f"{where}: missing '{key}'")
    hw_value = data["hardware"]
    hardware = hardware_preset(hw_value) if isinstance(hw_value, str) else hardware_from_json(hw_value, f"{where}: 'hardware'")
    gpus, rpn = data["gpus"], data.get("gpus_per_node", min(hardware.ranks_per_node, data["gpus"]) if isinstance(data["gpus"], int) else None)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (gpus, rpn)):
        raise PlannerError(f"{where}: 'gpus' and 'gpus_per_node' must be integers")
    table = BandwidthTable.from_json(data["bandwidth"]) if "bandwidth" in data else None
    if not isinstance(data["training"], dict):
        raise PlannerError(f"{where}: 'training' must be an object of TrainingSpec fields")
    try:
        training = TrainingSpec(**data["training"])
    except TypeError as exc:
        raise PlannerError(f"{where}: bad 'training': {exc}") from None
    rows = data.get("measurements", [])
    if not isinstance(rows, list):
        raise PlannerError(f"{where}: 'measurements' must be a list")
    plan, formats = data.get("plan"), _formats(data.get("formats"), where)
    return CalibrationRun(
        _model(data["model"], where), ClusterSpec(gpus, rpn, hardware, table), training,
        [_measurement(row, plan, formats, where) for row in rows], plan if isinstance(plan, str) else None, formats,
    )


def read_tensorboard(directory: Path) -> CalibrationRun:
    """The run description torchtitan wrote under ``directory`` and the median of its
    measured steps after the warm-up (tensorboard is imported only here)."""
    found = sorted(directory.rglob(RUN_FILE))
    if not found:
        raise PlannerError(f"no {RUN_FILE} under '{directory}' (the torchtitan integration writes it next to its TensorBoard events)")
    if len(found) > 1:
        raise PlannerError(f"{len(found)} runs under '{directory}'; pass one of their directories, e.g. '{found[-1].parent}'")
    run = run_from_json(read_json(found[0], "run description"), str(found[0]))
    if run.plan is None:
        raise PlannerError(f"{found[0]}: no 'plan'")
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise PlannerError("reading a TensorBoard directory needs the tensorboard package (pip install tensorboard)") from None
    events = EventAccumulator(str(found[0].parent), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags().get("scalars", [])
    if MEASURED_TAG not in tags:
        raise PlannerError(f"'{found[0].parent}' has no '{MEASURED_TAG}' scalars (the run logged no step)")
    steps = {e.step: e.value for e in events.Scalars(MEASURED_TAG) if e.step > WARMUP_STEPS}
    if not steps:
        raise PlannerError(f"'{found[0].parent}' has no measured step after the first {WARMUP_STEPS} (warm-up)")
    comm = {}
    for tag in tags:
        values = [e.value for e in events.Scalars(tag) if e.step in steps] if tag.startswith(EXPOSED_PREFIX) else []
        if values:
            comm[tag[len(EXPOSED_PREFIX):]] = statistics.median(values)
    run.measurements = [Measurement(run.plan, statistics.median(steps.values()), None, comm or None, run.formats)]
    return run


def load_run(path: str | Path) -> CalibrationRun:
    """A TensorBoard directory of a torchtitan run, or a ``lins-calibration/1`` file."""
    path = Path(path)
    if path.is_dir():
        return read_tensorboard(path)
    return run_from_json(read_json(path, "calibration file"), f"calibration file '{path}'")


# ----- the fit -------------------------------------------------------------------------
def predict(run: CalibrationRun, hardware: HardwareSpec, m: Measurement) -> PlanCost:
    """The cost model's prediction for one measured row on ``hardware``."""
    cluster = dataclasses.replace(run.cluster, hardware=hardware)
    training = run.training
    if m.microbatches is not None:
        training = dataclasses.replace(training, global_batch_tokens=m.microbatches * training.microbatch_tokens * cluster.gpus)
    try:
        plan = LinsPlan.parse(m.plan, world_size=cluster.gpus)
        plan.validate(cluster.gpus, cluster.gpus_per_node)
    except LinsPlanError as exc:
        raise PlannerError(f"measured plan '{m.plan}': {exc.detail}") from None
    return evaluate(plan, run.model, cluster, training, formats=CommFormats.parse(m.formats))


FITTED = ("efficiency", "inter_bw", "intra_bw")  # in the order they are tried
NOISE_FLOOR = 0.05  # share of the step added to exposed seconds before comparing their logarithms


def _exposed(cost: PlanCost, comm: float | dict[str, float]) -> list[float]:
    """The prediction of a row's measured exposed communication: the total, or per state."""
    if isinstance(comm, dict):
        return [cost.exposed_state_s.get(state, 0.0) for state in sorted(comm)]
    return [sum(cost.exposed_state_s.values())]


def _observations(run: CalibrationRun, hardware: HardwareSpec) -> list[float]:
    """Predicted values in the order of :func:`_measured`: each step time, then its
    exposed communication (total or per state) where that was measured."""
    out = []
    for m in run.measurements:
        cost = predict(run, hardware, m)
        out.append(cost.step_s)
        if m.comm_exposed_s is not None:
            out += _exposed(cost, m.comm_exposed_s)
    return out


def _measured(run: CalibrationRun) -> tuple[list[float], list[float]]:
    """Measured values and the seconds added to each before the logarithm: exposed
    seconds well under that are the step's noise, and a fully hidden prediction has
    no logarithm of its own."""
    values, floors = [], []
    for m in run.measurements:
        values.append(m.step_s)
        floors.append(0.0)
        if m.comm_exposed_s is not None:
            comm = m.comm_exposed_s
            values += [comm[k] for k in sorted(comm)] if isinstance(comm, dict) else [comm]
            floors += [NOISE_FLOOR * m.step_s] * (len(values) - len(floors))
    return values, floors


def _logs(values: list[float], floors: list[float]) -> list[float]:
    return [math.log(v + f) for v, f in zip(values, floors)]


def _with(base: HardwareSpec, x: dict[str, float]) -> HardwareSpec:
    """``base`` with the fitted fields set from their logarithms in ``x``."""
    return dataclasses.replace(base, **{k: math.exp(v) for k, v in x.items()})


def _identifiable(run: CalibrationRun, base: HardwareSpec, x0: dict[str, float]) -> tuple[list[str], str]:
    """The fields the measurements determine: the efficiency, then each bandwidth whose
    log-sensitivity column is large enough and not (nearly) in the span of the columns
    already taken, i.e. moves the measurements in a way the others cannot mimic."""
    h = math.log(1.25)
    floors = _measured(run)[1]
    y0 = _logs(_observations(run, _with(base, x0)), floors)
    taken: list[list[float]] = []  # orthonormal basis of the fitted fields' columns
    fitted, notes = [], []
    for name in FITTED:
        y = _logs(_observations(run, _with(base, {**x0, name: x0[name] + h})), floors)
        col = [(a - b) / h for a, b in zip(y, y0)]
        norm = math.sqrt(sum(c * c for c in col))
        for q in taken:
            dot = sum(c * e for c, e in zip(col, q))
            col = [c - dot * e for c, e in zip(col, q)]
        rest = math.sqrt(sum(c * c for c in col))
        link = "inter-node" if name == "inter_bw" else "intra-node"
        if name != "efficiency" and norm < 1e-2:
            notes.append(f"{name}: the measured plans send too little on {link} links to tell its bandwidth")
        elif name != "efficiency" and rest < MIN_SEPARATION * norm:
            notes.append(f"{name}: the measurements cannot separate it from {' and '.join(fitted)}: kept the start value; "
                         "measure another plan, or its exposed communication per state, to fit it")
        else:
            fitted.append(name)
            taken.append([c / rest for c in col])
            if name != "efficiency":
                notes.append(f"{name}: fitted to the measured plans' {link} traffic")
    return fitted, "; ".join(notes)


def _scan(f: Callable[[float], float], lo: float, hi: float, points: int = 13) -> float:
    """The best of ``points`` evenly spaced values: a start that the cost model's kinks
    (where an overlap saturates) cannot trap in a far local minimum."""
    grid = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
    return min(grid, key=f)


def _nelder_mead(f: Callable[[tuple[float, ...]], float], x0: tuple[float, ...], step: float, iters: int = 200) -> tuple[float, ...]:
    """Minimise ``f`` from ``x0`` with the downhill simplex: no derivatives (the cost
    model is piecewise smooth), and it follows the narrow valley along which slower
    compute trades for a faster network, where coordinate steps zig-zag."""
    n = len(x0)
    simplex = [tuple(x0)] + [tuple(v + (step if i == j else 0.0) for j, v in enumerate(x0)) for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if max(abs(a - b) for x in simplex[1:] for a, b in zip(x, simplex[0])) < 1e-5:
            break
        centre = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def towards(t: float) -> tuple[float, ...]:
            return tuple(c + t * (w - c) for c, w in zip(centre, worst))

        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best
                simplex = [simplex[0]] + [tuple((a + b) / 2 for a, b in zip(x, simplex[0])) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def fit(run: CalibrationRun) -> Calibration:
    """Fit the efficiency (always) and each bandwidth the measurements determine."""
    if not run.measurements:
        raise PlannerError("no measurements to calibrate from")
    base = run.cluster.hardware
    values, floors = _measured(run)
    measured = _logs(values, floors)
    lo_e, hi_e = (math.log(v) for v in EFFICIENCY_RANGE)
    start = {"efficiency": min(max(math.log(base.efficiency), lo_e), hi_e), "inter_bw": math.log(base.inter_bw), "intra_bw": math.log(base.intra_bw)}
    names, note = _identifiable(run, base, start)
    ranges = {k: (lo_e, hi_e) if k == "efficiency" else (v - math.log(BANDWIDTH_RANGE), v + math.log(BANDWIDTH_RANGE)) for k, v in start.items()}

    def loss(x: dict[str, float]) -> float:
        return sum((p - q) ** 2 for p, q in zip(_logs(_observations(run, _with(base, x)), floors), measured))

    def clamp(y: tuple[float, ...]) -> dict[str, float]:
        return {**start, **{k: min(max(v, ranges[k][0]), ranges[k][1]) for k, v in zip(names, y)}}

    def bounded(y: tuple[float, ...]) -> float:  # outside the ranges: the loss at the edge, plus a slope back in
        x = clamp(y)
        return loss(x) + sum(abs(x[k] - v) for k, v in zip(names, y))

    # A start that the cost model's kinks cannot trap: scan each field in turn, the
    # bandwidths first (each at the best of a low, the start and a high efficiency).
    x = dict(start)
    for k in names[1:]:
        x[k] = _scan(lambda v: min(loss({**x, k: v, "efficiency": e}) for e in (lo_e, x["efficiency"], hi_e)), *ranges[k])
    x["efficiency"] = _scan(lambda v: loss({**x, "efficiency": v}), lo_e, hi_e)
    x = clamp(_nelder_mead(bounded, tuple(x[k] for k in names), 0.2))
    name = base.name if base.name.endswith("(calibrated)") else f"{base.name} (calibrated)"
    fitted = dataclasses.replace(_with(base, {k: x[k] for k in names}), name=name)
    return Calibration(
        fitted, names, note,
        [predict(run, base, m).step_s for m in run.measurements], [predict(run, fitted, m).step_s for m in run.measurements],
    )


def report(run: CalibrationRun, cal: Calibration) -> str:
    """What was fitted and each measured row's prediction before and after."""
    base, hw = run.cluster.hardware, cal.hardware
    c = run.cluster
    lines = [
        f"calibrated {base.name} on {c.gpus} ranks ({c.nodes} nodes x {c.gpus_per_node}) from {len(run.measurements)} measured step time(s)",
        f"  efficiency {base.efficiency:.3f} -> {hw.efficiency:.3f} (the compute curve's scale)",
        f"  inter_bw   {base.inter_bw / 1e9:.4g} -> {hw.inter_bw / 1e9:.4g} GB/s per node",
        f"  intra_bw   {base.intra_bw / 1e9:.4g} -> {hw.intra_bw / 1e9:.4g} GB/s per rank",
        f"  ({cal.note})",
        f"  {'plan':<22} {'M':>3} {'measured s':>11} {'before s':>9} {'after s':>9} {'error':>7}",
    ]
    for m, before, after in zip(run.measurements, cal.before, cal.after):
        micro = m.microbatches or run.training.microbatches(c.gpus)
        lines.append(f"  {m.plan:<22} {micro:>3} {m.step_s:11.4f} {before:9.4f} {after:9.4f} {after / m.step_s - 1:+7.1%}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not the usage block
        raise PlannerError(f"calibrate: {message}")


def run_calibrate(argv: list[str]) -> int:
    """``lins-plan calibrate INPUT -o FILE``: fit, print the report, write the hardware file."""
    p = _Parser(prog="lins-plan calibrate", description="Fit the device efficiency and the bandwidths to measured "
                "step times and write a hardware file for --hardware-file / [lins] hardware_file.")
    p.add_argument("input", help=f"a torchtitan TensorBoard directory (with its {RUN_FILE}) or a '{FORMAT}' JSON file")
    p.add_argument("-o", "--output", required=True, help="hardware file to write ('lins-hardware/1' JSON)")
    args = p.parse_args(argv)
    run = load_run(args.input)
    cal = fit(run)
    try:
        save_hardware(cal.hardware, args.output)
    except OSError as exc:
        raise PlannerError(f"cannot write '{args.output}': {exc.strerror}") from None
    print(report(run, cal))
    print(f"wrote {args.output}: use it with 'lins-plan --hardware-file {args.output}' or [lins] hardware_file = \"{args.output}\"")
    return 0
