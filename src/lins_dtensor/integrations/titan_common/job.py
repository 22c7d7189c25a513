"""What Lins reads of a torchtitan job, whichever torchtitan release's config it came from.

torchtitan 0.2.2 keeps its settings in a TOML-backed ``JobConfig`` (``[training]
seq_len``), 0.3 in a typed ``Trainer.Config`` (``training.seq_len``, activation
checkpointing as a config class, quantization inside the model spec). Each release's
adapter fills one :class:`TitanJob`; planning, validation and the start-up table read
only this, so they are written once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from lins_dtensor.integrations.titan_common.settings import Lins


@dataclass(frozen=True)
class TitanJob:
    """The Lins settings and the torchtitan settings Lins depends on."""

    lins: Lins
    key_style: Literal["toml", "cli"]
    """How messages name a setting: ``[lins] plan`` (0.2.2's TOML) or ``lins.plan`` (0.3)."""

    tp: int
    pp: int
    cp: int
    ep: int
    seq_len: int
    local_batch_size: int
    global_batch_size: int
    """-1: one local batch per data-parallel rank (torchtitan's default)."""
    activation_checkpoint: str
    """none, selective, full or memory_budget."""
    param_dtype: str
    reduce_dtype: str
    max_norm: float
    cpu_offload: bool
    seed_checkpoint: bool
    """A one-process run that writes the unsharded model (no plan applies)."""
    init_timeout_s: int
    train_timeout_s: int
    refusals: tuple[str, ...] = field(default=())
    """Release-specific settings Lins cannot run with, each as its one-line message."""

    @classmethod
    def from_sections(cls, config, lins: Lins, key_style: Literal["toml", "cli"], activation_checkpoint: str,
                      refusals: tuple[str, ...]) -> "TitanJob":
        """Read the sections both releases keep under the same names (``parallelism``,
        ``training``, ``checkpoint``, ``comm``) from ``config``; the adapter gives what
        differs."""
        par, training = config.parallelism, config.training
        return cls(
            lins=lins,
            key_style=key_style,
            tp=par.tensor_parallel_degree,
            pp=par.pipeline_parallel_degree,
            cp=par.context_parallel_degree,
            ep=par.expert_parallel_degree,
            seq_len=training.seq_len,
            local_batch_size=training.local_batch_size,
            global_batch_size=training.global_batch_size,
            activation_checkpoint=activation_checkpoint,
            param_dtype=training.mixed_precision_param,
            reduce_dtype=training.mixed_precision_reduce,
            max_norm=float(training.max_norm),
            cpu_offload=training.enable_cpu_offload,
            seed_checkpoint=config.checkpoint.create_seed_checkpoint,
            init_timeout_s=config.comm.init_timeout_seconds,
            train_timeout_s=config.comm.train_timeout_seconds,
            refusals=refusals,
        )

    def key(self, section: str, name: str) -> str:
        return f"[{section}] {name}" if self.key_style == "toml" else f"{section}.{name}"

    @property
    def world_size(self) -> int:
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def grad_dtype(self) -> str:
        return self.lins.grad_dtype or self.reduce_dtype
