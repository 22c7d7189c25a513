"""scripts/gpu_smoke.sh --dry-run: the GPU smoke driver on CPU with the fake device, as
CI can run it (the GPU pass needs a GPU machine; its report is committed when one was
lent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_gpu_smoke_dry_run_passes_every_case_bitwise_without_host_syncs(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--dry-run", "--out-dir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.load(open(tmp_path / "gpu_smoke_dry-run.json"))
    assert report["ok"] and report["device"] == "fake"
    assert [c["case"] for c in report["cases"]] == ["fsdp2-into-g-chain", "optim-replica", "replicated-bucket", "hpz", "bf16", "tp2"]
    for case in report["cases"]:
        assert case["masters_max_rel_err"] == 0.0 and case["loss_max_abs_diff"] == 0.0, case["case"]
        assert [r["host_syncs"] for r in case["per_rank"]] == [0, 0, 0, 0], case["case"]
        assert case["states_measured_bytes"] == case["states_predicted_bytes"], case["case"]
    assert (tmp_path / "gpu_smoke_dry-run.md").read_text().rstrip().endswith("Overall: OK")
