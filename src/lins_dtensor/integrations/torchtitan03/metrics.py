"""torchtitan 0.3's metrics processor plus ``lins/*``
(:class:`~lins_dtensor.integrations.titan_common.metrics.LinsMetrics`); the trainer
swaps the class of ``config.metrics`` (:func:`lins_config`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan.components.metrics import MetricsProcessor

from lins_dtensor.integrations.titan_common.metrics import LinsMetrics


class LinsMetricsProcessor(LinsMetrics, MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        """torchtitan's metrics config, built into the processor that adds ``lins/*``."""

    use_hardware_file = "--lins.hardware_file hardware.json"

    @property
    def log_freq(self) -> int:
        return self.config.log_freq


def lins_config(config: MetricsProcessor.Config) -> LinsMetricsProcessor.Config:
    """The same settings, built into the Lins processor."""
    return LinsMetricsProcessor.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})
