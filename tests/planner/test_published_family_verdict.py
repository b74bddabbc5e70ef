"""benchmarks/published.py's final line judges each system family on its cases whose response lengths were
published: a family over 20% there fails the verdict, a family whose cases all rest on an assumed mean
response is named apart and does not sway it, and a case that did not plan counts nowhere but the failed list."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASSUMED = ["mean response 341 (max/3)"]


@pytest.fixture
def published(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module("published")
    yield module
    sys.modules.pop("published", None)


def case(name: str, family: str, error: float, assumed: list[str] | None = None) -> dict:
    return {"case": name, "family": family, "error": error, "assumed": assumed or [], "predicted_s": 1.0}


def test_every_family_with_published_lengths_within_20_percent_passes_and_the_others_are_named(published):
    out = published.summarise(
        [
            case("a1", "alpha", 0.10),
            case("a2", "alpha", 0.30),
            case("a3", "alpha", 0.15),  # alpha's median 0.15
            case("b1", "beta", 0.90, ASSUMED),  # beta rests on an assumed mean only
            case("g1", "gamma", 0.05),
            case("g2", "gamma", 0.70, ASSUMED),  # left out of gamma's judged median
            {"case": "c1", "family": "alpha", "failed": "no plan fits"},
        ]
    )
    assert out["families_within_20pct"] is True
    assert out["families_without_published_lengths"] == ["beta"]
    assert out["families"]["gamma"]["median_error_published_lengths"] == 0.05
    assert out["families"]["gamma"]["median_error"] == pytest.approx(0.375)
    assert out["failed"] == ["c1"]
    assert out["cases"] == 6


def test_one_family_over_20_percent_on_its_published_cases_fails_the_verdict(published):
    out = published.summarise([case("a1", "alpha", 0.10), case("d1", "delta", 0.21), case("d2", "delta", 0.25)])
    assert out["families_within_20pct"] is False
    assert out["families_without_published_lengths"] == []


def test_with_no_published_lengths_anywhere_there_is_no_verdict(published):
    out = published.summarise([case("b1", "beta", 0.05, ASSUMED)])
    assert out["families_within_20pct"] is None
    assert out["families_without_published_lengths"] == ["beta"]
