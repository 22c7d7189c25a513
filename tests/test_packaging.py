"""The core needs torch only: apply_lins, the planner and lins-plan import and run with
torchtitan, triton, tomli and tensorboard unavailable (the [torchtitan] extra)."""

from __future__ import annotations

import subprocess
import sys

_BLOCKED = ("torchtitan", "triton", "tomli", "tensorboard")

_PROBE = f"""
import importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {_BLOCKED!r}:
            raise ImportError(f"{{name}} is not installed (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocked())
import lins_dtensor
from lins_dtensor import apply_lins, build_lins_mesh, lins_optimizer, lins_stats
from lins_dtensor.planner import choose_plan
from lins_dtensor.planner.cli import main
sys.exit(main(["--model", "debugmodel", "--gpus", "8", "--hardware", "h100"]))
"""


def test_core_imports_and_plans_without_the_torchtitan_extra():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CHOSEN" in proc.stdout
    assert not any(f"import {name}" in proc.stderr for name in _BLOCKED)
