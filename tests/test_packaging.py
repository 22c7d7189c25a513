"""The core needs torch only: apply_lins, the planner and lins-plan import and run with
torchtitan, triton, tomli and tensorboard unavailable (the [torchtitan] extra). A torch
outside the supported range stops the import with one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lins_dtensor
from lins_dtensor.compat import SUPPORTED_TORCH

_BLOCKED = ("torchtitan", "triton", "tomli", "tensorboard")

# Each blocked package looks uninstalled: importing it raises ModuleNotFoundError and
# importlib.util.find_spec finds nothing (torch 2.14 probes triton that way at import).
_PROBE = f"""
import sys

for name in {_BLOCKED!r}:
    sys.modules[name] = None
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


# A torch outside compat.SUPPORTED_TORCH must stop the import with one line that names
# the range, the torch found and the fix. compat.py runs again as a fresh module under a
# patched torch.__version__ (scripts/test_torch_versions.sh checks a real out-of-range
# torch). The cases follow the range's ends: 2.10 and 2.16 are refused.
(_LO, _LO_MINOR), (_HI, _HI_MINOR) = SUPPORTED_TORCH
_OUTSIDE = [
    f"{_LO}.{_LO_MINOR - 1}.0",
    f"{_LO}.{_LO_MINOR - 1}.1+cpu",
    f"{_HI}.{_HI_MINOR + 1}.0",
    f"{_HI}.{_HI_MINOR + 1}.0.dev20261101+cu130",
    f"{_LO - 1}.99.0",
    f"{_HI + 1}.0.0",
]
_INSIDE = [f"{_LO}.{_LO_MINOR}.0", f"{_LO}.{_LO_MINOR}.0+cpu", f"{_HI}.{_HI_MINOR}.1+cu130", f"{_HI}.{_HI_MINOR}.0a0+git1234abc"]


def _exec_compat_under(monkeypatch, version: str):
    monkeypatch.setattr(torch, "__version__", version)
    spec = importlib.util.spec_from_file_location("_compat_under_test", Path(lins_dtensor.__file__).parent / "compat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("version", _OUTSIDE)
def test_torch_outside_the_range_stops_the_import_with_one_line(monkeypatch, version):
    with pytest.raises(ImportError) as info:
        _exec_compat_under(monkeypatch, version)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"lins_dtensor supports torch {_LO}.{_LO_MINOR} to {_HI}.{_HI_MINOR} "), message
    assert f"this is torch {version}: install torch==" in message, message


def test_pyproject_requires_the_supported_range():
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'"torch>={_LO}.{_LO_MINOR},<{_HI}.{_HI_MINOR + 1}"' in pyproject


@pytest.mark.parametrize("version", _INSIDE)
def test_torch_inside_the_range_imports(monkeypatch, version):
    assert _exec_compat_under(monkeypatch, version).SUPPORTED_TORCH == SUPPORTED_TORCH
