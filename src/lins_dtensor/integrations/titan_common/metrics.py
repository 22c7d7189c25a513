"""torchtitan's metrics plus ``lins/*``, for every torchtitan release.

Every time torchtitan logs a step, :class:`LinsMetrics` (mixed in before the release's
``MetricsProcessor``) adds the Lins
scalars (``lins_stats(model, wait=False).scalars()``: bytes per state / op / link,
exposed and hidden communication seconds per state, memory per state) of the last
step whose collectives have finished, the measured step time (``lins/step_s_measured``)
and, when the planner predicted one at start-up, that prediction for the running plan
(``lins/step_s_predicted``). They go through torchtitan's own loggers, so they land in
the same TensorBoard run. The plan and its start-up report are written once as
TensorBoard text (``lins/plan``), and the run's description for ``lins-plan calibrate``
as ``lins_run.json`` next to the events.

Once the first ``CHECK_STEPS`` steps after the first (compilation, allocation: not the
steady state) are measured, rank 0 warns once if their median is more than
``CHECK_TOLERANCE`` away from the prediction, naming the calibration commands.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch.distributed as dist
from torchtitan.components.metrics import TensorBoardLogger
from torchtitan.tools.logging import logger

from lins_dtensor import lins_stats
from lins_dtensor.integrations.titan_common.apply import REPORT_ATTR, RESOLVED_ATTR
from lins_dtensor.planner.calibrate import MEASURED_TAG, PREDICTED_TAG, RUN_FILE, WARMUP_STEPS

CHECK_STEPS = 3
CHECK_TOLERANCE = 0.25


def prediction_warning(measured: list[float], predicted: float, tensorboard_dir: str,
                       use_hardware_file: str = '[lins] hardware_file = "hardware.json"') -> str | None:
    """The one-line warning when the median measured step is off the prediction, else
    None; ``use_hardware_file`` says how the job's torchtitan release sets the file."""
    median = statistics.median(measured)
    if abs(median / predicted - 1) <= CHECK_TOLERANCE:
        return None
    return (
        f"lins: measured step {median:.3g} s is {median / predicted - 1:+.0%} off the planner's {predicted:.3g} s "
        f"(median of {len(measured)} steps); calibrate: lins-plan calibrate {tensorboard_dir or '<tensorboard dir>'} "
        f"-o hardware.json, then {use_hardware_file}"
    )


class LinsMetrics:
    """Mixed in before torchtitan's ``MetricsProcessor``; the subclass says how often
    torchtitan logs (:attr:`log_freq`), which each release keeps elsewhere, and may say
    how its release sets the planner's hardware file (:attr:`use_hardware_file`)."""

    use_hardware_file = '[lins] hardware_file = "hardware.json"'

    _plan_written = False
    _checked = False
    _measured: list[float] | None = None

    @property
    def log_freq(self) -> int:
        raise NotImplementedError

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
        measured = (time.perf_counter() - self.time_last_log) / self.log_freq
        scalars[MEASURED_TAG] = measured
        resolved = getattr(model, RESOLVED_ATTR, None)
        if resolved is not None and resolved.prediction is not None:
            chosen = resolved.prediction.chosen
            scalars[PREDICTED_TAG] = float(chosen.step_s)
            for state in ("params", "grads", "optim"):
                scalars[f"lins/memory_predicted/{state}"] = float(getattr(chosen.memory, state))
            scalars["lins/memory_predicted/peak"] = float(chosen.memory.peak)
        return scalars

    def _write_plan(self, model, step: int) -> None:
        report = getattr(model, REPORT_ATTR, "")
        resolved = getattr(model, RESOLVED_ATTR, None)
        run = None if resolved is None or resolved.prediction is None else resolved.prediction.run_description
        text = "    " + report.replace("\n", "\n    ")  # markdown code block
        for writer in self._tensorboard_writers():
            writer.add_text("lins/plan", text, step)
            if run is not None:
                (Path(writer.log_dir) / RUN_FILE).write_text(json.dumps(run) + "\n")
        self._plan_written = True

    def _check_prediction(self, step: int, scalars: dict[str, float]) -> None:
        """Collect measured steps after the warm-up; warn once (rank 0) when off."""
        if self._checked or PREDICTED_TAG not in scalars or step <= WARMUP_STEPS:
            return
        self._measured = [*(self._measured or []), scalars[MEASURED_TAG]]
        if len(self._measured) * self.log_freq < CHECK_STEPS:
            return
        self._checked = True
        writers = self._tensorboard_writers()
        warning = prediction_warning(self._measured, scalars[PREDICTED_TAG], writers[0].log_dir if writers else "",
                                     self.use_hardware_file)
        if warning and (not dist.is_initialized() or dist.get_rank() == 0):
            logger.warning(warning)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        model = self._lins_model()
        if model is not None:
            scalars = self.lins_scalars(model)
            extra_metrics = {**(extra_metrics or {}), **scalars}
            if not self._plan_written:
                self._write_plan(model, step)
            self._check_prediction(step, scalars)
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
