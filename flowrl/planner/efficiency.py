"""Matmul efficiency that depends on the work, fitted to published measurements rather than guessed.

The cost model turns FLOPs into time as ``FLOPs / (devices * peak_bf16 * efficiency)``. A constant
efficiency is wrong at both ends: a decode step of a few tokens streams every weight for little arithmetic
and reaches well under 1% of peak, while a training micro-batch of thousands of tokens reaches 40-60%.
This module gives that efficiency as a function of the work's shape.

Formula, per device (``R`` = peak FLOP/s / memory bytes/s, the device's roofline ridge in FLOP per byte)::

    1 / eff = (1 - a) * (1 / e_max + k_w * R / tokens + k_a * R * tp / hidden) + a / e_attn
    a       = seq_len / (seq_len + 12 * hidden)

Read ``1 / eff`` as time per FLOP in units of ``1 / peak``, summed over what the work waits for: dense
matmuls at their best (``1 / e_max``); streaming the weights once per call, which costs ``R / tokens``
relative to the FLOPs because a bf16 weight is 2 bytes and earns 2 FLOPs per token (``k_w``, about
1 / achieved-bandwidth-fraction); activation traffic of the elementwise ops (norms, activations,
residuals), ``tokens * hidden / tp`` bytes against ``tokens * hidden**2 / tp`` FLOPs per layer (``k_a``);
and attention, whose share of a causal pass's FLOPs is ``a`` (2 * seq_len * hidden against about
24 * hidden**2 per token and layer) and which runs at its own efficiency ``e_attn``. In tokens alone this is
the saturating curve ``eff = e_max * tokens / (tokens + tokens_half)`` with ``tokens_half = k_w * R * e_max``
(below it the call is memory-bound and eff grows linearly with tokens); hidden saturates the ceiling the
same way. Because the memory terms scale with the ridge ``R``, one set of four parameters carries to GPUs
the data does not cover (an H20, whose ridge is 37 FLOP/byte against the H100's 295, is far less
memory-bound at small batches).

Inputs: ``tokens`` = tokens one device processes per call (a training or forward micro-batch:
micro_batch * seq_len; a prefill: its prompt tokens; a decode step: the live sequences; tensor-parallel
ranks all see every token); ``hidden`` = the model's hidden size; ``seq_len`` = the length of the causal
pass (a token attends to seq_len / 2 keys on average; for a decode step over a context of C tokens pass
2 * C; 0 for a bare matmul); ``tp`` = the tensor-parallel ranks sharing each matmul. The efficiency is of
*executed* FLOPs counted the cost model's way (``ModelSpec.flops_per_token``: causal attention, no
embedding lookup): a training step with full activation recomputation executes 4 passes, not 3.

Fit: least squares on the relative error of eff (``1 / eff`` is linear in ``1 / e_max, k_w, k_a,
1 / e_attn``; iteratively reweighted so the residual is ``eff_fit / eff - 1``, with the bounds
``e_max, e_attn <= 1`` and ``k_w, k_a >= 0`` kept by solving on every support set). ``default_curve``
fits all 171 whole-model points (train, forward, prefill, decode) for the shared parameters, then refits
``e_max, k_a, e_attn`` per GPU family that has data (A100: 119 points; Hopper, i.e. H100: 52) with the
shared ``k_w``, which only the decode points pin down and which is a property of memory, not of the
family. Hopper siblings (H200, H800, H20) use the Hopper parameters with their own ridge; other GPUs get
the shared parameters (e_max 0.81, k_w 1.51, k_a 7.5, e_attn 0.24) with theirs.

    family   e_max   k_w    k_a    e_attn   tokens_half at hidden 4096
    A100     0.774   1.507  5.26   0.295    155 (A100-80G), 195 (A100-40G)
    Hopper   0.599   1.507  4.48   0.165    223 (H100), 164 (H200), 33 (H20)

Data: ``flowrl/planner/data/efficiency.yaml``, 186 points, each with its source, table and row: MosaicML
LLM Foundry's MPT training benchmarks (A100-40G, A100-80G, H100; 760M-70B, hidden 1536-8192, sequence
512-65536, micro-batches of 4k-98k tokens), torchtitan and IBM fms-fsdp Llama training on A100,
TensorRT-LLM first-token latencies and FasterTransformer prefill/decode latencies (prefills of 128-2048
tokens), gpt-fast batch-1 decode on A100, and XLA's measured bf16 GEMM table for sm_90 (``kind: gemm``:
the bare-matmul ceiling, kept for reference and not in the default fit). Each point's efficiency is
recomputed from the published throughput in the cost model's FLOP convention (published MFU counts
attention non-causally and counts no recompute), and ``load_points`` checks it against the stored
derivation.

Residuals (``python benchmarks/efficiency_fit.py``), relative error of the default curves over the 171
whole-model points: median 4.3%, 90th percentile 14%, max 39%; over the 11 prefill and decode points:
median 10%, max 29%. The curves overestimate the runs whose FSDP weight all-gathers were not hidden
(70B on 64 A100-40G at 2 x 2048 tokens per micro-batch, the worst point; 13B at one 4096-token sequence):
that communication is the cost model's own term, not the matmuls'. Tensor-parallel decode at batch 1
(all-reduce latency, also costed separately) and the largest-sequence runs are the other misses.

``flowrl profile`` on a GPU fills the same model: measure whole-layer forward (or forward + backward) steps
at a few (tokens, seq_len) shapes, turn each into an efficiency of executed FLOPs, and call
``fit_curve(samples, ridge=peak / bandwidth)``; a profile with a single seq_len cannot separate
``e_attn`` and should pass ``fixed={"e_attn": default_curve(name).e_attn}``.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import yaml
from msgspec import Meta

from flowrl.contract.checked import CheckedSpec, Count, Fraction, Positive, coerce_numbers
from flowrl.contract.hardware import CPU_DEVICES, DENSE_PER_LAYER, LOCAL_CPU, EfficiencyCurve, HardwareSpec
from flowrl.errors import ConfigError, did_you_mean
from flowrl.planner.hardware import HARDWARE_PRESETS
from flowrl.specs import Spec, convert, read_document

#: The measured points shipped with flowrl.
DEFAULT_DATA = Path(__file__).parent / "data" / "efficiency.yaml"
#: Kinds of work that run a whole model (the default curves are fitted to these); ``gemm`` is one bare matmul.
WHOLE_MODEL = ("train", "forward", "prefill", "decode")
#: Relative disagreement allowed between a point's efficiency and the one its derivation gives.
DERIVATION_TOLERANCE = 0.01
#: Fewest whole-model points a GPU family needs for its own fit (else it gets the shared parameters).
MIN_FAMILY_POINTS = 20
PARAMS = ("e_max", "k_w", "k_a", "e_attn")

Kind = Literal["train", "forward", "prefill", "decode", "gemm"]
NonNegativeInt = Annotated[int, Meta(ge=0)]


class Derivation(Spec):
    """How a point's efficiency follows from what was published: ``tokens_per_s * passes *
    flops_per_token / peak`` for whole-model work, ``flop_per_s / peak`` for a GEMM."""

    tokens_per_s: Positive | None = None  # per GPU
    flops_per_token: Positive | None = None  # forward FLOPs per token, the cost model's convention
    passes: Count | None = None  # 1 forward, 3 training step, 4 with full recomputation
    flop_per_s: Positive | None = None  # per GPU


class EfficiencyPoint(CheckedSpec, kw_only=True):
    """One measured point of ``efficiency.yaml``."""

    id: str
    gpu: str  # a HARDWARE_PRESETS name
    kind: Kind
    tokens: Positive
    hidden: Count
    seq_len: NonNegativeInt
    tp: Count = 1
    efficiency: Fraction
    derivation: Derivation | None = None
    measured: str = ""
    source: str
    where: str = ""

    @property
    def ridge(self) -> float:
        return _ridge(HARDWARE_PRESETS[self.gpu])


# ------------------------------------------------------------------ data


def load_points(path: str | Path = DEFAULT_DATA) -> list[EfficiencyPoint]:
    """The points of an efficiency data file (YAML, read with a safe loader). Errors are ConfigErrors that
    name the file and the point: a missing or malformed field, an efficiency outside (0, 1], an unknown
    GPU, a derivation that disagrees with the efficiency, a repeated id."""
    path = Path(path)
    what = f"efficiency data '{path}'"
    if not path.is_file():
        raise ConfigError(f"{what} does not exist.")
    if path.resolve() == DEFAULT_DATA.resolve() and hasattr(yaml, "CSafeLoader"):
        data = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)  # the shipped file (its ids are checked below)
    else:
        data = read_document(path)
    raw = data.get("points") if isinstance(data, dict) else None
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{what}: expected a mapping with a non-empty list 'points'.")
    points: list[EfficiencyPoint] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        name = item.get("id") if isinstance(item, dict) else None
        where = f"{what}, point {i}" + (f" ('{name}')" if name else "")
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected a mapping of fields, got {type(item).__name__}.")
        point = convert(coerce_numbers(item, EfficiencyPoint), EfficiencyPoint, where)
        if point.gpu not in HARDWARE_PRESETS:
            raise ConfigError(
                f"{where}: unknown gpu '{point.gpu}'.{did_you_mean(point.gpu, list(HARDWARE_PRESETS))} "
                f"Known: {', '.join(HARDWARE_PRESETS)}."
            )
        if point.id in seen:
            raise ConfigError(f"{where}: id '{point.id}' is given twice.")
        seen.add(point.id)
        _check_derivation(point, where)
        points.append(point)
    return points


def _check_derivation(point: EfficiencyPoint, where: str) -> None:
    d = point.derivation
    if d is None:
        return
    peak = HARDWARE_PRESETS[point.gpu].peak_flops_bf16
    if d.flop_per_s is not None:
        derived = d.flop_per_s / peak
    elif d.tokens_per_s is not None and d.flops_per_token is not None and d.passes is not None:
        derived = d.tokens_per_s * d.passes * d.flops_per_token / peak
    else:
        raise ConfigError(f"{where}: derivation needs flop_per_s, or tokens_per_s, flops_per_token and passes.")
    if abs(derived / point.efficiency - 1.0) > DERIVATION_TOLERANCE:
        raise ConfigError(
            f"{where}: efficiency {point.efficiency:g} disagrees with its derivation, which gives {derived:.4g} "
            f"(against the {point.gpu} peak of {peak:.4g} FLOP/s)."
        )


# ------------------------------------------------------------------ fit


Sample = EfficiencyPoint | Sequence[float]


def fit_curve(
    samples: Iterable[Sample], *, ridge: float | None = None, fixed: Mapping[str, float] | None = None
) -> EfficiencyCurve:
    """Fit the curve to measured samples: least squares on the relative error of the efficiency.

    ``samples``: EfficiencyPoints (each carries its GPU's ridge), or tuples ``(tokens, hidden, seq_len,
    efficiency)`` / ``(tokens, hidden, seq_len, efficiency, tp)`` measured on one device whose ``ridge``
    (peak FLOP/s / memory bytes/s) must then be given; this is what ``flowrl profile`` calls with its own
    measurements. The returned curve carries ``ridge``, else the samples' common ridge. ``fixed`` pins
    parameters by name (``e_max``, ``k_w``, ``k_a``, ``e_attn``); one the samples cannot determine (no
    sample with seq_len > 0 says nothing of ``e_attn``) is left at its bound (e_attn = 1, k = 0) unless pinned.
    """
    t, h, length, tp, r, eff = _arrays(samples, ridge)
    if ridge is None:
        if np.ptp(r) > 1e-9 * r[0]:
            raise ValueError("fit_curve: samples from devices with different ridges; pass ridge= for the curve")
        ridge = float(r[0])
    params = _fit(t, h, length, tp, r, eff, dict(fixed or {}))
    return EfficiencyCurve(**params, ridge=ridge)


def _arrays(samples: Iterable[Sample], ridge: float | None) -> tuple[np.ndarray, ...]:
    rows: list[tuple[float, float, float, float, float, float]] = []
    for s in samples:
        if isinstance(s, EfficiencyPoint):
            rows.append((s.tokens, s.hidden, s.seq_len, s.tp, s.ridge, s.efficiency))
            continue
        if len(s) not in (4, 5):
            raise ValueError(f"fit_curve: a sample is (tokens, hidden, seq_len, efficiency[, tp]), got {s!r}")
        if ridge is None:
            raise ValueError("fit_curve: tuple samples need ridge= (the device's peak FLOP/s / memory bytes/s)")
        tokens, hidden, seq_len, efficiency = (float(v) for v in s[:4])
        rows.append((tokens, hidden, seq_len, float(s[4]) if len(s) == 5 else 1.0, ridge, efficiency))
    if not rows:
        raise ValueError("fit_curve: no samples")
    arr = np.array(rows, dtype=float)
    if not (np.all(arr[:, 5] > 0) and np.all(arr[:, 5] <= 1) and np.all(arr[:, [0, 1, 3, 4]] > 0)):
        raise ValueError("fit_curve: efficiencies must lie in (0, 1] and tokens, hidden, tp, ridge be positive")
    return tuple(arr[:, i] for i in range(6))


def _design(t: np.ndarray, h: np.ndarray, length: np.ndarray, tp: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Columns whose combination with (1/e_max, k_w, k_a, 1/e_attn) is 1/eff."""
    a = length / (length + DENSE_PER_LAYER * h)
    return np.column_stack([1.0 - a, (1.0 - a) * r / np.maximum(t, 1.0), (1.0 - a) * r * tp / h, a])


