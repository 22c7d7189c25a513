"""Helpers for the torchtitan tests: launch the trainer, read its TensorBoard scalars."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
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


def stop_one_worker(args: list[str], after_line: str, delay_s: float, nproc: int = 4, rank: int = 1,
                    sig: int = signal.SIGSTOP) -> tuple[tuple[float, int], str]:
    """Run the job, send ``sig`` (SIGSTOP: the worker stops responding; SIGKILL: it
    dies) to worker ``rank`` ``delay_s`` after ``after_line`` is printed, and return
    ((seconds until the job ended, its exit status), its output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "lins_dtensor.train", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if after_line in line:
            break
    worker = next(pid for pid in _children(proc.pid) if _environ(pid).get("RANK") == str(rank))
    time.sleep(delay_s)
    os.kill(worker, sig)
    start = time.monotonic()
    try:
        rest, _ = proc.communicate(timeout=300)
    finally:
        for pid in [worker, proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return (time.monotonic() - start, proc.returncode), "".join(seen) + rest


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if int(Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
    return out


def _environ(pid: int) -> dict[str, str]:
    with contextlib.suppress(OSError):
        pairs = Path("/proc", str(pid), "environ").read_bytes().split(b"\0")
        return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
    return {}


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
