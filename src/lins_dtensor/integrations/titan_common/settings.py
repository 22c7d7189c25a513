"""The Lins settings of a torchtitan job, the same dataclass for every torchtitan release.

torchtitan 0.2.2 reads it as the ``[lins]`` TOML section (``JobConfig.lins``), 0.3 as
the ``lins`` field of ``LinsTrainer.Config`` (``--lins.plan zero2`` on the command line
of both). Fields with a fixed set of values are plain ``str`` on purpose: the command
line parser would reject a ``Literal`` with a multi-line usage text, while
:func:`lins_dtensor.integrations.titan_common.plan.check_config` stops the run with
one line naming the key, the value and the allowed ones.
"""

from dataclasses import dataclass

from lins_dtensor.plan import LinsPlanError

RESHARD_POLICIES = ("plan", "always", "never")
GRAD_DTYPES = ("", "float32", "bfloat16")


class LinsConfigError(LinsPlanError):
    """A Lins setting torchtitan cannot run with; the message names key and rule."""


@dataclass
class Lins:
    enable: bool = True
    """Shard the data-parallel dims with Lins instead of torchtitan's FSDP."""

    plan: str = "auto"
    """"auto" (the planner picks), "p=<s_p>,g=<s_g>,os=<s_os>[,hpz=<k>]", or a preset:
    ddp, zero1, zero2, zero3, fsdp, hsdp:<k>, mics:<k>, hpz:<k>."""

    ranks_per_node: int = 0
    """Ranks per node, used to lay groups inside nodes first (0: LOCAL_WORLD_SIZE)."""

    reshard_after_forward: str = "plan"
    """"plan" (the plan's choice: True, or k with hpz), "always" or "never"."""

    grad_dtype: str = ""
    """dtype gradients are reduced and accumulated in (G); "" follows
    training.mixed_precision_reduce. One of float32, bfloat16."""

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
