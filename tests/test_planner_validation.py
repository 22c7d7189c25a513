"""The planner against published runs (docs/planner-validation.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lins_dtensor.planner.hardware import hardware_preset
from lins_dtensor.planner.validation import PUBLISHED, fitted_efficiency, paper_ranking, render_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "planner-validation.md"


def test_committed_document_is_what_the_planner_predicts_today():
    assert DOC.read_text() == render_markdown(), "regenerate: python -m lins_dtensor.planner.validation > docs/planner-validation.md"


@pytest.mark.parametrize("run", [r for r in PUBLISHED if r.role == "fit"], ids=lambda r: r.id)
def test_presets_carry_the_efficiency_fitted_to_single_node_runs(run):
    assert run.gpus <= hardware_preset(run.hardware).ranks_per_node  # single node only
    assert hardware_preset(run.hardware).efficiency == pytest.approx(fitted_efficiency(run), abs=0.005)


@pytest.mark.parametrize("run", [r for r in PUBLISHED if r.role == "predict" and r.held], ids=lambda r: r.id)
def test_multi_node_predictions_within_15_percent(run):
    assert run.gpus > hardware_preset(run.hardware).ranks_per_node
    assert abs(run.error()) <= 0.15, f"{run.id}: predicted {run.predicted():.0f}, published {run.published:g}"


def test_rows_added_with_the_kernel_model_are_multi_node_predictions_with_a_source_url():
    """Rows added with the per-kernel compute model are reported, not held to a bound:
    nothing is fitted to them, and each names the page it was copied from."""
    added = [r for r in PUBLISHED if not r.held]
    assert len(added) >= 20 and {r.role for r in added} == {"predict", "check"}
    assert all("https://github.com/" in r.source for r in added)
    assert all(r.gpus > hardware_preset(r.hardware).ranks_per_node for r in added if r.role == "predict")


def test_paper_ranking_lins_first_zeropp_last_and_13b_30b_orders_reproduced():
    ranking = paper_ranking()
    for model, (published, predicted) in ranking.items():
        assert predicted[0] == published[0] == "lins", (model, predicted)
        assert predicted[-1] == published[-1] == "zeropp", (model, predicted)
    for model in ("llama_13b", "llama_30b"):
        assert ranking[model][0] == ranking[model][1]
