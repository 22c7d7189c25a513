"""LinsUnit in one process: its gradient chains (micro-batches into G, G to the OS
layout), the masters' gradients (unused parameters keep None), the update chain back
to P and the end of a step, over 4 or 8 simulated ranks of every plan
(tests/unit_harness.py); and ReplicatedParams' gradient bucket."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from unit_harness import SimWorld, world1_device_mesh

from lins_dtensor import LinsPlan, valid_plans
from lins_dtensor.schedule import (
    GRAD_SHARD_REDUCE_SCATTER,
    OPTIM_ALL_REDUCE,
    OPTIM_REDUCE_SCATTER,
    UPDATE_GATHER_GRAD,
    UPDATE_GATHER_OPTIM,
    UnitGeometry,
)
from lins_dtensor.units import ReplicatedParams

pytestmark = pytest.mark.quick  # in one process

# Rows that 2, 4 and 8 ranks cut unevenly, down to empty chunks (1 row over 4 ranks).
SHAPES = [(5, 3), (7,), (2, 2), (1, 4)]
# The unit sees only the plan's factors: hpZ's P regathering group is FSDP2's business.
PLANS = [str(p) for p in valid_plans(4, 2)]
# At world 8 the plans whose P, G and OS are three different groups (p=2,g=4,os=8),
# which the forked world-8 runs take at M = 2 only.
WORLD8_PLANS = [str(p) for p in valid_plans(8, 4)]


@pytest.fixture(scope="module")
def device_mesh() -> Iterator[DeviceMesh]:
    created = not dist.is_initialized()
    yield world1_device_mesh()
    if created:
        dist.destroy_process_group()


def make_world(plan: str, device_mesh: DeviceMesh, monkeypatch, param_dtype: torch.dtype = torch.float32,
               world_size: int = 4) -> SimWorld:
    world = SimWorld(LinsPlan.parse(plan, world_size), world_size, device_mesh, SHAPES, param_dtype)
    world.install(monkeypatch)
    return world


def integer_grads(seed: int) -> list[torch.Tensor]:
    """Whole-parameter gradients of small integers (every sum exact in any order)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(-8, 9, s, generator=gen).float() for s in SHAPES]


def run_backwards(world: SimWorld, grads: dict[tuple[int, int], list[torch.Tensor]], microbatches: int,
                  used: list[bool] | None = None) -> None:
    """Every rank's micro-batches in order (as ranks run them), the last one reducing."""
    for mb in range(microbatches):
        for rank, unit in enumerate(world.units):
            unit.accumulate(world.handed_on(rank, [grads[r, mb] for r in range(world.world_size)]), mb == microbatches - 1, used=used)


