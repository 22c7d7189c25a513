"""The convergence report's arithmetic (lins_dtensor.bench.convergence) on synthetic
loss curves: no training, so a wrong band or gap shows here and not in a 30-minute run."""

import json
import math

import pytest

from lins_dtensor.bench.convergence import (
    analyse,
    band,
    cluster_time_to_loss,
    gap,
    leave_one_out_gap,
    parse_log,
    report,
    smooth,
    time_to_loss,
)

SEEDS = [[5.0, 4.0, 3.0, 2.0], [5.2, 4.1, 3.2, 2.2], [4.9, 3.9, 2.9, 1.9]]


def test_smooth_is_a_trailing_mean_with_short_windows_at_the_start():
    assert smooth([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0, 4.0], window=10) == [2.0, 3.0]


def test_band_is_the_per_step_min_and_max():
    assert band(SEEDS) == ([4.9, 3.9, 2.9, 1.9], [5.2, 4.1, 3.2, 2.2])
    with pytest.raises(ValueError):
        band([[1.0, 2.0], [1.0]])


def test_a_run_inside_the_band_has_gap_zero():
    lo, hi = band(SEEDS)
    assert gap([5.0, 4.0, 3.1, 2.0], lo, hi) == (0.0, None)
    assert gap(lo, lo, hi) == (0.0, None)  # on the edge is inside


def test_a_run_outside_has_its_largest_distance_and_step():
    lo, hi = band(SEEDS)
    size, step = gap([5.3, 3.8, 3.2, 2.5], lo, hi)  # 0.1 above, 0.1 below, inside, 0.3 above
    assert step == 4 and size == pytest.approx(0.3)
    size, step = gap([4.9, 3.5, 3.0, 2.0], lo, hi)  # below the band at step 2
    assert step == 2 and size == pytest.approx(0.4)


def test_a_nan_loss_is_an_infinite_gap():
    lo, hi = band(SEEDS)
    assert gap([5.0, math.nan, 3.0, 2.0], lo, hi) == (math.inf, 2)


def test_leave_one_out_gap_is_how_far_one_seed_leaves_the_others_band():
    # Without seed 1 the band's top is seed 0, 0.2 below seed 1 (steps 1, 3, 4); without
    # seed 2 its bottom is seed 0, 0.1 above seed 2; seed 0 lies inside the other two.
    assert leave_one_out_gap(SEEDS) == pytest.approx(0.2)


def test_time_to_loss_is_the_first_step_at_or_below_the_target():
    assert time_to_loss([5.0, 4.0, 3.0, 2.0], 3.0) == 3
    assert time_to_loss([5.0, 4.0], 3.0) is None


def test_parse_log_reads_losses_and_step_times_through_colour_codes():
    log = "\n".join([
        "[rank0]:[titan] 2026-12-02 06:48:23,560 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss:  8.09608  \x1b[38;2;1;2;3mgrad_norm: 0.6",
        "[rank0]:[titan] 2026-12-02 06:48:23,600 - root - INFO - something else",
        "[rank0]:[titan] 2026-12-02 06:48:24,848 - root - INFO - \x1b[31mstep:  2  \x1b[32mloss:  8.08484  \x1b[38;2;1;2;3mgrad_norm: 0.6",
    ])
    losses, times = parse_log(log)
    assert losses == [8.09608, 8.08484]
    assert times[0] is None and times[1] == pytest.approx(1.288)


def _run(name, formats, seed, losses, plan="p=1,g=2,os=4"):
    return {"name": name, "seed": seed, "plan": plan, "formats": formats, "config": "c.toml",
            "steps": len(losses), "losses": losses, "step_times_s": [None] + [1.0] * (len(losses) - 1),
            "wall_s": 10.0, "started_utc": "2026-12-02 07:00:00", "commit": "abc1234", "command": "torchrun ..."}


