"""Calibration from a run: the fit, the hardware and run files, the CLI, the benchmark."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from lins_dtensor.planner.calibrate import (
    Calibration,
    CalibrationRun,
    Measurement,
    fit,
    load_run,
    predict,
    run_from_json,
    run_to_json,
)
from lins_dtensor.planner.cli import main
from lins_dtensor.planner.hardware import (
    HARDWARE_PRESETS,
    ClusterSpec,
    hardware_from_json,
    hardware_preset,
    hardware_to_json,
    load_hardware,
    save_hardware,
)
from lins_dtensor.planner.models import PlannerError, decoder_spec
from lins_dtensor.planner.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[1]
# The world-8 runs docs/calibration.md states its figures on: the first two of today's
# executor (gloo's reduce-scatter polled to completion, 2026-12-06); earlier runs timed
# chains that could not move on until the host blocked.
POST_FIX_RUNS = ["rsfix-2026-12-06", "rsfix-2-2026-12-06"]

MODEL = decoder_spec("small", n_layers=6, dim=256, ffn_dim=768, n_heads=8, vocab_size=2048)
TRAINING = TrainingSpec(seq_len=128, param_bytes=4, activation_bytes=4, clip_grad_norm=True, overlap_fraction=0.0)
CLUSTER = ClusterSpec(8, 4, hardware_preset("cpu-emulated"))
PLANS = ["p=1,g=8,os=8", "p=1,g=4,os=4", "p=8,g=8,os=8", "p=1,g=1,os=4"]


def synthetic(plans: list[str], with_comm: bool | str, efficiency: float = 0.3, bw_factor: float = 0.4,
              intra_factor: float = 0.5) -> tuple[CalibrationRun, object]:
    """Measurements that the cost model on a known 'true' hardware predicts; ``with_comm``
    "state" gives the exposed communication per state, True its total."""
    hw = CLUSTER.hardware
    true = dataclasses.replace(hw, efficiency=efficiency, inter_bw=hw.inter_bw * bw_factor, intra_bw=hw.intra_bw * intra_factor)
    run = CalibrationRun(MODEL, CLUSTER, TRAINING, [])
    rows = []
    for plan in plans:
        cost = predict(run, true, Measurement(plan, 1.0))
        comm = dict(cost.exposed_state_s) if with_comm == "state" else sum(cost.exposed_state_s.values()) if with_comm else None
        rows.append(Measurement(plan, cost.step_s, None, comm))
    run.measurements = rows
    return run, true


@pytest.mark.parametrize("plans, with_comm, fitted", [
    (PLANS, False, ["efficiency", "inter_bw", "intra_bw"]),
    (PLANS[:1], True, ["efficiency", "inter_bw"]),  # all its traffic crosses the nodes
    (["p=4,g=4,os=8"], "state", ["efficiency", "inter_bw", "intra_bw"]),  # P and G in a node, OS across
])
def test_fit_recovers_known_efficiency_and_bandwidth(plans, with_comm, fitted):
    run, true = synthetic(plans, with_comm)
    cal = fit(run)
    assert cal.fitted == fitted
    assert cal.hardware.efficiency == pytest.approx(true.efficiency, rel=0.02)
    assert cal.hardware.inter_bw == pytest.approx(true.inter_bw, rel=0.02)
    if "intra_bw" in fitted:
        assert cal.hardware.intra_bw == pytest.approx(true.intra_bw, rel=0.02)
    else:
        assert cal.hardware.intra_bw == CLUSTER.hardware.intra_bw and "intra_bw: the measured plans send too little" in cal.note
    for m, after in zip(run.measurements, cal.after):
        assert after == pytest.approx(m.step_s, rel=0.01)


def test_calibration_scales_a_gpu_compute_curve_and_keeps_its_shape():
    """On a GPU preset the fitted efficiency scales every kernel's rate; the curve's shape
    (GEMM and attention ceilings, sequence dependence) is the preset's."""
    cluster = ClusterSpec(16, 8, hardware_preset("h100-sxm"))
    run = CalibrationRun(decoder_spec("7b", n_layers=32, dim=4096, ffn_dim=11008, n_heads=32, vocab_size=32000), cluster,
                         TrainingSpec(seq_len=4096, activation_checkpointing="full"), [])
    true = dataclasses.replace(cluster.hardware, efficiency=0.55)
    run.measurements = [Measurement("fsdp", predict(run, true, Measurement("fsdp", 1.0)).step_s)]
    cal = fit(run)
    assert cal.fitted == ["efficiency"] and cal.hardware.efficiency == pytest.approx(0.55, rel=0.01)
    shape = ("gemm_efficiency", "gemm_call_s", "attention_efficiency", "attention_half_seq", "attention_backward_ratio", "attention_causal_work")
    assert all(getattr(cal.hardware, k) == getattr(cluster.hardware, k) for k in shape)


