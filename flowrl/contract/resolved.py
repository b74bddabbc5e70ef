"""What the planner resolves for each graph model and node: the specs engines receive (never the whole plan)."""

from __future__ import annotations

from typing import Any

from flowrl.specs import AlgoConfig, LoraConfig, Spec, TinyModelConfig


class NodeOptions(Spec):
    """A node's resolved options: the algorithm settings it runs with (the config's, with the node's
    overrides) and the keyword options its function receives (train nodes: epochs, mini_batches)."""

    algo: AlgoConfig
    options: dict[str, Any] = {}


class SamplingSpec(Spec):
    """How a model samples, and the temperature its log-probs are taken at."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16  # the response budget (tokens, EOS included)
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)
    stop: tuple[str, ...] = ()  # texts that end a response (the text is kept, the rest cut)
    dtype: str = "float32"  # the precision generation samples in
    tp: int = 1  # tensor-parallel size of each generation replica


class OptimizerSpec(Spec):
    """A trainable model's optimizer (AdamW) and step rules."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    skip_nonfinite: bool = False  # skip a step whose loss or gradient is not finite (else stop, naming the node)


class EngineNumerics(Spec):
    """How a training engine computes: weight dtype, attention kernel, activation recomputation."""

    dtype: str = "float32"
    attention: str = "eager"
    recompute: bool = False


class ModelRun(Spec):
    """Everything an engine needs to build and run one graph model, resolved by the planner."""

    model: str
    checkpoint: str | None = None  # an HF-format model folder; None: a fresh tiny model
    tiny: TinyModelConfig = TinyModelConfig()
    seed: int = 0
    training_engine: str = "local"
    generation_engine: str | None = None  # None: the model does not generate
    sampling: SamplingSpec = SamplingSpec()
    optimizer: OptimizerSpec | None = None  # None: frozen
    numerics: EngineNumerics = EngineNumerics()
    max_tokens_per_micro_batch: int | None = None  # a token budget per micro-batch (None: rows only)
    pack: bool = False  # each micro-batch's rows packed into one row without padding
    lora: LoraConfig | None = None  # LoRA adapters on a trainable model (None: it trains whole)
