"""Accounting: the collectives the runtime records are the ones the schedule predicts,
and their bytes and the persistent memory follow the closed forms in the docs."""

from __future__ import annotations

import pytest

from distributed import run
from scenarios import train_lins
from lins_dtensor import LinsPlan
from lins_dtensor.schedule import CollectiveRecord, Op, summarize


def test_recorded_collectives_equal_schedule_on_every_rank(world4_runs):
    for run_ in world4_runs:
        for rank, info in enumerate(run_["per_rank"]):
            assert info["bytes_match"], f"{run_['config']} rank {rank}: counted {info['counted']} predicted {info['predicted']}"


@pytest.mark.slow
def test_recorded_collectives_equal_schedule_world8(world8_runs):
    for run_ in world8_runs:
        for rank, info in enumerate(run_["per_rank"]):
            assert info["bytes_match"], f"{run_['config']} rank {rank}: counted {info['counted']} predicted {info['predicted']}"


def test_measured_memory_equals_schedule_with_padding(world4_runs):
    for run_ in world4_runs:
        for info in run_["per_rank"]:
            assert info["memory"] == info["memory_expected"], run_["config"]


EVEN = dict(vocab=64, dim=32, n_heads=8, hidden=64)  # every dim0 divisible by 8: no padding
PHI = 64 * 32 * 2 + 2 * (32 * 2 + 8 + 4 * 32 * 32 + 3 * 32 * 64) + 32


@pytest.fixture(scope="module")
def even_runs():
    plans = ["p=1,g=1,os=8", "p=2,g=4,os=8", "p=4,g=4,os=4", "p=8,g=8,os=8"]
    cfgs = [dict(plan=p, microbatches=2, steps=1, ranks_per_node=4, model_kwargs=EVEN) for p in plans]
    return run(train_lins, 8, cfgs)


@pytest.mark.slow
def test_bytes_follow_closed_form(even_runs):
    """Closed forms of schedule.py's docstring, fp32 everywhere (b_p = b_r = 4), M = 2."""
    n, m, b = 8, 2, 4
    for run_ in even_runs:
        plan = LinsPlan.parse(run_["config"]["plan"], n)
        sp, sg, so = plan.params, plan.grads, plan.optim
        records = [CollectiveRecord(name, "", Op(op), size, nodes, nbytes, count) for (name, op, size, nodes, nbytes), count in run_["records"].items()]
        by_name = {}
        for r in records:
            by_name[r.name] = by_name.get(r.name, 0) + r.wire_bytes
        expected = {
            "param_all_gather": m * (sp - 1) / sp * PHI * b,
            "param_regather": m * (sp - 1) / sp * (PHI - 2 * 64 * 32 - 32) * b,  # not the output/embedding? see below
        }
        # Every unit is resharded after forward except the (parameter-less) root, so the
        # backward re-gather moves as much as the forward gather.
        expected["param_regather"] = expected["param_all_gather"]
        expected["grad_reduce_scatter"] = m * (sp - 1) / sp * PHI * b
        expected["grad_shard_reduce_scatter"] = m * (1 / sp - 1 / sg) * PHI * b
        expected["optim_reduce_scatter"] = (1 / sg - 1 / so) * PHI * b
        expected["optim_all_reduce"] = 2 * (1 / so - 1 / n) * PHI * b
        expected["update_gather_optim"] = (1 / sg - 1 / so) * PHI * b
        expected["update_gather_grad"] = (1 / sp - 1 / sg) * PHI * b
        for name, value in expected.items():
            assert by_name.get(name, 0.0) == pytest.approx(value, rel=1e-9), (plan, name)


