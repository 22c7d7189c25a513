"""build_lins_mesh on shared process groups (``group_for``): the same training, bitwise,
with one group per set of ranks however many meshes use it."""

from __future__ import annotations

import pytest
import torch

from distributed import run
from scenarios import LinsRun, train_lins


@pytest.fixture(scope="module")
def shared_runs():
    # Two plans that share their P groups (pairs in a node) and their replica-free dims,
    # each first on groups of its own, then on the shared ones.
    plans = ["p=2,g=2,os=4", "p=2,g=4,os=4"]
    cfgs = [LinsRun(p, 2, 2, 2, shared_groups=shared) for shared in (False, True) for p in plans]
    return run(train_lins, 4, cfgs)


def test_a_mesh_on_shared_groups_trains_bitwise_like_its_own(shared_runs):
    own, shared = shared_runs[:2], shared_runs[2:]
    for a, b in zip(own, shared):
        assert b["config"].shared_groups and not a["config"].shared_groups
        assert a["masters"].keys() == b["masters"].keys()
        for name in a["masters"]:
            assert torch.equal(a["masters"][name], b["masters"][name]), (a["config"].plan, name)
        assert [r["param_digest"] for r in a["per_rank"]] == [r["param_digest"] for r in b["per_rank"]]
        assert all(r["bytes_match"] for r in b["per_rank"]), b["config"].plan


def test_meshes_on_shared_groups_use_one_group_per_set_of_ranks(shared_runs):
    own, shared = shared_runs[:2], shared_runs[2:]
    # The P dim is the same pairs of ranks under both plans: one group when shared, two otherwise.
    assert shared[0]["dim_groups"]["param_shard"] == shared[1]["dim_groups"]["param_shard"]
    assert own[0]["dim_groups"]["param_shard"] != own[1]["dim_groups"]["param_shard"]
    # Every dim of the second shared mesh whose ranks the first had reuses the first's group.
    names = {g for run_ in shared for g in run_["dim_groups"].values()}
    assert len(names) < sum(len(run_["dim_groups"]) for run_ in shared)
