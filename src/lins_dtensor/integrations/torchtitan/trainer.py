"""``LinsTrainer``: torchtitan's ``Trainer`` with these additions.

1. The ``[lins]`` section is checked before anything starts, so a wrong value stops
   the run with one line naming the key and the rule.
2. Gradient clipping goes through Lins. torchtitan's ``train_step`` clips with
   ``dist_utils.clip_grad_norm_(model.parameters(), max_norm)``; under Lins the
   parameters carry no ``.grad`` (gradients live in the G buffers until the step), so
   for the duration of ``train_step`` that one name, in ``torchtitan.train``'s
   namespace only, resolves to the Lins container's ``clip_grad_norm_``. The logged
   ``grad_norm`` is then the true global norm.
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

import contextlib
import types
from datetime import timedelta

import torchtitan.train as titan_train
from torchtitan.train import Trainer

from lins_dtensor.integrations.torchtitan.optimizer import LinsOptimizersContainer
from lins_dtensor.integrations.torchtitan.plan import check_config
from lins_dtensor.runtime import lins_state, set_gradient_accumulation_steps, set_requires_gradient_sync, wait_for_updates


class _DistUtilsWithLinsClip(types.ModuleType):
    """``torchtitan.distributed.utils`` with ``clip_grad_norm_`` routed to Lins."""

    def __init__(self, dist_utils, optimizers: LinsOptimizersContainer) -> None:
        super().__init__(dist_utils.__name__)
        self._dist_utils = dist_utils
        self._optimizers = optimizers

    def __getattr__(self, name):
        return getattr(self._dist_utils, name)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2.0, **kwargs):
        if max_norm is None or max_norm <= 0:
            return self._optimizers.clip_grad_norm_(float("inf"), norm_type)
        return self._optimizers.clip_grad_norm_(max_norm, norm_type)


@contextlib.contextmanager
def _lins_clipping(optimizers):
    """The one place Lins reaches into torchtitan's namespace. torchtitan 0.2.2's
    ``train_step`` clips with ``dist_utils.clip_grad_norm_`` and logs what it returns,
    with no hook to clip otherwise. Waits for: a ``Trainer`` clipping method (or the
    optimizer container's) that a subclass can override."""
    original = titan_train.dist_utils
    titan_train.dist_utils = _DistUtilsWithLinsClip(original, optimizers)
    try:
        yield
    finally:
        titan_train.dist_utils = original


class LinsTrainer(Trainer):
    def __init__(self, job_config) -> None:
        if hasattr(job_config, "lins"):
            check_config(job_config)
        super().__init__(job_config)
        if isinstance(self.optimizers, LinsOptimizersContainer):
            for model in self.model_parts:
                set_gradient_accumulation_steps(model, self.gradient_accumulation_steps)
                set_requires_gradient_sync(model, None if job_config.lins.reduce_in_backward else False)

    def train_step(self, data_iterator):
        if isinstance(self.optimizers, LinsOptimizersContainer):
            with _lins_clipping(self.optimizers):
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
