"""The TrainSpec's ``build_metrics_processor_fn``: torchtitan 0.2.2's metrics plus
``lins/*`` (:class:`~lins_dtensor.integrations.titan_common.metrics.LinsMetrics`)."""

from __future__ import annotations

from torchtitan.components.metrics import MetricsProcessor

from lins_dtensor.integrations.titan_common.metrics import LinsMetrics


class LinsMetricsProcessor(LinsMetrics, MetricsProcessor):
    @property
    def log_freq(self) -> int:
        return self.job_config.metrics.log_freq


def build_lins_metrics_processor(job_config, parallel_dims, model_args=None, tag=None) -> MetricsProcessor:
    return LinsMetricsProcessor(job_config, parallel_dims, tag)
