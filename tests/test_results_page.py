"""benchmarks/README.md is what benchmarks/results_page.py generates from benchmarks/results/, and a claim whose
results cannot be read stops the generator instead of dropping out of the page. Fast: it reads JSON only."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import results_page
from benchmarks.results_page import Claim, ResultsError, Source


def test_page_agrees_with_the_results(capsys):
    assert results_page.main(["--check"]) == 0, capsys.readouterr().out


def a_claim() -> Claim:
    return next(claim for _, claims in results_page.SECTIONS for claim in claims if claim.anchor == "smollm2-alone")


def test_a_claim_reads_its_figure_from_its_file():
    figure, verdict = a_claim().read()
    assert figure.values == (20.0, 22.0, 20.0) and verdict == "met"


@pytest.mark.parametrize(
    "source, message",
    [
        (Source("no_such_results.jsonl"), "no_such_results.jsonl: no such file"),
        (Source("isolated_smollm2.jsonl", {"config": "no_such.yaml"}), "no row matches config='no_such.yaml'"),
        (Source("gpu_round_h200.jsonl", lines=(9, 9)), "no rows"),
    ],
)
def test_a_source_that_reads_nothing_stops_the_page(monkeypatch, source, message):
    broken = dataclasses.replace(a_claim(), sources=(source,))
    monkeypatch.setattr(results_page, "SECTIONS", [("broken", [broken])])
    with pytest.raises(ResultsError, match=message):
        results_page.render()


def test_an_arm_without_runs_stops_the_page():
    claim = dataclasses.replace(
        a_claim(),
        sources=(Source("sharing_600.jsonl"),),
        figure=results_page.sharing_gain("no_such_arm", "silo_imitate", 600),
    )
    with pytest.raises(ResultsError, match="no_such_arm"):
        claim.read()


def test_a_heading_the_notebook_lacks_stops_the_page():
    claim = dataclasses.replace(a_claim(), notebook=("2026-12-02-smollm2", "No such heading"))
    with pytest.raises(ResultsError, match="No such heading"):
        results_page.row(claim, results_page.RESULTS, results_page.NOTEBOOK)


@pytest.mark.parametrize(
    "values, verdict",
    [((3.0, 4.0), "met"), ((-3.0, -2.5), "loses"), ((3.0, -2.5), "no better"), ((9.0, -1.0), "mixed")],
)
def test_gain_verdicts(values, verdict):
    assert results_page.Gain(2.0).verdict(results_page.Figure(values, "points")) == verdict
