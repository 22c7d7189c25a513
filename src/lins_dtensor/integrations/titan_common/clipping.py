"""Route torchtitan's gradient clipping to Lins for the length of a training step.

Both torchtitan releases clip inside ``train_step`` with the module-level
``dist_utils.clip_grad_norm_(<parameters>, max_norm, ...)`` of the trainer's module
(``torchtitan.train`` in 0.2.2, ``torchtitan.trainer`` in 0.3) and log what it
returns, with no hook to clip otherwise. Under Lins the parameters carry no ``.grad``
(gradients live in the G buffers until the step), so while :func:`lins_clipping` is
active that one name, in that one module's namespace, resolves to the Lins
container's ``clip_grad_norm_``; the logged ``grad_norm`` is then the true global norm.
Waits for: a ``Trainer`` clipping method (or the optimizer container's) that a
subclass can override.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

from lins_dtensor.integrations.titan_common.optimizer import LinsOptimizers


class _DistUtilsWithLinsClip(types.ModuleType):
    """``torchtitan.distributed.utils`` with ``clip_grad_norm_`` routed to Lins."""

    def __init__(self, dist_utils: types.ModuleType, optimizers: LinsOptimizers) -> None:
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
def lins_clipping(trainer_module: types.ModuleType, optimizers: LinsOptimizers) -> Iterator[None]:
    """While active, ``trainer_module.dist_utils.clip_grad_norm_`` clips through Lins."""
    original = trainer_module.dist_utils
    trainer_module.dist_utils = _DistUtilsWithLinsClip(original, optimizers)
    try:
        yield
    finally:
        trainer_module.dist_utils = original
