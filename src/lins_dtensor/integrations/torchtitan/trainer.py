"""``LinsTrainer``: torchtitan's ``Trainer`` with these additions.

1. The ``[lins]`` section is checked before anything starts, so a wrong value stops
   the run with one line naming the key and the rule.
2. Gradient clipping goes through Lins
   (:mod:`lins_dtensor.integrations.titan_common.clipping`, in ``torchtitan.train``'s
   namespace for the duration of ``train_step``). The logged ``grad_norm`` is then the
   true global norm.
3. Lins is told how many micro-batches a step has (torchtitan's gradient accumulation
   steps, :func:`lins_dtensor.set_gradient_accumulation_steps`), so that the last one
   reduces its gradients to the optimizer layout inside backward, overlapped with it;
   earlier micro-batches keep theirs in the G buffers. ``[lins] reduce_in_backward =
   false`` moves that reduction to the optimizer step
   (:func:`lins_dtensor.set_requires_gradient_sync`). After the last step it waits for
   the update gathers still in flight, before torchtitan destroys the process groups,
   and Lins' groups follow ``[comm]`` timeouts (start-up, then training after step 1).
"""

from __future__ import annotations

from datetime import timedelta

import torchtitan.train as titan_train
from torchtitan.train import Trainer

from lins_dtensor.integrations.titan_common.clipping import lins_clipping
from lins_dtensor.integrations.titan_common.plan import check_config
from lins_dtensor.integrations.torchtitan.optimizer import LinsOptimizersContainer
from lins_dtensor.integrations.torchtitan.plan import titan_job
from lins_dtensor.runtime import lins_state, set_gradient_accumulation_steps, set_requires_gradient_sync, wait_for_updates


class LinsTrainer(Trainer):
    def __init__(self, job_config) -> None:
        if hasattr(job_config, "lins"):
            check_config(titan_job(job_config))
        super().__init__(job_config)
        if isinstance(self.optimizers, LinsOptimizersContainer):
            for model in self.model_parts:
                set_gradient_accumulation_steps(model, self.gradient_accumulation_steps)
                set_requires_gradient_sync(model, None if job_config.lins.reduce_in_backward else False)

    def train_step(self, data_iterator):
        if isinstance(self.optimizers, LinsOptimizersContainer):
            with lins_clipping(titan_train, self.optimizers):
                result = super().train_step(data_iterator)
            if self.step == 1:  # as torchtitan moves its own groups to the training timeout
                timeout = timedelta(seconds=self.job_config.comm.train_timeout_seconds)
                for model in self.model_parts:
                    lins_state(model).mesh.set_timeout(timeout)
            return result
        return super().train_step(data_iterator)

    def train(self):
        super().train()
        # The last step's update gathers are still in flight (the next forward would
        # have waited for them); torchtitan's main destroys the process groups next.
        if isinstance(self.optimizers, LinsOptimizersContainer):
            for model in self.model_parts:
                wait_for_updates(model)
