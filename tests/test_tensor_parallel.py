"""Lins on a 3-D mesh: tensor parallelism inside the node, P / G / OS over the
data-parallel ranks. The tiny model runs torchtitan's LLaMA TP plan (column / row
parallel projections, sequence-parallel norms whose replicated weights get Partial
gradients, uneven TP and data-parallel chunks) and must train like plain FSDP2 + TP
and like one process on the union of the data-parallel ranks' batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distributed import run
from lins_dtensor import LinsError, LinsPlan, LinsPlanError, valid_plans
from scenarios import FsdpRun, LinsRun, hooks_after_to_empty, reference, train_fsdp, train_lins
from test_runtime import worst_rel_err

STEPS = 3
MODEL = {"n_heads": 4}  # 2 heads per TP rank
WORLD4_PLANS = [str(p) for p in valid_plans(2, 1)]  # 2 nodes x 2 ranks, tp 2: one DP rank per node
WORLD8_PLANS = ["p=1,g=2,os=4", "p=2,g=4,os=4", "fsdp"]  # 2 nodes x 4, tp 2: P replicated, in the node, across nodes


def _configs(plans: list[str], ranks_per_node: int, microbatches=(1, 2), **extra) -> list[LinsRun]:
    return [LinsRun(p, m, STEPS, ranks_per_node, tp=2, mode="told", model_kwargs=MODEL, **extra) for p in plans for m in microbatches]


@pytest.fixture(scope="module")
def world4():
    """Every plan, M in {1, 2}; and torchtitan's way of building: on the meta device,
    tensor-parallelised, sharded, then to_empty (which swaps DTensor parameters in
    place) and a full state dict loaded, with P replicated (no FSDP2) and sharded."""
    configs = _configs(WORLD4_PLANS, 2) + _configs(["p=1,g=1,os=2", "p=2,g=2,os=2"], 2, microbatches=(1,), init="meta")
    lins = run(train_lins, 4, configs + BF16_CONFIGS)
    fsdp_cfgs = [FsdpRun(2, m, STEPS, 2, model_kwargs=MODEL, tp=2) for m in (1, 2)]
    fsdp = run(train_fsdp, 4, fsdp_cfgs + [dataclasses.replace(fsdp_cfgs[0], param_dtype=torch.bfloat16)])
    refs = {m: reference(2, m, STEPS, model_kwargs=MODEL) for m in (1, 2)}
    return lins, fsdp, refs


# bf16 parameters (torchtitan's default) with P replicated and sharded, and built on the
# meta device: each rank's TP slice must be stored and computed in bf16.
BF16_CONFIGS = (_configs(["p=1,g=1,os=2", "p=2,g=2,os=2"], 2, microbatches=(1,), param_dtype=torch.bfloat16)
                + _configs(["p=1,g=2,os=2"], 2, microbatches=(1,), param_dtype=torch.bfloat16, init="meta"))


def _fp32(runs: list[dict]) -> list[dict]:
    return [r for r in runs if r["config"].param_dtype is None]


@pytest.fixture(scope="module")
def world8():
    lins = run(train_lins, 8, _configs(WORLD8_PLANS, 4))
    fsdp = run(train_fsdp, 8, [FsdpRun(4, m, STEPS, 4, model_kwargs=MODEL, tp=2) for m in (1, 2)])
    refs = {m: reference(4, m, STEPS, model_kwargs=MODEL) for m in (1, 2)}
    return lins, fsdp, refs


def _check_parity(lins: list[dict], fsdp: list[dict], refs: dict, tol: float) -> None:
    """``tol``: the bar of the parity tests without TP (test_runtime): 1e-5 at world 4;
    3e-5 at world 8, where stock FSDP2 + TP itself is 1.0e-5 from one process (Adam
    amplifies the reassociated sums of 4 ranks' gradients on a small second moment)."""
    lins, fsdp = _fp32(lins), _fp32(fsdp)
    fsdp_by_m = {r["config"].microbatches: r["params"] for r in fsdp}
    for r in fsdp:  # the baseline itself: TP's split matmuls reassociate sums, nothing more
        assert worst_rel_err(r["params"], refs[r["config"].microbatches]) < tol
    for r in lins:
        cfg, m = r["config"], r["config"].microbatches
        what = f"{cfg.plan} tp=2 M={m}"
        assert r["masters"].keys() == fsdp_by_m[m].keys(), what
        assert worst_rel_err(r["masters"], fsdp_by_m[m]) < tol, what
        assert worst_rel_err(r["masters"], refs[m]) < tol, what
        for name, value in r["params"].items():  # P holds the masters' values
            assert torch.equal(value, r["masters"][name]), f"{what}: {name}"
        assert r["frozen_unchanged"], what
        # Bytes and memory: what the schedule predicts from the TP slices, on every rank.
        for rank, mine in enumerate(r["per_rank"]):
            assert mine["bytes_match"], f"{what} rank {rank}: {mine['counted']} != {mine['predicted']}"
            assert mine["memory"]["params"] == mine["memory_expected"]["params"], f"{what} rank {rank}"
            assert mine["memory"]["grads"] == mine["memory_expected"]["grads"], f"{what} rank {rank}"


def test_world4_every_plan_matches_fsdp2_tp_and_one_process(world4):
    lins, fsdp, refs = world4
    assert len(_fp32(lins)) == 2 * len(WORLD4_PLANS) + 2 == 10
    _check_parity(lins, fsdp, refs, 1e-5)


def test_world4_bf16_error_is_within_fsdp2_tp_bf16_error(world4):
    """bf16 rounds every matmul input, so the bar is the non-TP one (test_runtime): at
    most 1.5x FSDP2 + TP's bf16 error from the fp32 reference plus 1e-3, below 5 %."""
    lins, fsdp, refs = world4
    fsdp_err = worst_rel_err(next(r for r in fsdp if r["config"].param_dtype)["params"], refs[1])
    assert fsdp_err > 1e-5, "the bf16 baseline did not compute in bf16"
    bf16 = [r for r in lins if r["config"].param_dtype]
    assert len(bf16) == len(BF16_CONFIGS)
    for r in bf16:
        what = f"{r['config'].plan} bf16 init={r['config'].init}"
        assert r["param_dtypes"] == {"torch.bfloat16"}, what
        err = worst_rel_err(r["masters"], refs[1])
        assert err <= 1.5 * fsdp_err + 1e-3 and err < 0.05, f"{what}: {err:.2e} vs FSDP2 + TP {fsdp_err:.2e}"


@pytest.mark.slow
def test_world8_plans_match_fsdp2_tp_and_one_process(world8):
    lins, fsdp, refs = world8
    assert len(lins) == 2 * len(WORLD8_PLANS)
    _check_parity(lins, fsdp, refs, 3e-5)


def test_masters_are_dtensors_of_the_whole_parameter(world4):
    """Masters keep the model's full shapes (what DCP reshards by), placed on the 5-D
    mesh with TP's placement first: a column-parallel weight Shard(0) by TP, a
    row-parallel one Shard(1), a sequence-parallel norm replicated over TP."""
    lins, _, refs = world4
    s0, s1, rep = "S(0)", "S(1)", "R"  # str() of Shard(0), Shard(1), Replicate()
    for r in lins:
        assert {k: v.shape for k, v in r["masters"].items()} == {k: refs[1][k].shape for k in r["masters"]}
        placements = r["master_placements"]
        os_dims = (rep, s0, s0, s0)  # optim_replica, param_shard, grad_shard, optim_shard
        assert placements["layers.0.attention.wq.weight"] == (s0, *os_dims)
        assert placements["layers.0.feed_forward.w2.weight"] == (s1, *os_dims)
        assert placements["layers.1.ffn_norm.weight"] == (rep, *os_dims)
        assert placements["layers.0.attention.head_gain"] == (s0, *os_dims)


def test_user_hooks_after_to_empty_keep_firing():
    """Lins re-arms its gradient hooks after to_empty without removing anyone else's:
    a hook registered after to_empty fires once per backward, with and without TP."""
    assert run(hooks_after_to_empty, 4, [1, 2]) == [[2] * 4, [2] * 4]


def _mesh_errors() -> list[str]:
    import torch.distributed as dist

    from lins_dtensor import build_lins_mesh

    out = []
    for plan, kwargs in [("p=2,g=2,os=2", dict(tp=3, ranks_per_node=2)), ("p=4,g=4,os=4", dict(tp=2, ranks_per_node=4)),
                         ("p=1,g=1,os=1", dict(tp=0, ranks_per_node=4))]:
        try:
            build_lins_mesh(LinsPlan.parse(plan, dist.get_world_size() // max(kwargs["tp"], 1)), device_type="cpu", **kwargs)
            out.append("")
        except LinsError as e:
            out.append(f"{type(e).__name__}: {e}")
    # A TP model and a Lins mesh without a TP dim, or with one the model was not
    # parallelised on (torchtitan's own world mesh, say).
    from torch.distributed.device_mesh import init_device_mesh

    from lins_dtensor import apply_lins
    from tiny_llama import build_model, tensor_parallelize

    other_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    for tp in (1, 2):
        mesh = build_lins_mesh(LinsPlan(1, 1, 1), ranks_per_node=4, device_type="cpu", tp=tp)
        try:
            apply_lins(tensor_parallelize(build_model(n_heads=4), other_tp), mesh)
            out.append("")
        except LinsError as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_bad_tp_layouts_are_one_line_errors():
    errors = run(_mesh_errors, 4)
    assert all(e and "\n" not in e for e in errors), errors
    assert errors[0].startswith("LinsPlanError: lins: tp=3 must divide ranks_per_node=2")
    assert errors[1].startswith("LinsPlanError: lins: optim=4 must divide the 2 data-parallel ranks (world_size / tp=2)")
    assert errors[2].startswith("LinsUsageError: lins: tp=0 must be a positive integer")
    assert errors[3].startswith("LinsUsageError: lins: parameter ")
    assert "is a DTensor (tensor parallelism?) but the Lins mesh has no TP dim" in errors[3]
    assert errors[4].startswith("LinsUsageError: lins: parameter ")
    assert "not on the Lins mesh's 'tp' dim: parallelise the model on mesh.tp_mesh()" in errors[4]


def test_hpz_with_tp_is_refused_by_the_plan_rules():
    LinsPlan.parse("hpz:2", 8).validate(8, 4)  # without TP: valid
    with pytest.raises(LinsPlanError, match=r"reshard_after_forward=2 \(hpZ\) with tp=2: FSDP2 cannot re-shard"):
        LinsPlan.parse("hpz:2", 8).validate(8, 4, tp=2)
