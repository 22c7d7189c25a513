"""Helpers for the torchtitan tests: launch the trainer, read its TensorBoard scalars."""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from distributed import free_port  # also sets the forkserver's preload, which train() forks its ranks from

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "llama3_debug_cpu_lins.toml"


def require_torchtitan(release: str) -> None:
    """Skip the calling test module unless the installed torchtitan is ``release``
    (e.g. "0.2" or "0.3"): each integration's tests run in their own venv
    (scripts/test_torchtitan_versions.sh), and skip cleanly in the other's."""
    import importlib.metadata

    import pytest

    try:
        found = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torchtitan is not installed", allow_module_level=True)
    if found.split(".")[:2] != release.split("."):
        pytest.skip(f"torchtitan {found} installed; these tests are for {release}.x", allow_module_level=True)


def env() -> dict[str, str]:
    """A torchrun launcher's environment: this process's, without its rank variables,
    offline, one thread per rank, unbuffered output."""
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


# torchtitan 0.3: the Lins launcher and its CPU debug job (config_registry.llama3_debug_cpu).
ENTRY_03 = "lins_dtensor.integrations.torchtitan03.train"


def base_args03(dump: Path, assets: Path, steps: int, *extra: str) -> list[str]:
    """torchtitan 0.3's twin of :func:`base_args`: the debug job, seq 128, log every step."""
    return [
        "--config", "llama3_debug_cpu",
        "--dump_folder", str(dump),
        "--hf_assets_path", str(assets),
        "--training.seq_len", "128",
        "--training.steps", str(steps),
        "--lr_scheduler.total_steps", "6",
        "--metrics.log_freq", "1",
        *extra,
    ]