def test_analyse_and_report_on_synthetic_runs(tmp_path):
    steps = 40
    base = [8.0 - 0.125 * i for i in range(steps)]  # binary fractions: exact sums
    seeds = [[x + d for x in base] for d in (0.0, 0.0625, -0.0625)]
    inside = [x - 0.015625 for x in base]
    outside = [x + (0.5 if i >= 30 else 0.0) for i, x in enumerate(base)]
    runs = [_run(f"fp32-seed{s}", "exact", s, c) for s, c in enumerate(seeds)]
    runs += [_run("grads-bf16", "grads=bf16", 0, inside), _run("grads-int8", "grads=int8", 0, outside),
             _run("ddp-fp32-seed0", "exact", 0, [x + 0.0078125 for x in seeds[0]], plan="ddp"),
             _run("ddp-grads-int8", "grads=int8", 0, [x + 0.03125 for x in seeds[0]], plan="ddp")]
    a = analyse(runs)
    rows = {r.name: r for r in a["rows"]}
    # The band: the plan with the most exact seeds; an exact run of another plan is compared with it.
    assert [r.name for r in a["rows"] if r.in_band] == ["fp32-seed0", "fp32-seed1", "fp32-seed2"]
    assert not rows["ddp-fp32-seed0"].in_band and rows["ddp-fp32-seed0"].smooth_gap == 0.0
    # What the format alone changes: the distance from the exact run of the same seed.
    assert rows["ddp-fp32-seed0"].vs_seed == pytest.approx(0.0078125)  # from the band's seed 0
    assert rows["ddp-grads-int8"].vs_seed == pytest.approx(0.0234375)  # from the exact ddp run of seed 0
    assert rows["grads-bf16"].vs_seed == pytest.approx(0.015625)
    assert rows["grads-int8"].vs_seed == pytest.approx(0.5)
    assert rows["grads-bf16"].smooth_gap == 0.0 and rows["grads-bf16"].raw_gap == 0.0
    # Raw: 0.5 above the base from step 31 on, 0.4375 above the band. Smoothed over 10
    # steps: only at step 40 are the last 10 losses all 0.5 higher, again 0.4375 above.
    assert rows["grads-int8"].raw_gap == 0.4375 and rows["grads-int8"].raw_gap_step == 31
    assert rows["grads-int8"].smooth_gap == pytest.approx(0.4375) and rows["grads-int8"].smooth_gap_step == 40
    assert a["tolerance"] == pytest.approx(0.0625)  # the seeds are parallel lines 0.0625 apart
    assert rows["grads-int8"].ttl is None and rows["grads-bf16"].ttl == steps  # target: the seeds' mean at the end

    results = tmp_path / "results"
    results.mkdir()
    for r in runs:
        (results / f"{r['name']}.json").write_text(json.dumps(r))
    doc = tmp_path / "convergence.md"
    report(results, doc, cluster=tmp_path / "no-cluster.json")
    text = doc.read_text()
    assert "Time to loss on the emulated cluster" not in text
    assert "| grads-bf16 | `p=1,g=2,os=4` | `grads=bf16` | 0 |" in text and "| ddp-fp32-seed0 | `ddp` | `exact` |" in text
    assert "| yes |" in text and "| **no** |" in text
    assert (tmp_path / "convergence.png").stat().st_size > 0


def test_the_band_needs_two_seeds_of_one_plan():
    with pytest.raises(ValueError, match="at least 2 exact seeds"):
        analyse([_run("fp32-seed0", "exact", 0, [3.0, 2.0]), _run("grads-int8", "grads=int8", 0, [3.0, 2.0])])


