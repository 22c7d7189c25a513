"""Helpers for the torchtitan tests: launch the trainer, read its TensorBoard scalars."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "llama3_debug_cpu_lins.toml"


def env() -> dict[str, str]:
    out = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(key, None)
    out.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return out


def base_args(dump: Path, assets: Path, steps: int, *extra: str) -> list[str]:
    """The debug job, made small: seq 128, AC selective, fp32, log every step."""
    return [
        "--job.config_file", str(CONFIG),
        "--job.dump_folder", str(dump),
        "--model.hf_assets_path", str(assets),
        "--training.seq_len", "128",
        "--training.steps", str(steps),
        "--lr_scheduler.total_steps", "6",
        "--metrics.log_freq", "1",
        *extra,
    ]


def train(args: list[str], nproc: int = 4, timeout: int = 600, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun -m lins_dtensor.train`` (``nproc`` = 1: plain ``python -m``)."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "lins_dtensor.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "-m", "lins_dtensor.train", *args]
    e = env()
    e.update(extra_env or {})
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
        raise AssertionError(f"training failed (rc={proc.returncode}):\n{tail}")
    return proc


def event_dirs(dump: Path) -> list[str]:
    return sorted({os.path.dirname(p) for p in glob.glob(str(dump / "tb" / "*" / "events.out.tfevents.*"))})


def scalars(dump: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag -> {step: value} from the run's TensorBoard folder(s)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for d in event_dirs(dump):
        acc = EventAccumulator(d, size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def texts(dump: Path) -> dict[str, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for d in event_dirs(dump):
        acc = EventAccumulator(d, size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            for e in acc.Tensors(tag):
                out[tag] = b"".join(e.tensor_proto.string_val).decode()
    return out


def losses(dump: Path) -> dict[int, float]:
    return scalars(dump)["loss_metrics/global_avg_loss"]
