"""Lins' collectives over real processes and a real interpreter shutdown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from titan_runs import env

HERE = Path(__file__).resolve().parent


def _exit_run(plan: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "--tee", "3",
           str(HERE / "exit_scenarios.py"), plan, *args]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert "terminate called" not in out and proc.returncode == 0, out[-3000:]
    # The case this checks: the gathers were in flight when each rank began to exit.
    assert out.count("updates in flight at exit: True") >= 3, out[-3000:]
    return out


@pytest.mark.timeout(300)
def test_a_job_that_exits_with_update_gathers_in_flight_ends_cleanly():
    """The README's loop ends after ``optimizer.step()``: its update gathers are still
    running on gloo's threads while the interpreter shuts down. Nothing of Lins may run
    Python there then: a future callback did, and every rank aborted ("terminate called
    without an active exception", exit -6) after a run that had trained correctly."""
    out = _exit_run("p=2,g=4,os=4")
    assert out.count("updates in flight at exit: True") == 4, out[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", ["p=2,g=4,os=4", "p=1,g=2,os=4"])
def test_ranks_that_exit_before_a_late_peer_wait_for_their_collectives(plan):
    """Rank 0 starts its last update gathers a second late: ranks whose gathers wait for
    it reach the interpreter's shutdown with them running. Had the shutdown freed Lins'
    references then, gloo's threads would free the gathers' tensors once rank 0 caught
    up, after the interpreter stopped taking the GIL: an abort (the torchtitan run, one
    in eight in CI). Lins waits for them at exit: none is running once shutdown begins
    (without the wait, rank 2 still had its 5 update gathers running).

    With P replicated (p=1,g=2,os=4) each update is a gather across the nodes, then one
    inside the node, which a rank issues only once the first is done: the other ranks
    reach their exit with the second not issued, and rank 0, having issued it, failed
    with "Connection closed by peer" when they ended (the job failed after training
    well). At exit Lins runs its chains to their end, after destroy_process_group."""
    out = _exit_run(plan, "late")
    assert out.count("collectives running at shutdown: 0") == 4, out[-3000:]


@pytest.mark.timeout(120)
def test_a_reduce_scatter_on_gloo_is_seen_completed_without_blocking_and_sums_as_torch():
    """gloo's own reduce-scatter work never reports is_completed(): the executor, which
    polls on CPU, could start nothing after it until the host blocked. Lins' reduce-scatter
    is polled to completion, and its result is bitwise torch's (odd size, 4 ranks)."""
    from collective_scenarios import polled_reduce_scatter
    from distributed import run

    assert run(polled_reduce_scatter, 4, 1001) == {"seen_completed": True, "bitwise": True, "input_kept": True}


class _Work:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


class _Flight:
    """What the exit hook reads of a :class:`~lins_dtensor.collectives.Flight`."""

    def __init__(self, done: bool, fails: bool = False) -> None:
        self.work, self.joined, self.fails = _Work(done), False, fails
        self.spec = type("Spec", (), {"name": "update_gather_params"})()
        self.stream = type("Stream", (), {"on_device": False})()

    def completed(self) -> bool:
        return self.joined or self.work.is_completed()

    def join(self) -> None:
        if self.fails:
            raise RuntimeError("lins: collective update_gather_params (params) failed: Connection reset by peer")
        self.work.done = self.joined = True


@pytest.fixture
def exit_hook(monkeypatch):
    """The exit hook over fake flights; ``os._exit`` records its status instead."""
    from lins_dtensor import collectives

    ended: list[int] = []

    def end(status: int) -> None:
        ended.append(status)
        raise _Ended

    monkeypatch.setattr(collectives, "_RELEASE_GRACE_S", 0.0)
    monkeypatch.setattr(collectives.os, "_exit", end)

    def run(flights: list[_Flight]) -> list[int]:
        monkeypatch.setattr(collectives, "_LIVE_FLIGHTS", flights)
        try:
            collectives.finish_in_flight_at_exit()
        except _Ended:
            pass
        return ended

    return run


class _Ended(Exception):
    """``os._exit`` in the tests: the hook stops where the process would have ended."""


def test_at_exit_running_collectives_are_waited_for(exit_hook, monkeypatch):
    monkeypatch.delattr("sys.last_value", raising=False)
    flights = [_Flight(done=True), _Flight(done=False)]
    assert exit_hook(flights) == [] and flights[1].joined and not flights[0].joined


def test_at_exit_c10d_gets_its_grace_even_when_every_collective_was_waited_for(exit_hook, monkeypatch):
    """The torchtitan trainer waits for its last update gathers and shuts down
    milliseconds later, while gloo's thread may still hold a completed gather (the abort
    one run in eight): the grace is slept whatever the host has waited for."""
    from lins_dtensor import collectives

    monkeypatch.delattr("sys.last_value", raising=False)
    monkeypatch.setattr(collectives, "_RELEASE_GRACE_S", 0.25)
    slept: list[float] = []
    monkeypatch.setattr(collectives.time, "sleep", slept.append)
    joined = _Flight(done=True)
    joined.joined = True
    assert exit_hook([joined]) == [] and slept == [0.25]
    assert exit_hook([]) == [] and slept == [0.25, 0.25]


def test_an_uncaught_exception_ends_the_rank_at_once_without_waiting(exit_hook, monkeypatch, capfd):
    monkeypatch.setattr("sys.last_value", ValueError("a step failed"), raising=False)
    flights = [_Flight(done=False)]
    assert exit_hook(flights) == [1] and not flights[0].joined
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "uncaught exception with 1 collective(s) in flight (e.g. update_gather_params)" in err


def test_a_collective_failing_at_exit_is_named_and_ends_the_rank_with_status_1(exit_hook, monkeypatch, capfd):
    monkeypatch.delattr("sys.last_value", raising=False)
    assert exit_hook([_Flight(done=False, fails=True)]) == [1]
    err = capfd.readouterr().err
    assert err.strip() == "lins: collective update_gather_params (params) failed: Connection reset by peer (at exit)"
