"""From the Lins settings of a torchtitan job to a validated :class:`LinsPlan` (or a one-line error).

Explicit plans are checked before the process group exists, so a wrong value stops
the run at start-up with a message that names the key and the rule. ``plan = "auto"``
asks the planner (``lins_dtensor.planner.choose_plan``).
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from lins_dtensor.integrations.titan_common import planning
from lins_dtensor.integrations.titan_common.job import TitanJob
from lins_dtensor.errors import LinsConfigError, LinsPlanError, PlannerError
from lins_dtensor.integrations.titan_common.settings import check_choices
from lins_dtensor.formats import CommFormats, parse_allowed
from lins_dtensor.plan import PRESET_NAMES, LinsPlan
from lins_dtensor.planner.hardware import hardware_preset, load_hardware


def ranks_per_node(job: TitanJob) -> int:
    world = job.world_size
    value = job.lins.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if value < 1 or world % value:
        raise LinsConfigError(
            f"{job.key('lins', 'ranks_per_node')} = {job.lins.ranks_per_node}: must be >= 1 and divide the world size {world}"
        )
    return value


def check_parallelism(job: TitanJob) -> None:
    """Lins owns the data-parallel dims and composes with torchtitan's tensor
    parallelism; pipeline, context and expert parallelism are not composed with it yet."""
    tp_key = job.key("parallelism", "tensor_parallel_degree")
    if job.tp < 1:
        raise LinsConfigError(f"{tp_key} = {job.tp}: must be >= 1")
    if job.seq_len % job.tp:
        raise LinsConfigError(
            f"{job.key('training', 'seq_len')} = {job.seq_len}: must be divisible by {tp_key} = {job.tp} "
            "(sequence parallelism splits it)"
        )
    others = {"pipeline_parallel_degree": job.pp, "context_parallel_degree": job.cp, "expert_parallel_degree": job.ep}
    for name, value in others.items():
        if value != 1:
            raise LinsConfigError(
                f"{job.key('parallelism', name)} = {value}: {job.key('lins', 'enable')} = true composes with data and "
                f"tensor parallelism only (pp, cp, ep = 1); set {job.key('lins', 'enable')} = false to use "
                "torchtitan's other parallelisms"
            )
    if job.cpu_offload:
        raise LinsConfigError(f"{job.key('training', 'enable_cpu_offload')} = true: not supported with {job.key('lins', 'enable')} = true")
    if job.refusals:
        raise LinsConfigError(job.refusals[0])


def check_config(job: TitanJob) -> None:
    """Validate the Lins settings against the world size, the ranks per node and the
    TP degree; raises LinsConfigError."""
    lins = job.lins
    if not lins.enable:
        return
    check_parallelism(job)
    check_choices(lins, lambda name: job.key("lins", name))
    if lins.hardware:
        try:
            hardware_preset(lins.hardware)
        except PlannerError as exc:
            raise LinsConfigError(f"{job.key('lins', 'hardware')} = '{lins.hardware}': {exc.detail}") from None
    if lins.bandwidth_file and not os.path.isfile(lins.bandwidth_file):
        raise LinsConfigError(f"{job.key('lins', 'bandwidth_file')} = '{lins.bandwidth_file}': no such file")
    if lins.hardware_file:
        try:
            load_hardware(lins.hardware_file)
        except PlannerError as exc:
            raise LinsConfigError(f"{job.key('lins', 'hardware_file')}: {exc.detail}") from None
    if job.seed_checkpoint:
        return  # one process writes the unsharded model; the plan applies when it is loaded
    rpn = ranks_per_node(job)
    if rpn % job.tp:
        raise LinsConfigError(
            f"{job.key('parallelism', 'tensor_parallel_degree')} = {job.tp}: must divide the {rpn} ranks per node "
            f"({job.key('lins', 'ranks_per_node')}): a tensor-parallel group stays inside a node"
        )
    if lins.plan.strip().lower() != "auto":
        explicit_plan(job, rpn)
        explicit_formats(job)
    else:
        allowed_formats(job)


def explicit_formats(job: TitanJob) -> CommFormats:
    """The ``comm_formats`` setting next to an explicit plan: the wire formats to use."""
    try:
        return CommFormats.parse(job.lins.comm_formats)
    except LinsConfigError as exc:
        raise _formats_error(job, exc) from None


def allowed_formats(job: TitanJob) -> str | None:
    """The ``comm_formats`` setting next to plan = "auto": the wire formats the planner
    may choose from (``parse_allowed``'s text; None: exact only)."""
    text = job.lins.comm_formats
    try:
        parse_allowed(text)
    except LinsConfigError as exc:
        raise _formats_error(job, exc) from None
    return None if text.strip().lower() in ("", "exact") else text


def _formats_error(job: TitanJob, exc: LinsConfigError) -> LinsConfigError:
    """formats' error under the TOML key's name (its own names the apply_lins argument)."""
    rule = exc.detail.split(": ", 1)[1] if exc.detail.startswith("comm_formats") else exc.detail
    return LinsConfigError(f"{job.key('lins', 'comm_formats')} = '{job.lins.comm_formats}': {rule}")


def explicit_plan(job: TitanJob, rpn: int) -> LinsPlan:
    """The ``plan`` setting as a plan over the ``world / tp`` data-parallel ranks."""
    text, world, tp = job.lins.plan, job.world_size, job.tp
    key = job.key("lins", "plan")
    try:
        plan = LinsPlan.parse(text, world // tp)
    except LinsPlanError as exc:
        raise LinsConfigError(f"{key} = '{text}': {exc.detail} (presets: {', '.join(PRESET_NAMES)}, or 'auto')") from None
    plan = with_reshard_policy(plan, job.lins.reshard_after_forward)
    try:
        plan.validate(world // tp, rpn // tp, tp)
    except LinsPlanError as exc:
        where = f"on {world} ranks, {rpn} per node" + (f", tensor_parallel_degree {tp}" if tp > 1 else "")
        raise LinsConfigError(f"{key} = '{text}' ({plan}) {where}: {exc.detail}") from None
    return plan


def with_reshard_policy(plan: LinsPlan, policy: str) -> LinsPlan:
    if policy == "always":
        return dataclasses.replace(plan, reshard_after_forward=True)
    if policy == "never":
        return dataclasses.replace(plan, reshard_after_forward=False)
    return plan


@dataclasses.dataclass
class Resolved:
    plan: LinsPlan  # over the data-parallel ranks
    ranks_per_node: int  # ranks of the job per node, TP ranks included
    prediction: planning.Prediction | None = None  # the planner's explanation too when auto
    tp: int = 1
    formats: CommFormats = CommFormats()  # the wire formats (auto: the planner's choice)


def _rank0s(plan: LinsPlan, formats: CommFormats) -> tuple[LinsPlan, CommFormats]:
    """Rank 0's choice on every rank: a near-tie in the planner may break differently in
    another process, and ranks sharding with different plans or formats would deadlock."""
    if not dist.is_initialized():
        return plan, formats
    box = [str(plan), str(formats)]
    dist.broadcast_object_list(box, src=0)
    return LinsPlan.parse(box[0]), CommFormats.parse(box[1])


def resolve(job: TitanJob, model) -> Resolved:
    """The plan this run uses (explicit, or the planner's choice for ``model``) and the
    planner's prediction for it."""
    world, tp = job.world_size, job.tp
    rpn = ranks_per_node(job)
    if job.lins.plan.strip().lower() != "auto":
        plan, formats = explicit_plan(job, rpn), explicit_formats(job)
        return Resolved(plan, rpn, planning.predict(job, model, plan, world, rpn, formats), tp, formats)
    plan, prediction = planning.choose(job, model, world, rpn, allowed_formats=allowed_formats(job))
    plan, formats = _rank0s(plan, prediction.formats)
    plan = with_reshard_policy(plan, job.lins.reshard_after_forward)
    try:
        plan.validate(world // tp, rpn // tp, tp)
    except LinsPlanError as exc:
        raise LinsConfigError(f"{job.key('lins', 'plan')} = 'auto': the planner chose {plan}, which is invalid: {exc.detail}") from None
    return Resolved(plan, rpn, prediction, tp, formats)
