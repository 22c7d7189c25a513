"""Run a function on N gloo ranks in fresh processes and collect rank 0's result."""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lins_dtensor.executor import run_every_chain_to_end


# Ranks are forked from a server that imported torch, Lins, torchtitan's trainer and the
# scenarios once for the whole session: "spawn" (or torchrun) imports them again in
# every rank of every launch, about 14 s of a 4-rank launch on 2 cores, 20 s with
# torchtitan (titan_runs.train forks its trainer ranks from this server too). The
# server runs no torch op before forking (no thread pools, no process group); the only
# threads the imports start are idle helpers (one of torch's, pyarrow's jemalloc
# background thread, which registers fork handlers), so each rank starts as clean as
# a spawned one. torchtitan and Hugging Face read the offline switches at import: set
# before the server starts.
# A module that cannot be imported (torchtitan absent) is skipped by the server.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
multiprocessing.set_forkserver_preload([
    "torch", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint", "lins_dtensor",
    "torchtitan.train", "scenarios", "checkpoint_scenarios", "error_scenarios", "fault_scenarios", "device_scenarios", "step_scenarios",
])


def free_port() -> int:
    """A port free now for rank 0's store (the race until it binds is the one torchrun's
    --standalone has too)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_path: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(*args)
        # A rank's process ends with os._exit (no atexit): it runs Lins' chains to their
        # end first, as a real process does at exit, so that no peer waits for a
        # collective it never issued (the last update gathers of a two-level gather).
        run_every_chain_to_end()
        if rank == 0:
            torch.save({"result": result}, out_path)
    except BaseException:
        torch.save({"error": f"rank {rank}: " + traceback.format_exc()}, f"{out_path}.error{rank}")
        raise
    finally:
        dist.destroy_process_group()


def run(fn, world_size: int, *args):
    """``fn(*args)`` on every rank; returns rank 0's return value (re-raises its error)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.pt")
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), out_path, fn, args), nprocs=world_size, start_method="forkserver")
        except mp.ProcessRaisedException:
            # The first failure is the cause; later ones are peers losing their connection.
            errors = sorted((os.path.getmtime(os.path.join(tmp, f)), f) for f in os.listdir(tmp) if ".error" in f)
            if errors:
                raise AssertionError(torch.load(os.path.join(tmp, errors[0][1]), weights_only=False)["error"]) from None
            raise
        payload = torch.load(out_path, weights_only=False)
    return payload["result"]
