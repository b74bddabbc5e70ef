"""The work-dependent efficiency curve: its shape, its fit to the repository's measured points, and the
data file's checks."""

from __future__ import annotations

import statistics
from pathlib import Path

import msgspec
import numpy as np
import pytest
import yaml

from flowrl.errors import ConfigError
from flowrl.planner import efficiency as eff
from flowrl.planner.efficiency import EfficiencyCurve, default_curve, fit_curve, load_points
from flowrl.planner.hardware import HARDWARE_PRESETS, cpu_cluster

GPUS = ["A100-80G", "A100-40G", "H100-80G", "H200-141G", "H20"]
TOKENS = [2.0**k for k in range(17)]  # 1 .. 65536


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
def test_rises_with_tokens_and_saturates_below_one(gpu, hidden):
    curve = default_curve(gpu)
    values = np.array([curve.at(t, hidden, 2048) for t in TOKENS])
    assert np.all(np.diff(values) > 0)
    assert np.all((values > 0) & (values < 1))
    # saturated: doubling 32k -> 64k tokens gains under 2%, while 1 -> 2 tokens nearly doubles it
    assert values[-1] / values[-2] < 1.02
    assert values[1] / values[0] > 1.9
    assert values[-1] <= curve.e_max


@pytest.mark.parametrize("gpu", GPUS)
def test_decode_shapes_get_low_efficiency(gpu):
    curve = default_curve(gpu)
    for hidden in (2048, 4096, 8192):
        for batch in (1, 2, 4):
            assert curve.at(batch, hidden, 2 * 1024) < 0.2
    # a batch-1 step on an A100 or H100 streams every weight for 2 FLOPs each: well under 1% of peak
    if gpu.startswith(("A100", "H100")):
        assert curve.at(1, 4096, 200) < 0.01


def test_memory_bound_regime_scales_with_the_ridge():
    """Same SM family, different memory: the H20 (ridge 37 FLOP/B) is far less memory-bound at small
    batches than the H100 (295 FLOP/B), and both saturate towards the same ceiling."""
    h100, h20 = default_curve("H100-80G"), default_curve("H20")
    assert h20.e_max == h100.e_max
    assert h20.at(8, 4096) > 4 * h100.at(8, 4096)
    assert h20.at(65536, 8192) == pytest.approx(h100.at(65536, 8192), rel=0.1)


def test_more_tensor_parallel_ranks_never_raise_efficiency():
    curve = default_curve("H100-80G")
    for tokens in (16, 1024, 16384):
        per_tp = [curve.at(tokens, 8192, 4096, tp=tp) for tp in (1, 2, 4, 8)]
        assert per_tp == sorted(per_tp, reverse=True)


def test_long_sequences_lower_efficiency_through_attention():
    curve = default_curve("A100-80G")
    values = [curve.at(65536, 4096, seq) for seq in (0, 2048, 8192, 32768)]
    assert values == sorted(values, reverse=True)
    assert values[-1] < 0.75 * values[0]


def test_arrays_in_arrays_out():
    curve = default_curve("A100-80G")
    batch = np.array([1, 8, 64, 512])
    context = np.array([100, 200, 400, 800])
    out = curve.at(batch, 4096, 2 * context)
    assert isinstance(out, np.ndarray) and out.shape == (4,)
    assert out == pytest.approx([curve.at(b, 4096, 2 * c) for b, c in zip(batch, context)])
    assert curve.at(0, 4096) == curve.at(1, 4096)  # an empty call is read as one token, never a 0 efficiency


def test_large_training_shapes_of_the_data_are_fitted():
    """Training points with micro-batches of >= 16k tokens and sequences up to 8k: median relative error
    within 5%, every point within 25%."""
    points = [p for p in load_points() if p.kind == "train" and p.tokens >= 16384 and p.seq_len <= 8192]
    assert len(points) >= 50
    errors = [abs(fit / p.efficiency - 1) for p, fit in eff.fitted(points)]
    assert statistics.median(errors) < 0.05
    worst = max(range(len(points)), key=errors.__getitem__)
    assert errors[worst] < 0.25, points[worst].id


def test_inference_points_are_fitted():
    points = [p for p in load_points() if p.kind in ("prefill", "decode")]
    assert len(points) >= 8
    errors = [abs(fit / p.efficiency - 1) for p, fit in eff.fitted(points)]
    assert statistics.median(errors) < 0.15
    assert max(errors) < 0.35


def test_shipped_data_spans_the_shapes_the_planner_costs():
    points = load_points()
    assert len(points) >= 30
    assert {"A100-80G", "H100-80G"} <= {p.gpu for p in points}
    assert {"train", "prefill", "decode"} <= {p.kind for p in points}
    whole = [p for p in points if p.kind in eff.WHOLE_MODEL]
    assert min(p.tokens for p in whole) <= 1 and max(p.tokens for p in whole) >= 65536
    assert min(p.hidden for p in whole) <= 2048 and max(p.hidden for p in whole) >= 8192
    assert all(p.source.startswith("https://") and p.derivation is not None for p in points)


def test_fit_recovers_known_parameters():
    truth = EfficiencyCurve(e_max=0.7, k_w=1.4, k_a=6.0, e_attn=0.3, ridge=200.0)
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(40):
        tokens, hidden = float(2 ** rng.integers(0, 16)), int(rng.choice([1024, 2048, 4096, 8192]))
        seq_len, tp = int(rng.choice([0, 512, 4096, 32768])), int(rng.choice([1, 2, 8]))
        samples.append((tokens, hidden, seq_len, truth.at(tokens, hidden, seq_len, tp=tp), tp))
    got = fit_curve(samples, ridge=200.0)
    for name in eff.PARAMS:
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert got.ridge == 200.0


