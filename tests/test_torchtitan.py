"""torchtitan integration: the trainer runs with Lins on 4 CPU ranks (gloo).

Quick (unmarked): a wrong [lins] value stops the run with a one-line message, and one
end-to-end run, launched by torchrun, whose loss falls and whose TensorBoard has the
lins/* scalars. Slow: parity with torchtitan's own FSDP from one seed checkpoint
(fsdp preset and a Lins-only plan, with activation checkpointing, gradient
accumulation and clipping), bf16 mixed precision, a worker killed mid-step (the job
ends naming it) and one killed while a checkpoint is being written (each job resumed
to the uninterrupted losses), a stopped worker ending the job by the train timeout,
and tensor parallelism: Lins + TP 2 against torchtitan's FSDP + TP 2, and a checkpoint
saved under one (plan, TP) resumed under another at world 8. The fault tests run
under torchrun; the other jobs fork their ranks from the tests' preloaded server
(titan_runs.train), which runs the same trainer main().
"""
from __future__ import annotations

import glob
import re
import shutil
import signal
import statistics
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan_runs import require_torchtitan

require_torchtitan("0.2")  # the TOML integration; tests/test_torchtitan03.py covers 0.3

from titan_runs import base_args, check, held_line, losses, printed_losses, scalars, stop_one_worker, texts, train

# Parity tolerance. Both runs start from the same seed checkpoint, see the same
# batches and do the same fp32 math; only the order of floating-point sums may differ
# (FSDP reduce-scatters each gradient over 4 ranks at once, Lins over its P group and
# then over the G/OS groups; the clipping norm is summed per OS shard). Measured here:
# losses bit-identical, grad norms within 1.5e-7 relative (one fp32 ulp). 1e-5 leaves
# room for other BLAS/thread counts, while a real bug (wrong divide factor, a missing
# shard, an unclipped or double-clipped step) moves the loss by > 1e-3 within 2 steps.
LOSS_RTOL = 1e-5
BF16_RTOL = 1e-4  # bf16 compute copy is the same rounding of the same fp32 masters
WEIGHT_RTOL = 1e-5  # fp32 weights after a few steps: summation order only


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """One tokenizer/corpus folder for every run (built once, by the first run)."""
    return tmp_path_factory.mktemp("assets")


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "override, key, rule",
    [
        ("plan=zero4", "[lins] plan = 'zero4'", "presets"),
        ("plan=p=3,g=3,os=3", "[lins] plan = 'p=3,g=3,os=3'", "must divide world_size=4"),
        ("grad_dtype=float16", "[lins] grad_dtype = 'float16'", "must be one of"),
    ],
)
def test_wrong_lins_value_stops_at_startup(tmp_path, assets, override, key, rule):
    name, value = override.split("=", 1)
    # The check runs before any process group exists: one process that believes it
    # is rank 0 of 4 is enough.
    proc = train(
        base_args(tmp_path, assets, 2, f"--lins.{name}", value),
        nproc=1,
        timeout=180,
        extra_env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lins: error:")]
    assert len(errors) == 1 and key in errors[0] and rule in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("model", "converters", ["float8"], "[model] converters = ['float8']: Lins shards plain tensors"),
        ("parallelism", "pipeline_parallel_degree", 2, "[parallelism] pipeline_parallel_degree = 2: [lins] enable = true composes"),
        ("parallelism", "tensor_parallel_degree", 3, "[training] seq_len = 2048: must be divisible by [parallelism] tensor_parallel_degree = 3"),
    ],
)
def test_settings_lins_cannot_run_with_are_refused_in_one_line(section, key, value, expected):
    from torchtitan.config import JobConfig

    from lins_dtensor.integrations.titan_common.plan import LinsConfigError, check_parallelism
    from lins_dtensor.integrations.titan_common.settings import Lins
    from lins_dtensor.integrations.torchtitan.plan import titan_job

    job_config = JobConfig()
    job_config.lins = Lins()
    setattr(getattr(job_config, section), key, value)
    with pytest.raises(LinsConfigError) as error:
        check_parallelism(titan_job(job_config))
    assert str(error.value).startswith("lins: " + expected) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    "tp, plan, expected",
    [
        (4, "fsdp", "[parallelism] tensor_parallel_degree = 4: must divide the 2 ranks per node"),
        (2, "p=2,g=2,os=8", "[lins] plan = 'p=2,g=2,os=8' (p=2,g=2,os=8) on 8 ranks, 2 per node, tensor_parallel_degree 2: "
                            "optim=8 must divide the 4 data-parallel ranks"),
        (2, "p=2,g=2,os=2,hpz=2", "[lins] plan = 'p=2,g=2,os=2,hpz=2'"),
    ],
)
def test_tensor_parallel_layouts_lins_cannot_run_are_refused_in_one_line(monkeypatch, tp, plan, expected):
    """The plan counts data-parallel ranks (world / tp) and TP stays inside a node."""
    from torchtitan.config import JobConfig

    from lins_dtensor.integrations.titan_common.plan import LinsConfigError, check_config
    from lins_dtensor.integrations.titan_common.settings import Lins
    from lins_dtensor.integrations.torchtitan.plan import titan_job

    monkeypatch.setenv("WORLD_SIZE", "8")
    job_config = JobConfig()
    job_config.lins = Lins(enable=True, plan=plan, ranks_per_node=2)
    job_config.parallelism.tensor_parallel_degree = tp
    with pytest.raises(LinsConfigError) as error:
        check_config(titan_job(job_config))
    assert str(error.value).startswith("lins: " + expected) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("reshard_after_forward", "sometimes", "[lins] reshard_after_forward = 'sometimes': must be one of 'plan', 'always', 'never'"),
        ("grad_dtype", "float16", "[lins] grad_dtype = 'float16': must be one of '', 'float32', 'bfloat16'"),
        ("hardware", "h300", "[lins] hardware = 'h300': unknown hardware preset 'h300'; known: a100-80gb,"),
    ],
)
def test_lins_keys_with_fixed_values_are_checked_in_one_line(monkeypatch, key, value, expected):
    """The Literal keys take only their values, and ``hardware`` only a planner preset."""
    from torchtitan.config import JobConfig

    from lins_dtensor.integrations.titan_common.plan import LinsConfigError, check_config
    from lins_dtensor.integrations.titan_common.settings import Lins
    from lins_dtensor.integrations.torchtitan.plan import titan_job

    monkeypatch.setenv("WORLD_SIZE", "4")
    job_config = JobConfig()
    job_config.lins = Lins(enable=True, plan="fsdp", ranks_per_node=2, **{key: value})
    with pytest.raises(LinsConfigError) as error:
        check_config(titan_job(job_config))
    assert str(error.value).startswith("lins: " + expected) and "\n" not in str(error.value), str(error.value)
    job_config.lins = Lins(enable=True, plan="fsdp", ranks_per_node=2, hardware="H100")  # a preset's alias, any case
    check_config(titan_job(job_config))


