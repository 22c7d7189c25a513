"""Wire formats (lins_dtensor.formats): bytes, encode/decode, settings and their errors."""

import math

import pytest
import torch

from lins_dtensor import CommFormats
from lins_dtensor.errors import LinsConfigError
from lins_dtensor.formats import BLOCK, FORMATS, format_choices, parse_allowed, wire_format
from lins_dtensor.plan import LinsPlan, valid_plans



@pytest.mark.quick
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1000])
@pytest.mark.parametrize("chunks", [1, 3])
def test_encoded_bytes_are_what_chunk_bytes_says_and_decode_inverts_within_the_format(numel, chunks):
    torch.manual_seed(numel)
    values = torch.randn(chunks * numel) * torch.logspace(-3, 3, chunks * numel)
    for name, fmt in FORMATS.items():
        if not fmt.lossy:
            continue
        out = torch.empty(chunks * fmt.chunk_bytes(numel, 4), dtype=torch.uint8)
        fmt.encode(values, chunks, out)
        decoded = fmt.decode(out, chunks, numel).reshape(-1)
        if name == "bf16":
            assert torch.equal(decoded, values.bfloat16().float())
        else:  # int8 blocks: at most half a step of the block's scale off
            blocks = values.view(chunks, numel)
            for c in range(chunks):
                for start in range(0, numel, BLOCK):
                    block = blocks[c, start : start + BLOCK]
                    step = block.abs().max() / 127
                    assert (decoded.view(chunks, numel)[c, start : start + BLOCK] - block).abs().max() <= step / 2 * (1 + 1e-6)
        again = torch.empty_like(out)
        assert torch.equal(fmt.encode(values.clone(), chunks, again), out)  # deterministic


@pytest.mark.quick
def test_byte_sizes():
    assert FORMATS["bf16"].chunk_bytes(1000, 4) == 2000
    assert FORMATS["int8"].chunk_bytes(1000, 4) == math.ceil(1000 / BLOCK) * (BLOCK + 4)
    assert FORMATS["exact"].chunk_bytes(1000, 2) == 2000


@pytest.mark.quick
def test_int8_zero_blocks_and_rows_decode_to_zeros():
    fmt = FORMATS["int8"]
    values = torch.zeros(2 * 300)
    values[310] = 5.0
    out = torch.empty(2 * fmt.chunk_bytes(300, 4), dtype=torch.uint8)
    decoded = fmt.decode(fmt.encode(values, 2, out), 2, 300).reshape(-1)
    assert torch.equal(decoded, values)


@pytest.mark.quick
def test_settings_text_round_trips_and_defaults_to_exact():
    formats = CommFormats.parse("grads=int8, params:intra=bf16")
    assert (formats.grads_inter, formats.params_intra, formats.grads_intra, formats.params_inter) == ("int8", "bf16", "exact", "exact")
    assert CommFormats.parse(str(formats)) == formats
    assert CommFormats.parse(None) == CommFormats.parse("exact") == CommFormats()
    assert not CommFormats().lossy and CommFormats().as_json() == "exact"
    assert formats.as_json() == {"grads": {"inter": "int8", "intra": "exact"}, "params": {"inter": "exact", "intra": "bf16"}}
    assert CommFormats.from_json(formats.as_json()) == formats and CommFormats.from_json("exact") == CommFormats()


@pytest.mark.quick
@pytest.mark.parametrize("text, needle", [
    ("grads=int4", "unknown format 'int4'"),
    ("weights=bf16", "expected 'kind[:level]=format'"),
    ("grads:cross=bf16", "expected 'kind[:level]=format'"),
    ("grads", "expected 'kind[:level]=format'"),
    ("grads=int8|bf16", "one format per kind and level"),
])
def test_bad_settings_are_one_line_errors_naming_the_setting(text, needle):
    with pytest.raises(LinsConfigError) as error:
        CommFormats.parse(text)
    message = str(error.value)
    assert needle in message and "comm_formats" in message and "\n" not in message


