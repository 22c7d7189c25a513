"""Lins' on-device path, on CPU ranks: the executor's device branch over fake_device's
streams and events (gloo moves the data), against the CPU path's bits; and the hazards
that only a GPU would show as wrong values, checked through the order Lins imposes."""

from __future__ import annotations

import pytest
import torch

from conftest import STEPS
from device_scenarios import forward_prefetch, forward_prefetch_on_fake_device, step_writes_after_pending_gathers, train_on_fake_device
from distributed import run
from scenarios import LinsRun
from test_runtime import _key

# P replicated (no FSDP2), P inside the node (FSDP2 hands Lins its output), fsdp (every
# level one group), hpZ; M = 3 so the last backward reduces while earlier ones accumulate.
DEVICE_PLANS = ["p=1,g=2,os=4", "p=2,g=2,os=4", "p=2,g=4,os=4", "fsdp", "hpz:2"]


@pytest.fixture(scope="module")
def device_runs():
    configs = [LinsRun(p, 3, STEPS, 2) for p in DEVICE_PLANS]
    # A bound that lets one chain at a time hold bytes: the device path waits on streams.
    configs.append(LinsRun("p=1,g=2,os=4", 3, STEPS, 2, max_inflight_bytes=1))
    return run(train_on_fake_device, 4, configs)


def test_the_device_path_gives_the_cpu_path_bits_without_a_host_sync(device_runs, world4_runs):
    """Every chain enqueued whole on the side stream at submission, ordered by events,
    its inputs held until the stream that made them has waited for it: the same
    collectives in the same order per group as the CPU path, so the same masters bit for
    bit; and the host never waited for the device while training."""
    at_step = {_key(r["config"]): r for r in world4_runs}
    for result in device_runs:
        cfg = result["config"]
        for name, value in result["masters"].items():
            assert torch.equal(value, at_step[_key(cfg)]["masters"][name]), f"{cfg}: {name}"
        assert result["host_syncs"] == 0, cfg
        assert result["violations"] == [], cfg
        assert result["side_streams"] == 1, cfg
        assert "optim" in result["timed_states"], cfg  # lins_stats read the device timings


def test_the_step_waits_for_a_pending_update_gather_before_writing_its_masters():
    """Finding 5: a unit whose forward was skipped (its weight read directly) keeps last
    step's update gather pending, and the optimizer wrote the masters that gather reads
    without anything having waited for it. On one in-order side stream the step's own
    reductions, enqueued after it, order it after all; on CPU chains on other groups pass
    it, so the write could race gloo's read (here gloo had always finished: nothing made
    it so). The step now waits for every pending gather of the masters it writes."""
    for plan in ("p=1,g=2,os=4", "p=1,g=2,os=2"):
        assert run(step_writes_after_pending_gathers, 4, plan) == [], plan


def test_fsdp2_forward_prefetch_gathers_updated_parameters():
    """Finding 4: FSDP2's forward prefetch (torchtitan can set it) gathers the next block
    from this block's pre-forward; Lins must have written that block's update by then.
    A byte bound of one chain at a time leaves the next block's update in flight, so a
    stale gather shows as other masters."""
    configs = [dict(plan=p, prefetch=prefetch, max_inflight_bytes=1) for p in ("p=2,g=2,os=4", "p=2,g=4,os=4") for prefetch in (False, True)]
    runs = run(forward_prefetch, 4, configs)
    for without, with_prefetch in zip(runs[::2], runs[1::2]):
        for name, value in without["masters"].items():
            assert torch.equal(with_prefetch["masters"][name], value), f"{with_prefetch['config']}: {name}"


def test_on_a_device_fsdp2_prefetch_waits_on_fsdp2s_streams_not_on_compute():
    """Finding 4 on a device: the next block's update must be visible to FSDP2's
    all-gather streams when the block before it starts the prefetch, while the compute
    stream still waits only in that block's own pre-forward (the update gathers keep
    overlapping the forward)."""
    for plan in ("p=2,g=2,os=4", "p=2,g=4,os=4"):
        assert run(forward_prefetch_on_fake_device, 4, plan) == [], plan