def _fit(
    t: np.ndarray,
    h: np.ndarray,
    length: np.ndarray,
    tp: np.ndarray,
    r: np.ndarray,
    eff: np.ndarray,
    fixed: dict[str, float],
) -> dict[str, float]:
    unknown = set(fixed) - set(PARAMS)
    if unknown:
        raise ValueError(f"fit_curve: unknown parameter(s) {sorted(unknown)}; known: {', '.join(PARAMS)}")
    x = _design(t, h, length, tp, r)
    y = 1.0 / eff
    # theta = (1/e_max, k_w, k_a, 1/e_attn) = floor + q with q >= 0
    floor = np.array([1.0, 0.0, 0.0, 1.0])
    theta_fixed = {
        i: (1.0 / fixed[p] if p in ("e_max", "e_attn") else fixed[p]) for i, p in enumerate(PARAMS) if p in fixed
    }
    free = [i for i in range(4) if i not in theta_fixed and np.any(x[:, i] > 0)]
    base = x @ floor
    for i, v in theta_fixed.items():
        base += x[:, i] * (v - floor[i])
    target = y - base
    q = np.zeros(4)
    weight = 1.0 / y
    for _ in range(100):
        q_new = np.zeros(4)
        q_new[free] = _nnls(x[:, free] * weight[:, None], target * weight)
        fitted = base + x[:, free] @ q_new[free]
        weight_new = 1.0 / fitted
        done = np.allclose(q_new, q, rtol=1e-10, atol=1e-12)
        q, weight = q_new, weight_new
        if done:
            break
    theta = floor + q
    for i, v in theta_fixed.items():
        theta[i] = v
    return {
        "e_max": float(1.0 / theta[0]),
        "k_w": float(theta[1]),
        "k_a": float(theta[2]),
        "e_attn": float(1.0 / theta[3]),
    }


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a q - b| subject to q >= 0, exactly, by trying every support (at most 4 columns here)."""
    n = a.shape[1]
    best, best_cost = np.zeros(n), float(b @ b)
    for k in range(1, n + 1):
        for support in itertools.combinations(range(n), k):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            q = np.zeros(n)
            q[cols] = sol
            cost = float(np.sum((a @ q - b) ** 2))
            if cost < best_cost:
                best, best_cost = q, cost
    return best


# ------------------------------------------------------------------ defaults


def family(hardware_name: str) -> str | None:
    """The GPU family whose fitted parameters a device uses: 'A100' (A100, A800) or 'Hopper' (H100, H200,
    H800, H20: the same SM and kernels, so the same parameters, with each part's own ridge), else None (the
    shared parameters)."""
    if re.search(r"A100|A800", hardware_name, re.IGNORECASE):
        return "A100"
    if re.search(r"H100|H200|H800|H20", hardware_name, re.IGNORECASE):
        return "Hopper"
    return None


@cache
def _default_points() -> tuple[EfficiencyPoint, ...]:
    return tuple(p for p in load_points(DEFAULT_DATA) if p.kind in WHOLE_MODEL)


@cache
def _family_params(name: str | None) -> tuple[tuple[str, float], ...]:
    points = _default_points()
    shared = _fit(*_arrays(points, None), {})
    members = [p for p in points if family(p.gpu) == name] if name else []
    if len(members) < MIN_FAMILY_POINTS:
        return tuple(shared.items())
    return tuple(_fit(*_arrays(members, None), {"k_w": shared["k_w"]}).items())


def _ridge(hw: HardwareSpec) -> float:
    return hw.peak_flops_bf16 / hw.memory_bandwidth


@cache
def default_curve(hardware_name: str, ridge: float | None = None) -> EfficiencyCurve:
    """The curve fitted to the repository's data for a device: its family's parameters where the data has
    that family (A100, H100 and its Hopper siblings), the shared ones otherwise, with the device's ridge
    (the preset's, or ``ridge`` = peak FLOP/s / memory bytes/s for a device that is not a preset)."""
    if ridge is None:
        preset = HARDWARE_PRESETS.get(hardware_name)
        if preset is None:
            raise ConfigError(
                f"no efficiency curve for hardware '{hardware_name}': it is not a preset "
                f"({', '.join(HARDWARE_PRESETS)}); pass its ridge (peak FLOP/s / memory bytes/s) "
                "or use curve_for(spec)."
            )
        ridge = _ridge(preset)
    if not (ridge > 0 and math.isfinite(ridge)):
        raise ValueError(f"default_curve: ridge must be a positive number, got {ridge!r}")
    return EfficiencyCurve(**dict(_family_params(family(hardware_name))), ridge=ridge)


def curve_for(hw: HardwareSpec) -> EfficiencyCurve | None:
    """The default curve for a hardware spec (presets, cluster files, `flowrl profile` results); None for
    this machine's CPU, which the GPU data says nothing about (keep ``hw.matmul_efficiency`` there)."""
    if hw.name == CPU_DEVICES or hw.name.startswith(LOCAL_CPU):
        return None
    return default_curve(hw.name, _ridge(hw))


def fitted(points: Iterable[EfficiencyPoint]) -> list[tuple[EfficiencyPoint, float]]:
    """Each point with the efficiency its GPU's default curve gives at its shape."""
    return [(p, default_curve(p.gpu).at(p.tokens, p.hidden, p.seq_len, tp=p.tp)) for p in points]
