"""The TrainSpec's ``build_metrics_processor_fn``: torchtitan's metrics plus ``lins/*``.

Every time torchtitan logs a step, :class:`LinsMetricsProcessor` adds the Lins
scalars (``lins_stats(model, wait=False).scalars()``: bytes per state / op / link,
exposed and hidden communication seconds per state, memory per state) of the last
step whose collectives have finished, the measured step time and,
when the planner predicted one, the predicted step time. They go through torchtitan's
own loggers, so they land in the same TensorBoard run. The plan and its start-up
report are written once as TensorBoard text (``lins/plan``).
"""

from __future__ import annotations

import time

from torchtitan.components.metrics import MetricsProcessor, TensorBoardLogger

from lins_dtensor import lins_stats
from lins_dtensor.integrations.torchtitan.parallelize import REPORT_ATTR, RESOLVED_ATTR


class LinsMetricsProcessor(MetricsProcessor):
    _plan_written = False

    def _lins_model(self):
        for model in self.model_parts or []:
            if hasattr(model, "_lins_state"):
                return model
        return None

    def _tensorboard_writers(self):
        loggers = getattr(self.logger, "_loggers", [self.logger])
        return [lg.writer for lg in loggers if isinstance(lg, TensorBoardLogger)]

    def lins_scalars(self, model) -> dict[str, float]:
        # Without waiting: the update gathers of the step just ended keep overlapping the
        # next forward; while they run, the scalars are the previous step's.
        scalars = dict(lins_stats(model, wait=False).scalars())
        measured = (time.perf_counter() - self.time_last_log) / self.job_config.metrics.log_freq
        scalars["lins/step_seconds/measured"] = measured
        resolved = getattr(model, RESOLVED_ATTR, None)
        if resolved is not None and resolved.prediction is not None:
            chosen = resolved.prediction.chosen
            scalars["lins/step_seconds/predicted"] = float(chosen.step_s)
            for state in ("params", "grads", "optim"):
                scalars[f"lins/memory_predicted/{state}"] = float(getattr(chosen.memory, state))
            scalars["lins/memory_predicted/peak"] = float(chosen.memory.peak)
        return scalars

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        model = self._lins_model()
        if model is not None:
            extra_metrics = {**(extra_metrics or {}), **self.lins_scalars(model)}
            if not self._plan_written:
                report = getattr(model, REPORT_ATTR, "")
                for writer in self._tensorboard_writers():
                    text = "    " + report.replace("\n", "\n    ")  # markdown code block
                    writer.add_text("lins/plan", text, step)
                self._plan_written = True
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)


def build_lins_metrics_processor(job_config, parallel_dims, model_args=None, tag=None) -> MetricsProcessor:
    return LinsMetricsProcessor(job_config, parallel_dims, tag)
