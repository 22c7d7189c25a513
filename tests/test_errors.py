"""Bad input: one clear LinsPlanError naming the setting and the rule."""

from __future__ import annotations

import pytest

from distributed import run
from error_scenarios import misuse_messages


@pytest.fixture(scope="module")
def messages():
    return run(misuse_messages, 4)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("world_mismatch", "world_size=8 does not match the 4 ranks"),
        ("not_nested", "factors must nest, params | grads | optim: got params=2, grads=1, optim=4"),
        ("rpn_not_dividing", "ranks_per_node=3 must be >= 1 and divide world_size=4"),
        ("plan_mesh_mismatch", "the mesh was built for plan 'p=2,g=2,os=4' but apply_lins got plan 'p=1,g=2,os=4'"),
        ("raw_device_mesh", "mesh must come from build_lins_mesh"),
        ("applied_twice", "already applied"),
        ("already_fsdp", "module 'layers.0' is already sharded by FSDP"),
        ("ddp_wrapped", "DistributedDataParallel"),
        ("accumulation_steps", "gradient_accumulation_steps=0 must be a positive integer or None"),
        ("gradient_sync", "requires_gradient_sync='yes' must be True, False or None"),
        ("inflight_bytes", "max_inflight_bytes=-1 must be a non-negative integer or None"),
        ("set_reduce_in_backward", "set_requires_gradient_sync(model, enabled) is the direct replacement; syncs: True"),
    ],
)
def test_misuse_raises_clear_error(messages, case, expected):
    assert expected in messages[case]
    assert "\n" not in messages[case]
