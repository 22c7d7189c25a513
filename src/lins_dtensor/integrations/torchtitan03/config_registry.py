"""Lins job configs for torchtitan 0.3: ``--module lins_dtensor.integrations.torchtitan03 --config <name>``.

Each function returns a :class:`LinsTrainer.Config` (torchtitan's ``Trainer.Config``
plus ``lins``); every field can be overridden on the command line
(``--lins.plan zero2``, ``--training.steps 20``). :func:`with_lins` turns any of
torchtitan's configs into a Lins one, for a registry of your own::

    def my_llama3_8b() -> LinsTrainer.Config:
        return with_lins(torchtitan.models.llama3.config_registry.llama3_8b(), Lins(plan="auto"))
"""

from __future__ import annotations

import dataclasses

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer
from torchtitan.config import CommConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import config_registry as llama3, model_registry
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from lins_dtensor.integrations.titan_common.assets import DATASET_NAME
from lins_dtensor.integrations.titan_common.settings import Lins
from lins_dtensor.integrations.torchtitan03.job import SPMD_BACKEND
from lins_dtensor.integrations.torchtitan03.trainer import LinsTrainer


def with_lins(config: Trainer.Config, lins: Lins | None = None) -> LinsTrainer.Config:
    """``config`` with the Lins settings (default: ``plan = "auto"``), as Lins runs it:
    the ``partial_dtensor`` SPMD backend (DTensors for TP only; Lins owns the
    data-parallel layout), and the loss computed whole rather than in chunks (a chunked
    loss runs one backward per chunk outside the model's forward, which Lins would
    count as micro-batches)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    out = LinsTrainer.Config(**fields, lins=lins or Lins())
    out.parallelism.spmd_backend = SPMD_BACKEND
    if isinstance(out.loss, ChunkedLossWrapper.Config):
        out.loss = out.loss.loss_fn
    return out


def cpu_attention(model_spec: ModelSpec) -> ModelSpec:
    """``model_spec`` with causal SDPA attention: FlexAttention, 0.3's attention for
    language models, has no CPU backward, and 0.3 refuses ``attn_backend="sdpa"``
    because SDPA cannot mask per document. Without masks torchtitan's trainer runs
    SDPA causal over the whole packed sequence (documents attend to earlier ones in
    the same row), which a CPU debug job can afford."""
    for _, _, parent, attr in list(model_spec.model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return model_spec


def llama3_debugmodel() -> LinsTrainer.Config:
    return with_lins(llama3.llama3_debugmodel())


def llama3_8b() -> LinsTrainer.Config:
    return with_lins(llama3.llama3_8b())


def llama3_70b() -> LinsTrainer.Config:
    return with_lins(llama3.llama3_70b())


def llama3_debug_cpu() -> LinsTrainer.Config:
    """torchtitan's LLaMA-3 debug model on CPU ranks (gloo), offline: the 0.3 twin of
    ``train_configs/llama3_debug_cpu_lins.toml``. Causal SDPA attention
    (:func:`cpu_attention`), fp32, seq 256, batch 2, the tokenizer and corpus generated
    from Python's stdlib under the run folder; plan p=2,g=4,os=4 on 4 ranks as 2 "nodes"."""
    model_spec = cpu_attention(model_registry("debugmodel"))
    dump = "./outputs/llama3_debug_cpu_lins03"
    config = Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        hf_assets_path=f"{dump}/assets",
        dump_folder=dump,
        model_spec=model_spec,
        optimizer=dataclasses.replace(default_adamw(lr=8e-4), implementation="foreach"),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=2, seq_len=256, steps=10, max_norm=1.0,
                                mixed_precision_param="float32", mixed_precision_reduce="float32",
                                disable_cuda_graphs=True),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=DATASET_NAME),
        metrics=MetricsProcessor.Config(log_freq=1, enable_tensorboard=True, save_tb_folder="tb"),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=False, folder="checkpoint", interval=5, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
        comm=CommConfig(init_timeout_seconds=120, train_timeout_seconds=120, trace_buf_size=0),
        debug=DebugConfig(seed=42),
    )
    return with_lins(config, Lins(plan="p=2,g=4,os=4", ranks_per_node=2, grad_dtype="float32"))