def test_a_compressed_run_of_a_plan_with_its_own_exact_seeds_is_judged_against_their_band(tmp_path):
    """Where P is sharded torchtitan initialises other weights for the same seed: a plan
    with exact seeds of its own (here 1.0 above the main band, as parallel lines) judges
    its compressed runs against its own band, tolerance and target; its exact seeds and
    a compressed run of a plan without seeds are compared with the main band. A tie in
    exact seeds makes the earliest plan's the main band."""
    steps = 40
    base = [8.0 - 0.125 * i for i in range(steps)]
    main = [_run(f"fp32-seed{s}", "exact", s, [x + d for x in base]) for s, d in enumerate((0.0, 0.0625, -0.0625))]
    sharded = [dict(_run(f"fp32-p2-seed{s}", "exact", s, [x + 1.0 + d for x in base], plan="p=2,g=2,os=4"),
                    started_utc="2026-12-02 21:00:00") for s, d in enumerate((0.0, 0.125, -0.125))]
    lossy = _run("int8-p2", "grads=int8", 0, [x + 1.0 - 0.0625 for x in base], plan="p=2,g=2,os=4")
    stray = _run("int8-p4", "grads=int8", 0, [x + 1.0 for x in base], plan="p=4,g=4,os=4")
    repeat = _run("fp32-p4-seed0-again", "exact", 0, [x + 1.0 for x in base], plan="p=4,g=4,os=4")  # one seed twice: no band
    a = analyse(main + sharded + [lossy, stray, repeat, dict(repeat, name="fp32-p4-seed0")])
    rows = {r.name: r for r in a["rows"]}
    assert a["plan"] == "p=1,g=2,os=4" and list(a["plan_bands"]) == ["p=2,g=2,os=4"]
    assert a["plan_bands"]["p=2,g=2,os=4"]["tolerance"] == pytest.approx(0.125)
    assert rows["int8-p2"].band_plan == "p=2,g=2,os=4" and rows["int8-p2"].smooth_gap == 0.0
    assert rows["int8-p2"].tolerance == pytest.approx(0.125) and rows["int8-p2"].vs_seed == pytest.approx(0.0625)
    assert rows["int8-p2"].ttl == steps  # its plan's target: its seeds' mean at the end, 1.0 above the main one
    assert rows["fp32-p2-seed0"].band_plan == "p=1,g=2,os=4" and rows["fp32-p2-seed0"].smooth_gap == pytest.approx(0.9375)
    assert rows["int8-p4"].band_plan == "p=1,g=2,os=4" and rows["int8-p4"].smooth_gap == pytest.approx(0.9375)
    results = tmp_path / "results"
    results.mkdir()
    for r in main + sharded + [lossy, stray]:
        (results / f"{r['name']}.json").write_text(json.dumps(r))
    report(results, tmp_path / "convergence.md", cluster=tmp_path / "no-cluster.json")
    text = (tmp_path / "convergence.md").read_text()
    assert "| int8-p2 | `p=2,g=2,os=4` | `grads=int8` | 0 | `p=2,g=2,os=4` |" in text
    assert "Band of plan `p=2,g=2,os=4` (fp32-p2-seed0, fp32-p2-seed1, fp32-p2-seed2)" in text


def _bench_row(strategy, m, formats, median, plan="p=1,g=4,os=8"):
    return {"strategy": strategy, "microbatches": m, "plan": plan, "formats": formats, "chosen_for": ["unlimited"],
            "step_time_s": {"median": median}}


