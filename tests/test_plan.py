"""LinsPlan: text form, presets and the rules (no process group needed)."""

from __future__ import annotations

import pytest

from lins_dtensor import LinsPlan, LinsPlanError, valid_plans

pytestmark = pytest.mark.quick  # in one process


def test_parse_text_and_round_trip():
    plan = LinsPlan.parse("p=4, g=4, os=8")
    assert (plan.params, plan.grads, plan.optim, plan.reshard_after_forward) == (4, 4, 8, True)
    assert LinsPlan.parse(str(plan)) == plan
    hpz = LinsPlan.parse("p=8,g=8,os=8,hpz=4")
    assert hpz.reshard_after_forward == 4 and str(hpz) == "p=8,g=8,os=8,hpz=4"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("ddp", (1, 1, 1)),
        ("zero1", (1, 1, 8)),
        ("zero2", (1, 8, 8)),
        ("zero3", (8, 8, 8)),
        ("fsdp", (8, 8, 8)),
        ("hsdp:4", (4, 4, 4)),
        ("mics:2", (2, 2, 2)),
        ("hpz:4", (8, 8, 8)),
    ],
)
def test_presets(text, expected):
    plan = LinsPlan.parse(text, world_size=8)
    assert (plan.params, plan.grads, plan.optim) == expected
    plan.validate(8, 4)
    assert (plan.reshard_after_forward == 4) == text.startswith("hpz")


@pytest.mark.parametrize(
    "text, world, message",
    [
        ("zero9", 8, "expected 'p=<s_p>"),
        ("hsdp", 8, "must be written 'hsdp:<k>'"),
        ("zero1:2", 8, "must be written 'zero1'"),
        ("fsdp", None, "needs world_size"),
        ("p=2,g=2", 8, "missing os"),
        ("p=x,g=2,os=2", 8, "not a positive integer"),
    ],
)
def test_parse_errors_name_the_problem(text, world, message):
    with pytest.raises(LinsPlanError, match=message):
        LinsPlan.parse(text, world)


@pytest.mark.parametrize(
    "plan, world, rpn, message",
    [
        (LinsPlan(2, 2, 3), 6, 6, "factors must nest"),
        (LinsPlan(4, 2, 8), 8, 4, "factors must nest"),
        (LinsPlan(1, 1, 16), 8, 4, "optim=16 must divide world_size=8"),
        (LinsPlan(1, 1, 8), 8, 3, "ranks_per_node=3 must be >= 1 and divide world_size=8"),
        (LinsPlan(1, 6, 12), 24, 4, "grads=6 must divide ranks_per_node=4 or be a multiple"),
        (LinsPlan(0, 1, 1), 8, 4, "params=0 must be a positive integer"),
        (LinsPlan(8, 8, 8, reshard_after_forward=3), 8, 4, "reshard_after_forward=3"),
        (LinsPlan(4, 4, 4, reshard_after_forward=4), 8, 4, "reshard_after_forward=4"),
        (LinsPlan(4, 4, 8, reshard_after_forward=2), 8, 4, "needs params == world_size=8"),
    ],
)
def test_validate_names_rule_and_values(plan, world, rpn, message):
    with pytest.raises(LinsPlanError, match=message):
        plan.validate(world, rpn)


def test_valid_plans_counted_by_hand():
    # N=4, 2 ranks/node: factors {1,2,4}; nested chains s_p <= s_g <= s_os: 10.
    assert len(valid_plans(4, 2)) == 10
    # ... plus (4,4,4) re-sharded to 2 after forward.
    assert len(valid_plans(4, 2, with_hpz=True)) == 11
    # N=6, 6 ranks/node: divisors {1,2,3,6}; chains by divisibility: 1|1|{1,2,3,6}=4,
    # 1|2|{2,6}=2, 1|3|{3,6}=2, 1|6|6=1, 2|2|{2,6}=2, 2|6|6=1, 3|3|{3,6}=2, 3|6|6=1, 6|6|6=1.
    assert len(valid_plans(6, 6)) == 16
    # N=8, 2 ranks/node: factors 1,2,4,8 all node-aligned: C(4+2, 3) = 20.
    assert len(valid_plans(8, 2)) == 20
    # N=24, 4/node: 3, 6, 12 neither divide 4 nor are multiples of it.
    assert all(getattr(p, s) not in (3, 6) for p in valid_plans(24, 4) for s in ("params", "grads", "optim"))


def test_split_in_node_times_nodes():
    assert LinsPlan(8, 8, 32).split(8) == {"params": (8, 1), "grads": (8, 1), "optim": (8, 4)}
    assert LinsPlan(1, 4, 8).split(8) == {"params": (1, 1), "grads": (4, 1), "optim": (8, 1)}