@pytest.mark.quick
def test_bf16_gathers_of_bf16_parameters_are_refused():
    with pytest.raises(LinsConfigError, match="params:inter=bf16: the parameters are already torch.bfloat16"):
        CommFormats.parse("params=bf16").check(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    CommFormats.parse("params=int8,grads=bf16").check(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.mark.quick
def test_allowed_sets_enumerate_every_combination_with_exact_first():
    allowed = parse_allowed("grads=int8|bf16,params=bf16")
    assert allowed["grads_inter"] == ("exact", "int8", "bf16") and allowed["grads_intra"] == ("exact",)
    choices = list(format_choices(allowed))
    assert choices[0] == CommFormats() and len(choices) == 3 * 2 and len(set(choices)) == 6
    assert wire_format("bf16") is FORMATS["bf16"]


# ----- the runtime with lossy formats (4 ranks, 2 emulated nodes) ----------------------------
ALL_LOSSY = "grads=int8,grads:intra=bf16,params=bf16,params:intra=bf16"
INT8_GATHERS = "grads=bf16,params=int8,params:intra=int8"


def _runs():
    from scenarios import LinsRun

    plans = [str(p) for p in valid_plans(4, 2)]
    return ([LinsRun(plan, 2, 2, 2, comm_formats=ALL_LOSSY) for plan in plans]
            + [LinsRun(plan, 2, 2, 2, comm_formats=INT8_GATHERS) for plan in ("ddp", "p=1,g=2,os=4", "p=2,g=4,os=4", "p=1,g=4,os=4", "p=4,g=4,os=4,hpz=2")])


@pytest.fixture(scope="module")
def lossy_runs():
    from distributed import run
    from scenarios import train_lins

    return run(train_lins, 4, _runs())


def test_lossy_formats_send_what_the_schedule_says_and_every_rank_computes_with_the_same_parameters(lossy_runs):
    """Every valid world-4 plan with every collective that may be lossy lossy: the recorded
    collectives (all-to-alls, gathers of encoded sums, encoded update gathers, FSDP2's
    encoded gathers of P, with their formats and the bytes they stand for) equal
    schedule.step_collectives on every rank; where P is replicated every rank holds
    bitwise the same P; with bf16 gathers P is the masters
    rounded to bf16, exactly (every rank, the owner of a chunk included, decodes it); the
    memory per state, error-feedback residuals included, is the schedule's."""
    assert len(lossy_runs) == len(_runs())
    for result in lossy_runs:
        cfg = result["config"]
        label = f"{cfg.plan} {cfg.comm_formats}"
        assert all(r["bytes_match"] and r["unwaited_bytes_match"] for r in result["per_rank"]), (label, result["per_rank"][0]["counted"])
        assert all(r["memory"] == r["memory_expected"] for r in result["per_rank"]), (label, result["per_rank"][0]["memory"])
        plan = LinsPlan.parse(cfg.plan, 4)
        lossy = {key[0] for key in result["records"] if key[5] != "exact"}
        lins_collectives = plan.optim > plan.params or plan.optim < 4  # else FSDP2's alone
        assert bool(lossy - {"param_all_gather", "param_regather"}) == lins_collectives, label
        assert ("param_all_gather" in lossy) == (plan.params > 1), label  # every level's params are lossy here
        assert "grad_reduce_scatter" not in lossy, label
        if plan.params == 1:
            assert len({r["param_digest"] for r in result["per_rank"]}) == 1, label
        for name, param in result["params"].items():
            assert torch.isfinite(param).all(), label
            if cfg.comm_formats == ALL_LOSSY and plan.optim > plan.params:
                assert torch.equal(param, result["masters"][name].bfloat16().float()), (label, name)


@pytest.mark.parametrize("plan, formats", [
    ("p=2,g=4,os=4", "params:intra=bf16"),  # P over the 2 ranks of a node
    ("p=2,g=4,os=4", "params:intra=int8"),
    ("p=4,g=4,os=4", "params=int8"),  # P over both nodes
    ("p=4,g=4,os=4,hpz=2", "params=bf16,params:intra=int8"),  # forward across the nodes, backward inside
    ("p=4,g=4,os=4", "params:intra=bf16"),  # nothing of P's inside one node: exact
])
def test_fsdp2_gathers_of_p_give_every_rank_the_same_decoded_parameters(plan, formats):
    """Where P is sharded, FSDP2's gathers take the params format of their group's level:
    every rank computes with bitwise the same values, the decoded shards (a shard's owner
    too), while P itself (each rank's shard) stays as the update left it. bf16: exactly P
    rounded to bf16; int8: within half a quantum of P's largest value, and not P (a
    matrix). A frozen parameter (replicated, never gathered) is exact."""
    from distributed import run
    from format_scenarios import computed_parameters

    out = run(computed_parameters, 4, plan, formats)
    assert out["frozen"] == {"pos"}
    forward_format = CommFormats.parse(formats).of("params", "intra" if plan.startswith("p=2") else "inter")
    assert out["computed"][0].keys() == out["params"].keys()
    largest = max(p.abs().max() for n, p in out["params"].items() if n not in out["frozen"])
    for name, whole in out["params"].items():
        seen = [rank[name] for rank in out["computed"]]
        assert all(torch.equal(seen[0], other) for other in seen[1:]), name
        got = seen[0].reshape(whole.shape)
        if forward_format.name == "exact" or name in out["frozen"]:
            assert torch.equal(got, whole), name
        elif forward_format.name == "bf16":
            assert torch.equal(got, whole.bfloat16().float()), name
        else:
            assert (got - whole).abs().max() <= largest / 254 * 1.0001, name  # a block may span parameters
            # A unit of a few values (the final norm's) is gathered exact: int8 would not shrink it.
            assert not torch.equal(got, whole) or whole.dim() == 1, name


@pytest.mark.parametrize("plan, rounded_sum", [("ddp", True), ("p=1,g=4,os=4", False)])
def test_bf16_reductions_sum_bf16_rounded_gradients_in_fp32(plan, rounded_sum):
    """The gradient the optimizer gets is the fp32 sum of every rank's gradient rounded to
    bf16 (not a bf16 accumulation), divided by the ranks; after an all-reduce it is that
    sum rounded to bf16 once more, the value every replica decoded (ddp: an all-reduce
    over 2 nodes; p=1,g=4,os=4: the G-level reduce-scatter over 2 nodes)."""
    from distributed import run
    from format_scenarios import reduced_gradients

    out = run(reduced_gradients, 4, plan, "grads=bf16")
    assert out["reduced"]
    for name, got in out["reduced"].items():
        grads = torch.stack([rank[name] for rank in out["per_rank"]])
        total = grads.bfloat16().float().sum(dim=0)
        expected = (total.bfloat16().float() if rounded_sum else total) / 4
        assert torch.equal(got, expected), (name, (got - expected).abs().max())
        assert not torch.equal(got, grads.sum(dim=0) / 4) or torch.equal(grads, grads.bfloat16().float()), name
