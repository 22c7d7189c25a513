"""From the ``[lins]`` section to a validated :class:`LinsPlan` (or a one-line error).

Explicit plans are checked before the process group exists, so a wrong value stops
the run at start-up with a message that names the key and the rule. ``plan = "auto"``
asks the planner (``lins_dtensor.planner.choose_plan``).
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from lins_dtensor.errors import LinsConfigError, LinsPlanError, PlannerError
from lins_dtensor.integrations.torchtitan import planning
from lins_dtensor.integrations.torchtitan.config import ReshardPolicy, check_choices
from lins_dtensor.plan import PRESET_NAMES, LinsPlan
from lins_dtensor.planner.hardware import hardware_preset, load_hardware


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def ranks_per_node(lins, world: int) -> int:
    value = lins.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if value < 1 or world % value:
        raise LinsConfigError(
            f"[lins] ranks_per_node = {lins.ranks_per_node}: must be >= 1 and divide the world size {world}"
        )
    return value


def tp_degree(job_config) -> int:
    """torchtitan's tensor-parallel degree, which Lins composes with."""
    return job_config.parallelism.tensor_parallel_degree


def check_parallelism(job_config) -> None:
    """Lins owns the data-parallel dims and composes with torchtitan's tensor
    parallelism; pipeline, context and expert parallelism are not composed with it yet."""
    par = job_config.parallelism
    if par.tensor_parallel_degree < 1:
        raise LinsConfigError(f"[parallelism] tensor_parallel_degree = {par.tensor_parallel_degree}: must be >= 1")
    if job_config.training.seq_len % par.tensor_parallel_degree:
        raise LinsConfigError(
            f"[training] seq_len = {job_config.training.seq_len}: must be divisible by [parallelism] "
            f"tensor_parallel_degree = {par.tensor_parallel_degree} (sequence parallelism splits it)"
        )
    others = {
        "pipeline_parallel_degree": par.pipeline_parallel_degree,
        "context_parallel_degree": par.context_parallel_degree,
        "expert_parallel_degree": par.expert_parallel_degree,
    }
    for key, value in others.items():
        if value != 1:
            raise LinsConfigError(
                f"[parallelism] {key} = {value}: [lins] enable = true composes with data and tensor parallelism "
                "only (pp, cp, ep = 1); set [lins] enable = false to use torchtitan's other parallelisms"
            )
    if job_config.training.enable_cpu_offload:
        raise LinsConfigError("[training] enable_cpu_offload = true: not supported with [lins] enable = true")
    if job_config.optimizer.early_step_in_backward:
        raise LinsConfigError("[optimizer] early_step_in_backward = true: not supported with [lins] enable = true")
    if job_config.model.converters:
        raise LinsConfigError(
            f"[model] converters = {list(job_config.model.converters)}: Lins shards plain tensors and does not "
            "compose with float8 / quantized converters yet; remove them or set [lins] enable = false"
        )


def check_config(job_config) -> None:
    """Validate the ``[lins]`` section against the world size, the ranks per node and the
    TP degree; raises LinsConfigError."""
    lins = job_config.lins
    if not lins.enable:
        return
    check_parallelism(job_config)
    check_choices(lins)
    if lins.hardware:
        try:
            hardware_preset(lins.hardware)
        except PlannerError as exc:
            raise LinsConfigError(f"[lins] hardware = '{lins.hardware}': {exc.detail}") from None
    if lins.bandwidth_file and not os.path.isfile(lins.bandwidth_file):
        raise LinsConfigError(f"[lins] bandwidth_file = '{lins.bandwidth_file}': no such file")
    if lins.hardware_file:
        try:
            load_hardware(lins.hardware_file)
        except PlannerError as exc:
            raise LinsConfigError(f"[lins] hardware_file: {exc.detail}") from None
    if job_config.checkpoint.create_seed_checkpoint:
        return  # one process writes the unsharded model; the plan applies when it is loaded
    world = world_size()
    rpn = ranks_per_node(lins, world)
    tp = tp_degree(job_config)
    if rpn % tp:
        raise LinsConfigError(
            f"[parallelism] tensor_parallel_degree = {tp}: must divide the {rpn} ranks per node "
            "([lins] ranks_per_node): a tensor-parallel group stays inside a node"
        )
    if lins.plan.strip().lower() != "auto":
        explicit_plan(lins, world, rpn, tp)


def explicit_plan(lins, world: int, rpn: int, tp: int = 1) -> LinsPlan:
    """The ``[lins] plan`` value as a plan over the ``world / tp`` data-parallel ranks."""
    text = lins.plan
    try:
        plan = LinsPlan.parse(text, world // tp)
    except LinsPlanError as exc:
        raise LinsConfigError(
            f"[lins] plan = '{text}': {exc.detail} (presets: {', '.join(PRESET_NAMES)}, or 'auto')"
        ) from None
    plan = with_reshard_policy(plan, lins.reshard_after_forward)
    try:
        plan.validate(world // tp, rpn // tp, tp)
    except LinsPlanError as exc:
        where = f"on {world} ranks, {rpn} per node" + (f", tensor_parallel_degree {tp}" if tp > 1 else "")
        raise LinsConfigError(f"[lins] plan = '{text}' ({plan}) {where}: {exc.detail}") from None
    return plan


def with_reshard_policy(plan: LinsPlan, policy: ReshardPolicy) -> LinsPlan:
    """``plan`` with ``[lins] reshard_after_forward`` applied ("plan" keeps its own)."""
    if policy == "always":
        return dataclasses.replace(plan, reshard_after_forward=True)
    if policy == "never":
        return dataclasses.replace(plan, reshard_after_forward=False)
    return plan


@dataclasses.dataclass
class Resolved:
    plan: LinsPlan  # over the data-parallel ranks
    ranks_per_node: int  # ranks of the job per node, TP ranks included
    prediction: object | None = None  # planning.Prediction (planner's explanation when auto)
    tp: int = 1


def _rank0s(plan: LinsPlan) -> LinsPlan:
    """Rank 0's choice on every rank: a near-tie in the planner may break differently in
    another process, and ranks sharding with different plans would deadlock."""
    if not dist.is_initialized():
        return plan
    box = [str(plan)]
    dist.broadcast_object_list(box, src=0)
    return LinsPlan.parse(box[0])


def resolve(job_config, model) -> Resolved:
    """The plan this run uses (explicit, or the planner's choice for ``model``) and the
    planner's prediction for it."""
    lins = job_config.lins
    world = world_size()
    rpn = ranks_per_node(lins, world)
    tp = tp_degree(job_config)
    if lins.plan.strip().lower() != "auto":
        plan = explicit_plan(lins, world, rpn, tp)
        return Resolved(plan, rpn, planning.predict(job_config, model, plan, world, rpn, tp), tp)
    plan, prediction = planning.choose(job_config, model, world, rpn, tp)
    plan = with_reshard_policy(_rank0s(plan), lins.reshard_after_forward)
    try:
        plan.validate(world // tp, rpn // tp, tp)
    except LinsPlanError as exc:
        raise LinsConfigError(f"[lins] plan = 'auto': the planner chose {plan}, which is invalid: {exc.detail}") from None
    return Resolved(plan, rpn, prediction, tp)