def test_time_to_loss_on_the_cluster_multiplies_each_rows_steps_by_its_step_time(tmp_path):
    """A benchmark row's time to loss: the steps of the seed-0 convergence run that trains
    as it does (its Lins formats as text, a DDP hook by strategy, exact for exact
    training of any plan) times its median step; a run that never reached the target
    or was never run shows so; rows of other strategies are left out."""
    steps = 40
    base = [8.0 - 0.125 * i for i in range(steps)]
    runs = [_run(f"fp32-seed{s}", "exact", s, [x + d for x in base]) for s, d in enumerate((0.0, 0.0625, -0.0625))]
    runs += [_run("everywhere-int8", "grads=int8,grads:intra=int8,params=int8,params:intra=int8", 0,
                  [x - 0.5 for x in base]),
             _run("ddp-bf16-hook-seed0", "ddp bf16_compress_hook", 0, base, plan="ddp"),
             _run("ddp-powersgd-seed0", "ddp powerSGD rank 4", 0, [x + 1.0 for x in base], plan="ddp")]
    a = analyse(runs)
    int8 = {kind: {"inter": "int8", "intra": "int8"} for kind in ("grads", "params")}
    bf16 = {"grads": {"inter": "bf16", "intra": "exact"}, "params": {"inter": "exact", "intra": "exact"}}
    cluster = {"meta": {"nodes": 2, "ranks_per_node": 4, "link_rate": "300mbit", "model": {"size": "small", "params": 6163712}},
               "strategies": [_bench_row("lins-planner", 1, "exact", 2.0), _bench_row("lins-planner-compressed", 1, int8, 0.5),
                        _bench_row("lins-planner-compressed", 4, bf16, 1.5), _bench_row("ddp-bf16-hook", 1, {}, 1.0, None),
                        _bench_row("ddp-powersgd", 1, {}, 0.75, None), _bench_row("hsdp", 1, "exact", 3.0, None)]}
    by = {(e["strategy"], e["microbatches"]): e for e in cluster_time_to_loss(a, cluster)}
    assert len(by) == 5 and ("hsdp", 1) not in by
    exact_steps = a["rows"][0].ttl  # the band's seed 0
    assert by[("lins-planner", 1)]["run"] == "fp32-seed0" and by[("lins-planner", 1)]["seconds"] == exact_steps * 2.0
    first = next(i for i, x in enumerate(base, start=1) if x - 0.5 <= a["target"])  # the int8 run's curve is lower
    assert by[("lins-planner-compressed", 1)]["run"] == "everywhere-int8"
    assert by[("lins-planner-compressed", 1)]["steps"] < exact_steps  # smoothed: a step or so after `first`
    assert by[("lins-planner-compressed", 1)]["steps"] >= first
    assert by[("lins-planner-compressed", 1)]["seconds"] == by[("lins-planner-compressed", 1)]["steps"] * 0.5
    assert by[("lins-planner-compressed", 4)]["run"] is None and by[("lins-planner-compressed", 4)]["formats"] == "grads=bf16"
    assert by[("ddp-bf16-hook", 1)]["run"] == "ddp-bf16-hook-seed0"
    assert by[("ddp-powersgd", 1)]["steps"] is None and by[("ddp-powersgd", 1)]["seconds"] is None

    results = tmp_path / "results"
    results.mkdir()
    for r in runs:
        (results / f"{r['name']}.json").write_text(json.dumps(r))
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    doc = tmp_path / "convergence.md"
    report(results, doc, cluster=tmp_path / "cluster.json")
    text = doc.read_text()
    assert "## Time to loss on the emulated cluster" in text
    assert f"| 1 | lins-planner | unlimited | `p=1,g=4,os=8` | `exact` | fp32-seed0 | {exact_steps} | 2.000 | {exact_steps * 2:.0f} |" in text
    assert f"| 1 | ddp-powersgd | unlimited | `-` | `ddp powerSGD rank 4` | ddp-powersgd-seed0 | > {steps} | 0.750 | > {steps * 0.75:.0f} |" in text
    assert "| 4 | lins-planner-compressed | unlimited | `p=1,g=4,os=8` | `grads=bf16` | - | no run | 1.500 | - |" in text

    # A later benchmark run follows the committed one, under its own path and a sub-heading.
    later = json.loads(json.dumps(cluster))
    later["strategies"] = [_bench_row("lins-planner", 1, "exact", 4.0)]
    (tmp_path / "later.json").write_text(json.dumps(later))
    report(results, doc, cluster=tmp_path / "cluster.json", more_clusters=[tmp_path / "later.json"])
    text = doc.read_text()
    first, second = text.split("### Time to loss in the run " + tmp_path.name)
    assert "## Time to loss on the emulated cluster" in first and f"(`{tmp_path / 'later.json'}`:" in second
    assert f"| 1 | lins-planner | unlimited | `p=1,g=4,os=8` | `exact` | fp32-seed0 | {exact_steps} | 4.000 | {exact_steps * 4:.0f} |" in second
    assert "2.000" not in second