def test_one_step_time_fits_efficiency_only():
    """One number cannot tell slow compute from a slow network: the bandwidth stays."""
    run, _ = synthetic(PLANS[:1], with_comm=False)
    cal = fit(run)
    assert cal.fitted == ["efficiency"]
    assert cal.hardware.inter_bw == CLUSTER.hardware.inter_bw
    assert "cannot separate" in cal.note
    assert cal.after[0] == pytest.approx(run.measurements[0].step_s, rel=0.01)


def test_hardware_file_round_trip(tmp_path):
    for hw in HARDWARE_PRESETS.values():  # cpu-emulated has an infinite tree latency
        path = tmp_path / f"{hw.name}.json"
        save_hardware(hw, path)
        assert json.loads(path.read_text())["format"] == "lins-hardware/1"
        assert load_hardware(path) == hw


def test_run_file_round_trip():
    run, _ = synthetic(PLANS[:2], with_comm="state")
    again = run_from_json(json.loads(json.dumps(run_to_json(run))))
    assert again.model == run.model and again.cluster == run.cluster and again.training == run.training
    assert again.measurements == run.measurements


def test_hardware_file_rejects_bad_fields():
    good = hardware_to_json(HARDWARE_PRESETS["h100-sxm"])
    for bad, message in [
        ({**good, "format": "x"}, "not a 'lins-hardware/1'"),
        ({**good, "efficiency": 1.5}, "efficiency"),
        ({**good, "gemm_efficiency": 1.2}, "'gemm_efficiency' = 1.2 must be in"),
        ({**good, "attention_half_seq": -1}, "'attention_half_seq' = -1"),
        ({**good, "inter_bw": -1}, "'inter_bw' = -1"),
        ({**good, "inter_bw": "fast"}, "'inter_bw' = 'fast'"),
        ({**good, "nics": 4}, "unknown field 'nics'"),
        ({k: v for k, v in good.items() if k != "peak_flops"}, "missing field 'peak_flops'"),
    ]:
        with pytest.raises(PlannerError, match=message):
            hardware_from_json(bad)


def test_calibrate_from_tensorboard_dir(tmp_path):
    """The torchtitan integration's files: lins_run.json next to the events and the
    lins/step_s_measured and lins/comm/exposed_s/<state> scalars; the warm-up step is skipped."""
    from torch.utils.tensorboard import SummaryWriter

    run, true = synthetic(PLANS[:1], with_comm="state")
    m = run.measurements[0]
    logdir = tmp_path / "tb" / "20250101-0000"
    writer = SummaryWriter(str(logdir))
    for step in range(1, 6):
        slow = 10.0 if step == 1 else 1.0
        writer.add_scalar("lins/step_s_measured", m.step_s * slow, step)
        for state, seconds in m.comm_exposed_s.items():
            writer.add_scalar(f"lins/comm/exposed_s/{state}", seconds * slow, step)
    writer.close()
    description = run_to_json(dataclasses.replace(run, measurements=[], plan=m.plan))
    (logdir / "lins_run.json").write_text(json.dumps(description))
    loaded = load_run(tmp_path / "tb")
    assert loaded.measurements[0].plan == m.plan
    assert loaded.measurements[0].step_s == pytest.approx(m.step_s, rel=1e-6)
    assert loaded.measurements[0].comm_exposed_s == pytest.approx(m.comm_exposed_s, rel=1e-6)
    out = tmp_path / "hw.json"
    assert main(["calibrate", str(tmp_path / "tb"), "-o", str(out)]) == 0
    assert load_hardware(out).inter_bw == pytest.approx(true.inter_bw, rel=0.02)


