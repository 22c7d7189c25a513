"""Shared, cached multi-process runs: each spawns its ranks once for many plans."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore", message=".*sequential all_gather operations.*")

from distributed import run  # noqa: E402
from scenarios import reference, train_fsdp, train_lins  # noqa: E402

from lins_dtensor import valid_plans  # noqa: E402

STEPS = 3
WORLD8_PLANS = ["p=1,g=1,os=8", "p=2,g=2,os=8", "p=2,g=4,os=8", "p=4,g=4,os=4", "p=8,g=8,os=8", "hpz:4"]
WORLD8_TOLD = ["p=1,g=1,os=8", "p=2,g=4,os=8", "hpz:4"]  # the overlapped executor: P replicated, in the node, hpZ
WORLD8_MICROBATCHES = (1, 2)


def _configs(plans, ranks_per_node, microbatches=(1, 3), **extra):
    return [dict(plan=str(p), microbatches=m, steps=STEPS, ranks_per_node=ranks_per_node, **extra) for p in plans for m in microbatches]


@pytest.fixture(scope="session")
def world4_runs():
    """Every valid plan at world 4 (2 nodes x 2 ranks), hpZ included, M in {1, 3}."""
    return run(train_lins, 4, _configs(valid_plans(4, 2, with_hpz=True), 2))


@pytest.fixture(scope="session")
def overlap_runs():
    """The last micro-batch reduced to the OS layout inside backward (paper's executor)."""
    plans = ["p=1,g=1,os=4", "p=1,g=2,os=4", "p=2,g=4,os=4", "hsdp:2"]
    return run(train_lins, 4, _configs(plans, 2, reduce_in_backward=True))


@pytest.fixture(scope="session")
def async_runs():
    """The overlapped executor as a trainer uses it: Lins told M up front, so the last
    micro-batch reduces during its backward and the update gathers run until the next
    forward; every valid plan at world 4, M in {1, 3}, with and without clipping. Plus
    the count learned from the previous step, a count told too small, and a byte bound
    that lets one chain run at a time."""
    plans = valid_plans(4, 2, with_hpz=True)
    configs = [c for clip in (True, False) for c in _configs(plans, 2, mode="told", clip=clip)]
    configs += _configs(["p=1,g=1,os=4", "p=1,g=2,os=4", "p=2,g=4,os=4", "fsdp"], 2, microbatches=(3,), mode="learned")
    configs += _configs(["p=1,g=2,os=4", "p=2,g=4,os=4"], 2, microbatches=(3,), mode="told", told_steps=2)
    configs += _configs(["p=1,g=2,os=4", "p=2,g=4,os=4", "ddp"], 2, mode="told", max_inflight_bytes=1)
    return run(train_lins, 4, configs)


@pytest.fixture(scope="session")
def tied_runs():
    """A GPT-2-shaped tree (blocks under transformer.layers) with the output head tied to
    the embedding, under the default units, and with units given as a block class."""
    tree = {"tied": True, "tree": "hf"}
    configs = _configs(["p=1,g=2,os=4", "p=2,g=4,os=4", "fsdp"], 2, microbatches=(3,), mode="told", model_kwargs=tree)
    configs += _configs(["p=2,g=2,os=4"], 2, microbatches=(3,), mode="told", model_kwargs=tree, units="Block")
    return run(train_lins, 4, configs), reference(4, 3, STEPS, model_kwargs=tree)


# Model trees whose blocks sit in nested containers (tests/tiny_llama.py's TREES).
NESTED_TREES = {"nanogpt": {"tied": True, "tree": "nanogpt"}, "lists": {"tree": "lists"}, "dicts": {"tree": "dicts"},
                "sequential": {"tree": "sequential"}}
NESTED_TREE_STEPS = 2


@pytest.fixture(scope="session")
def nested_tree_runs():
    """Each of NESTED_TREES under the default units, every valid plan at world 4 (hpZ
    included), M = 1, with its single-process reference."""
    plans = valid_plans(4, 2, with_hpz=True)
    configs = [{**c, "steps": NESTED_TREE_STEPS, "tree_name": name} for name, kwargs in NESTED_TREES.items()
               for c in _configs(plans, 2, microbatches=(1,), mode="told", model_kwargs=kwargs)]
    refs = {name: reference(4, 1, NESTED_TREE_STEPS, model_kwargs=kwargs) for name, kwargs in NESTED_TREES.items()}
    return run(train_lins, 4, configs), refs


PARAM_GROUP_STEPS = 2


@pytest.fixture(scope="session")
def param_group_runs():
    """lins_optimizer with two param groups of different weight decay, given as the
    parameters and as their names (alternating), every valid plan at world 4, M = 1; and
    torch.optim.AdamW in one process with the same groups (True) and with one (False)."""
    plans = valid_plans(4, 2, with_hpz=True)
    configs = [{**c, "steps": PARAM_GROUP_STEPS, "param_groups": ("params", "names")[i % 2]}
               for i, c in enumerate(_configs(plans, 2, microbatches=(1,), mode="told"))]
    refs = {groups: reference(4, 1, PARAM_GROUP_STEPS, param_groups=groups) for groups in (True, False)}
    return run(train_lins, 4, configs), refs


@pytest.fixture(scope="session")
def reinit_runs():
    """Parameters replaced under Lins: meta-device build + to_empty + a full state dict,
    and load_state_dict(assign=True), with P replicated (no FSDP2) and sharded."""
    plans = ["p=1,g=2,os=4", "p=2,g=2,os=4"]
    configs = [c for init in ("meta", "assign") for c in _configs(plans, 2, microbatches=(1,), mode="told", init=init)]
    return run(train_lins, 4, configs)


@pytest.fixture(scope="session")
def world8_runs():
    m = WORLD8_MICROBATCHES
    return run(train_lins, 8, _configs(WORLD8_PLANS, 4, microbatches=m) + _configs(WORLD8_TOLD, 4, microbatches=m, mode="told"))


@pytest.fixture(scope="session")
def references():
    return {**{(4, m): reference(4, m, STEPS) for m in (1, 3)}, **{(8, m): reference(8, m, STEPS) for m in WORLD8_MICROBATCHES}}


@pytest.fixture(scope="session")
def references_without_clipping():
    return {m: reference(4, m, STEPS, clip=False) for m in (1, 3)}


@pytest.fixture(scope="session")
def fsdp_runs():
    """FSDP2 full sharding and HSDP at world 4, fp32 and bf16, with Lins' equivalents."""
    fsdp_cfgs = [
        dict(shard=4, microbatches=3, steps=STEPS, ranks_per_node=2),
        dict(shard=2, microbatches=1, steps=STEPS, ranks_per_node=2),
        dict(shard=4, microbatches=1, steps=STEPS, ranks_per_node=2, param_dtype=_bf16()),
        dict(shard=2, microbatches=1, steps=STEPS, ranks_per_node=2, param_dtype=_bf16()),
    ]
    lins_cfgs = [
        dict(plan="fsdp", microbatches=3, steps=STEPS, ranks_per_node=2),
        dict(plan="hsdp:2", microbatches=1, steps=STEPS, ranks_per_node=2),
        dict(plan="fsdp", microbatches=1, steps=STEPS, ranks_per_node=2, param_dtype=_bf16()),
        dict(plan="hsdp:2", microbatches=1, steps=STEPS, ranks_per_node=2, param_dtype=_bf16()),
        dict(plan="zero1", microbatches=1, steps=STEPS, ranks_per_node=2, param_dtype=_bf16()),
        dict(plan="p=1,g=2,os=4", microbatches=1, steps=STEPS, ranks_per_node=2, param_dtype=_bf16()),
    ]
    return run(train_fsdp, 4, fsdp_cfgs), run(train_lins, 4, lins_cfgs)


def _bf16():
    import torch

    return torch.bfloat16