@pytest.mark.parametrize(
    "plan, formats, expected",
    [
        ("fsdp", "grads=int4", "[lins] comm_formats = 'grads=int4': unknown format 'int4'"),
        ("fsdp", "grads=int8|bf16", "[lins] comm_formats = 'grads=int8|bf16': one format per kind"),
        ("auto", "weights=bf16", "[lins] comm_formats = 'weights=bf16': expected 'kind[:level]=format'"),
    ],
)
def test_comm_formats_are_checked_in_one_line_before_any_collective(monkeypatch, plan, formats, expected):
    """With an explicit plan one format per kind and level; with plan = "auto" the
    formats the planner may choose from ('|')."""
    from torchtitan.config import JobConfig

    from lins_dtensor.integrations.titan_common.plan import LinsConfigError, allowed_formats, check_config
    from lins_dtensor.integrations.titan_common.settings import Lins
    from lins_dtensor.integrations.torchtitan.plan import titan_job

    monkeypatch.setenv("WORLD_SIZE", "4")
    job_config = JobConfig()
    job_config.lins = Lins(enable=True, plan=plan, ranks_per_node=2, comm_formats=formats)
    with pytest.raises(LinsConfigError) as error:
        check_config(titan_job(job_config))
    assert str(error.value).startswith("lins: " + expected) and "\n" not in str(error.value), str(error.value)
    job_config.lins = Lins(enable=True, plan="auto", ranks_per_node=2, comm_formats="grads=int8|bf16")
    check_config(titan_job(job_config))
    assert allowed_formats(titan_job(job_config)) == "grads=int8|bf16"