def test_cli_calibrate_then_plan_with_the_hardware_file(tmp_path, capsys):
    run, true = synthetic(PLANS, with_comm=False)
    src = tmp_path / "runs.json"
    src.write_text(json.dumps(run_to_json(run)))
    out = tmp_path / "hw.json"
    assert main(["calibrate", str(src), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "efficiency 0.500 -> 0.30" in text and "--hardware-file" in text
    shape = ["--model", "custom", "--layers", "6", "--dim", "256", "--ffn-dim", "768", "--heads", "8", "--vocab", "2048"]
    assert main([*shape, "--seq-len", "128", "--gpus", "8", "--gpus-per-node", "4", "--hardware-file", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"]["hardware"] == "cpu-emulated (calibrated)"


@pytest.mark.parametrize("content, message", [
    (None, "cannot read calibration file"),
    ("{", "is not JSON"),
    ('{"format": "lins-hardware/1"}', "is not a 'lins-calibration/1'"),
    ('{"format": "lins-calibration/1", "model": "llama_7b", "hardware": "h100", "gpus": 8, "training": {}}', "no measurements"),
    ('{"format": "lins-calibration/1", "model": "llama_7b", "hardware": "h100", "gpus": 8, "training": {},'
     ' "measurements": [{"plan": "p=3,g=3,os=3", "step_s": 1}]}', "measured plan 'p=3,g=3,os=3'"),
    ('{"format": "lins-calibration/1", "model": "llama_7b", "hardware": "h100", "gpus": 8, "training": {},'
     ' "measurements": [{"plan": "ddp", "step_s": -1}]}', "'step_s' = -1"),
    ('{"format": "lins-calibration/1", "model": "llama_7b", "hardware": "tpu", "gpus": 8, "training": {}}', "unknown hardware preset"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "in.json"
    if content is not None:
        path.write_text(content)
    assert main(["calibrate", str(path), "-o", str(tmp_path / "hw.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_cli_bad_hardware_file_is_one_line(tmp_path, capsys):
    (tmp_path / "hw.json").write_text('{"format": "lins-hardware/1", "name": "x"}')
    assert main(["--model", "llama_7b", "--gpus", "8", "--hardware-file", str(tmp_path / "hw.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing field" in err, err
    assert main(["calibrate", str(tmp_path / "none"), "-o", str(tmp_path / "h.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def bench_rows(bench: dict) -> dict[tuple[str, int], Measurement]:
    """Each Lins plan an emulated-cluster run measured exact (its first row), with Lins'
    own measured exposed communication per state (the other strategies are other
    runtimes; a lossy row is the same plan in other wire formats)."""
    rows = {}
    for s in bench["strategies"]:
        if s["instance"].startswith("lins:") and s.get("formats", "exact") == "exact":
            comm = {state: v["exposed"] for state, v in s["comm_time_s"].items()}
            rows.setdefault((s["plan"], s["microbatches"]), Measurement(s["plan"], s["step_time_s"]["median"], s["microbatches"], comm))
    return rows


def calibrate_on(bench: dict, key: tuple[str, int]) -> tuple[CalibrationRun, Calibration, dict, dict]:
    """From the 'cpu-emulated' preset (what a CPU torchtitan run starts from), calibrate
    on the Lins plan ``key`` = (plan, M) of an emulated-cluster run and predict the
    other Lins plans measured in the same run: (run, calibration, calibrated and preset
    relative errors per other plan)."""
    meta = bench["meta"]
    shape = meta["model"]
    model = decoder_spec("bench", n_layers=shape["n_layers"], dim=shape["dim"], ffn_dim=shape["ffn_dim"],
                         n_heads=shape["n_heads"], vocab_size=shape["vocab_size"])
    training = TrainingSpec(seq_len=meta["seq_len"], micro_batch=meta["batch_size"], param_bytes=4, reduce_bytes=4,
                            master_bytes=4, activation_bytes=4, clip_grad_norm=True,
                            overlap_fraction=meta["overlap_fraction"], lins_overlap_fraction=meta["lins_overlap_fraction"])
    cluster = ClusterSpec(meta["world_size"], meta["ranks_per_node"], hardware_preset("cpu-emulated"))
    rows = bench_rows(bench)
    run = CalibrationRun(model, cluster, training, [rows.pop(key)])
    cal = fit(run)
    errors = {k: predict(run, cal.hardware, m).step_s / m.step_s - 1 for k, m in rows.items()}
    preset = {k: predict(run, cluster.hardware, m).step_s / m.step_s - 1 for k, m in rows.items()}
    print(f"calibrated on {key[0]} M={key[1]}:")
    print("\n".join(f"  {p:<14} M={mb} calibrated {errors[(p, mb)]:+.1%} preset {preset[(p, mb)]:+.1%}" for p, mb in rows))
    return run, cal, errors, preset


def load_bench(name: str) -> dict:
    return json.loads((ROOT / "bench" / "results" / name / "cluster.json").read_text())


def mean_abs(errors: dict) -> float:
    return sum(map(abs, errors.values())) / len(errors)


@pytest.mark.parametrize("name", POST_FIX_RUNS)
def test_bench_calibrate_from_the_budgeted_pick_predicts_the_others(name):
    """World 8: calibrated on the planner's pick under the 64 MiB budget at M=4
    (p=4,g=4,os=8: P and G inside the node, OS across, so its exposed time per state
    pins both bandwidths), the other 10 exact Lins plans of the run come out at mean
    13 % / 9 % (9 / 8 of 10 within 20 %), closer than the preset on all 10, with the
    fitted link at 28 / 32 MB/s on the 37.5 MB/s rate limit. Until the cost model let
    cross-node reductions hide behind FSDP2's intra-node collectives on CPU
    (2026-12-07), the fit put the link at 58-66 MB/s, above its rate, to explain the
    chain's hidden time, and missed the P-replicated plans by 40-53 %."""
    bench = load_bench(name)
    picks = [p["plan"] for p in bench["meta"]["planner"] if p["microbatches"] == 4 and p["budget"] == "0.0625 GiB"]
    assert picks == ["p=4,g=4,os=8"]
    run, cal, errors, preset = calibrate_on(bench, ("p=4,g=4,os=8", 4))
    assert cal.fitted == ["efficiency", "inter_bw", "intra_bw"]
    # The fit's efficiency can stop at its bound (1.0, run 2), a few % off the step it read.
    assert cal.after[0] == pytest.approx(run.measurements[0].step_s, rel=0.1)
    assert len(errors) == 10 and mean_abs(errors) < 0.15, errors
    assert sum(abs(e) < 0.2 for e in errors.values()) >= 8, errors
    assert all(abs(errors[k]) < abs(preset[k]) for k in errors), (errors, preset)
    # The link between the nodes is rate-limited to 300 Mbit/s (37.5 MB/s).
    assert 20e6 < cal.hardware.inter_bw < 37.5e6, cal.hardware.inter_bw


@pytest.mark.parametrize("name", POST_FIX_RUNS)
def test_bench_calibration_from_any_plan_but_one_beats_the_preset(name):
    """World 8, every exact Lins plan of the run as the source in turn: calibrated on any
    but one, the others' mean error is below the preset's (calibrated 9-26 %, preset
    33-36 %). The exception is p=1,g=1,os=4 at M=4 (37-44 %): its only traffic across
    the nodes is one all-reduce of a node's OS shard a step, behind four micro-batches
    of compute, so one run of it cannot tell the link from the cores. The weakest of the
    others is p=4,g=8,os=8 at M=1 (26 %, the link fitted at 46-49 MB/s)."""
    bench = load_bench(name)
    means = {}
    for key in bench_rows(bench):
        _, _, errors, preset = calibrate_on(bench, key)
        means[key] = (mean_abs(errors), mean_abs(preset))
    assert len(means) == 11
    beaten = {key for key, (calibrated, preset) in means.items() if calibrated < preset}
    assert set(means) - beaten <= {("p=1,g=1,os=4", 4)}, means
    assert all(means[key][0] < 0.3 for key in beaten), means


WORLD4_RUNS = ["world4-2026-12-01-1", "world4-2026-12-01-2"]


@pytest.mark.parametrize("name", WORLD4_RUNS)
def test_world4_calibrate_from_one_plan_predicts_the_others_within_20_percent(name):
    """2 nodes x 2 ranks (4 ranks on the 2 cores, half the oversubscription of world 8),
    two runs: calibrated on any measured Lins plan whose collectives all cross the
    nodes (6 of the 8: the fsdp, zero1 and zero2 plans at M=1 and 4), every other Lins
    plan is predicted within 20 % (18.3 % at worst: p=1,g=1,os=2 at M=4, whose reduction
    starts inside the node and is exposed whole since dba4c11; 13.0 % before). A plan with traffic inside the
    node is a worse source here: one exposed time per state cannot pin the loopback
    links, which on this host are the cores that compute (p=1,g=2,os=2 at M=1: 26-28 %
    at worst; p=1,g=1,os=2 at M=4: 13.5 % and 17.8 %)."""
    bench = load_bench(name)
    rows = bench_rows(bench)
    worst = {}
    for key in rows:
        run, cal, errors, _ = calibrate_on(bench, key)
        if all(r.link == "inter" for r in predict(run, cal.hardware, run.measurements[0]).records):
            worst[key] = max(map(abs, errors.values()))
    print({f"{p}@{m}": f"{w:.1%}" for (p, m), w in worst.items()})
    assert sorted(worst) == sorted((p, m) for p in ("p=1,g=1,os=4", "p=1,g=4,os=4", "p=4,g=4,os=4") for m in (1, 4))
    assert all(w < 0.20 for w in worst.values()), worst
