"""``LinsTrainer``: torchtitan 0.3's ``Trainer`` with a ``lins`` config field and Lins for DP.

0.3 builds the trainer from its config (``config.build()`` constructs the class that
owns the config's class), so :class:`LinsTrainer.Config` adds the ``lins`` field
(:class:`~lins_dtensor.integrations.titan_common.settings.Lins`, ``--lins.plan ...``
on the command line) and building it builds this trainer, which writes the offline
tokenizer and corpus when asked to (``lins.offline_assets``), before torchtitan reads
them, and with ``lins.enable``:

1. checks the settings before anything starts (one line naming the key and the rule);
2. binds ``model_spec.parallelize_fn`` to Lins (:func:`.parallelize.parallelize_lins`)
   and builds the optimizer and metrics configs into the Lins container and processor;
3. clips through Lins in ``train_step``
   (:mod:`lins_dtensor.integrations.titan_common.clipping`, in ``torchtitan.trainer``);
4. tells Lins the gradient accumulation steps (the last micro-batch reduces in
   backward) or, with ``lins.reduce_in_backward = false``, to reduce at the step;
   moves Lins' groups to ``comm.train_timeout_seconds`` after this process's first
   step, as torchtitan does its own; and after the last step waits for the update
   gathers still in flight, before torchtitan destroys the process groups.

With ``lins.enable = false`` it trains as torchtitan's ``Trainer``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from datetime import timedelta

import torchtitan.trainer as titan_trainer
from torchtitan.trainer import Trainer

from lins_dtensor.integrations.titan_common.assets import DATASET_NAME, prepare
from lins_dtensor.integrations.titan_common.clipping import lins_clipping
from lins_dtensor.integrations.titan_common.plan import check_config
from lins_dtensor.integrations.titan_common.settings import Lins
from lins_dtensor.integrations.torchtitan03 import metrics, optimizer
from lins_dtensor.integrations.torchtitan03.job import titan_job
from lins_dtensor.integrations.torchtitan03.parallelize import parallelize_lins
from lins_dtensor.runtime import lins_state, set_gradient_accumulation_steps, set_requires_gradient_sync, wait_for_updates


class LinsTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        lins: Lins = field(default_factory=Lins)
        """Lins' sharding of the data-parallel dims (parameters, gradients and optimizer
        states each over their own group); ``--lins.plan auto`` lets the planner choose."""

    config: Config

    def __init__(self, config: Config) -> None:
        self._lins_timeout_moved = False
        job = titan_job(config, config.lins)
        check_config(job)
        _prepare_assets(config)  # the job's data, with or without Lins
        if config.lins.enable and not job.seed_checkpoint:  # a seed run saves the unsharded model
            config.model_spec = dataclasses.replace(
                config.model_spec, parallelize_fn=functools.partial(parallelize_lins, job=job), pipelining_fn=None
            )
            config.optimizer = optimizer.lins_config(config.optimizer)
            config.metrics = metrics.lins_config(config.metrics)
        super().__init__(config)
        if self._lins:
            for model in self.model_parts:
                set_gradient_accumulation_steps(model, self.gradient_accumulation_steps)
                set_requires_gradient_sync(model, None if config.lins.reduce_in_backward else False)

    @property
    def _lins(self) -> bool:
        return isinstance(self.optimizers, optimizer.LinsOptimizersContainer)

    def train_step(self, data_iterator):
        if not self._lins:
            return super().train_step(data_iterator)
        with lins_clipping(titan_trainer, self.optimizers):
            result = super().train_step(data_iterator)
        if not self._lins_timeout_moved:  # as torchtitan moves its own groups after this process's first step
            timeout = timedelta(seconds=self.config.comm.train_timeout_seconds)
            for model in self.model_parts:
                lins_state(model).mesh.set_timeout(timeout)
            self._lins_timeout_moved = True
        return result

    def train(self):
        super().train()
        # The last step's update gathers are still in flight (the next forward would
        # have waited for them); torchtitan's main destroys the process groups next.
        if self._lins:
            for model in self.model_parts:
                wait_for_updates(model)


def _prepare_assets(config: LinsTrainer.Config) -> None:
    """The offline tokenizer and corpus (:mod:`lins_dtensor.integrations.titan_common.assets`)
    in ``hf_assets_path``, and the ``python_stdlib`` dataset pointed at them."""
    prepare(config.lins, config.hf_assets_path, config.model_spec.model.vocab_size)
    dataloader = config.dataloader
    if getattr(dataloader, "dataset", None) == DATASET_NAME and not dataloader.dataset_path:
        dataloader.dataset_path = config.hf_assets_path
