"""Lins' collectives over real processes and a real interpreter shutdown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from titan_runs import env

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(300)
def test_a_job_that_exits_with_update_gathers_in_flight_ends_cleanly():
    """The README's loop ends after ``optimizer.step()``: its update gathers are still
    running on gloo's threads while the interpreter shuts down. Nothing of Lins may run
    Python there then: a future callback did, and every rank aborted ("terminate called
    without an active exception", exit -6) after a run that had trained correctly."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "--tee", "3",
           str(HERE / "exit_scenarios.py"), "p=2,g=4,os=4"]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert "terminate called" not in out and proc.returncode == 0, out[-3000:]
    # The case this checks: the gathers were in flight when each rank began to exit.
    assert out.count("updates in flight at exit: True") == 4, out[-3000:]
