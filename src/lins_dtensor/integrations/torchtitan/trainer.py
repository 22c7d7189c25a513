"""``LinsTrainer``: torchtitan's ``Trainer`` with three additions.

1. The ``[lins]`` section is checked before anything starts, so a wrong value stops
   the run with one line naming the key and the rule.
2. Gradient clipping goes through Lins. torchtitan's ``train_step`` clips with
   ``dist_utils.clip_grad_norm_(model.parameters(), max_norm)``; under Lins the
   parameters carry no ``.grad`` (gradients live in the G buffers until the step), so
   for the duration of ``train_step`` that one name, in ``torchtitan.train``'s
   namespace only, resolves to the Lins container's ``clip_grad_norm_``. The logged
   ``grad_norm`` is then the true global norm.
3. With ``[lins] reduce_in_backward = true`` (default) the last micro-batch of each
   step reduces its gradients to the optimizer layout inside backward
   (:func:`lins_dtensor.runtime.set_reduce_in_backward`), so that traffic overlaps
   the rest of backward; earlier micro-batches keep theirs in the G buffers.
"""

from __future__ import annotations

import contextlib
import types

import torchtitan.train as titan_train
from torchtitan.train import Trainer

from lins_dtensor.integrations.torchtitan.optimizer import LinsOptimizersContainer
from lins_dtensor.integrations.torchtitan.plan import check_config
from lins_dtensor.runtime import set_reduce_in_backward


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

    def train_step(self, data_iterator):
        self._lins_microbatch = 0
        if isinstance(self.optimizers, LinsOptimizersContainer):
            with _lins_clipping(self.optimizers):
                return super().train_step(data_iterator)
        return super().train_step(data_iterator)

    def forward_backward_step(self, *args, **kwargs):
        if isinstance(self.optimizers, LinsOptimizersContainer):
            last = self._lins_microbatch == self.gradient_accumulation_steps - 1
            for model in self.model_parts:
                set_reduce_in_backward(model, last and self.job_config.lins.reduce_in_backward)
            self._lins_microbatch += 1
        return super().forward_backward_step(*args, **kwargs)