@pytest.mark.timeout(660)
def test_end_to_end_loss_falls_and_tensorboard_has_lins_scalars(tmp_path, assets):
    dump = tmp_path / "run"
    proc = check(train(base_args(dump, assets, 5, "--lins.plan", "p=2,g=4,os=4", "--activation_checkpoint.mode", "none"),
                       torchrun=True))
    loss = losses(dump)
    assert sorted(loss) == [1, 2, 3, 4, 5]
    assert loss[5] < loss[1] - 0.1, loss
    tags = scalars(dump)
    lins = {t for t in tags if t.startswith("lins/")}
    # p=2 < g=4 = os: params gathered over pairs, grads reduced on to 4 ranks.
    for tag in ("lins/comm_seconds", "lins/memory/params", "lins/memory/grads", "lins/memory/optim",
                "lins/step_s_measured", "lins/step_s_predicted"):
        assert tag in lins, sorted(lins)
    # Rank 0 warns once, after steps 2-4, iff their median is >25 % off the prediction,
    # and leaves the run's description for `lins-plan calibrate <tb dir>`.
    measured = statistics.median(tags["lins/step_s_measured"][s] for s in (2, 3, 4))
    off = abs(measured / tags["lins/step_s_predicted"][4] - 1) > 0.25
    log = proc.stdout + proc.stderr
    assert log.count("lins-plan calibrate") == int(off), (measured, tags["lins/step_s_predicted"][4])
    assert len(glob.glob(str(dump / "tb" / "*" / "lins_run.json"))) == 1
    assert any(t.startswith("lins/bytes/params/") for t in lins), sorted(lins)
    assert any(t.startswith("lins/bytes/grads/") for t in lins), sorted(lins)
    assert any(t.endswith("/inter") for t in lins if t.startswith("lins/bytes/")), sorted(lins)
    assert tags["lins/memory/optim"][5] > 0
    plan_text = texts(dump).get("lins/plan/text_summary", "")
    assert "p=2,g=4,os=4" in plan_text


# ----- slow: parity with torchtitan FSDP, bf16, resume --------------------------------