def expected_grad(world: SimWorld, grads: dict[tuple[int, int], list[torch.Tensor]], rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s OS rows of the gradient summed over ranks and micro-batches,
    divided by the data-parallel world (the unit's gradient_divide_factor)."""
    total = [sum(g[i] for g in grads.values()) / world.world_size for i in range(len(SHAPES))]
    return world.optim_rows(rank, total)


def step_specs(plan: LinsPlan, world_size: int, microbatches: int) -> list[str]:
    """The collectives one rank issues for one unit in one step, from the plan's
    factors: G finer than P reduce-scatters every micro-batch; OS finer than G
    reduce-scatters once, replicas all-reduce once; the update gathers back up."""
    replicas = world_size // plan.optim
    grads = [GRAD_SHARD_REDUCE_SCATTER.name] * microbatches if plan.grads > plan.params else []
    optim = [OPTIM_REDUCE_SCATTER.name] * (plan.optim > plan.grads) + [OPTIM_ALL_REDUCE.name] * (replicas > 1)
    update = [UPDATE_GATHER_OPTIM.name] * (plan.optim > plan.grads) + [UPDATE_GATHER_GRAD.name] * (plan.grads > plan.params)
    return grads + optim + update


@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("world_size, plan", [(4, p) for p in PLANS] + [(8, p) for p in WORLD8_PLANS])
def test_a_step_reduces_every_rank_and_microbatch_and_gathers_the_update_into_p(world_size, plan, microbatches, device_mesh,
                                                                                 monkeypatch):
    """Micro-batches into G, G to the OS layout, the masters' gradient exactly the sum
    over ranks and micro-batches / N; the masters' update back in P on every rank; each
    collective is the plan's, with the geometry's message size, in the same order on
    every rank of its group."""
    world = make_world(plan, device_mesh, monkeypatch, world_size=world_size)
    grads = {(rank, mb): integer_grads(10 * rank + mb) for rank in range(world_size) for mb in range(microbatches)}
    run_backwards(world, grads, microbatches)
    new_values = integer_grads(99)
    for rank, unit in enumerate(world.units):
        unit.finalize_grads([True] * len(SHAPES))
        for master, want in zip(unit.local_masters, expected_grad(world, grads, rank)):
            assert torch.equal(master.grad, want), (plan, rank)
        with torch.no_grad():  # the optimizer's step
            for master, value in zip(unit.local_masters, world.optim_rows(rank, new_values)):
                master.copy_(value)
        unit.end_step()
    for unit in world.units:
        unit.start_update()
    for rank, unit in enumerate(world.units):
        unit.wait_update()
        assert not unit.update_pending()
        for shard, want in zip(unit.backend.local_shards(), world.p_rows(rank, new_values)):
            assert torch.equal(shard.reshape(want.shape), want), (plan, rank)
    parsed = LinsPlan.parse(plan, world_size)
    for rank, unit in enumerate(world.units):
        mine = [i for i in world.issued if i.rank == rank]
        assert [i.spec.name for i in mine] == step_specs(parsed, world_size, microbatches), (plan, rank)
        for issued in mine:
            assert issued.message_numel == unit.geometry.message_numel(issued.spec), (plan, rank, issued.spec.name)
            assert issued.group_size == world.sizes[issued.spec.mesh_dim], (plan, rank, issued.spec.name)


@pytest.mark.parametrize("plan", ["p=1,g=2,os=4", "p=2,g=4,os=4", "p=1,g=1,os=2"])
def test_bf16_parameters_take_the_fp32_masters_update(plan, device_mesh, monkeypatch):
    """P in bf16, masters fp32: the update is cast to P's dtype on the way (its gather
    messages are bf16), and P holds exactly the masters' (bf16-exact) values."""
    world = make_world(plan, device_mesh, monkeypatch, param_dtype=torch.bfloat16)
    new_values = integer_grads(7)
    for rank, unit in enumerate(world.units):
        assert unit.master_flat.dtype == torch.float32
        assert all(s.dtype == torch.bfloat16 for s in unit.backend.local_shards())
        with torch.no_grad():
            for master, value in zip(unit.local_masters, world.optim_rows(rank, new_values)):
                master.copy_(value)
        unit.start_update()
    for rank, unit in enumerate(world.units):
        unit.wait_update()
        for shard, want in zip(unit.backend.local_shards(), world.p_rows(rank, new_values)):
            assert shard.dtype == torch.bfloat16 and torch.equal(shard.reshape(want.shape).float(), want), (plan, rank)


@pytest.mark.parametrize("plan", PLANS)
def test_parameters_unused_everywhere_keep_no_gradient(plan, device_mesh, monkeypatch):
    """A parameter no rank used keeps ``grad`` None (torch.optim then leaves it alone);
    one that only rank 0 used gets rank 0's gradient, the zeros of the others added."""
    world = make_world(plan, device_mesh, monkeypatch)
    zeros = [torch.zeros(s) for s in SHAPES]
    used0, others = [True, False, True, False], [True, False, False, False]
    used = [used0] + [others] * (world.world_size - 1)
    grads = {(rank, 0): [g if u else z for g, u, z in zip(integer_grads(rank), used[rank], zeros)] for rank in range(world.world_size)}
    for rank, unit in enumerate(world.units):
        unit.accumulate(world.handed_on(rank, [grads[r, 0] for r in range(world.world_size)]), True, used=used[rank])
    used_anywhere = [any(u.grad_state.used[i] for u in world.units) for i in range(len(SHAPES))]
    assert used_anywhere == used0
    for rank, unit in enumerate(world.units):
        unit.finalize_grads(used_anywhere)
        want = expected_grad(world, grads, rank)
        assert [m.grad is None for m in unit.local_masters] == [False, True, False, True], (plan, rank)
        assert torch.equal(unit.local_masters[2].grad, want[2]) and torch.equal(unit.local_masters[0].grad, want[0]), (plan, rank)


@pytest.mark.parametrize("plan", PLANS)
def test_end_step_forgets_the_step_so_the_next_one_starts_from_zero(plan, device_mesh, monkeypatch):
    """end_step resets StepGradient (no flags, no chain, no OS gradient) and drops the
    masters' gradients, after a step that raised between micro-batches (G holds a
    gradient never reduced) as after a whole one; the next step's gradient is its own,
    not added to what was left."""
    world = make_world(plan, device_mesh, monkeypatch)
    for step, raised in enumerate([True, False, False]):
        grads = {(rank, mb): integer_grads(100 * step + 10 * rank + mb) for rank in range(world.world_size) for mb in range(2)}
        if raised:  # the first micro-batch ran, the second raised in its forward
            for rank, unit in enumerate(world.units):
                unit.accumulate(world.handed_on(rank, [grads[r, 0] for r in range(world.world_size)]), False)
            for unit in world.units:
                unit.ctx.executor.wait_all()  # as LinsState does before it ends a step that raised
        else:
            run_backwards(world, grads, 2)
            for rank, unit in enumerate(world.units):
                unit.finalize_grads([True] * len(SHAPES))
                want = expected_grad(world, grads, rank)
                assert all(torch.equal(m.grad, w) for m, w in zip(unit.local_masters, want)), (plan, step)
        for unit in world.units:
            unit.end_step()
            state = unit.grad_state
            assert (state.used, state.g_has_data, state.os_grad, state.os_grad_is_g, state.chain, state.grads_ready) == \
                ([False] * len(SHAPES), False, None, False, None, False)
            assert all(m.grad is None for m in unit.local_masters)


@pytest.mark.parametrize("plan", PLANS)
def test_microbatches_after_the_reduction_are_reduced_and_added(plan, device_mesh, monkeypatch):
    """A count told too small: the step's reduction has run (its OS gradient may be
    the G buffer itself) and another micro-batch arrives, reducing again; the masters'
    gradient is the sum of both."""
    world = make_world(plan, device_mesh, monkeypatch)
    grads = {(rank, mb): integer_grads(10 * rank + mb) for rank in range(world.world_size) for mb in range(2)}
    for mb in range(2):
        for rank, unit in enumerate(world.units):
            unit.accumulate(world.handed_on(rank, [grads[r, mb] for r in range(world.world_size)]), True)
    for rank, unit in enumerate(world.units):
        unit.finalize_grads([True] * len(SHAPES))
        assert all(torch.equal(m.grad, w) for m, w in zip(unit.local_masters, expected_grad(world, grads, rank))), (plan, rank)


def test_chain_fields_are_written_when_the_chain_runs_not_at_submission(device_mesh, monkeypatch):
    """StepGradient's wait rule: the reduction's OS gradient exists only once the
    chain has run, which needs every peer's collective; it is read after the wait."""
    world = make_world("p=1,g=2,os=4", device_mesh, monkeypatch)
    first = world.units[0]
    first.accumulate(world.p_rows(0, integer_grads(0)), True)
    assert first.grad_state.chain is not None and not first.grad_state.chain.done
    assert first.grad_state.os_grad is None
    with pytest.raises(RuntimeError, match=r"ranks \[1\] never issue"):
        first.finalize_grads([True] * len(SHAPES))  # its grad_shard peer has no gradient yet
    for rank, unit in list(enumerate(world.units))[1:]:
        unit.accumulate(world.p_rows(rank, integer_grads(rank)), True)
    first.ctx.executor.wait(first.grad_state.chain)
    assert first.grad_state.chain.done and first.grad_state.os_grad is not None


# ----- ReplicatedParams' bucket ------------------------------------------------------------
class ThreeParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        self.b = nn.Parameter(torch.tensor([5.0, 6.0, 7.0]))
        self.c = nn.Parameter(torch.tensor([[-1.0], [2.0]]))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = (self.a @ x + self.c.squeeze(1)).sum()
        return out + self.b.sum() * 2 if use_b else out


def bucket() -> tuple[ThreeParams, ReplicatedParams, list]:
    """A module's parameters as one replicated unit; what the bucket sends is collected."""
    module = ThreeParams()
    params = list(module.parameters())
    backend = ReplicatedParams(module, params, MixedPrecisionPolicy())
    plan = LinsPlan.parse("p=1,g=1,os=1", 1)
    geometry = UnitGeometry.build([p.shape for p in params], plan, {"param_shard": 0, "grad_shard": 0, "optim_shard": 0})
    sent: list = []
    backend.attach(None, lambda rows, inputs, used: sent.append((rows, inputs, list(used))), geometry)
    return module, backend, sent


def reference_grads(use_b: bool) -> list[torch.Tensor]:
    model = ThreeParams()
    model(torch.tensor([1.0, -1.0]), use_b).backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def test_a_bucket_whose_parameters_all_arrive_goes_on_in_backward():
    module, backend, sent = bucket()
    module(torch.tensor([1.0, -1.0]), True).backward()
    assert len(sent) == 1
    rows, _, used = sent[0]
    assert used == [True, True, True]
    for row, want, param in zip(rows, reference_grads(True), module.parameters()):
        assert torch.equal(row, want.reshape(row.shape)) and param.grad is None  # the parameter keeps no copy
    backend.end_backward()
    assert len(sent) == 1  # nothing left over to send


def test_a_bucket_with_unused_parameters_goes_on_at_the_end_of_backward_with_zeros():
    """b took no part: the bucket waits for it until the backward ends, then sends its
    rows as zeros and says it was unused; autograd's own gradients are the chain's inputs."""
    module, backend, sent = bucket()
    module(torch.tensor([1.0, -1.0]), False).backward()
    assert sent == []
    backend.end_backward()
    rows, inputs, used = sent[0]
    assert used == [True, False, True]
    assert torch.equal(rows[1], torch.zeros(3, 1))
    for row, want in zip(rows, reference_grads(False)):
        assert torch.equal(row, want.reshape(row.shape))
    assert len(inputs) == 3 and inputs[0].data_ptr() == rows[0].data_ptr()  # no copy of autograd's gradient


def test_a_bucket_reset_after_a_failed_backward_sends_nothing():
    """A backward that raised left part of the bucket; reset() drops it, so the next
    end of backward sends nothing from it."""
    module, backend, sent = bucket()
    module(torch.tensor([1.0, -1.0]), False).backward()
    backend.reset()
    backend.end_backward()
    assert sent == []


# ----- lossy wire formats: error feedback ------------------------------------------------------
# Large enough that int8 blocks shrink every rank's chunk (SHAPES' would run exact).
FEEDBACK_SHAPES = [(5, 130), (700,), (2, 2), (1, 4)]


@pytest.mark.parametrize("plan", ["ddp", "p=1,g=4,os=4"])
def test_int8_error_feedback_delays_what_rounding_loses_and_loses_nothing(plan, device_mesh, monkeypatch):
    """int8 gradient reductions across 2 emulated nodes of 2 ranks (ddp: the all-reduce
    over the replicas, as an all-to-all and a gather of encoded sums; p=1,g=4,os=4: the
    G-level reduce-scatter, as an all-to-all), 5 steps of random gradients: what the
    reductions delivered to the optimizer, plus every residual the ranks still hold, is
    the exact sum of all gradients (error feedback delays what rounding loses, it does
    not lose it), while each step's delivered gradient is not the exact one."""
    from lins_dtensor.formats import CommFormats

    world = SimWorld(LinsPlan.parse(plan, 4), 4, device_mesh, FEEDBACK_SHAPES, formats=CommFormats.parse("grads=int8,grads:intra=int8"),
                     ranks_per_node=2)
    world.install(monkeypatch)
    assert all(unit.geometry.optim.k == 1 for unit in world.units)  # the OS gradient is in the G chunk's layout
    delivered = [[torch.zeros(s) for s in unit.geometry.local_shapes("optim")] for unit in world.units]
    total = [torch.zeros(s) for s in FEEDBACK_SHAPES]
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        grads = {(r, 0): [torch.randn(s, generator=gen) for s in FEEDBACK_SHAPES] for r in range(4)}
        run_backwards(world, grads, 1)
        exact = [sum(grads[r, 0][i] for r in range(4)) for i in range(len(FEEDBACK_SHAPES))]
        total = [t + e for t, e in zip(total, exact)]
        rounded = False
        for rank, unit in enumerate(world.units):
            unit.finalize_grads([True] * len(FEEDBACK_SHAPES))
            got = [m.grad * 4 for m in unit.local_masters]  # the unit divided by the 4 ranks
            rounded |= any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(got, world.optim_rows(rank, exact)))
            delivered[rank] = [d + g for d, g in zip(delivered[rank], got)]
            unit.end_step()
        assert rounded, step  # (a block holding one value is exact: rank 3's only row here)
    # The residuals, in each rank's OS (= G chunk) layout: the all-to-all inputs' (every
    # rank's, the rows of chunk j for rank j) and, for an all-reduce, each rank's slice of the sums.
    spec = OPTIM_ALL_REDUCE.name if plan == "ddp" else GRAD_SHARD_REDUCE_SCATTER.name
    residuals = [unit.residuals[spec] for unit in world.units]
    for rank, unit in enumerate(world.units):
        g = unit.geometry
        if plan == "ddp":
            held = sum(r[0] for r in residuals) + torch.cat([r[1] for r in residuals])
            flat = held[: g.grads.chunk_numel]
        else:
            flat = sum(r[0].view(4, -1)[g.grad_index] for r in residuals)
        rows = [v.view(s) for v, s in zip(g.grads.views(flat, g.grad_index), g.local_shapes("optim"))]
        for d, r, t in zip(delivered[rank], rows, world.optim_rows(rank, total)):
            torch.testing.assert_close(d + r, t, atol=1e-5, rtol=1e-5)
