"""torchtitan 0.3 integration: the trainer runs with Lins on 4 CPU ranks (gloo).

Runs only where torchtitan 0.3 is installed (``bash scripts/test_torchtitan_versions.sh
0.3.0`` makes such a venv); skips in the main 0.2.2 venv. Quick: settings Lins cannot
run with are refused in one line (from the config, and from the command line before
any process group exists); a run whose loss falls, with the start-up plan table and
the lins/* TensorBoard scalars. Slow: the fsdp preset and a Lins-only plan reproduce
torchtitan 0.3's own FSDP losses from one seed checkpoint (gradient accumulation,
clipping, activation checkpointing); a Lins-only run resumes from its checkpoint to
the uninterrupted losses; Lins + TP 2 against torchtitan's FSDP + TP 2.
"""
from __future__ import annotations

import shutil

import pytest

from titan_runs import require_torchtitan

require_torchtitan("0.3")  # the typed-config integration; tests/test_torchtitan.py covers 0.2.2

from titan_runs import base_args03, check, losses, scalars, texts, train03  # noqa: E402

LOSS_RTOL = 1e-5  # as tests/test_torchtitan.py: fp32, the same math, sums in another order


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """One tokenizer/corpus folder for every run (built once, by the first run)."""
    return tmp_path_factory.mktemp("assets")


def _config(**changes):
    from lins_dtensor.integrations.torchtitan03.config_registry import llama3_debug_cpu

    config = llama3_debug_cpu()
    for path, value in changes.items():
        section, name = path.split("__")
        setattr(getattr(config, section), name, value)
    return config


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"parallelism__spmd_backend": "spmd_types"}, "parallelism.spmd_backend = 'spmd_types': Lins keeps each parameter"),
        ({"parallelism__pipeline_parallel_degree": 2}, "parallelism.pipeline_parallel_degree = 2: lins.enable = true composes"),
        ({"parallelism__data_parallel_replicate_degree": 2}, "parallelism.data_parallel_replicate_degree = 2: Lins shards"),
        ({"lins__plan": "p=3,g=3,os=3"}, "lins.plan = 'p=3,g=3,os=3' (p=3,g=3,os=3) on 4 ranks, 2 per node: optim=3 must divide"),
        ({"lins__grad_dtype": "float16"}, "lins.grad_dtype = 'float16': must be one of"),
        ({"parallelism__tensor_parallel_degree": 4}, "parallelism.tensor_parallel_degree = 4: must divide the 2 ranks per node"),
    ],
)
def test_settings_lins_cannot_run_with_are_refused_in_one_line(monkeypatch, changes, expected):
    from lins_dtensor.integrations.titan_common.plan import LinsConfigError, check_config
    from lins_dtensor.integrations.torchtitan03.job import titan_job

    monkeypatch.setenv("WORLD_SIZE", "4")
    config = _config(**changes)
    with pytest.raises(LinsConfigError) as error:
        check_config(titan_job(config, config.lins))
    assert str(error.value).startswith("lins: " + expected) and "\n" not in str(error.value), str(error.value)


def test_quantized_models_are_refused_in_one_line(monkeypatch):
    """torchtitan's float8 configs need torchao (not installed here): the model spec is
    declared quantized instead, through the check the refusal uses."""
    from lins_dtensor.integrations.titan_common.plan import LinsConfigError, check_config
    from lins_dtensor.integrations.torchtitan03 import job

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(job, "has_quantization", lambda model_config: True)
    config = _config()
    with pytest.raises(LinsConfigError, match="^lins: model_spec: the model has float8 / quantized linears") as error:
        check_config(job.titan_job(config, config.lins))
    assert "\n" not in str(error.value)


def test_with_lins_keeps_torchtitans_settings_and_uses_the_whole_loss():
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.models.llama3 import config_registry

    from lins_dtensor.integrations.torchtitan03.config_registry import llama3_8b

    titan, lins = config_registry.llama3_8b(), llama3_8b()
    assert isinstance(titan.loss, ChunkedLossWrapper.Config) and isinstance(lins.loss, CrossEntropyLoss.Config)
    assert lins.lins.plan == "auto" and lins.parallelism.spmd_backend == "partial_dtensor"
    assert (lins.training, lins.dataloader, lins.checkpoint) == (titan.training, titan.dataloader, titan.checkpoint)