def _parity_args(dump, assets, seed, steps, *extra, interval=1000):
    # Gradient accumulation (global batch 16 = 2 micro-batches x 2 seqs x 4 ranks),
    # clipping that bites (grad norms are ~0.6-0.9), selective AC.
    return base_args(
        dump, assets, steps,
        "--training.global_batch_size", "16",
        "--training.max_norm", "0.5",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path", str(seed),
        "--checkpoint.interval", str(interval),
        *extra,
    )


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory, assets):
    """torchtitan's seed checkpoint: one process, unsharded model, step 0."""
    dump = tmp_path_factory.mktemp("seed")
    check(train(base_args(dump, assets, 1, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"), nproc=1, timeout=400))
    return dump / "checkpoint" / "step-0"


@pytest.fixture(scope="module")
def fsdp_losses(tmp_path_factory, assets, seed_checkpoint):
    """torchtitan's own LLaMA FSDP (model.name = llama3) from the seed checkpoint."""
    dump = tmp_path_factory.mktemp("fsdp")
    check(train(_parity_args(dump, assets, seed_checkpoint, 6, "--model.name", "llama3",
                             "--training.dataset_path", str(assets))))
    return losses(dump), scalars(dump)["grad_norm"]


@pytest.fixture(scope="module")
def lins_runs(tmp_path_factory, assets, seed_checkpoint):
    """``run(plan)``: the dump folder of Lins' 6-step parity job from the seed
    checkpoint, run once per plan for the parity and the resume tests."""
    dumps = {}

    def run(plan: str):
        if plan not in dumps:
            dump = tmp_path_factory.mktemp("lins")
            check(train(_parity_args(dump, assets, seed_checkpoint, 6, "--lins.plan", plan)))
            dumps[plan] = dump
        return dumps[plan]

    return run


def _assert_close(got: dict, want: dict, rtol: float):
    assert sorted(got) == sorted(want)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= rtol, f"max relative difference {worst:.2e} > {rtol:.0e}\n lins {got}\n fsdp {want}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("plan", ["fsdp", "p=1,g=2,os=4"])
def test_matches_torchtitan_fsdp_from_seed_checkpoint(lins_runs, fsdp_losses, plan):
    dump = lins_runs(plan)
    want_loss, want_norm = fsdp_losses
    _assert_close(losses(dump), want_loss, LOSS_RTOL)
    _assert_close(scalars(dump)["grad_norm"], want_norm, LOSS_RTOL)


def _model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model entries of a torchtitan DCP checkpoint, as full tensors."""
    whole = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, whole)
    return {k: v for k, v in torch.load(whole, weights_only=False).items() if k.endswith((".weight", ".bias"))}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_bf16_from_torchtitan_init_matches_torchtitan_hsdp(tmp_path, assets):
    """bf16 compute, fp32 model, no seed checkpoint: both jobs initialise the model on
    the meta device with the same seed and the same 2-way parameter shards (torchtitan
    HSDP 2 x 2, Lins p=2 over node pairs), so Lins' fp32 masters must start from the
    same fp32 weights torchtitan keeps, not from their bf16 rounding (which moves the
    weights by ~2e-3 relative). Losses agree to the bf16 tolerance; the weights after the
    first step (init + one AdamW update, whose sign-like size hides the gradients'
    summation order) agree to fp32 rounding."""
    bf16 = ("--training.mixed_precision_param", "bfloat16", "--training.mixed_precision_reduce", "float32")
    common = ("--training.global_batch_size", "16", "--training.max_norm", "0.5", "--checkpoint.enable",
              "--checkpoint.interval", "1", *bf16)
    hsdp, lins = tmp_path / "hsdp", tmp_path / "lins"
    check(train(base_args(lins, assets, 2, *common, "--lins.plan", "p=2,g=4,os=4")))  # builds the assets
    check(train(base_args(hsdp, assets, 2, *common, "--model.name", "llama3", "--training.dataset_path", str(assets),
                          "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2")))
    _assert_close(losses(lins), losses(hsdp), BF16_RTOL)
    want, got = _model_weights(hsdp / "checkpoint" / "step-1"), _model_weights(lins / "checkpoint" / "step-1")
    assert sorted(got) == sorted(want) and want
    worst = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in want)
    assert worst < WEIGHT_RTOL, f"weights after one step differ by {worst:.2e} relative"


# torchrun's failure report lists every failed rank; rank 1 there with SIGKILL's status
# (the first failure it reports may be a peer's "Connection closed by peer").
_KILLED_RANK_1 = re.compile(r"rank +: 1 \(local_rank: 1\)\n +exitcode +: -9 ")
RESUME_PLAN = "p=1,g=2,os=4"  # the config saves full checkpoints (model, optimizer, LR, data loader)


def _resume(dump, args, step: int) -> dict[int, float]:
    """Rerun the killed job's command: it must load checkpoint ``step-<step>`` and
    train on to step 6; returns the losses it logged."""
    shutil.rmtree(dump / "tb", ignore_errors=True)  # the killed run's (unflushed) events
    proc = check(train(args))
    log = proc.stdout + proc.stderr
    assert f"Loading the checkpoint from {dump / 'checkpoint' / f'step-{step}'}." in log, log[-3000:]
    assert f"Training starts at step {step + 1}" in log, log[-3000:]
    return losses(dump)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_worker_killed_mid_step_resumes_to_the_uninterrupted_losses(tmp_path, assets, seed_checkpoint, lins_runs):
    """Checkpoint every 3 steps; SIGKILL rank 1 in the middle of step 5. The job ends
    non-zero within 30 s naming the rank, with step-3 complete. Rerun, it resumes
    from step-3 and steps 4-6 give the uninterrupted run's losses (the LR schedule is
    fixed by total_steps = 6)."""
    want = losses(lins_runs(RESUME_PLAN))
    dump = tmp_path / "run"
    args = _parity_args(dump, assets, seed_checkpoint, 6, "--lins.plan", RESUME_PLAN, interval=3)
    (elapsed, returncode), output = stop_one_worker(args, after_line="step:  4", delay_s=0.3, sig=signal.SIGKILL)
    assert returncode != 0
    assert elapsed < 30, f"the job ran {elapsed:.0f} s after the worker died"
    assert _KILLED_RANK_1.search(output), output[-3000:]
    assert (dump / "checkpoint" / "step-3" / ".metadata").is_file()
    # Killed inside step 5 (not logged), on the uninterrupted run's path until then.
    before = printed_losses(output)
    assert sorted(before) == [1, 2, 3, 4], output[-3000:]
    assert all(abs(before[s] - want[s]) <= 1e-5 for s in before), (before, want)

    after = _resume(dump, args, 3)
    assert sorted(after) == [4, 5, 6]
    _assert_close(after, {s: want[s] for s in after}, 1e-6)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_kill_during_checkpoint_save_resumes_from_the_previous_checkpoint(tmp_path, assets, seed_checkpoint, lins_runs):
    """Checkpoint every 2 steps; SIGKILL rank 1 while step-4 is being written: after
    its data files, before rank 0 writes step-4/.metadata (DCP's last file). The job
    ends non-zero and step-4 is left partial. Rerun, it skips step-4 (torchtitan loads
    only folders with .metadata), loads step-2, trains on, writes a complete step-4
    over the partial one, and steps 3-6 give the uninterrupted run's losses."""
    want = losses(lins_runs(RESUME_PLAN))
    dump = tmp_path / "run"
    args = _parity_args(dump, assets, seed_checkpoint, 6, "--lins.plan", RESUME_PLAN, interval=2)
    (_, returncode), output = stop_one_worker(args, after_line=held_line("step-4", 1), delay_s=0,
                                              sig=signal.SIGKILL, hold_write_of="step-4")
    assert returncode != 0
    assert _KILLED_RANK_1.search(output), output[-3000:]
    checkpoints = dump / "checkpoint"
    assert (checkpoints / "step-2" / ".metadata").is_file()
    assert list((checkpoints / "step-4").glob("*.distcp")), output[-3000:]
    assert not (checkpoints / "step-4" / ".metadata").exists()

    after = _resume(dump, args, 2)
    assert sorted(after) == [3, 4, 5, 6]
    _assert_close(after, {s: want[s] for s in after}, 1e-6)
    assert (checkpoints / "step-4" / ".metadata").is_file()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stopped_worker_ends_the_job_by_the_train_timeout(tmp_path, assets):
    """SIGSTOP one worker in the middle of a step: with --comm.train_timeout_seconds 5 the
    job ends (non-zero) instead of hanging on Lins' groups, which used to wait 30 min;
    torchrun then kills the stopped worker after its SIGTERM grace (5 s here)."""
    args = base_args(tmp_path / "run", assets, 40, "--lins.plan", "p=1,g=2,os=4", "--comm.train_timeout_seconds", "5",
                     "--activation_checkpoint.mode", "none")
    (elapsed, returncode), output = stop_one_worker(args, after_line="step:  4", delay_s=0.3)
    assert returncode != 0
    assert elapsed < 45, f"the job ran {elapsed:.0f} s after the worker stopped"
    assert "Timed out waiting 5000ms" in output, output[-3000:]


# ----- slow: tensor parallelism ----------------------------------------------------------
TP2 = ("--parallelism.tensor_parallel_degree", "2")
TP_STEPS = 2


@pytest.fixture(scope="module")
def fsdp_tp_losses(tmp_path_factory, assets, seed_checkpoint):
    """torchtitan's own FSDP + TP 2 (2 data-parallel x 2 TP ranks, sequence and loss
    parallel) from the seed checkpoint."""
    dump = tmp_path_factory.mktemp("fsdp_tp")
    check(train(_parity_args(dump, assets, seed_checkpoint, TP_STEPS, "--model.name", "llama3", "--lins.no-enable",
                             "--training.dataset_path", str(assets), *TP2)))
    return losses(dump), scalars(dump)["grad_norm"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("plan", ["fsdp", "p=1,g=2,os=2"])
def test_tp2_matches_torchtitan_fsdp_tp_from_seed_checkpoint(tmp_path, assets, seed_checkpoint, fsdp_tp_losses, plan):
    """The fsdp preset is torchtitan's layout; p=1,g=2,os=2 (ZeRO-2 over the 2 data-
    parallel ranks) is one torchtitan cannot express. With 2 data-parallel ranks every
    gradient sum has two terms, whose order does not change an fp32 sum, so the bar is
    the same LOSS_RTOL as without TP (measured: identical losses, grad norms within
    one fp32 ulp)."""
    check(train(_parity_args(tmp_path, assets, seed_checkpoint, TP_STEPS, "--lins.plan", plan, *TP2)))
    want_loss, want_norm = fsdp_tp_losses
    _assert_close(losses(tmp_path), want_loss, LOSS_RTOL)
    _assert_close(scalars(tmp_path)["grad_norm"], want_norm, LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_tp2_checkpoint_saved_under_one_plan_resumes_under_another_at_world8(tmp_path, assets, seed_checkpoint):
    """World 8 (4 nodes x 2 ranks, TP 2 inside each: 4 data-parallel ranks). Saved at
    step 1 under the Lins-only plan p=1,g=2,os=4, then resumed under the fsdp preset
    (p=4,g=4,os=4): step 2 gives the uninterrupted run's loss."""
    dump = tmp_path / "run"
    args = _parity_args(dump, assets, seed_checkpoint, 2, *TP2, interval=1)
    check(train([*args, "--lins.plan", "p=1,g=2,os=4"], nproc=8))
    want = losses(dump)
    assert sorted(want) == [1, 2]
    shutil.rmtree(dump / "checkpoint" / "step-2")  # resume from step 1
    shutil.rmtree(dump / "tb", ignore_errors=True)
    proc = check(train([*args, "--lins.plan", "fsdp"], nproc=8))
    assert "Training starts at step 2" in proc.stdout + proc.stderr
    _assert_close(losses(dump), {2: want[2]}, LOSS_RTOL)
