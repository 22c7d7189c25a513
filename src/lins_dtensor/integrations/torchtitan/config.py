"""The ``[lins]`` section of a torchtitan job config.

Point torchtitan at this module with ``[job] custom_config_module =
"lins_dtensor.integrations.torchtitan.config"``: torchtitan merges the ``JobConfig``
dataclass below into its own, so ``[lins]`` keys can be set in the TOML file or on the
command line (``--lins.plan zero2``).

A key with a fixed set of values has a ``Literal`` type, the one place that lists them;
:func:`check_choices` refuses any other value (``plan.check_config`` calls it at start-up).
"""

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal

import tyro

from lins_dtensor.errors import LinsConfigError

ReshardPolicy = Literal["plan", "always", "never"]
GradDtype = Literal["", "float32", "bfloat16"]

# torchtitan parses the command line with tyro, which would refuse a value outside a
# Literal in a multi-line box of its own; parsed as text, it reaches check_choices,
# which refuses it in the one ``lins:`` line that names the key and the allowed values.
_AS_TEXT = tyro.conf.arg(constructor=str)


@dataclass
class Lins:
    """The ``[lins]`` section; every key is documented where it is declared."""

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

    reduce_in_backward: bool = True
    """Reduce the last micro-batch's gradients to the optimizer layout during its
    backward, overlapped with it (Lins is told torchtitan's gradient accumulation steps);
    false: at the optimizer step. Results are bitwise identical."""

    bandwidth_file: str = ""
    """JSON bandwidth profile for the planner (plan = "auto"); "" uses its hardware model."""

    hardware: str = ""
    """Hardware preset the planner models: a name from ``lins_dtensor.planner.HARDWARE_PRESETS``
    or one of its aliases (``lins-plan --help`` lists them). "" guesses: from the CUDA
    device's name (h200, h100, a800, a100; h100 if none matches), cpu-emulated without
    CUDA. Unused when hardware_file is set."""

    hardware_file: str = ""
    """Hardware file from ``lins-plan calibrate`` used instead of the preset ("" : none)."""

    offline_assets: bool = True
    """When model.hf_assets_path has no tokenizer.json, train a small BPE tokenizer there
    from text that ships with Python (no hub access needed)."""


@dataclass
class JobConfig:
    """What torchtitan merges into its own JobConfig: the ``[lins]`` section."""

    lins: Lins = field(default_factory=Lins)


def check_choices(lins: Lins) -> None:
    """Refuse a value outside its key's ``Literal`` choices, in one line."""
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
            raise LinsConfigError(f"[lins] {f.name} = {value!r}: must be one of {', '.join(map(repr, choices))}")
