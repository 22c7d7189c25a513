"""Shared, cached multi-process runs: each spawns its ranks once for many plans."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore", message=".*sequential all_gather operations.*")

from distributed import run  # noqa: E402
from scenarios import FsdpRun, LinsRun, reference, train_fsdp, train_lins  # noqa: E402

import lins_dtensor.executor as executor_module  # noqa: E402
from lins_dtensor import valid_plans  # noqa: E402

STEPS = 3


@pytest.fixture(autouse=True)
def _no_chains_left_past_the_test(monkeypatch):
    """Executors a test makes in this process (stand-in collectives, simulated ranks)
    are forgotten after it: the exit hook would otherwise run their chains to the end
    when pytest exits, on collectives that cannot complete any more."""
    monkeypatch.setattr(executor_module, "_WITH_CHAINS_LEFT", {})


def _configs(plans, ranks_per_node: int, microbatches=(1, 3), steps: int = STEPS, **extra) -> list[LinsRun]:
    """A run of each plan (LinsPlan or its text) with each micro-batch count, ``extra``
    as in every one of them."""
    return [LinsRun(str(p), m, steps, ranks_per_node, **extra) for p in plans for m in microbatches]


# The runs of the session fixtures below, named so that the tests derive what they
# expect from them (each fixture returns one result per run, in this order).
WORLD4_PLANS = valid_plans(4, 2, with_hpz=True)  # 2 nodes x 2 ranks

WORLD4_RUNS = _configs(WORLD4_PLANS, 2)  # every valid plan, M in {1, 3}
OVERLAP_RUNS = _configs(["p=1,g=1,os=4", "p=1,g=2,os=4", "p=2,g=4,os=4", "hsdp:2"], 2, reduce_in_backward=True)
# The overlapped executor as a trainer uses it (Lins told M): every plan and M with
# clipping; without clipping at M = 3 (the optimizer step, not clip_grad_norm_, is then
# what waits for the reductions; M = 1 changes only the first micro-batch's path, which
# the clipped runs take).
ASYNC_TOLD = _configs(WORLD4_PLANS, 2, mode="told", clip=True) + _configs(WORLD4_PLANS, 2, microbatches=(3,), mode="told", clip=False)
ASYNC_LEARNED = _configs(["p=1,g=1,os=4", "p=1,g=2,os=4", "p=2,g=4,os=4", "fsdp"], 2, microbatches=(3,), mode="learned")
ASYNC_MISCOUNTED = _configs(["p=1,g=2,os=4", "p=2,g=4,os=4"], 2, microbatches=(3,), mode="told", told_steps=2)
ASYNC_ONE_CHAIN = _configs(["p=1,g=2,os=4", "p=2,g=4,os=4", "ddp"], 2, mode="told", max_inflight_bytes=1)

TIED_TREE = {"tied": True, "tree": "hf"}
TIED_RUNS = (_configs(["p=1,g=2,os=4", "p=2,g=4,os=4", "fsdp"], 2, microbatches=(3,), mode="told", model_kwargs=TIED_TREE)
             + _configs(["p=2,g=2,os=4"], 2, microbatches=(3,), mode="told", model_kwargs=TIED_TREE, units="Block"))

# Model trees whose blocks sit in nested containers (tests/tiny_llama.py's TREES).
NESTED_TREES = {"nanogpt": {"tied": True, "tree": "nanogpt"}, "lists": {"tree": "lists"}, "dicts": {"tree": "dicts"},
                "sequential": {"tree": "sequential"}}
NESTED_TREE_STEPS = 2
NESTED_TREE_RUNS = [c for name, kwargs in NESTED_TREES.items()
                    for c in _configs(WORLD4_PLANS, 2, microbatches=(1,), steps=NESTED_TREE_STEPS, mode="told", model_kwargs=kwargs,
                                      tree_name=name)]

PARAM_GROUP_STEPS = 2
# The groups given as the parameters and as their names, alternating over the plans.
PARAM_GROUP_RUNS = [dataclasses.replace(c, param_groups=("params", "names")[i % 2])
                    for i, c in enumerate(_configs(WORLD4_PLANS, 2, microbatches=(1,), steps=PARAM_GROUP_STEPS, mode="told"))]

REINIT_RUNS = [c for init in ("meta", "assign") for c in _configs(["p=1,g=2,os=4", "p=2,g=2,os=4"], 2, microbatches=(1,), mode="told",
                                                                   init=init)]

# 2 nodes x 4 ranks: the plans whose P, G and OS levels are three different groups
# (p=2,g=4,os=8) need 8 ranks. M = 2: its first micro-batch writes the G buffer and its
# last one reduces, the paths M = 1 takes in one (at world 4, M = 1 runs every plan).
WORLD8_PLANS = ["p=1,g=1,os=8", "p=2,g=2,os=8", "p=2,g=4,os=8", "p=4,g=4,os=4", "p=8,g=8,os=8", "hpz:4"]
WORLD8_TOLD = ["p=1,g=1,os=8", "p=2,g=4,os=8", "hpz:4"]  # the overlapped executor: P replicated, in the node, hpZ
WORLD8_MICROBATCHES = (2,)
WORLD8_RUNS = _configs(WORLD8_PLANS, 4, microbatches=WORLD8_MICROBATCHES) + _configs(WORLD8_TOLD, 4, microbatches=WORLD8_MICROBATCHES,
                                                                                     mode="told")


@pytest.fixture(scope="session")
def world4_runs():
    """WORLD4_RUNS: every valid plan at world 4, hpZ included, M in {1, 3}."""
    return run(train_lins, 4, WORLD4_RUNS)


@pytest.fixture(scope="session")
def overlap_runs():
    """OVERLAP_RUNS: the last micro-batch reduced to the OS layout inside backward (paper's executor)."""
    return run(train_lins, 4, OVERLAP_RUNS)


@pytest.fixture(scope="session")
def async_runs():
    """The overlapped executor as a trainer uses it: Lins told M up front, so the last
    micro-batch reduces during its backward and the update gathers run until the next
    forward (ASYNC_TOLD). Plus the count learned from the previous step, a count told
    too small, and a byte bound that lets one chain run at a time."""
    return run(train_lins, 4, ASYNC_TOLD + ASYNC_LEARNED + ASYNC_MISCOUNTED + ASYNC_ONE_CHAIN)


@pytest.fixture(scope="session")
def tied_runs():
    """A GPT-2-shaped tree (blocks under transformer.layers) with the output head tied to
    the embedding, under the default units, and with units given as a block class."""
    return run(train_lins, 4, TIED_RUNS), reference(4, 3, STEPS, model_kwargs=TIED_TREE)


@pytest.fixture(scope="session")
def nested_tree_runs():
    """Each of NESTED_TREES under the default units with every valid plan at world 4, M = 1,
    with its single-process reference."""
    refs = {name: reference(4, 1, NESTED_TREE_STEPS, model_kwargs=kwargs) for name, kwargs in NESTED_TREES.items()}
    return run(train_lins, 4, NESTED_TREE_RUNS), refs


@pytest.fixture(scope="session")
def param_group_runs():
    """lins_optimizer with two param groups of different weight decay (PARAM_GROUP_RUNS);
    and torch.optim.AdamW in one process with the same groups (True) and with one (False)."""
    refs = {groups: reference(4, 1, PARAM_GROUP_STEPS, param_groups=groups) for groups in (True, False)}
    return run(train_lins, 4, PARAM_GROUP_RUNS), refs


@pytest.fixture(scope="session")
def reinit_runs():
    """Parameters replaced under Lins: meta-device build + to_empty + a full state dict,
    and load_state_dict(assign=True), with P replicated (no FSDP2) and sharded."""
    return run(train_lins, 4, REINIT_RUNS)


@pytest.fixture(scope="session")
def world8_runs():
    return run(train_lins, 8, WORLD8_RUNS)


@pytest.fixture(scope="session")
def references():
    return {**{(4, m): reference(4, m, STEPS) for m in (1, 3)}, **{(8, m): reference(8, m, STEPS) for m in WORLD8_MICROBATCHES}}


@pytest.fixture(scope="session")
def references_without_clipping():
    return {m: reference(4, m, STEPS, clip=False) for m in sorted({c.microbatches for c in ASYNC_TOLD if not c.clip})}


@pytest.fixture(scope="session")
def fsdp_runs():
    """FSDP2 full sharding and HSDP at world 4, fp32 and bf16, with Lins' equivalents."""
    bf16 = _bf16()
    fsdp_cfgs = [FsdpRun(4, 3, STEPS, 2), FsdpRun(2, 1, STEPS, 2), FsdpRun(4, 1, STEPS, 2, bf16), FsdpRun(2, 1, STEPS, 2, bf16)]
    lins_cfgs = [LinsRun("fsdp", 3, STEPS, 2), LinsRun("hsdp:2", 1, STEPS, 2)]
    lins_cfgs += [LinsRun(plan, 1, STEPS, 2, bf16) for plan in ("fsdp", "hsdp:2", "zero1", "p=1,g=2,os=4")]
    return run(train_fsdp, 4, fsdp_cfgs), run(train_lins, 4, lins_cfgs)


def _bf16():
    import torch

    return torch.bfloat16
