"""Lins for torchtitan 0.2.2, without forking it.

Job config::

    [job]
    custom_config_module = "lins_dtensor.integrations.torchtitan.config"
    [experimental]
    custom_import = "lins_dtensor.integrations.torchtitan"
    [model]
    name = "lins_llama3"
    [lins]
    plan = "auto"        # or "p=8,g=8,os=64", or a preset (zero1, fsdp, hsdp:8, ...)

Importing this package registers the ``lins_llama3`` TrainSpec (torchtitan's llama3
spec with Lins' parallelize, optimizer, metrics and tokenizer builders) and the
``python_stdlib`` dataset. The modules, one job each, adapting
:mod:`lins_dtensor.integrations.titan_common` (shared with the torchtitan 0.3 integration)
to 0.2.2:

- ``config``: the ``[lins]`` section;  ``plan``: the JobConfig as a ``TitanJob``;
- ``parallelize``: TP + AC + compile + Lins;  ``optimizer``: the container;
- ``metrics``: ``lins/*`` TensorBoard scalars;  ``trainer``: config check, clipping;
- ``assets``: the tokenizer builder;  ``cpu``: the CPU/gloo shims;
- ``lins_dtensor.train``: the launcher.
"""

from __future__ import annotations

import dataclasses
import functools

from torchtitan.components.tokenizer import build_hf_tokenizer
from torchtitan.models.llama3 import get_train_spec
from torchtitan.protocols.train_spec import register_train_spec

from lins_dtensor.integrations.titan_common.assets import register_dataset
from lins_dtensor.integrations.torchtitan import assets, cpu
from lins_dtensor.integrations.torchtitan.metrics import build_lins_metrics_processor
from lins_dtensor.integrations.torchtitan.optimizer import build_lins_optimizers
from lins_dtensor.integrations.torchtitan.parallelize import parallelize_lins

SPEC_NAME = "lins_llama3"


def lins_train_spec():
    """torchtitan's llama3 TrainSpec with the Lins builders swapped in."""
    return dataclasses.replace(
        get_train_spec(),
        parallelize_fn=parallelize_lins,
        pipelining_fn=None,
        build_optimizers_fn=build_lins_optimizers,
        build_metrics_processor_fn=build_lins_metrics_processor,
        build_tokenizer_fn=functools.partial(assets.build_tokenizer, build_hf_tokenizer=build_hf_tokenizer),
    )


def register() -> None:
    """Register the TrainSpec and the dataset (idempotent); patch for CPU when needed."""
    cpu.install()
    register_dataset()
    try:
        register_train_spec(SPEC_NAME, lins_train_spec())
    except ValueError:  # already registered by an earlier import
        pass


register()
