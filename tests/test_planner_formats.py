"""The planner with lossy wire formats (lins_dtensor.formats): what it costs is what
lins_dtensor.schedule counts, and the default (exact only) is today's planner."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lins_dtensor.errors import LinsConfigError
from lins_dtensor.formats import CommFormats
from lins_dtensor.plan import LinsPlan
from lins_dtensor.planner import ClusterSpec, TrainingSpec, choose_plan, evaluate, hardware_preset, search
from lins_dtensor.planner.bandwidth import BandwidthTable, CollectiveTimer, alpha_beta_seconds
from lins_dtensor.planner.cli import main
from lins_dtensor.planner.cost import _can_hide, network_bytes
from lins_dtensor.planner.hardware import CODEC_BYTES_PER_VALUE, hardware_from_json, hardware_to_json
from lins_dtensor.planner.memory import memory_breakdown, rank0_units
from lins_dtensor.planner.models import PlannerError, model_preset
from lins_dtensor.planner.profile import measure_codec_rates, needed_shapes
from lins_dtensor.planner.search import effective_formats, explain_tie, pick_winner
from lins_dtensor.schedule import Op, codec_values, error_feedback_bytes, step_collectives

# A slow network (1 Gbit/s per node) under fast GPUs: compressing gradients pays.
SLOW = dataclasses.replace(hardware_preset("a800"), inter_bw=1e9 / 8)
TRAINING = TrainingSpec(seq_len=2048)
INT8 = CommFormats(grads_inter="int8")


def _schedule_args(cluster: ClusterSpec, training: TrainingSpec, formats: CommFormats) -> dict:
    return dict(world_size=cluster.dp_ranks, ranks_per_node=cluster.dp_per_node, microbatches=training.microbatches(cluster.dp_ranks),
                param_bytes=training.param_bytes, reduce_bytes=training.reduce_bytes, formats=formats)


@pytest.mark.parametrize("text", ["p=2,g=4,os=8", "p=1,g=1,os=8", "p=1,g=2,os=2", "ddp", "p=8,g=8,os=8,hpz=2"])
@pytest.mark.parametrize("formats", ["grads=int8", "grads=bf16,params=int8", "grads=int8,grads:intra=bf16,params:intra=int8"])
def test_planner_bytes_equal_step_collectives_with_formats(text, formats):
    model, world, rpn, m = model_preset("debugmodel"), 8, 2, 3
    plan, fmts = LinsPlan.parse(text, world), CommFormats.parse(formats)
    training = TrainingSpec(seq_len=64, global_batch_tokens=64 * world * m)
    cluster = ClusterSpec.preset("cpu-emulated", world, rpn)
    cost = evaluate(plan, model, cluster, training, formats=fmts)
    expected = step_collectives(plan, rank0_units(model, plan), **_schedule_args(cluster, training, fmts))
    assert sorted(cost.records, key=repr) == sorted(expected, key=repr)
    assert cost.formats == fmts


def test_lossy_format_saves_comm_and_adds_codec_compute_and_error_feedback():
    model, cluster = model_preset("debugmodel"), ClusterSpec(8, 2, SLOW)
    plan = LinsPlan.parse("p=1,g=2,os=2", 8)  # the step all-reduce spans the 4 nodes
    exact = evaluate(plan, model, cluster, TRAINING)
    lossy = evaluate(plan, model, cluster, TRAINING, formats=INT8)
    all_reduces = [r for r in lossy.records if r.name == "optim_all_reduce"]
    assert {r.op for r in all_reduces if r.format == "int8"} == {Op.ALL_TO_ALL, Op.ALL_GATHER}
    # The norm weights' units run exact: int8 blocks padded around their few values would not shrink them.
    assert all(r.message_bytes < min(q.exact_bytes for q in all_reduces if q.format == "int8") for r in all_reduces if r.format == "exact")
    assert sum(lossy.comm_s.values()) < sum(exact.comm_s.values()) and lossy.step_s < exact.step_s
    assert lossy.link_bytes("inter") < exact.link_bytes("inter")
    # Codec work: schedule's values at the hardware's rate, added to its phase's compute.
    units, args = rank0_units(model, plan), _schedule_args(cluster, TRAINING, INT8)
    values = codec_values(plan, units, **args)
    assert values["step"]["int8"] > 0
    for phase, by_format in values.items():
        seconds = sum((n * CODEC_BYTES_PER_VALUE[fmt] / SLOW.hbm_bw for fmt, n in by_format.items()), 0.0)
        assert lossy.codec_s[phase] == pytest.approx(seconds, rel=1e-12)
        assert lossy.compute_s[phase] == exact.compute_s[phase] + lossy.codec_s[phase]
    assert exact.codec_s == {"forward": 0.0, "backward": 0.0, "step": 0.0}
    # Error-feedback residuals: schedule's bytes, persistent, in the peak.
    assert exact.memory.error_feedback == 0
    assert lossy.memory.error_feedback == error_feedback_bytes(plan, units, **args) > 0
    assert lossy.memory.peak >= exact.memory.peak + lossy.memory.error_feedback
    assert memory_breakdown(model, plan, TRAINING, formats=INT8, world_size=8, ranks_per_node=2) == lossy.memory
    with pytest.raises(PlannerError, match="need world_size and ranks_per_node"):
        memory_breakdown(model, plan, TRAINING, formats=INT8)


def test_fsdp2_gathers_of_p_take_the_params_format_of_their_level():
    """With P sharded inside the node (p=4 of 4 ranks per node), ``params:intra`` puts
    FSDP2's forward and backward gathers of P in its format: fewer bytes inside the node,
    codec work in forward and backward, their encoded buffers in memory; the search keeps
    the setting for such a plan and drops it where no parameter gather stays in a node."""
    model, training = model_preset("debugmodel"), TrainingSpec(seq_len=64, global_batch_tokens=64 * 8)
    cluster = ClusterSpec.preset("cpu-emulated", 8, 4)
    plan, fmts = LinsPlan.parse("p=4,g=8,os=8", 8), CommFormats(params_intra="int8")
    exact = evaluate(plan, model, cluster, training)
    lossy = evaluate(plan, model, cluster, training, formats=fmts)
    gathers = [r for r in lossy.records if r.name in ("param_all_gather", "param_regather") and r.format == "int8"]
    assert {r.name for r in gathers} == {"param_all_gather", "param_regather"}
    # bf16 parameters (the training's default): int8 blocks of 256 values and a 4-byte scale, about half.
    assert all(r.link == "intra" and r.message_bytes < 0.52 * r.exact_bytes for r in gathers)
    assert lossy.link_bytes("intra") < exact.link_bytes("intra") and lossy.link_bytes("inter") == exact.link_bytes("inter")
    assert lossy.codec_s["forward"] > 0 and lossy.codec_s["backward"] > 0 and lossy.codec_s["step"] == 0
    assert lossy.memory.buffers > exact.memory.buffers and lossy.memory.error_feedback == 0
    assert effective_formats(fmts, plan, cluster, training) == fmts
    assert effective_formats(fmts, LinsPlan.parse("p=1,g=8,os=8", 8), cluster, training) == CommFormats()


def test_codec_work_gives_no_room_to_hide_collectives():
    """A slower codec lengthens the step by its own seconds and hides nothing more: the
    encode runs before its collective is issued and the decode after it completes (on
    the emulated cluster, counting it as room predicted a fifth of int8's exposed time)."""
    model, plan = model_preset("debugmodel"), LinsPlan.parse("p=1,g=8,os=8", 8)
    cluster = ClusterSpec(8, 2, SLOW)
    fast = evaluate(plan, model, cluster, TRAINING, formats=INT8)
    slow_codec = dataclasses.replace(SLOW, codec_s_per_value={"int8": 1e-8})
    slow = evaluate(plan, model, ClusterSpec(8, 2, slow_codec), TRAINING, formats=INT8)
    assert sum(slow.codec_s.values()) > 10 * sum(fast.codec_s.values()) > 0
    assert slow.exposed_s == fast.exposed_s and sum(slow.exposed_s.values()) > 0
    assert slow.step_s == pytest.approx(fast.step_s + sum(slow.codec_s.values()) - sum(fast.codec_s.values()), rel=1e-12)


def test_where_intra_node_traffic_cannot_hide_neither_do_all_to_alls_with_node_local_ranks():
    """On hardware whose cores move the intra-node bytes (the emulated cluster), a lossy
    reduction's all-to-all over several ranks of each node is exposed in full, as the
    intra-node collectives are (measured: bench/results/codec-fixes-2026-12-02); one with
    a single rank per node still hides, and on GPUs both hide."""
    model, world = model_preset("debugmodel"), 8
    emulated = dataclasses.replace(hardware_preset("cpu-emulated"), ranks_per_node=4)
    training = TrainingSpec(seq_len=256, micro_batch=1, global_batch_tokens=256 * world)

    def costs(plan: str, hides: bool):
        cluster = ClusterSpec(world, 4, dataclasses.replace(emulated, intra_comm_hides=hides))
        cost = evaluate(LinsPlan.parse(plan, world), model, cluster, training, formats=INT8)
        a2a = [t for r, t in zip(cost.records, cost.record_s) if r.op is Op.ALL_TO_ALL]
        return cost, sum(a2a), len(a2a)

    spread, a2a_s, count = costs("p=1,g=8,os=8", hides=False)  # 4 ranks on each of 2 nodes
    assert count and spread.records[0].nodes == 2
    on_gpu, _, _ = costs("p=1,g=8,os=8", hides=True)
    assert sum(spread.exposed_s.values()) >= a2a_s > sum(on_gpu.exposed_s.values())
    one_per_node, _, count = costs("p=1,g=4,os=8", hides=False)  # the int8 group: 1 rank on each node
    crossing = [r for r in one_per_node.records if r.op is Op.ALL_TO_ALL]
    assert count and all(r.group_size == r.nodes == 2 and _can_hide(r, intra_hides=False) for r in crossing)
    assert not any(_can_hide(r, intra_hides=False) for r in spread.records if r.op is Op.ALL_TO_ALL)


def test_where_intra_node_traffic_cannot_hide_a_lossy_collective_inside_a_node_is_timed_at_its_exact_bytes():
    """On the emulated cluster the intra-node "link" is copies on the cores that compute:
    encoding an intra-node collective saves none of its time (measured: FSDP2's gathers of
    P inside the node took 0.49 s in int8 and 0.54 s exact per step), so it is timed at
    its exact bytes, its codec charged besides; across the nodes, and on GPUs, at its
    encoded bytes."""
    model, world = model_preset("debugmodel"), 8
    emulated = dataclasses.replace(hardware_preset("cpu-emulated"), ranks_per_node=4)
    training = TrainingSpec(seq_len=256, micro_batch=1, global_batch_tokens=256 * world)
    plan, fmts = LinsPlan.parse("p=4,g=8,os=8", world), CommFormats(params_inter="int8", params_intra="int8")

    def gather_seconds(hides: bool, formats: CommFormats) -> dict[str, float]:
        cluster = ClusterSpec(world, 4, dataclasses.replace(emulated, intra_comm_hides=hides))
        cost = evaluate(plan, model, cluster, training, formats=formats)
        out: dict[str, float] = {}
        for r, t in zip(cost.records, cost.record_s):
            if r.name in ("param_all_gather", "update_gather_grad"):
                out[r.name] = out.get(r.name, 0.0) + t
        return out

    exact, lossy = gather_seconds(False, CommFormats()), gather_seconds(False, fmts)
    assert lossy["param_all_gather"] == pytest.approx(exact["param_all_gather"], rel=1e-12)  # inside the node: exact's time
    assert lossy["update_gather_grad"] < 0.6 * exact["update_gather_grad"]  # across the nodes: the encoded bytes' (int8 of bf16)
    on_gpu = gather_seconds(True, fmts)
    assert on_gpu["param_all_gather"] < 0.6 * gather_seconds(True, CommFormats())["param_all_gather"]


def test_a_near_tie_goes_to_fewer_lossy_formats_before_fewer_intra_node_bytes():
    """A lossy gather inside the node moves fewer bytes; where intra-node traffic cannot
    hide it is timed at its exact bytes plus its codec, so it is slower, not faster. A
    near-tie (here within a wide tolerance) must not buy it for its bytes: the emulated
    cluster's M = 4 pick was p=1,g=1,os=4 with params:intra=bf16, 1.3 % slower than the
    same plan with exact gathers inside the node and the same inter-node bytes."""
    model, world = model_preset("debugmodel"), 8
    cluster = ClusterSpec(world, 4, dataclasses.replace(hardware_preset("cpu-emulated"), ranks_per_node=4))
    training = TrainingSpec(seq_len=256, micro_batch=1, global_batch_tokens=4 * 256 * world, param_bytes=4)  # fp32, as the bench
    plan = LinsPlan.parse("p=1,g=1,os=4", world)
    across = evaluate(plan, model, cluster, training, formats=CommFormats.parse("grads=int8"))
    inside_too = evaluate(plan, model, cluster, training, formats=CommFormats.parse("grads=int8,params:intra=bf16"))
    assert inside_too.link_bytes("inter") == across.link_bytes("inter")
    assert inside_too.link_bytes("intra") < across.link_bytes("intra") and inside_too.step_s > across.step_s
    assert pick_winner([across, inside_too], tie_tolerance=0.5) is across
    # The explanation names what settles such a tie (here asked the other way round).
    assert "has lossy formats grads=int8,params:intra=bf16 where p=1,g=1,os=4 has grads=int8" in explain_tie(across, inside_too)


def test_planner_chooses_a_lossy_format_that_pays_and_says_what_it_bought():
    cluster = ClusterSpec(8, 2, SLOW)
    plan, ex = choose_plan("debugmodel", cluster, TRAINING, allowed_formats="grads=int8")
    assert ex.formats == INT8 and plan == ex.plan and ex.exact is not None and not ex.exact.formats.lossy
    assert ex.cost.step_s * 1.02 < ex.exact.step_s
    assert f"lossy formats grads=int8 save {ex.exact.step_s - ex.cost.step_s:.3g} s per step over the fastest exact plan {ex.exact.plan}" in ex.reason
    assert "inter-node bytes" in ex.reason
    # A format where a plan has no Lins collective is the exact choice: costed once.
    pairs = [(c.plan, c.formats) for c in ex.ranked + ex.dropped]
    assert len(pairs) == len(set(pairs))
    zero3 = LinsPlan.parse("zero3", 8)  # FSDP2 alone reduces: no Lins gradient collective
    assert (zero3, INT8) not in pairs and (zero3, CommFormats()) in pairs


def test_error_feedback_memory_drops_int8_under_a_tight_budget():
    free = choose_plan("debugmodel", ClusterSpec(8, 2, SLOW), TRAINING, allowed_formats="grads=int8")[1]
    exact_same = evaluate(free.plan, model_preset("debugmodel"), ClusterSpec(8, 2, SLOW), TRAINING)
    assert exact_same.memory.peak < free.cost.memory.peak
    tight = ClusterSpec(8, 2, SLOW, memory_budget_bytes=exact_same.memory.peak)
    ex = search("debugmodel", tight, TRAINING, allowed_formats="grads=int8")
    assert (free.plan, INT8) in [(c.plan, c.formats) for c in ex.dropped]
    assert (free.plan, CommFormats()) in [(c.plan, c.formats) for c in ex.ranked]
    assert ex.cost.fits and not (ex.plan == free.plan and ex.formats.lossy)


def test_default_is_exact_and_a_lossy_format_that_does_not_pay_changes_nothing():
    cluster = ClusterSpec.preset("a800", 16)  # fast links: bf16 buys 2.5 %, int8 nothing
    none = search("debugmodel", cluster, TRAINING, tie_tolerance=0.1)
    lossy = search("debugmodel", cluster, TRAINING, tie_tolerance=0.1, allowed_formats="grads=int8|bf16")
    assert min(c.step_s for c in lossy.ranked if c.formats.lossy) < none.cost.step_s  # faster, but within the tolerance
    assert none.exact is None and not none.formats.lossy and lossy.plan == none.plan and not lossy.formats.lossy
    assert none.reason == lossy.reason and dataclasses.astuple(none.cost) == dataclasses.astuple(lossy.cost)
    assert [dataclasses.astuple(c) for c in none.ranked] == [dataclasses.astuple(c) for c in lossy.ranked if not c.formats.lossy]
    again = evaluate(none.plan, model_preset("debugmodel"), cluster, TRAINING)
    assert dataclasses.astuple(again) == dataclasses.astuple(none.cost)


def test_gather_half_of_a_lossy_all_reduce_is_a_step_reduction():
    # p=g=os: no update gathers; the step all-reduce spans nodes, in int8 an all-to-all
    # and an all-gather. With reductions at the step nothing hides them: the step's
    # exposed time is all of its collectives, the gather half included.
    model, cluster = model_preset("debugmodel"), ClusterSpec(8, 2, SLOW)
    plan = LinsPlan.parse("p=2,g=2,os=2", 8)
    training = dataclasses.replace(TRAINING, reduce_in_backward=False)
    cost = evaluate(plan, model, cluster, training, formats=INT8)
    halves = [(r, t) for r, t in zip(cost.records, cost.record_s) if r.name == "optim_all_reduce"]
    assert {r.op for r, _ in halves if r.format == "int8"} == {Op.ALL_TO_ALL, Op.ALL_GATHER}
    step = sum(t for t, phase in zip(cost.record_s, cost.record_phase) if phase == "step")
    assert cost.exposed_s["step"] == pytest.approx(step, rel=1e-12)
    # Had FSDP2 issued the step reductions, both halves move to backward.
    moved = evaluate(plan, model, cluster, training, formats=INT8, fsdp2_reductions=True)
    assert {phase for r, phase in zip(moved.records, moved.record_phase) if r.name == "optim_all_reduce"} == {"backward"}


def test_all_to_all_timing():
    hw = dataclasses.replace(hardware_preset("a800"), reduce_scatter_is_all_reduce=False)
    # Same bytes per rank as a reduce-scatter inside a node and with one rank per node ...
    assert alpha_beta_seconds(hw, 8, "all_to_all", 8, 1, 1e8) == alpha_beta_seconds(hw, 8, "reduce_scatter", 8, 1, 1e8)
    assert alpha_beta_seconds(hw, 8, "all_to_all", 4, 4, 1e8) == alpha_beta_seconds(hw, 8, "reduce_scatter", 4, 4, 1e8)
    # ... but across nodes with r ranks on each, each rank sends its own chunks off-node.
    assert alpha_beta_seconds(hw, 8, "all_to_all", 16, 2, 1e8) > 3 * alpha_beta_seconds(hw, 8, "reduce_scatter", 16, 2, 1e8)
    record = next(r for r in step_collectives(LinsPlan.parse("p=1,g=16,os=16", 16), rank0_units(model_preset("debugmodel"), LinsPlan.parse("p=1,g=16,os=16", 16)),
                                              world_size=16, ranks_per_node=8, microbatches=1, param_bytes=2, reduce_bytes=4, formats=INT8)
                  if r.op is Op.ALL_TO_ALL)
    assert network_bytes(record) == pytest.approx(record.message_bytes * record.count * 8 / 16)
    # A table without all-to-alls times them by its reduce-scatter of the same shape.
    table = BandwidthTable(8, {("reduce_scatter", 8, 2): [(1e6, 1e-3), (1e8, 0.1)]})
    timer = CollectiveTimer(hw, 8, table)
    assert timer.seconds("all_to_all", 16, 2, 1e7) == timer.seconds("reduce_scatter", 16, 2, 1e7) and not timer.fallbacks
    assert timer.seconds("all_to_all", 8, 1, 1e7) == alpha_beta_seconds(hw, 8, "all_to_all", 8, 1, 1e7)
    assert timer.fallbacks == {("all_to_all", 8, 1)}
    assert ("all_to_all", 1, 4) in needed_shapes(8, 2)


def test_codec_rates_measured_and_kept_in_hardware_files():
    rates = measure_codec_rates(torch.device("cpu"), numel=1 << 16, iters=1)
    assert set(rates) == {"bf16", "int8"} and all(r > 0 for r in rates.values())
    hw = dataclasses.replace(hardware_preset("h100-sxm"), codec_s_per_value=rates)
    assert hardware_from_json(json.loads(json.dumps(hardware_to_json(hw)))) == hw
    assert hw.codec_seconds("int8") == rates["int8"]
    assert hardware_preset("h100-sxm").codec_seconds("int8") == CODEC_BYTES_PER_VALUE["int8"] / 3.35e12
    for bad in ({"int4": 1e-9}, {"exact": 1e-9}, {"int8": 0}, [1e-9]):
        with pytest.raises(PlannerError, match="codec_s_per_value"):
            hardware_from_json({**hardware_to_json(hw), "codec_s_per_value": bad})
    older = {k: v for k, v in hardware_to_json(hw).items() if k != "codec_s_per_value"}  # a file from before formats
    assert hardware_from_json(older).codec_s_per_value == {}


def test_cli_allow_formats(capsys):
    args = ["--model", "debugmodel", "--gpus", "8", "--gpus-per-node", "2", "--hardware", "a800", "--inter-node-gbit", "1", "--seq-len", "2048"]
    assert main([*args, "--allow-formats", "grads=int8"]) == 0
    out = capsys.readouterr().out
    assert "CHOSEN           p=1,g=2,os=2 grads=int8" in out and "wire formats grads=int8: encode/decode" in out
    assert "lossy formats grads=int8 save" in out
    assert main([*args, "--allow-formats", "grads=int8", "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["formats"] == {"grads": {"inter": "int8", "intra": "exact"}, "params": {"inter": "exact", "intra": "exact"}}
    assert chosen["memory_gib"]["error_feedback"] > 0 and chosen["codec_s"]["step"] > 0
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chosen"]["formats"] == "exact"
    for bad in ("grads=int4", "gradients=int8", "grads"):
        assert main([*args, "--allow-formats", bad]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("lins-plan: error: --allow-formats: ") and captured.err.count("\n") == 1
    with pytest.raises(LinsConfigError):
        search("debugmodel", ClusterSpec(8, 2, SLOW), TRAINING, allowed_formats="grads=int4")


def test_calibration_runs_carry_their_formats():
    from lins_dtensor.planner.calibrate import CalibrationRun, Measurement, predict, run_from_json, run_to_json

    cluster = ClusterSpec(8, 2, SLOW)
    run = CalibrationRun(model_preset("debugmodel"), cluster, TRAINING, [Measurement("p=1,g=2,os=2", 0.1)], "p=1,g=2,os=2", "grads=int8")
    again = run_from_json(json.loads(json.dumps(run_to_json(run))))
    assert again.formats == "grads=int8" and again.measurements[0].formats == "grads=int8"
    cost = predict(again, SLOW, again.measurements[0])
    assert cost.formats == INT8
    assert cost.step_s == evaluate(LinsPlan.parse("p=1,g=2,os=2", 8), model_preset("debugmodel"), cluster, TRAINING, formats=INT8).step_s
    assert "formats" not in run_to_json(dataclasses.replace(run, formats=None))
    for bad, message in (("grads=int4", "'formats': comm_formats: unknown format"), (8, "'formats' = 8 must be a string")):
        with pytest.raises(PlannerError, match=message):
            run_from_json({**run_to_json(run), "formats": bad})


def test_sweep_marks_a_change_of_formats(capsys):
    args = ["--model", "debugmodel", "--gpus", "8", "--gpus-per-node", "2", "--hardware", "a800", "--seq-len", "2048",
            "--allow-formats", "grads=int8", "--sweep", "inter-node-gbit=100,1000", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [pt["chosen"]["formats"] != "exact" for pt in out["points"]] == [True, False]
    assert [(c["plan_from"], c["plan_to"]) for c in out["changes"]] == [("p=1,g=2,os=4", "p=1,g=2,os=4")]
    assert main(args[:-1]) == 0
    assert "100 -> 1000 Gbit/s: p=1,g=2,os=4 grads=int8 -> p=1,g=2,os=4 " in capsys.readouterr().out