def test_fit_with_a_pinned_parameter_and_no_attention_samples():
    """A profile at seq_len 0 cannot see attention: pin e_attn and the rest is still recovered."""
    truth = EfficiencyCurve(e_max=0.8, k_w=1.6, k_a=3.0, e_attn=0.25, ridge=37.0)
    samples = [(t, h, 0, truth.at(t, h, 0)) for t in (1, 4, 32, 256, 4096) for h in (2048, 5120)]
    got = fit_curve(samples, ridge=37.0, fixed={"e_attn": 0.25})
    assert (got.e_max, got.k_w, got.k_a, got.e_attn) == pytest.approx((0.8, 1.6, 3.0, 0.25), rel=1e-6)
    unpinned = fit_curve(samples, ridge=37.0)
    assert unpinned.e_attn == 1.0  # nothing said about attention: left at its bound
    with pytest.raises(ValueError, match="ridge"):
        fit_curve(samples)
    with pytest.raises(ValueError, match="unknown parameter"):
        fit_curve(samples, ridge=37.0, fixed={"e_maxx": 0.5})


def test_fit_keeps_the_bounds_on_noisy_data():
    rng = np.random.default_rng(1)
    samples = [(t, 4096, 2048, min(1.0, 0.9 * rng.uniform(0.8, 1.2))) for t in (1024, 2048, 4096, 8192)]
    got = fit_curve(samples, ridge=100.0)
    assert 0 < got.e_max <= 1 and 0 < got.e_attn <= 1 and got.k_w >= 0 and got.k_a >= 0


def test_default_curves_per_family_and_for_specs():
    a100, h100, h200 = default_curve("A100-80G"), default_curve("H100-80G"), default_curve("H200-141G")
    assert a100.e_max != h100.e_max  # each family with data has its own fit
    assert h200.e_max == h100.e_max and h200.ridge < h100.ridge  # Hopper siblings: same fit, own ridge
    assert a100.k_w == h100.k_w  # shared: the weight stream is a property of memory
    assert default_curve("A100-80G") is a100  # cached
    spec = msgspec.structs.replace(HARDWARE_PRESETS["H100-80G"], name="NVIDIA H100 80GB HBM3")
    assert eff.curve_for(spec) == h100
    assert eff.curve_for(cpu_cluster(HARDWARE_PRESETS["H100-80G"], 2).hardware) is None
    with pytest.raises(ConfigError, match="not a preset"):
        default_curve("B300-ish")
    assert default_curve("B300-ish", ridge=250.0).ridge == 250.0  # unknown family: the shared parameters


def test_curve_is_a_plain_spec():
    curve = default_curve("A100-80G")
    assert msgspec.json.decode(msgspec.json.encode(curve), type=EfficiencyCurve) == curve
    with pytest.raises(ConfigError):
        EfficiencyCurve(e_max=1.2, k_w=1.0, k_a=1.0, e_attn=0.3, ridge=100.0)


# ------------------------------------------------------------------ bad data files


GOOD = {
    "id": "p1",
    "gpu": "A100-80G",
    "kind": "train",
    "tokens": 8192,
    "hidden": 4096,
    "seq_len": 4096,
    "tp": 1,
    "efficiency": 0.5,
    "derivation": {"tokens_per_s": 3900.0, "flops_per_token": 1.3333e10, "passes": 3},
    "source": "https://example.org/table",
}


def write(tmp_path: Path, *points: dict) -> Path:
    path = tmp_path / "eff.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "points": list(points)}))
    return path


def test_good_file_loads(tmp_path):
    (point,) = load_points(write(tmp_path, GOOD))
    assert point.id == "p1" and point.efficiency == 0.5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"source": None}, "source"),
        ({"efficiency": 1.3}, "efficiency"),
        ({"efficiency": 0.0}, "efficiency"),
        ({"tokens": -5}, "tokens"),
        ({"kind": "sampling"}, "kind"),
        ({"gpu": "A100-80"}, "Did you mean 'A100-80G'"),
        ({"efficiency": 0.4}, "disagrees with its derivation"),
        ({"derivation": {"tokens_per_s": 10.0}}, "derivation needs"),
        ({"hiden": 4096}, "hiden"),
    ],
    ids=[
        "missing-field",
        "above-one",
        "zero",
        "negative-tokens",
        "bad-kind",
        "unknown-gpu",
        "derivation",
        "partial-derivation",
        "typo",
    ],
)
def test_bad_points_name_the_file_and_the_point(tmp_path, change, message):
    bad = {k: v for k, v in {**GOOD, "id": "bad-one", **change}.items() if v is not None}
    path = write(tmp_path, GOOD, bad)
    with pytest.raises(ConfigError) as err:
        load_points(path)
    text = str(err.value)
    assert str(path) in text and "point 1 ('bad-one')" in text and message in text


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_points(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="id 'p1' is given twice"):
        load_points(write(tmp_path, GOOD, GOOD))
    empty = tmp_path / "empty.yaml"
    empty.write_text("version: 1\npoints: []\n")
    with pytest.raises(ConfigError, match="non-empty list 'points'"):
        load_points(empty)
    unsafe = tmp_path / "unsafe.yaml"
    unsafe.write_text("points: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError):
        load_points(unsafe)
