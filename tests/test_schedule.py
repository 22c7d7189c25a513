"""Accounting: the collectives the runtime records are the ones the schedule predicts,
and their bytes and the persistent memory follow the closed forms in the docs."""

from __future__ import annotations

import pytest

from distributed import run
from scenarios import LinsRun, train_lins
from lins_dtensor import LinsPlan
from lins_dtensor.schedule import CollectiveRecord, Op, summarize


@pytest.mark.quick
def test_recorded_collectives_equal_schedule_on_every_rank(world4_runs):
    for run_ in world4_runs:
        for rank, info in enumerate(run_["per_rank"]):
            assert info["bytes_match"], f"{run_['config']} rank {rank}: counted {info['counted']} predicted {info['predicted']}"


@pytest.mark.slow
def test_recorded_collectives_equal_schedule_world8(world8_runs):
    for run_ in world8_runs:
        for rank, info in enumerate(run_["per_rank"]):
            assert info["bytes_match"], f"{run_['config']} rank {rank}: counted {info['counted']} predicted {info['predicted']}"


@pytest.mark.quick
def test_measured_memory_equals_schedule_with_padding(world4_runs):
    for run_ in world4_runs:
        for info in run_["per_rank"]:
            assert info["memory"] == info["memory_expected"], run_["config"]


EVEN = dict(vocab=64, dim=32, n_heads=8, hidden=64)  # every dim0 divisible by 8: no padding
PHI = 64 * 32 * 2 + 2 * (32 * 2 + 8 + 4 * 32 * 32 + 3 * 32 * 64) + 32


@pytest.fixture(scope="module")
def even_runs():
    plans = ["p=1,g=1,os=8", "p=2,g=4,os=8", "p=4,g=4,os=4", "p=8,g=8,os=8"]
    cfgs = [LinsRun(p, 2, 1, 4, model_kwargs=EVEN) for p in plans]
    return run(train_lins, 8, cfgs)


@pytest.mark.slow
def test_bytes_follow_closed_form(even_runs):
    """Closed forms of schedule.py's docstring, fp32 everywhere (b_p = b_r = 4), M = 2."""
    n, m, b = 8, 2, 4
    for run_ in even_runs:
        plan = LinsPlan.parse(run_["config"].plan, n)
        sp, sg, so = plan.params, plan.grads, plan.optim
        records = [CollectiveRecord(name, "", Op(op), size, nodes, nbytes, count) for (name, op, size, nodes, nbytes, *_), count in run_["records"].items()]
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
        plan = LinsPlan.parse(run_["config"].plan, 8)
        closed = {"params": 4 * PHI / plan.params, "grads": 4 * PHI / plan.grads, "optim": 12 * PHI / plan.optim}
        for info in run_["per_rank"]:
            for state, value in closed.items():
                assert abs(info["memory"][state] - value) <= 0.05 * value, (plan, state, info["memory"][state], value)


@pytest.mark.quick
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


@pytest.mark.quick
def test_local_copies_follow_the_runtime_paths():
    """With P sharded, FSDP2 copies around every gather and reduce-scatter, per
    micro-batch; with P replicated there is no FSDP2 and no copy in forward. The first
    micro-batch copies its gradient into G, later ones add; the step divides, and
    writes the update into P."""
    from lins_dtensor.schedule import local_copy_bytes

    n, full, b = 8, 64 * 32, 4

    def copies(text: str, m: int) -> dict:
        plan = LinsPlan.parse(text, n)
        return local_copy_bytes(plan, _one_unit(plan), microbatches=m, param_bytes=b, reduce_bytes=b, master_bytes=b)

    fsdp = copies("p=8,g=8,os=8", 2)
    # copy-out of the gathered unit plus copy-in of the shard, forward and backward re-gather
    assert fsdp["forward"] == 2 * (2 * full + 2 * full // 8) * b
    # per micro-batch: reduce-scatter copy-in and the re-gather; then G: copy (read 1,
    # write 1), add (read 2, write 1); the OS layout is the G buffer itself: no pack
    assert fsdp["backward"] == (2 * (2 * full + 2 * full + 2 * full // 8) + (2 + 3) * full // 8) * b
    # divide the OS gradient, copy the update into FSDP2's shard
    assert fsdp["step"] == (2 + 2) * full // 8 * b

    replicated = copies("p=1,g=1,os=8", 1)
    assert replicated["forward"] == 0  # no FSDP2 where nothing is gathered
    # gradient into G, then G packed for the OS reduce-scatter (read G, write the 8 chunks)
    assert replicated["backward"] == (2 * full + 2 * full) * b
    assert replicated["step"] == (2 * full // 8 + 2 * full) * b  # divide, write the update into P

    one, four = copies("p=2,g=4,os=8", 1), copies("p=2,g=4,os=8", 4)
    assert four["forward"] == 4 * one["forward"] and four["step"] == one["step"]
    # three more micro-batches: FSDP2's copy-in and re-gather, the pack for the G
    # reduce-scatter (read the P shard, write the 2 G chunks), the add of its output
    p_shard, g_chunk = full // 2, full // 4
    assert four["backward"] - one["backward"] == 3 * (2 * full + (2 * full + 2 * p_shard) + (p_shard + 2 * g_chunk) + 3 * g_chunk) * b


@pytest.mark.quick
def test_local_copies_of_hpz_regather_from_the_post_forward_shard():
    from lins_dtensor.schedule import local_copy_bytes

    n, full, b = 8, 64 * 32, 4
    plan = LinsPlan.parse("p=8,g=8,os=8,hpz=4", n)
    hpz = local_copy_bytes(plan, _one_unit(plan), microbatches=1, param_bytes=b, reduce_bytes=b, master_bytes=b)
    shard = 2 * (full // 4) * b
    assert hpz["forward"] == (2 * full + 2 * full // 8) * b + shard  # gather, then keep a 1/4 shard
    assert hpz["backward"] == (2 * full + 2 * full // 8) * b + 2 * full * b + shard  # re-gather from it


@pytest.mark.quick
def test_chain_buffers_are_what_the_chains_allocate():
    """Bytes per chain: the gradient a G chain is handed (the P shard), packed inputs
    and gathered outputs, none where a level is one rank wide or the OS layout is the G
    chunk itself."""
    from lins_dtensor.schedule import chain_buffer_bytes

    full, b = 64 * 32, 4
    for text, expected in [
        ("p=8,g=8,os=8", {"grads": 0, "optim": 0, "update": 0}),
        ("p=1,g=1,os=8", {"grads": 0, "optim": full * b, "update": full * b}),
        ("p=1,g=2,os=8", {"grads": (full + full + full // 2) * b, "optim": full // 2 * b, "update": (full // 2 + full // 2 + full) * b}),
        ("p=1,g=8,os=8", {"grads": (full + full + full // 8) * b, "optim": 0, "update": full * b}),
        ("p=2,g=8,os=8", {"grads": (full // 2 + full // 2 + full // 8) * b, "optim": 0, "update": full // 2 * b}),
    ]:
        plan = LinsPlan.parse(text, 8)
        geometry = _one_unit(plan)[0].geometry
        assert chain_buffer_bytes(geometry, param_bytes=b, reduce_bytes=b, master_bytes=b) == expected, text
