"""What one RL step processes: prompts, samples, and the prompt/response length distributions
(workload files and flags: `flowrl.planner.workload`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

from msgspec import Meta

from flowrl.contract.checked import CheckedSpec, Count, Fraction, SpecFieldError
from flowrl.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]


class LengthDistribution(CheckedSpec, tag_field="kind"):
    """Base of the length distributions (a tagged union on ``kind``)."""


class Fixed(LengthDistribution, kw_only=True, tag="fixed"):
    value: Count


class LogNormal(LengthDistribution, kw_only=True, tag="lognormal"):
    """``clamp(round(exp(N(log(median), sigma))), 1, max)``: RL response lengths have a long tail."""

    median: PositiveFloat
    sigma: Annotated[float, Meta(ge=0, le=10)]  # beyond 10 the mean overflows; real RL tails are sigma < 2
    max: Count


class Histogram(LengthDistribution, kw_only=True, tag="histogram"):
    """An empirical distribution: ``lengths[i]`` with probability ``weights[i] / sum(weights)``."""

    lengths: list[Count]
    weights: list[PositiveFloat]

    def __post_init__(self) -> None:
        if not self.lengths:
            raise SpecFieldError("Histogram field 'lengths' must not be empty")
        if len(self.lengths) != len(self.weights):
            raise SpecFieldError(
                f"Histogram fields 'lengths' and 'weights' must have the same length, got {len(self.lengths)} "
                f"and {len(self.weights)}"
            )
        super().__post_init__()
        if not all(math.isfinite(w) for w in self.weights):
            raise SpecFieldError("Histogram field 'weights' must be finite")


Lengths = Fixed | LogNormal | Histogram
_KINDS = ("fixed", "lognormal", "histogram")


def sample_lengths(dist: Lengths, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths as an int64 array; the same ``rng`` state gives the same lengths."""
    import numpy as np

    if n < 0:
        raise ConfigError(f"sample_lengths: n must be >= 0, got {n}.")
    if isinstance(dist, Fixed):
        return np.full(n, dist.value, dtype=np.int64)
    if isinstance(dist, LogNormal):
        raw = rng.lognormal(mean=math.log(dist.median), sigma=dist.sigma, size=n)
        return np.clip(np.rint(raw), 1, dist.max).astype(np.int64)
    if isinstance(dist, Histogram):
        weights = _probabilities(dist)
        index = rng.choice(len(dist.lengths), size=n, p=weights)
        return np.asarray(dist.lengths, dtype=np.int64)[index]
    raise TypeError(f"not a length distribution: {dist!r}")


def _probabilities(dist: Histogram) -> np.ndarray:
    """A histogram's weights as probabilities, scaled first so that huge weights (1e308) do not
    overflow their sum."""
    import numpy as np

    weights = np.asarray(dist.weights, dtype=np.float64)
    weights = weights / weights.max()
    return weights / weights.sum()


def mean_length(dist: Lengths) -> float:
    """The expected length.

    Exact for ``fixed`` and ``histogram``. For ``lognormal`` it is the closed-form mean of the
    *clamped* continuous distribution, ``E[clamp(X, 1, max)]`` with ``X ~ LogNormal(log(median),
    sigma)``; only the rounding to integers is ignored (it moves the mean by well under one token).
    """
    if isinstance(dist, Fixed):
        return float(dist.value)
    if isinstance(dist, Histogram):
        import numpy as np

        return float(np.dot(_probabilities(dist), np.asarray(dist.lengths, dtype=np.float64)))
    if isinstance(dist, LogNormal):
        lo, hi = 1.0, float(dist.max)
        mu, s = math.log(dist.median), dist.sigma
        if s == 0:
            return min(max(dist.median, lo), hi)
        if hi <= lo:
            return lo

        def cdf(z: float) -> float:
            return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

        a, b = (math.log(lo) - mu) / s, (math.log(hi) - mu) / s
        # E[X; lo < X < hi] = exp(mu + s^2/2) * (Phi(b - s) - Phi(a - s))
        middle = math.exp(mu + s * s / 2) * (cdf(b - s) - cdf(a - s))
        return lo * cdf(a) + middle + hi * (1.0 - cdf(b))
    raise TypeError(f"not a length distribution: {dist!r}")


def max_length(dist: Lengths) -> int:
    """The longest length the distribution can produce."""
    if isinstance(dist, Fixed):
        return dist.value
    if isinstance(dist, LogNormal):
        return dist.max
    if isinstance(dist, Histogram):
        return max(dist.lengths)
    raise TypeError(f"not a length distribution: {dist!r}")


#: Sequences per step beyond which a workload is a typo (the simulator samples a length per sequence).
MAX_SEQUENCES = 1 << 24


class WorkloadSpec(CheckedSpec, kw_only=True):
    prompts_per_step: Count = 1024
    samples_per_prompt: Count = 1
    prompt_length: Count = 1024
    response_length: Lengths = Fixed(value=1024)
    ppo_epochs: Count = 1
    mini_batches: Count = 1
    # dynamic sampling: the fraction of sampled prompt groups a graph's filter keeps; generation
    # samples rounds of prompts until the batch is full (1/acceptance_rate rounds, at most the
    # filter's max_rounds). A run measures it and writes it into its plan.yaml's workload.
    acceptance_rate: Fraction = 1.0
    # multi-turn episodes: model turns per response (each a generation call that re-reads the context
    # so far) and the seconds an environment takes to answer one turn (in the driver, turn by turn)
    turns: Count = 1
    env_s_per_turn: float = 0.0
    # a trainer without remove-padding (verl before its use_remove_padding, early 2025): every row its train and
    # forward passes compute is padded to this many tokens, its prompt budget plus its response budget; None:
    # rows as the runtime cuts them (each micro-batch padded to its longest, or packed)
    padded_to: Count | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.padded_to is not None and self.padded_to < self.prompt_length + self.max_response():
            raise SpecFieldError(
                f"WorkloadSpec field 'padded_to' ({self.padded_to}) must hold a whole row: at least prompt_length + "
                f"the longest response ({self.prompt_length} + {self.max_response()})"
            )
        if not 0.0 <= self.env_s_per_turn < 3600:
            raise SpecFieldError(
                f"WorkloadSpec field 'env_s_per_turn' must be in [0, 3600) seconds, got {self.env_s_per_turn}"
            )
        if self.sequences > MAX_SEQUENCES:
            raise SpecFieldError(
                f"WorkloadSpec fields 'prompts_per_step' x 'samples_per_prompt' = {self.sequences:.3g} sequences per "
                f"step, more than the {MAX_SEQUENCES:,} the planner models (no published run comes near); check "
                "them for a typo"
            )
        if self.mini_batches > self.sequences:
            raise SpecFieldError(
                f"WorkloadSpec field 'mini_batches' ({self.mini_batches}) must not exceed the sequences per step "
                f"({self.sequences} = prompts_per_step x samples_per_prompt)"
            )

    @property
    def sequences(self) -> int:
        """Sequences generated (and trained on) per step: prompts x samples."""
        return self.prompts_per_step * self.samples_per_prompt

    def max_response(self) -> int:
        return max_length(self.response_length)

    def mean_response(self) -> float:
        return mean_length(self.response_length)

    def max_sequence(self) -> int:
        """Longest prompt + response."""
        return self.prompt_length + self.max_response()

    def longest_trained_row(self) -> int:
        """The longest row a train or forward pass computes: prompt + longest response, or the length a trainer
        without remove-padding pads every row to (``padded_to``)."""
        return self.padded_to or self.max_sequence()
