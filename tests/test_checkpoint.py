"""Checkpoints: DCP round trip and reload under another plan give identical next steps;
with tensor parallelism, under another plan, another tp degree and plain FSDP2 + TP;
through torch's state-dict API with param groups, under another plan and FSDP2 and back."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from checkpoint_scenarios import TP_MODEL, in_one_launch, load_plain_state_dict, save_then_resume, through_torch_state_dict_api
from distributed import run
from tiny_llama import build_model

PLANS = ["p=2,g=2,os=4", "p=1,g=2,os=4", "p=4,g=4,os=4", "ddp"]
TP_SAVE = ("p=1,g=1,os=2", 2)  # world 4 = 2 nodes x 2 ranks: 2 data-parallel ranks, one per node
TP_LOADS = [("p=2,g=2,os=2", 2), ("p=2,g=4,os=4", 1), ("p=1,g=2,os=4", 1), ("fsdp", 2)]
FSDP_TO_LINS = ("p=2,g=2,os=2", 2)
PLAIN_LOADS = [(("p=2,g=4,os=4", 1), {}), (("p=2,g=2,os=2", 2), TP_MODEL), (("p=1,g=1,os=2", 2), TP_MODEL)]
# torch's state-dict API: saved by Lins with two param groups, loaded (layout, how) as
# through_torch_state_dict_api says; FSDP2's own checkpoint goes back into TORCH_API_BACK.
TORCH_API_SAVE = ("p=2,g=2,os=4", 1)
TORCH_API_LOADS = [(("p=1,g=2,os=4", 1), "sharded"), (("p=4,g=4,os=4", 1), "full"),
                   (("p=1,g=1,os=4", 1), "full state dicts"), (("fsdp", 1), "sharded")]
TORCH_API_BACK = ("p=2,g=4,os=4", 1)
TRAINABLE_TP = {n for n, p in build_model(**TP_MODEL).named_parameters() if p.requires_grad}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The three scenarios in one launch of 4 ranks. In the TP one every layout trains on
    the batches of 2 data shards (the TP save's 2 data-parallel ranks; at tp=1 two ranks
    share each), so all see the same global batch."""
    path = tmp_path_factory.mktemp("ckpt")
    return run(in_one_launch, 4, [
        partial(save_then_resume, str(path / "plans"), (PLANS[0], 1), [(p, 1) for p in PLANS]),
        partial(save_then_resume, str(path / "tp"), TP_SAVE, TP_LOADS, model_kwargs=TP_MODEL, data_ranks=2,
                fsdp_round_trip=FSDP_TO_LINS),
        partial(load_plain_state_dict, PLAIN_LOADS),
        partial(through_torch_state_dict_api, str(path / "torch_api"), TORCH_API_SAVE, TORCH_API_LOADS, TORCH_API_BACK),
    ])


@pytest.fixture(scope="module")
def resumed(launched):
    return launched[0]


@pytest.fixture(scope="module")
def resumed_tp(launched):
    return launched[1]


def test_same_plan_round_trip_is_exact(resumed):
    loss, params = resumed["uninterrupted"]
    loss2, params2 = resumed[PLANS[0], 1]
    assert loss2 == loss
    for name in params:
        assert torch.equal(params2[name], params[name]), name


@pytest.mark.parametrize("plan", PLANS[1:])
def test_reload_under_another_plan(resumed, plan):
    loss, params = resumed["uninterrupted"]
    loss2, params2 = resumed[plan, 1]
    assert loss2 == pytest.approx(loss, rel=1e-6)
    for name in params:
        err = _rel_err(params2[name], params[name])
        assert err < 1e-5, (plan, name, err)


@pytest.mark.parametrize("layout", TP_LOADS + [(TP_LOADS[-1], "round trip")], ids=str)
def test_tp_checkpoint_reloads_under_another_plan_tp_degree_and_fsdp2(resumed_tp, layout):
    """Saved by Lins p=1,g=1,os=2 with tp=2 after 2 steps; loaded under another plan
    with tp=2, under two plans with tp=1, into FSDP2 + TP, and from there (FSDP2's own
    checkpoint, _StridedShard placements and all) back into Lins + TP: step 3 matches
    the uninterrupted run. The bar is the one without TP; measured worst errors: 0 at
    tp=2 (Lins and the FSDP2 round trip), 2.9e-8 at tp=1 and 1.8e-8 in FSDP2 + TP, where
    whole matmuls and FSDP2's reductions reassociate the sums; the losses are equal."""
    loss, params = resumed_tp["uninterrupted"]
    loss2, params2 = resumed_tp[layout]
    assert params2.keys() == params.keys() == TRAINABLE_TP
    assert loss2 == pytest.approx(loss, rel=1e-6)
    for name in params:
        err = _rel_err(params2[name], params[name])
        assert err < 1e-5, (layout, name, err)


@pytest.mark.parametrize("case", range(len(PLAIN_LOADS)), ids=[str(layout) for layout, _ in PLAIN_LOADS])
def test_unsharded_state_dict_loads_into_sharded_and_tp_models(launched, case):
    assert launched[2][case], PLAIN_LOADS[case]


@pytest.mark.parametrize("case", TORCH_API_LOADS + [(TORCH_API_BACK, "from fsdp")], ids=str)
def test_torch_state_dict_api_round_trips_lins_with_param_groups(launched, case):
    """get_state_dict / set_state_dict (sharded, full_state_dict with cpu_offload, and
    full state dicts on every rank) on a Lins model and lins_optimizer with two param
    groups, through DCP: under another plan, into plain FSDP2 + torch.optim.AdamW and
    from FSDP2's checkpoint back into Lins, step 3 matches the uninterrupted run and
    the groups' weight decays are the checkpoint's, not the fresh optimizer's."""
    results = launched[3]
    loss, params, decays = results["uninterrupted"]
    loss2, params2, decays2 = results[case]
    assert decays == [0.1, 0.0] and decays2 == decays, (case, decays2)
    assert params2.keys() == params.keys() and params
    assert loss2 == pytest.approx(loss, rel=1e-6)
    for name in params:
        err = _rel_err(params2[name], params[name])
        assert err < 1e-5, (case, name, err)
