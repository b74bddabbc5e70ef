"""benchmarks/published.py's final line judges each system family on the median step-time error of its cases:
every family within 20% passes, one family over it (or with a non-finite error, or with no case planned) fails
the verdict and is named, a family whose cases all rest on an assumed mean response is named as such, and a
case that did not plan beside planned ones of its family counts only in the failed list."""

from __future__ import annotations

import pytest
from helpers import benchmark_module

ASSUMED = ["mean response 341 (max/3)"]


@pytest.fixture
def published():
    with benchmark_module("published") as module:
        yield module


def case(name: str, family: str, error: float, assumed: list[str] | None = None) -> dict:
    return {"case": name, "family": family, "error": error, "assumed": assumed or [], "predicted_s": 1.0}


def test_every_family_within_20_percent_passes_and_the_failed_case_counts_only_as_failed(published):
    out = published.summarise(
        [
            case("a1", "alpha", 0.10),
            case("a2", "alpha", 0.30),
            case("a3", "alpha", 0.15),  # alpha's median 0.15
            case("b1", "beta", 0.12, ASSUMED),  # beta rests on an assumed mean only
            {"case": "c1", "family": "alpha", "failed": "no plan fits"},
        ]
    )
    assert out["families_within_20pct"] is True
    assert out["families_over_20pct"] == []
    assert out["families_on_assumed_lengths"] == ["beta"]
    assert out["families"]["alpha"]["median_error"] == 0.15
    assert out["failed"] == ["c1"]
    assert out["cases"] == 4


def test_a_family_over_20_percent_fails_the_verdict_even_on_assumed_lengths(published):
    out = published.summarise(
        [case("a1", "alpha", 0.10), case("g1", "gamma", 0.05), case("g2", "gamma", 0.70, ASSUMED),
         case("g3", "gamma", 0.90, ASSUMED)]
    )  # fmt: skip
    assert out["families_within_20pct"] is False
    assert out["families_over_20pct"] == ["gamma"]
    assert out["families"]["gamma"]["median_error_published_lengths"] == 0.05
    assert out["families_on_assumed_lengths"] == []


def test_with_no_case_at_all_there_is_no_verdict(published):
    out = published.summarise([{"case": "s1", "family": "alpha", "skipped": "workload not published"}])
    assert out["families_within_20pct"] is None
    assert out["families_over_20pct"] == [] and out["families_unplanned"] == []


def test_a_family_whose_median_error_is_nan_is_named_over_20_percent(published):
    # a NaN error (a non-finite prediction) is neither <= 0.2 nor > 0.2: the verdict must not fail unnamed
    out = published.summarise([case("a1", "alpha", 0.10), case("n1", "nu", float("nan"))])
    assert out["families_within_20pct"] is False
    assert out["families_over_20pct"] == ["nu"]


def test_a_family_whose_cases_all_failed_to_plan_keeps_the_verdict_from_passing(published):
    out = published.summarise([case("a1", "alpha", 0.10), {"case": "z1", "family": "zeta", "failed": "no plan fits"}])
    assert out["families_within_20pct"] is False
    assert out["families_unplanned"] == ["zeta"]
    assert out["families_over_20pct"] == []


def test_the_verdict_reads_the_unrounded_median(published):
    out = published.summarise([case("a1", "alpha", 0.20004)])
    assert out["families"]["alpha"]["median_error"] == 0.2  # as printed
    assert out["families_within_20pct"] is False
    assert out["families_over_20pct"] == ["alpha"]


def test_a_failed_or_skipped_case_carries_its_family(published, tmp_path, monkeypatch):
    (tmp_path / "x.yaml").write_text("name: sys-x\nworkload: {prompts_per_step: null}\n")
    (tmp_path / "y.yaml").write_text("name: other-y\nfamily: fam\nworkload: {prompts_per_step: null}\n")
    assert published.run_case(tmp_path / "x.yaml", 1.0)["family"] == "sys"
    assert published.run_case(tmp_path / "y.yaml", 1.0)["family"] == "fam"


def test_the_verdict_over_families_with_published_lengths_leaves_out_those_resting_on_an_assumed_mean(published):
    out = published.summarise(
        [
            case("a1", "alpha", 0.10),
            case("a2", "alpha", 0.50, ASSUMED),  # alpha has a published-length case: judged on all of its cases
            case("b1", "beta", 0.60, ASSUMED),  # beta rests on an assumed mean only: left out of this verdict
            case("g1", "gamma", 0.05),
        ]
    )
    assert out["families_within_20pct"] is False and out["families_over_20pct"] == ["alpha", "beta"]
    assert out["families_with_published_lengths"] == ["alpha", "gamma"]
    assert out["families_with_published_lengths_within_20pct"] is False  # alpha's median 0.30
    calm = published.summarise([case("b1", "beta", 0.60, ASSUMED), case("g1", "gamma", 0.05)])
    assert calm["families_with_published_lengths"] == ["gamma"]
    assert calm["families_with_published_lengths_within_20pct"] is True and calm["families_within_20pct"] is False
    none = published.summarise([case("b1", "beta", 0.10, ASSUMED)])
    assert (
        none["families_with_published_lengths"] == [] and none["families_with_published_lengths_within_20pct"] is None
    )