@pytest.mark.slow
def test_memory_within_5_percent_of_closed_form(even_runs):
    """2Φ/s_p + 4Φ/s_g + 12Φ/s_os in the paper's bf16 form; here fp32 P: 4Φ/s_p."""
    for run_ in even_runs:
        plan = LinsPlan.parse(run_["config"]["plan"], 8)
        closed = {"params": 4 * PHI / plan.params, "grads": 4 * PHI / plan.grads, "optim": 12 * PHI / plan.optim}
        for info in run_["per_rank"]:
            for state, value in closed.items():
                assert abs(info["memory"][state] - value) <= 0.05 * value, (plan, state, info["memory"][state], value)


def test_summarize_groups_by_state_op_link():
    records = [
        CollectiveRecord("a", "params", Op.ALL_GATHER, 4, 2, 100, count=2),
        CollectiveRecord("b", "params", Op.ALL_GATHER, 2, 1, 10),
        CollectiveRecord("c", "optim", Op.ALL_REDUCE, 2, 2, 8),
    ]
    out = summarize(records)
    assert out[("params", "all_gather", "inter")]["message_bytes"] == 200
    assert out[("params", "all_gather", "inter")]["wire_bytes"] == pytest.approx(150)
    assert out[("optim", "all_reduce", "inter")]["wire_bytes"] == pytest.approx(8)
    assert out[("params", "all_gather", "intra")]["count"] == 1


def _one_unit(plan: LinsPlan, rows: int = 64, cols: int = 32) -> list:
    import torch

    from lins_dtensor.schedule import UnitGeometry, UnitSchedule

    zero = {"optim_replica": 0, "param_shard": 0, "grad_shard": 0, "optim_shard": 0}
    return [UnitSchedule(UnitGeometry.build([torch.Size((rows, cols))], plan, zero))]


def test_local_copies_follow_the_runtime_paths():
    """FSDP2 copies around every gather and reduce-scatter (also on a one-rank group),
    per micro-batch; the step's packing happens once, whatever M is."""
    from lins_dtensor.schedule import local_copy_bytes

    n, full, b = 8, 64 * 32, 4

    def copies(text: str, m: int) -> dict:
        plan = LinsPlan.parse(text, n)
        return local_copy_bytes(plan, _one_unit(plan), microbatches=m, param_bytes=b, reduce_bytes=b, master_bytes=b)

    fsdp = copies("p=8,g=8,os=8", 2)
    # copy-out of the gathered unit plus copy-in of the shard, forward and backward re-gather
    assert fsdp["forward"] == 2 * (2 * full + 2 * full // 8) * b
    # reduce-scatter copy-in, accumulation into G (read 2, write 1), the re-gather
    assert fsdp["backward"] == 2 * (2 * full + 3 * full // 8 + 2 * full + 2 * full // 8) * b
    # pack G, divide, zero G, copy the update into FSDP2's shard
    assert fsdp["step"] == (2 + 2 + 1 + 2) * full // 8 * b

    replicated = copies("p=1,g=1,os=8", 1)
    assert replicated["forward"] == 2 * full * b  # FSDP2 copies the shard even on one rank
    assert replicated["backward"] > fsdp["backward"] / 2  # plus the one-rank reduce-scatter's output copy

    one, four = copies("p=2,g=4,os=8", 1), copies("p=2,g=4,os=8", 4)
    assert four["forward"] == 4 * one["forward"] and four["backward"] == 4 * one["backward"]
    assert four["step"] == one["step"]



def test_local_copies_of_hpz_regather_from_the_post_forward_shard():
    from lins_dtensor.schedule import local_copy_bytes

    n, full, b = 8, 64 * 32, 4
    plan = LinsPlan.parse("p=8,g=8,os=8,hpz=4", n)
    hpz = local_copy_bytes(plan, _one_unit(plan), microbatches=1, param_bytes=b, reduce_bytes=b, master_bytes=b)
    shard = 2 * (full // 4) * b
    assert hpz["forward"] == (2 * full + 2 * full // 8) * b + shard  # gather, then keep a 1/4 shard
    assert hpz["backward"] == (2 * full + 3 * full // 8) * b + 2 * full * b + shard  # re-gather from it
