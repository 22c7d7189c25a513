"""Checkpoints: DCP round trip and reload under another plan give identical next steps."""

from __future__ import annotations

import pytest
import torch

from checkpoint_scenarios import load_plain_state_dict, save_then_resume
from distributed import run


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step2")
    return run(save_then_resume, 4, path, "p=2,g=2,os=4", ["p=2,g=2,os=4", "p=1,g=2,os=4", "p=4,g=4,os=4", "ddp"])


def test_same_plan_round_trip_is_exact(resumed):
    loss, params = resumed["uninterrupted"]
    loss2, params2 = resumed["p=2,g=2,os=4"]
    assert loss2 == loss
    for name in params:
        assert torch.equal(params2[name], params[name]), name


@pytest.mark.parametrize("plan", ["p=1,g=2,os=4", "p=4,g=4,os=4", "ddp"])
def test_reload_under_another_plan(resumed, plan):
    loss, params = resumed["uninterrupted"]
    loss2, params2 = resumed[plan]
    assert loss2 == pytest.approx(loss, rel=1e-6)
    for name in params:
        err = ((params2[name] - params[name]).norm() / params[name].norm()).item()
        assert err < 1e-5, (plan, name, err)


def test_unsharded_state_dict_loads_into_sharded_model():
    assert run(load_plain_state_dict, 4, "p=2,g=4,os=4")
