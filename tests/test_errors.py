"""Bad input: one clear line, ``lins: `` first, naming the setting and the rule, raised as
the LinsError subclass of its kind (plan, usage, checkpoint)."""

from __future__ import annotations

import pytest

from distributed import run
from error_scenarios import misuse_messages
from fault_scenarios import program_collectives_between_lins_chains, stalled_peer


@pytest.fixture(scope="module")
def messages():
    return run(misuse_messages, 4)


@pytest.mark.parametrize(
    "case, kind, expected",
    [
        ("world_mismatch", "LinsPlanError", "world_size=8 does not match the 4 ranks"),
        ("not_nested", "LinsPlanError", "factors must nest, params | grads | optim: got params=2, grads=1, optim=4"),
        ("rpn_not_dividing", "LinsPlanError", "ranks_per_node=3 must be >= 1 and divide world_size=4"),
        ("plan_mesh_mismatch", "LinsUsageError", "the mesh was built for plan 'p=2,g=2,os=4' but apply_lins got plan 'p=1,g=2,os=4'"),
        ("raw_device_mesh", "LinsUsageError", "mesh must come from build_lins_mesh"),
        ("applied_twice", "LinsUsageError", "already applied"),
        ("already_fsdp", "LinsUsageError", "module 'layers.0' is already sharded by FSDP"),
        ("ddp_wrapped", "LinsUsageError", "DistributedDataParallel"),
        ("accumulation_steps", "LinsUsageError", "gradient_accumulation_steps=0 must be a positive integer or None"),
        ("gradient_sync", "LinsUsageError", "requires_gradient_sync='yes' must be True, False or None"),
        ("inflight_bytes", "LinsUsageError", "max_inflight_bytes=-1 must be a non-negative integer or None"),
        ("set_reduce_in_backward", None, "set_requires_gradient_sync(model, enabled) is the direct replacement; syncs: True"),
        ("tied_units", "LinsUsageError", "units=: 'tok_embeddings' and 'output' share a parameter (tied weights); leave both out of units="),
        ("units_class", "LinsUsageError", "units=<class 'torch.nn.modules.rnn.LSTM'>: the model has no module of that class"),
        ("tensor_subclass", "LinsUsageError", "parameter 'norm.weight' is a _Float8Like tensor subclass"),
        ("nonfinite_clip_False", None, "returned nan"),
        ("bf16_model_masters", None, "torch.float32"),
        ("bf16_masters_asked", None, "torch.bfloat16"),
        ("master_dtype", "LinsUsageError", "master_dtype=torch.int32 must be a floating-point torch.dtype or None"),
        ("other_model_shapes", "LinsCheckpointError", "checkpoint entry 'tok_embeddings.weight' has shape (50, 30), the model's parameter (50, 24)"),
        ("missing_key", "LinsCheckpointError", "the state dict has no entry 'norm.weight' (strict load)"),
        ("param_in_no_group", "LinsUsageError", "parameter 'layers.0.attention.wq.weight' is in no optimizer param group"),
        ("param_in_two_groups", "LinsUsageError", "parameter 'output.weight' is in optimizer param groups 0 and 1: give each parameter one group"),
        ("param_collected_early", "LinsUsageError", "optimizer param group 0: a tensor of shape (50, 24) is not a trainable "
                                                    "parameter of the model (collected before apply_lins?"),
        ("nonfinite_clip_True", None, "lins: clip_grad_norm_: the order-2 norm of the gradients is nan, not finite; nothing was clipped"),
    ],
)
def test_misuse_raises_clear_error(messages, case, kind, expected):
    """``kind``: the LinsError subclass raised (None: a warning, a value or torch's error)."""
    if kind is not None:
        assert messages[case].startswith(f"{kind}: lins: "), messages[case]
    assert expected in messages[case]
    assert "\n" not in messages[case]


def test_a_stopped_peer_fails_the_collective_within_the_timeout():
    """A rank that stops responding ends the others' wait after the mesh's timeout with an
    error that names the Lins collective, instead of a hang (30 minutes by default)."""
    result = run(stalled_peer, 2, 3.0, 12.0)
    assert result["message"].startswith("lins: collective grad_shard_reduce_scatter (grads) failed:"), result["message"]
    assert "\n" not in result["message"]
    assert 2.5 < result["elapsed_s"] < 10.0, result


def test_lins_groups_are_its_own_so_program_collectives_cannot_interleave():
    """A mesh dim that spans every rank used to reuse the default process group; the
    program's all-reduce on it then met Lins' update gathers in a different order on a
    late rank and hung (seen in the benchmark). Lins' groups are now its own."""
    results = run(program_collectives_between_lins_chains, 4, "p=1,g=1,os=4", 10.0)
    assert results == {"shared_with_default_group": [], "message": "no error"}, results



def test_lins_errors_say_lins_once_and_keep_their_kind_across_processes():
    """The base class adds the prefix; a wrapper quotes ``detail``; spawned ranks send
    errors back pickled, which rebuilds them from the full message."""
    import pickle

    import lins_dtensor
    from lins_dtensor import LinsCheckpointError, LinsError, LinsPlanError, LinsUsageError
    from lins_dtensor.errors import LinsConfigError, PlannerError
    from lins_dtensor.plan import LinsPlanError as from_plan

    assert from_plan is LinsPlanError is lins_dtensor.LinsPlanError
    for kind in (LinsPlanError, LinsUsageError, LinsCheckpointError, LinsConfigError, PlannerError):
        assert issubclass(kind, LinsError) and issubclass(kind, ValueError)
        error = kind("x=1 must be 2")
        assert str(error) == "lins: x=1 must be 2" and error.detail == "x=1 must be 2"
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is kind and str(again) == str(error)
    assert not issubclass(LinsUsageError, LinsPlanError) and not issubclass(LinsCheckpointError, LinsPlanError)
    with pytest.raises(LinsPlanError) as error:
        lins_dtensor.LinsPlan.parse("zero4", 4)
    assert str(error.value).startswith("lins: plan 'zero4': expected")