@pytest.mark.timeout(300)
def test_wrong_value_on_the_command_line_stops_at_startup(tmp_path, assets):
    """The check runs before any process group exists: one process that believes it is
    rank 0 of 4 is enough."""
    proc = train03(base_args03(tmp_path, assets, 2, "--lins.plan", "zero4"), nproc=1, timeout=240,
                   extra_env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lins: error:")]
    assert errors == [errors[0]] and "lins.plan = 'zero4'" in errors[0] and "presets" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(900)
def test_end_to_end_loss_falls_with_plan_table_and_lins_scalars(tmp_path, assets):
    dump = tmp_path / "run"
    proc = check(train03(base_args03(dump, assets, 5, "--lins.plan", "p=2,g=4,os=4", "activation-checkpoint:none")))
    loss = losses(dump)
    assert sorted(loss) == [1, 2, 3, 4, 5]
    assert loss[5] < loss[1] - 0.1, loss
    log = proc.stdout + proc.stderr
    assert "Lins: plan p=2,g=4,os=4 on 4 ranks (2 per node)" in log and "ZeRO-3/FSDP" in log, log[-3000:]
    tags = scalars(dump)
    for tag in ("lins/comm_seconds", "lins/memory/params", "lins/memory/grads", "lins/memory/optim",
                "lins/step_s_measured", "lins/step_s_predicted"):
        assert tag in tags, sorted(tags)
    assert any(t.startswith("lins/bytes/grads/") and t.endswith("/inter") for t in tags), sorted(tags)
    assert "p=2,g=4,os=4" in texts(dump).get("lins/plan/text_summary", "")


# ----- slow: parity with torchtitan 0.3's FSDP, resume, TP ---------------------------------


def _parity_args(dump, assets, seed, steps, *extra, interval=1000):
    # Gradient accumulation (global batch 16 = 2 micro-batches x 2 seqs x 4 ranks),
    # clipping that bites, selective AC.
    return base_args03(dump, assets, steps, "--training.global_batch_size", "16", "--training.max_norm", "0.5",
                       "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
                       "--checkpoint.interval", str(interval), *extra)


@pytest.fixture(scope="module")
def seed_checkpoint(tmp_path_factory, assets):
    """torchtitan's seed checkpoint: one process, unsharded model, step 0."""
    dump = tmp_path_factory.mktemp("seed")
    check(train03(base_args03(dump, assets, 1, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint"), nproc=1,
                  timeout=400))
    return dump / "checkpoint" / "step-0"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, assets, seed_checkpoint):
    """torchtitan 0.3's own FSDP (``--lins.no-enable``) from the seed checkpoint."""
    dump = tmp_path_factory.mktemp("fsdp")
    check(train03(_parity_args(dump, assets, seed_checkpoint, 4, "--lins.no-enable")))
    return losses(dump), scalars(dump)["grad_norm"]


def _assert_close(got: dict, want: dict, rtol: float):
    assert sorted(got) == sorted(want)
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= rtol, f"max relative difference {worst:.2e} > {rtol:.0e}\n lins {got}\n fsdp {want}"


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("plan", ["fsdp", "p=1,g=2,os=4"])
def test_matches_torchtitan_fsdp_from_seed_checkpoint(tmp_path, assets, seed_checkpoint, fsdp_run, plan):
    check(train03(_parity_args(tmp_path, assets, seed_checkpoint, 4, "--lins.plan", plan)))
    want_loss, want_norm = fsdp_run
    _assert_close(losses(tmp_path), want_loss, LOSS_RTOL)
    _assert_close(scalars(tmp_path)["grad_norm"], want_norm, LOSS_RTOL)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_lins_only_plan_resumes_to_the_uninterrupted_losses(tmp_path, assets, seed_checkpoint):
    """p=1,g=2,os=4 (a layout torchtitan cannot express), checkpoint every 2 steps, 4
    steps; then step-4 is removed and the same command resumes from step-2: steps 3-4
    give the uninterrupted losses (model, optimizer, LR schedule and data loader restored)."""
    dump = tmp_path / "run"
    args = _parity_args(dump, assets, seed_checkpoint, 4, "--lins.plan", "p=1,g=2,os=4", interval=2)
    check(train03(args))
    want = losses(dump)
    shutil.rmtree(dump / "checkpoint" / "step-4")
    shutil.rmtree(dump / "tb")
    proc = check(train03(args))
    assert "Training starts at step 3" in proc.stdout + proc.stderr
    _assert_close(losses(dump), {s: want[s] for s in (3, 4)}, 1e-6)


TP2 = ("--parallelism.tensor_parallel_degree", "2")


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("plan", ["fsdp", "p=1,g=2,os=2"])
def test_tp2_matches_torchtitan_fsdp_tp_from_seed_checkpoint(tmp_path, assets, seed_checkpoint, plan):
    """World 4 = TP 2 x 2 data-parallel ranks; torchtitan's own FSDP + TP 2 (declared
    per module in 0.3) is the reference."""
    fsdp_tp = tmp_path / "fsdp_tp"
    check(train03(_parity_args(fsdp_tp, assets, seed_checkpoint, 2, "--lins.no-enable", *TP2)))
    lins = tmp_path / "lins"
    proc = check(train03(_parity_args(lins, assets, seed_checkpoint, 2, "--lins.plan", plan, *TP2)))
    assert "tensor parallel 2 x 2 data-parallel ranks" in proc.stdout + proc.stderr
    _assert_close(losses(lins), losses(fsdp_tp), LOSS_RTOL)
    _assert_close(scalars(lins)["grad_norm"], scalars(fsdp_tp)["grad_norm"], LOSS_RTOL)
