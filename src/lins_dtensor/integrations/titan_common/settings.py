"""The Lins settings of a torchtitan job, the same dataclass for every torchtitan release.

torchtitan 0.2.2 reads it as the ``[lins]`` TOML section (``JobConfig.lins``), 0.3 as
the ``lins`` field of ``LinsTrainer.Config`` (``--lins.plan zero2`` on the command line
of both). A key with a fixed set of values has a ``Literal`` type, the one place that
lists them; :func:`check_choices` refuses any other value in one line
(:func:`lins_dtensor.integrations.titan_common.plan.check_config` calls it at start-up).
"""

import dataclasses
import typing
from dataclasses import dataclass
from typing import Annotated, Literal

import tyro

from lins_dtensor.errors import LinsConfigError

__all__ = ["GradDtype", "Lins", "LinsConfigError", "ReshardPolicy", "check_choices"]

ReshardPolicy = Literal["plan", "always", "never"]
GradDtype = Literal["", "float32", "bfloat16"]

# torchtitan parses the command line with tyro (0.2.2 and 0.3), which would refuse a
# value outside a Literal in a multi-line box of its own; parsed as text, it reaches
# check_choices, which refuses it in the one ``lins:`` line that names the key and the
# allowed values.
_AS_TEXT = tyro.conf.arg(constructor=str)


@dataclass
class Lins:
    """The Lins settings; every key is documented where it is declared."""

    enable: bool = True
    """Shard the data-parallel dims with Lins instead of torchtitan's FSDP."""

    plan: str = "auto"
    """"auto" (the planner picks), "p=<s_p>,g=<s_g>,os=<s_os>[,hpz=<k>]", or a preset:
    ddp, zero1, zero2, zero3, fsdp, hsdp:<k>, mics:<k>, hpz:<k>."""

    ranks_per_node: int = 0
    """Ranks per node, used to lay groups inside nodes first (0: LOCAL_WORLD_SIZE)."""

    reshard_after_forward: Annotated[ReshardPolicy, _AS_TEXT] = "plan"
    """"plan" (the plan's choice: True, or k with hpz), "always" or "never"."""

    grad_dtype: Annotated[GradDtype, _AS_TEXT] = ""
    """dtype gradients are reduced and accumulated in (G); "" follows
    training.mixed_precision_reduce. One of float32, bfloat16."""

    comm_formats: str = "exact"
    """Wire formats of Lins' collectives, e.g. "grads=int8,params=bf16" (inter-node
    level; "grads:intra=bf16" for the intra-node level) or "exact"; with plan = "auto"
    the formats the planner may choose from."""

    reduce_in_backward: bool = True
    """Reduce the last micro-batch's gradients to the optimizer layout during its
    backward, overlapped with it (Lins is told torchtitan's gradient accumulation steps);
    false: at the optimizer step. Results are bitwise identical."""

    bandwidth_file: str = ""
    """JSON bandwidth profile for the planner (plan = "auto"); "" uses its hardware model."""

    hardware: str = ""
    """Hardware preset the planner models ("" guesses: h100 on CUDA, cpu-emulated on CPU)."""

    hardware_file: str = ""
    """Hardware file from ``lins-plan calibrate`` used instead of the preset ("" : none)."""

    offline_assets: bool = True
    """When the tokenizer folder (hf_assets_path) has no tokenizer.json, train a small
    BPE tokenizer there from text that ships with Python (no hub access needed)."""


def check_choices(lins: Lins, key: typing.Callable[[str], str] = lambda name: f"[lins] {name}") -> None:
    """Refuse a value outside its key's ``Literal`` choices, in one line naming the key
    (``key``: how the job's torchtitan release spells it)."""
    hints = typing.get_type_hints(Lins, include_extras=True)
    for f in dataclasses.fields(Lins):
        hint = hints[f.name]
        if typing.get_origin(hint) is Annotated:
            hint = typing.get_args(hint)[0]
        if typing.get_origin(hint) is not Literal:
            continue
        choices = typing.get_args(hint)
        value = getattr(lins, f.name)
        if value not in choices:
            raise LinsConfigError(f"{key(f.name)} = {value!r}: must be one of {', '.join(map(repr, choices))}")