def train03(args: list[str], nproc: int = 4, timeout: int = 600, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the torchtitan 0.3 launcher on ``nproc`` ranks under torchrun (one: plain
    ``python -m``) and return rank 0's stdout and stderr. No preloaded server here:
    torchtitan 0.3 parses its config per process from ``--module``/``--config``."""
    if nproc == 1:
        cmd = [sys.executable, "-m", ENTRY_03, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "-m", ENTRY_03, *args]
    e = env()
    e.update(extra_env or {})
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def train(args: list[str], nproc: int = 4, timeout: int = 600, extra_env: dict | None = None,
          torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run the trainer (``lins_dtensor.train``) on ``nproc`` ranks and return rank 0's
    stdout and stderr (and, after a failure, the failed ranks' output in stderr).

    The ranks fork from the tests' preloaded server (:mod:`distributed`): the same
    ``main()`` that ``python -m lins_dtensor.train`` runs, without ~20 s of imports
    per launch. ``torchrun=True``: the real command line, ``torchrun -m
    lins_dtensor.train`` (``nproc`` = 1: plain ``python -m``), for the tests of what
    the launcher sees."""
    if not torchrun:
        return _forked(args, nproc, timeout, extra_env or {})
    e = env()
    e.update(extra_env or {})
    with tempfile.TemporaryDirectory(prefix="lins-torchrun-") as logs:  # every rank's output, read after a failure
        if nproc == 1:
            cmd = [sys.executable, "-m", "lins_dtensor.train", *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--log-dir", logs,
                   "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "-m", "lins_dtensor.train", *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:  # the console shows rank 0 only: add the end of every rank's output
            # (stderr: why; stdout, last: the last step it logged, where it stopped)
            for name, lines in (("stderr.log", 15), ("stdout.log", 5)):
                for path in sorted(glob.glob(f"{logs}/**/{name}", recursive=True)):
                    tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
                    proc.stderr += f"\n--- {Path(path).relative_to(logs)}\n" + "\n".join(tail)
        return proc


def _forked(args: list[str], nproc: int, timeout: int, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    """Start the ranks, wait for them (see :func:`_wait`) and collect what rank 0 printed
    and, after a failure, what the failing rank printed; a rank still running when this
    returns or raises (timeout, an interrupted test) is killed."""
    ctx = multiprocessing.get_context("forkserver")
    port = free_port()
    ranks: list[multiprocessing.process.BaseProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = [(os.path.join(tmp, f"{rank}.out"), os.path.join(tmp, f"{rank}.err")) for rank in range(nproc)]
        try:
            for rank in range(nproc):
                ranks.append(ctx.Process(target=_trainer_rank, args=(rank, nproc, port, args, logs[rank], extra_env)))
                ranks[-1].start()
            first_failed = _wait(ranks, time.monotonic() + timeout)
        finally:
            _kill(ranks)
        outputs = [tuple(Path(f).read_text(errors="replace") if os.path.exists(f) else "" for f in pair) for pair in logs]
    command = ["lins_dtensor.train", *args]
    if first_failed is None and any(p.exitcode for p in ranks):  # none failed, yet some were killed: the deadline
        raise subprocess.TimeoutExpired(command, timeout, output=outputs[0][0], stderr=outputs[0][1])
    if first_failed is None:
        return subprocess.CompletedProcess(command, 0, outputs[0][0], outputs[0][1])
    failed = ranks[first_failed]
    cause = "" if first_failed == 0 else f"\n--- rank {first_failed} exited {failed.exitcode} ---\n" + "".join(outputs[first_failed])
    return subprocess.CompletedProcess(command, failed.exitcode, outputs[0][0], outputs[0][1] + cause)


def _wait(ranks: list[multiprocessing.process.BaseProcess], deadline: float) -> int | None:
    """Wait for every rank until ``deadline``; the first one to exit non-zero ends the
    wait, as under torchrun (the others would wait in a collective for the process-group
    timeout). Returns that rank, or None (all exited 0, or the deadline passed)."""
    alive = list(ranks)
    while alive and time.monotonic() < deadline:
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=deadline - time.monotonic())
        ended = [p for p in alive if not p.is_alive()]
        alive = [p for p in alive if p.is_alive()]
        for p in ended:
            if p.exitcode:
                return ranks.index(p)
    return None


def _kill(ranks: list[multiprocessing.process.BaseProcess]) -> None:
    """SIGTERM every rank still running, SIGKILL it 5 s later (torchrun's way, with the
    tests' grace)."""
    for p in ranks:
        if p.is_alive():
            p.terminate()
    for p in ranks:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _trainer_rank(rank: int, nproc: int, port: int, args: list[str], logs: tuple[str, str], extra_env: dict[str, str]) -> None:
    """One rank, in a process forked from the preloaded server: torchrun's environment,
    its own stdout/stderr files, then the trainer's ``main()``; exits with its status."""
    import torch

    from lins_dtensor.train import main

    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(extra_env)
    torch.set_num_threads(1)  # as torchrun's workers with OMP_NUM_THREADS=1 (env() sets it)
    for fd, path in zip((1, 2), logs):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdout.reconfigure(line_buffering=True)  # what a killed or timed-out rank printed stays
    sys.stderr.reconfigure(line_buffering=True)
    sys.argv = ["lins_dtensor.train", *args]
    # torchtitan's ConfigManager.parse_args(args=sys.argv[1:]) bound its default when the
    # server imported it, with the server's argv: give it this job's.
    from torchtitan.config import ConfigManager

    ConfigManager.parse_args.__defaults__ = (args,)
    code = 1
    try:
        code = main()
    except SystemExit as exc:  # as the interpreter would: None is 0, a message goes to stderr
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def stop_one_worker(args: list[str], after_line: str, delay_s: float, nproc: int = 4, rank: int = 1,
                    sig: int = signal.SIGSTOP, hold_write_of: str | None = None) -> tuple[tuple[float, int], str]:
    """Run the job, send ``sig`` (SIGSTOP: the worker stops responding; SIGKILL: it
    dies) to worker ``rank`` ``delay_s`` after ``after_line`` is printed, and return
    ((seconds until the job ended, its exit status), its output).

    ``hold_write_of`` (a checkpoint folder name, ``"step-4"``): launch the trainer
    through this file (see :func:`_hold_checkpoint_write`), so that worker ``rank``,
    once it has written its files of that checkpoint, prints :func:`held_line` and
    waits there, before rank 0 can finish the checkpoint."""
    entry = ["-m", "lins_dtensor.train"]
    run_env = env()
    if hold_write_of is not None:
        entry = [str(Path(__file__).resolve())]
        run_env[HOLD_ENV] = f"{hold_write_of}:{rank}"
    # torchrun gives the other workers 5 s after its SIGTERM (default 30) before SIGKILL:
    # a SIGSTOPped worker never exits by itself.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--shutdown_timeout", "5",
           *entry, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        lines = (proc.stdout + proc.stderr).splitlines()
        # A rank that aborts (a gloo enforce, a C++ terminate) says why far above torchrun's
        # summary: keep those lines with the tail.
        causes = [line for line in lines if "what():" in line or "terminate called" in line]
        tail = "\n".join(causes[:10] + lines[-90:])
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


def printed_losses(output: str) -> dict[int, float]:
    """{step: loss} from the trainer's log lines (5 decimals), for a run whose
    TensorBoard was never flushed (a killed job)."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"step:\s*(\d+)\s.*?loss:\s*(-?[\d.]+)", output)}


# ----- a trainer whose checkpoint write can be caught in the middle ------------------

HOLD_ENV = "TITAN_RUNS_HOLD_WRITE"
HOLD_SECONDS = 300


def held_line(folder: str, rank: int) -> str:
    return f"titan_runs: rank {rank} wrote its files of {folder}, holding"


def _hold_checkpoint_write(spec: str) -> None:
    """``spec`` = ``"step-4:1"``: on rank 1, each DCP write into a folder named step-4
    writes its files, prints :func:`held_line` and sleeps before returning to DCP. The
    coordinator (rank 0) writes the folder's ``.metadata`` only after every rank's
    write has returned, so a worker killed while it holds leaves a checkpoint folder
    with data files and no ``.metadata``: a save cut short. Only this test entry point
    patches DCP; the library and torchtitan run unchanged."""
    folder, rank = spec.rsplit(":", 1)
    if os.environ.get("RANK") != rank:
        return
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def write_then_hold(self, plan, planner):
        written = write_data(self, plan, planner)
        if Path(self.path).name == folder:
            print(held_line(folder, int(rank)), flush=True)
            time.sleep(HOLD_SECONDS)
        return written

    FileSystemWriter.write_data = write_then_hold


if __name__ == "__main__":
    # torchrun ... tests/titan_runs.py <trainer args>: lins_dtensor.train with the hold
    # above. Python put tests/ first on sys.path; the trainer should not see it.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    _hold_checkpoint_write(os.environ[HOLD_ENV])
    from lins_dtensor.train import main

    sys.exit(main())
