"""Run configuration specs (msgspec) and the one function that loads them.

Precedence, lowest first: struct defaults < the graph module's ``DEFAULTS`` < ``--config FILE``
< ``--set key=value`` < dedicated CLI flags (``--steps``, ``--seed``, ``--model``, ``--out``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from flowrl.errors import ConfigError, did_you_mean, plain_name


class Spec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The base of every spec and plan struct: frozen, keyword-only, unknown fields refused."""


class TinyModelConfig(Spec):
    """The Llama-style model built from scratch when no ``--model`` directory is given."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 2  # heads of 32: the smallest size vLLM's CPU attention kernels run
    num_kv_heads: int = 1
    vocab_size: int | None = None  # None: the tokenizer's size
    max_position_embeddings: int = 128


class RolloutConfig(Spec):
    prompts_per_step: int = 32
    samples_per_prompt: int = 16
    max_new_tokens: int | None = None  # None: the task's budget
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False  # always generate max_new_tokens (benchmarks)
    stop: list[str] = []  # texts that end a response (kept in it; what follows is cut), e.g. ["</answer>"]
    # How rollouts flow (None: the planner chooses; one device: sync). '+'-joined parts of
    # sync | one_step_off | async (when generation may start) and partial, streaming:
    # e.g. "one_step_off", "async", "partial", "partial+async", "streaming".
    mode: str | None = None
    staleness: int | None = None  # eta: the oldest token a trained sample may hold, in versions (None: the mode's)
    overprovision: float = 0.25  # partial: extra prompts launched per step (APRIL)
    chunk_tokens: int | None = None  # partial/async/streaming: tokens decoded between checks (None: budget/4, >= 8)
    stream_groups: int = 8  # streaming: prompt groups per micro-batch sent downstream while generation goes on


#: ``generation.engine=auto``: the planner picks the engine it predicts fastest (see planner/passes/place.py:
#: place); ``train.dtype`` / ``train.attention`` ``auto``: the device's best (`resolve_numerics`).
AUTO = "auto"


class LoraConfig(Spec):
    """LoRA adapters on a trained model's linear layers (through peft): only the adapters (and a
    critic's value head) train; checkpoints hold them, and weight syncs send the merged weights."""

    rank: int = 0  # 0: no adapters, the whole model trains
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrainConfig(Spec):
    lr: float = 2e-3
    critic_lr: float | None = None  # None: same as lr
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    epochs: int = 1  # passes over each batch (PPO epochs)
    mini_batches: int = 2  # optimizer steps per epoch
    micro_batch_size: int | None = None  # None: the planner chooses
    engine: str = "local"  # the training engine (a registered plugin) for every model
    # a non-finite loss or gradient: False stops the run naming the node; True skips that
    # optimizer step (counted in the node's `skipped` metric)
    skip_nonfinite: bool = False
    # how the training engine computes (master weights and optimizer states stay float32): the precision
    # the model computes in, the attention kernel, and recomputing each decoder layer's activations in
    # the backward pass instead of keeping them. auto: bfloat16 + sdpa on a GPU, float32 + eager on a
    # CPU (faster there for the models a CPU trains)
    dtype: Literal["auto", "float32", "bfloat16"] = AUTO
    attention: Literal["auto", "sdpa", "eager", "flash_attention_2"] = AUTO
    recompute: bool = False
    # a token budget per micro-batch (rows x padded length), for training and forward passes: rows of
    # similar length share a micro-batch until it is full, and data-parallel ranks get equal tokens;
    # None: micro-batches of micro_batch_size rows
    max_tokens_per_micro_batch: int | None = None
    # each micro-batch's rows packed into one row of their real tokens (no padding; attention kept
    # within each row); with max_tokens_per_micro_batch, the budget counts those tokens
    pack: bool = False
    lora: LoraConfig = LoraConfig()


class GenerationConfig(Spec):
    # the generation engine (a registered plugin; the training engine's own when equal), or auto: the
    # planner's choice among the training engine and the engines `flowrl profile` calibrated here
    engine: str = AUTO
    # the precision it samples in; training stays float32 (vllm: either; local samples with the training weights)
    dtype: Literal["float32", "bfloat16"] = "float32"


class AlgoConfig(Spec):
    clip_low: float = 0.2
    clip_high: float = 0.28  # > clip_low: DAPO's clip-higher
    dual_clip: float | None = None
    kl_coef: float = 0.05  # keeps exploring: without it a policy trained from scratch stops emitting EOS
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    gamma: float = 1.0
    lam: float = 0.95
    vf_clip: float | None = 0.2
    vf_coef: float = 1.0
    whiten_advantages: bool = True
    # importance weights between the proximal (old_logprobs) and behaviour (sampling) policy for
    # tokens sampled by older weights (decoupled PPO): clip at is_cap, mask those tokens, or none
    is_correction: Literal["clip", "mask", "none"] = "clip"
    is_cap: float = 5.0
    # sampler/trainer mismatch (e.g. a bf16 vLLM engine beside an fp32 trainer): each token's ratio
    # r = exp(old_logprobs - sampler log-prob) corrects tokens of the current version (stale tokens keep
    # is_correction's weight, so r counts once). tis: weight min(r, mismatch_cap); icepop: weight r, and
    # every token with r outside [mismatch_low, mismatch_high] masked; seq-mask: every response whose
    # geometric-mean r is outside [mismatch_seq_low, mismatch_seq_high] masked; "tis+seq-mask" and
    # "icepop+seq-mask" do both; none: current tokens weigh 1. gspo weighs each response by its geometric-mean r
    mismatch: Literal["none", "tis", "icepop", "seq-mask", "tis+seq-mask", "icepop+seq-mask"] = "tis"
    mismatch_cap: float = 2.0  # tis: the truncation of r (>= 1)
    mismatch_low: float = 0.5  # icepop: tokens with r below it are masked (in (0, 1))
    mismatch_high: float = 2.0  # icepop: tokens with r above it are masked (> 1)
    mismatch_seq_low: float = 0.99  # seq-mask: responses whose geometric-mean r is below it are masked (in (0, 1))
    mismatch_seq_high: float = 1.01  # seq-mask: responses whose geometric-mean r is above it are masked (> 1)
    # how the ppo loss makes one number of its per-token terms: a mean over the batch's tokens; the
    # mean over rows of each row's token mean; or (Dr. GRPO) the mean over rows of each row's token
    # sum over loss_norm tokens (None: the response budget, rollout.max_new_tokens)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    loss_norm: int | None = None


#: What a loss is a mean over (its registered ``aggregate``), so that the training engine weighs each
#: micro-batch's loss by its share of the mini-batch and the gradients add up to the mini-batch's: a
#: token mean by its tokens, a mean over rows by its rows, a sum by 1; ``loss_agg``: as ``algo.loss_agg``.
LOSS_UNITS = ("token-mean", "seq-mean", "sum")
AGGREGATES = (*LOSS_UNITS, "loss_agg")


def loss_unit(aggregate: str, algo: AlgoConfig) -> str:
    """The unit (`LOSS_UNITS`) a loss registered with ``aggregate`` weighs micro-batches in under ``algo``."""
    if aggregate == "loss_agg":
        return "token-mean" if algo.loss_agg == "token-mean" else "seq-mean"
    return aggregate


#: The task that reads the user's files (data.train).
DATA_TASK = "data"


class DataConfig(Spec):
    """Prompts from the user's files (``--data FILE``): the ``data`` task.

    Files are jsonl, json, csv, parquet or a ``datasets.save_to_disk`` folder. ``prompt_key``
    names the column with the prompt (text, or a list of ``{role, content}`` messages),
    ``answer_key`` the ground truth (GSM8K's ``... #### 42`` is read as ``42``); every other
    column reaches reward functions as the row's metadata (``prompt.meta``)."""

    train: str | list[str] = []
    val: str | list[str] = []  # evaluated every eval.every steps and once before training
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # an offline source (graphs/sft.py) trains on each row's response in this column (a conversation in
    # data.prompt_key, assistant turns included, needs none); None: rows are prompts only
    response_key: str | None = None
    # a preference source (rows="pairs": graphs/dpo.py) trains on each row's chosen and rejected response
    # in these columns (text, or a list of messages: the assistant's turns, or the whole conversation
    # with the prompt's turns first); None: rows hold no preference pairs
    chosen_key: str | None = None
    rejected_key: str | None = None
    source_key: str = "source"  # a column naming each row's source: evaluation reports each one
    system_prompt: str | None = None
    chat_template: str = "auto"  # auto: the tokenizer's when it has one | none | a Jinja template FILE
    # longer prompts are dropped (counted) or truncated (data.overlong); None: the model's context
    # (max_position_embeddings) less the response budget, at least half the context
    max_prompt_tokens: int | None = None
    overlong: Literal["drop", "truncate"] = "drop"
    shuffle: bool = True  # a seeded shuffle per epoch
    verifier: str = "math"  # how the `task` reward scores a response: math | exact | regex | none

    def files(self, split: Literal["train", "val"]) -> list[str]:
        value = getattr(self, split)
        return [value] if isinstance(value, str) else list(value)


class EvalConfig(Spec):
    """Validation: every ``every`` steps and once before training, ``samples`` responses per prompt at
    ``temperature`` (mean@K, unbiased pass@K, maj@K) and one greedy response (accuracy)."""

    every: int = 0  # 0: no evaluation
    samples: int = 4  # 0: the greedy response only
    temperature: float = 1.0
    greedy: bool = True
    prompts: int = 64  # without data.val: prompts the task draws for evaluation (a fixed, seeded set)
    max_prompts: int | None = None  # with data.val: at most this many of its rows (None: all)


class RewardConfig(Spec):
    """How reward functions run (`flowrl.runtime.rewardpool`): in the driver once per batch (``workers`` 0,
    a synchronous function), or in calls of ``rows_per_call`` rows by ``workers`` forked processes (an
    ``async def`` function: awaited, ``concurrency`` calls at once), each within ``timeout_s``; a call
    that raises or times out scores by ``on_error``."""

    workers: int = 0
    timeout_s: float | None = None  # None: no limit
    on_error: Literal["zero", "drop", "fail"] = "fail"  # drop: its rows score their prompt's other rows' mean
    rows_per_call: int = 1
    concurrency: int = 16


class LogConfig(Spec):
    """Where metrics go besides metrics.jsonl, and how many sample rows samples.jsonl gets."""

    loggers: list[str] = []  # tensorboard, wandb, mlflow, trackio (--logger tensorboard,wandb)
    samples_every: int = 0  # steps between (prompt, response, reward) rows in samples.jsonl; 0: at evals only
    samples: int = 4  # rows written each time


def algo_problems(algo: AlgoConfig) -> list[tuple[str, str]]:
    """(field, why) for each AlgoConfig value out of its range: the config's and each node's own."""
    checks = [
        (0 < algo.clip_low < 1, "clip_low", "must be in (0, 1)"),
        (0 < algo.clip_high < math.inf, "clip_high", "must be > 0"),
        (algo.dual_clip is None or 1 < algo.dual_clip < math.inf, "dual_clip", "must be > 1"),
        (0 <= algo.kl_coef < math.inf, "kl_coef", "must be >= 0"),
        (0 <= algo.gamma <= 1, "gamma", "must be in [0, 1]"),
        (0 <= algo.lam <= 1, "lam", "must be in [0, 1]"),
        (algo.vf_clip is None or 0 < algo.vf_clip < math.inf, "vf_clip", "must be > 0"),
        (0 <= algo.vf_coef < math.inf, "vf_coef", "must be >= 0"),
        (math.isfinite(algo.is_cap) and algo.is_cap >= 1, "is_cap", "must be finite and >= 1"),
        (math.isfinite(algo.mismatch_cap) and algo.mismatch_cap >= 1, "mismatch_cap", "must be finite and >= 1"),
        (0 < algo.mismatch_low < 1, "mismatch_low", "must be in (0, 1): a ratio of 1 (no mismatch) is kept"),
        (1 < algo.mismatch_high < math.inf, "mismatch_high", "must be > 1 and finite: a ratio of 1 is kept"),
        (0 < algo.mismatch_seq_low < 1, "mismatch_seq_low", "must be in (0, 1): a ratio of 1 (no mismatch) is kept"),
        (1 < algo.mismatch_seq_high < math.inf, "mismatch_seq_high", "must be > 1 and finite: a ratio of 1 is kept"),
        (algo.loss_norm is None or algo.loss_norm >= 1, "loss_norm", "must be >= 1 (tokens)"),
    ]
    return [(field, why) for ok, field, why in checks if not ok]


#: Bounds beyond which a number is a typo rather than a run (each would take years or petabytes).
MAX_STEPS = 10**9
MAX_PROMPTS = 1 << 20
MAX_SAMPLES = 1 << 16
MAX_STALENESS = 1024
MAX_TOKENS = 1 << 20


class RunConfig(Spec):
    task: str = "copy"  # a registered task; "data" reads data.train (what --data sets)
    task_options: dict[str, Any] = {}
    # an HF-format model directory for every model (None: build TinyModelConfig), or per model or
    # role: "actor=DIR,reward=DIR2" (a bare entry is the default); see `model_folders`
    model: str | None = None
    # run a model folder's own Python (an auto_map in its config.json or tokenizer_config.json): only for
    # folders you trust. False: such a folder is refused, naming the file (never a question on stdin).
    # A run setting: a plan file or run folder never grants it; `flowrl run --trust-remote-code` does.
    trust_remote_code: bool = False
    tiny_model: TinyModelConfig = TinyModelConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    generation: GenerationConfig = GenerationConfig()
    algo: AlgoConfig = AlgoConfig()
    steps: int = 600
    seed: int = 0
    out: str = "runs"
    name: str | None = None  # None: the graph's name
    executor: str = "local"  # the executor (a registered plugin) that runs the plan; older name: backend
    device: str = "cpu"
    threads: int | None = None  # torch intra-op threads; None: torch's default
    memory_limit_gib: float | None = None  # None: what the device reports
    checkpoint: bool = True  # False: no checkpoints at all
    save_every: int | None = None  # steps between checkpoints; None: about ten per run; 0: only at the end
    keep_checkpoints: int = 2  # the newest K step checkpoints kept in runs/<name>/checkpoints
    progress: bool = True
    # a worker or node lost mid-run (flowrl.runtime.recovery): the run restarts from its last checkpoint by
    # itself, at most this many times per invocation (0: it stops; `flowrl run --resume DIR` continues it)
    max_restarts: int = 3
    # when the devices the plan needs do not come back within device_wait_s: re-plan for the devices left
    # (False: stop, printing the resume command)
    replan_on_loss: bool = False
    # seconds a restart waits for a lost node's devices to come back (a replacement node) before it re-plans or stops
    device_wait_s: float = 60.0
    # node -> option -> value, over the options the graph gives its nodes (--set nodes.select.mode=correct)
    nodes: dict[str, dict[str, Any]] = {}
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    reward: RewardConfig = RewardConfig()

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint is written after ``step`` (0-based): every save_every steps and at the end."""
        if not self.checkpoint:
            return False
        every = self.save_every if self.save_every is not None else max(1, math.ceil(self.steps / 10))
        return step + 1 == self.steps or (every > 0 and (step + 1) % every == 0)

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.steps <= MAX_STEPS, "steps", f"must be in [0, {MAX_STEPS}]"),
            (
                1 <= self.rollout.prompts_per_step <= MAX_PROMPTS,
                "rollout.prompts_per_step",
                f"must be in [1, {MAX_PROMPTS}]",
            ),
            (
                1 <= self.rollout.samples_per_prompt <= MAX_SAMPLES,
                "rollout.samples_per_prompt",
                f"must be in [1, {MAX_SAMPLES}]",
            ),
            (
                self.rollout.max_new_tokens is None or 1 <= self.rollout.max_new_tokens <= MAX_TOKENS,
                "rollout.max_new_tokens",
                f"must be in [1, {MAX_TOKENS}]",
            ),
            (self.rollout.temperature > 0, "rollout.temperature", "must be > 0"),
            (0 < self.rollout.top_p <= 1, "rollout.top_p", "must be in (0, 1]"),
            (self.train.lr > 0, "train.lr", "must be > 0"),
            (self.train.epochs >= 1, "train.epochs", "must be >= 1"),
            (self.train.mini_batches >= 1, "train.mini_batches", "must be >= 1"),
            (
                self.train.micro_batch_size is None or self.train.micro_batch_size >= 1,
                "train.micro_batch_size",
                "must be >= 1",
            ),
            (self.train.lora.rank >= 0, "train.lora.rank", "must be >= 0 (0: no adapters)"),
            (self.train.lora.alpha > 0, "train.lora.alpha", "must be > 0"),
            (0 <= self.train.lora.dropout < 1, "train.lora.dropout", "must be in [0, 1)"),
            (
                self.train.lora.rank == 0 or bool(self.train.lora.target_modules),
                "train.lora.target_modules",
                "must name at least one module",
            ),
            (
                self.train.max_tokens_per_micro_batch is None or self.train.max_tokens_per_micro_batch >= 1,
                "train.max_tokens_per_micro_batch",
                "must be >= 1 (tokens)",
            ),
            (
                self.rollout.staleness is None or 0 <= self.rollout.staleness <= MAX_STALENESS,
                "rollout.staleness",
                f"must be >= 0 and <= {MAX_STALENESS}",
            ),
            (0 <= self.rollout.overprovision <= 16, "rollout.overprovision", "must be >= 0 and <= 16"),
            (0 <= self.reward.workers <= 256, "reward.workers", "must be in [0, 256] (0: in the driver)"),
            (self.reward.timeout_s is None or self.reward.timeout_s > 0, "reward.timeout_s", "must be > 0 seconds"),
            (self.reward.rows_per_call >= 1, "reward.rows_per_call", "must be >= 1"),
            (self.reward.concurrency >= 1, "reward.concurrency", "must be >= 1"),
            (
                self.rollout.chunk_tokens is None or self.rollout.chunk_tokens >= 1,
                "rollout.chunk_tokens",
                "must be >= 1",
            ),
            (self.rollout.stream_groups >= 1, "rollout.stream_groups", "must be >= 1"),
            (
                self.generation.dtype == "float32" or self.generation.engine != self.train.engine,
                "generation.dtype",
                f"must be float32 when the training engine '{self.train.engine}' also generates (it samples with "
                "its own float32 weights); bfloat16 needs a separate generation engine, e.g. generation.engine=vllm",
            ),
            (
                self.memory_limit_gib is None or 1 / 1024 <= self.memory_limit_gib <= 2**20,
                "memory_limit_gib",
                "must be between 1 MiB and 1 PiB (in GiB: 0.001 to 1048576)",
            ),
            (self.threads is None or self.threads >= 1, "threads", "must be >= 1"),
            (self.save_every is None or self.save_every >= 0, "save_every", "must be >= 0 (0: only at the end)"),
            (self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1"),
            (0 <= self.max_restarts <= 1000, "max_restarts", "must be in [0, 1000] (0: a lost worker stops the run)"),
            (0 <= self.device_wait_s <= 86400, "device_wait_s", "must be in [0, 86400] seconds"),
            (0 <= self.seed < 2**63, "seed", "must be in [0, 2**63)"),
            (math.isfinite(self.rollout.temperature), "rollout.temperature", "must be finite"),
            (all(0 <= b < 1 for b in self.train.betas), "train.betas", "must both be in [0, 1)"),
            (self.train.grad_clip > 0, "train.grad_clip", "must be > 0"),
            (0 <= self.train.weight_decay < math.inf, "train.weight_decay", "must be >= 0"),
            (math.isfinite(self.train.lr), "train.lr", "must be finite"),
            (self.train.critic_lr is None or 0 < self.train.critic_lr < math.inf, "train.critic_lr", "must be > 0"),
            (
                self.name is None or plain_name(self.name),
                "name",
                "must be one plain folder name (no '/', '\\' or '..')",
            ),
        ]
        checks += [
            (self.eval.every >= 0, "eval.every", "must be >= 0 (0: no evaluation)"),
            (0 <= self.eval.samples <= MAX_SAMPLES, "eval.samples", f"must be in [0, {MAX_SAMPLES}] (0: greedy only)"),
            (self.eval.greedy or self.eval.samples > 0, "eval.samples", "must be >= 1 when eval.greedy is false"),
            (0 < self.eval.temperature < math.inf, "eval.temperature", "must be > 0 and finite"),
            (1 <= self.eval.prompts <= MAX_PROMPTS, "eval.prompts", f"must be in [1, {MAX_PROMPTS}]"),
            (self.eval.max_prompts is None or self.eval.max_prompts >= 1, "eval.max_prompts", "must be >= 1"),
            (self.log.samples_every >= 0, "log.samples_every", "must be >= 0 (0: at evaluations only)"),
            (self.log.samples >= 0, "log.samples", "must be >= 0"),
            (
                self.data.max_prompt_tokens is None or self.data.max_prompt_tokens >= 1,
                "data.max_prompt_tokens",
                "must be >= 1",
            ),
        ]
        checks += [(False, f"algo.{field}", why) for field, why in algo_problems(self.algo)]
        for ok, field, why in checks:
            if not ok:
                raise ConfigError(f"config field '{field}' {why}.")
        if self.rollout.mode is not None:
            rollout_parts(self.rollout.mode)


#: The files of an HF model folder whose ``auto_map`` names Python in the folder that transformers runs.
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def remote_code(folder: str | Path) -> list[str]:
    """The files of model folder ``folder`` that ask transformers to run the folder's own Python (an
    ``auto_map``), by name; [] for a plain model. Read as JSON only (nothing is imported)."""
    import json

    found = []
    for name in REMOTE_CODE_FILES:
        path = Path(folder) / name
        try:
            if not path.is_file() or path.stat().st_size > 64 << 20:
                continue
            data = json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError):  # unreadable: the loader that reads it says so
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            found.append(name)
    return found


def check_remote_code(folder: str | Path, trust: bool, what: str = "model folder") -> None:
    """ConfigError when ``folder`` holds code transformers would run (`remote_code`) and ``trust`` is off;
    the message names the folder, the file and ``--trust-remote-code``."""
    files = [] if trust else remote_code(folder)
    if files:
        raise ConfigError(
            f"{what} '{folder}' holds its own Python code: {' and '.join(files)} has an 'auto_map' that transformers "
            "would import and run. flowrl runs a model folder's code only when you say so: add --trust-remote-code "
            "(config trust_remote_code: true) if you trust this folder, or use a folder without auto_map."
        )


def model_folders(model: str | None) -> tuple[str | None, dict[str, str]]:
    """``RunConfig.model`` -> (the default folder, {model or role name: folder}):
    ``"DIR"`` -> ("DIR", {}); ``"actor=DIR,reward=DIR2"`` -> (None, {"actor": "DIR", "reward": "DIR2"});
    a bare entry among named ones is the default. A key names a graph model or a role."""
    if model is None or "=" not in model:
        return model, {}
    return named_entries(model, "config field 'model'", ("folder", "name", "NAME=DIR", "actor=DIR,reward=DIR2"))


def named_entries(text: str, where: str, words: tuple[str, str, str, str]) -> tuple[str | None, dict[str, str]]:
    """``"a=X,b=Y,Z"`` -> ("Z", {"a": "X", "b": "Y"}): named entries and at most one bare (default)
    one. ``words``: (what a value is, what a key is, the entry's form, an example), for the errors,
    which name ``where`` the text came from."""
    value_word, key_word, form, example = words
    default: str | None = None
    named: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            if default is not None:
                raise ConfigError(f"{where} '{text}' names two default {value_word}s; give the others as {form}.")
            default = key
            continue
        if not key or not value:
            raise ConfigError(f"{where} entry '{item}' must be {form} (e.g. {example}).")
        if key in named:
            raise ConfigError(f"{where} names {key_word} '{key}' twice.")
        named[key] = value
    return default, named


ROLLOUT_STARTS = ("sync", "one_step_off", "async")  # when generation of a step may start
ROLLOUT_FLAGS = ("partial", "streaming")


def rollout_parts(mode: str) -> tuple[str, set[str]]:
    """``"partial+async"`` -> ("async", {"partial"}); a ConfigError naming what is wrong."""
    parts = [p.strip() for p in mode.split("+") if p.strip()]
    known = (*ROLLOUT_STARTS, *ROLLOUT_FLAGS)
    for p in parts:
        if p not in known:
            raise ConfigError(
                f"config field 'rollout.mode': unknown part '{p}'.{did_you_mean(p, known)} A mode joins with '+' one "
                f"of {', '.join(ROLLOUT_STARTS)} and any of {', '.join(ROLLOUT_FLAGS)} (e.g. 'partial+async')."
            )
    starts = [p for p in parts if p in ROLLOUT_STARTS]
    twice = sorted({p for p in parts if parts.count(p) > 1})
    if twice:
        raise ConfigError(f"config field 'rollout.mode' is '{mode}': '{twice[0]}' appears twice.")
    if len(starts) > 1 or not parts:
        raise ConfigError(
            f"config field 'rollout.mode' is '{mode}': name at most one of {', '.join(ROLLOUT_STARTS)} "
            "(plus partial and/or streaming)."
        )
    return (starts[0] if starts else "sync"), {p for p in parts if p in ROLLOUT_FLAGS}


# ------------------------------------------------------------------ loading


def writable(path: str | Path, force: bool, flag: str) -> Path:
    """``path`` for a new output file: refused when a file is already there, unless --force."""
    path = Path(path)
    if path.exists() and not force:
        kind = "folder" if path.is_dir() else "file"
        raise ConfigError(
            f"{flag} '{path}': a {kind} is already there; pick another name, or add --force to replace it."
        )
    if path.is_dir():
        raise ConfigError(f"{flag} '{path}' is a folder; name a file.")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{flag} '{path}': '{parent}' is a file, so nothing can be written under it.")
    return path


#: The largest config file read (bytes): a run config is a page of settings, not data.
MAX_CONFIG_BYTES = 4 << 20

#: The most values (mappings, lists and scalars, aliases counted each time they are used) a config
#: may expand to: YAML anchors can make a small file stand for billions ("billion laughs").
MAX_CONFIG_VALUES = 200_000


def read_document(path: str | Path) -> dict[str, Any]:
    """Read a YAML, TOML or JSON file into a plain mapping (never executes anything): a regular file of
    at most `MAX_CONFIG_BYTES` that expands to at most `MAX_CONFIG_VALUES` values."""
    import stat

    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError)
        raise ConfigError(
            f"config file '{path}' " + ("does not exist." if missing else f"cannot be read: {exc.strerror or exc}.")
        ) from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"config file '{path}' is a folder; name a YAML, TOML or JSON file.")
    if not stat.S_ISREG(mode):
        raise ConfigError(
            f"config file '{path}' is not a regular file (a pipe or a device); name a YAML, TOML or JSON file."
        )
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc.strerror or exc}.") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file '{path}' is over the {MAX_CONFIG_BYTES >> 20} MiB a config may be "
            "(flowrl.specs.MAX_CONFIG_BYTES); a run config holds settings, its data goes in data files."
        )
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.load(raw, Loader=_UniqueKeyLoader) or {}
        elif path.suffix == ".toml":
            data = _toml().loads(raw.decode())
        elif path.suffix == ".json":
            import json

            data = json.loads(raw, object_pairs_hook=_unique_pairs)
        else:
            raise ConfigError(f"config file '{path}': unknown format '{path.suffix}' (use .yaml, .toml or .json).")
    except ConfigError:
        raise
    except Exception as exc:  # each parser has its own error type
        raise ConfigError(f"config file '{path}' is not valid {path.suffix[1:].upper()}: {_one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping at the top level, found {type(data).__name__}.")
    _check_size(data, f"config file '{path}'")
    bad = _non_text_key(data)
    if bad is not None:
        raise ConfigError(f"config file '{path}': key {bad} is not text; field names are words such as train.lr.")
    return data


def _toml() -> Any:
    """The TOML reader: tomllib from Python 3.11 on, its backport tomli before."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib


class _DuplicateKey(ValueError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                if key in seen:
                    raise _DuplicateKey(f"key '{key}' is given twice (line {key_node.start_mark.line + 1})")
                seen.add(key)
            except TypeError:  # an unhashable key: the base class reports it
                pass
        return super().construct_mapping(node, deep=deep)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(f"key '{key}' is given twice")
        out[key] = value
    return out


def _check_size(data: Any, where: str) -> None:
    """Refuse a value that expands to over `MAX_CONFIG_VALUES` values (shared YAML aliases counted
    each time they are used), walked with an explicit stack and stopped at the limit."""
    stack, seen = [data], 0
    while stack:
        value = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_VALUES:
            raise ConfigError(
                f"{where} expands to over {MAX_CONFIG_VALUES:,} values (flowrl.specs.MAX_CONFIG_VALUES), e.g. "
                "through YAML anchors and aliases (&a / *a) used inside one another; write the settings out."
            )
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _non_text_key(data: Any, where: str = "") -> str | None:
    """The dotted path of the first mapping key that is not a string, if any."""
    if isinstance(data, dict):
        for key, value in data.items():
            if not isinstance(key, str):
                return f"{where}{key!r}"
            found = _non_text_key(value, f"{where}{key}.")
            if found is not None:
                return found
    elif isinstance(data, list):
        for item in data:
            found = _non_text_key(item, where)
            if found is not None:
                return found
    return None


def _one_line(exc: Exception) -> str:
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:  # YAML: "problem at line L, column C" without the source excerpt
        return f"{getattr(exc, 'problem', None) or exc} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(exc).split())


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as a YAML scalar/list."""
    if "=" not in text:
        raise ConfigError(f"--set '{text}' must look like key=value (e.g. --set train.lr=1e-3).")
    key, _, value = text.partition("=")
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set '{text}' has an empty key.")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    except ValueError:  # an integer of over 4300 digits
        raise ConfigError(
            f"--set '{key}': the value is a number too long to read ({len(value):,} characters)."
        ) from None
    except RecursionError:
        raise ConfigError(f"--set '{key}': the value is nested too deeply to read; give a plain value.") from None
    _check_size(parsed, f"--set '{key}'")
    if not isinstance(parsed, (str, int, float, bool, list, dict, type(None))):
        parsed = value  # e.g. YAML reads 2024-01-01 as a date; the user meant the text
    if isinstance(parsed, dict) and not value.strip().startswith("{"):
        parsed = value  # "Finish with: N." is a sentence, not a mapping (a mapping is written {a: 1})
    if isinstance(parsed, str):
        try:  # YAML 1.1 reads "1e-3" as a string; users mean a number
            parsed = (
                float(parsed)
                if any(c.isdigit() for c in parsed)
                and parsed.lower()
                .lstrip("+-")
                .replace(".", "", 1)
                .replace("e", "", 1)
                .replace("-", "", 1)
                .replace("+", "", 1)
                .isdigit()
                else parsed
            )
        except ValueError:
            pass
    return path, parsed


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge two mappings (update wins)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def nested(path: list[str], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value


#: Config fields under an older name: older name -> field. Config files, ``--set`` and plan files
#: written before the rename still say the older name; each layer is read as if it said the field.
OLDER_NAMES = {"backend": "executor"}

#: Where a run goes and how it checkpoints and reports: not plan content. They may change for a
#: ``--plan`` or ``--resume`` run without changing what is planned (the plan's id leaves them out).
RUN_SETTINGS = (
    "out",
    "name",
    "save_every",
    "keep_checkpoints",
    "progress",
    "eval",
    "log",
    "trust_remote_code",
    "max_restarts",
    "replan_on_loss",
    "device_wait_s",
)

#: Config sections and fields (dotted) added after plans were first written: a plan's id leaves
#: them out while they hold their defaults, so a plan file an earlier flowrl wrote keeps its id.
LATER_SECTIONS = (
    "data",
    "data.response_key",
    "data.chosen_key",
    "data.rejected_key",
    "rollout.stop",
    "reward",
    *(f"algo.{name}" for name in ("mismatch", "mismatch_cap", "mismatch_low", "mismatch_high")),
    "algo.mismatch_seq_low",
    "algo.mismatch_seq_high",
)


def current_names(layer: dict[str, Any]) -> dict[str, Any]:
    """``layer`` (one config mapping) with each field's older name (``backend``) read as the field
    (``executor``); a layer giving both with different values is refused."""
    if not isinstance(layer, dict) or not any(old in layer for old in OLDER_NAMES):
        return layer
    out = dict(layer)
    for old, new in OLDER_NAMES.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out and out[new] != value:
            raise ConfigError(
                f"the config gives both {new}={out[new]!r} and {old}={value!r}; '{old}' is the older name of "
                f"'{new}': give only {new}."
            )
        out[new] = value
    return out


def build_config(*layers: dict[str, Any]) -> RunConfig:
    """Merge layers (lowest precedence first) and validate into a RunConfig."""
    data: dict[str, Any] = {}
    for layer in layers:
        data = merge(data, current_names(layer))
    if isinstance(data.get("data"), dict):
        data["data"] = _absolute_files(data["data"])
    files = data.get("data", {}).get("train") if isinstance(data.get("data"), dict) else None
    if files:  # --data / data.train: the prompts are the user's; the task is `data`
        task = data.setdefault("task", DATA_TASK)
        if task != DATA_TASK:
            raise ConfigError(
                f"the config gives task '{task}' and data.train ({files!r}); training data is the task "
                f"'{DATA_TASK}': drop --task (or task), or drop --data to train on '{task}'."
            )
    try:
        return convert(data, RunConfig, "config")
    except ConfigError as exc:
        nodes = [k for k, v in data.items() if k not in RunConfig.__struct_fields__ and isinstance(v, dict)]
        if not nodes:
            raise
        raise ConfigError(
            f"{exc} If '{nodes[0]}' is a node of the graph, its options go under nodes: "
            f"--set nodes.{nodes[0]}.OPTION=VALUE."
        ) from None


def _absolute_files(section: dict[str, Any]) -> dict[str, Any]:
    """data.train, data.val and a data.chat_template file as absolute paths where they exist, so a
    plan or a resumed run finds them from any folder (a missing one stays as given: its error names it)."""

    def absolute(value: Any) -> Any:
        if isinstance(value, list):
            return [absolute(v) for v in value]
        try:
            if isinstance(value, str) and value and Path(value).expanduser().exists():
                return str(Path(value).expanduser().resolve())
        except (OSError, RuntimeError, ValueError):  # a name too long, a link loop: its reader names it
            pass
        return value

    out = dict(section)
    for key in ("train", "val", "chat_template"):
        if key in out and not (key == "chat_template" and out[key] in ("auto", "none")):
            out[key] = absolute(out[key])
    return out


def convert(data: Any, type_: type, what: str) -> Any:
    """msgspec.convert with errors turned into a ConfigError naming the field's dotted path."""
    try:
        return msgspec.convert(data, type_)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{what}: {_explain(str(exc), type_)}") from None


def _explain(message: str, type_: type) -> str:
    """Rewrite msgspec's "... - at `$.a.b`" into a sentence naming the dotted field path."""
    at = re.search(r" - at `\$\.?([^`]*)`$", message)
    where = at.group(1) if at else ""
    text = message[: at.start()] if at else message
    unknown = re.match(r"Object contains unknown field `([^`]+)`", text)
    if unknown:
        path = ".".join(p for p in (where, unknown.group(1)) if p)
        known = _fields_at(type_, where)
        did = did_you_mean(
            ".".join(p for p in (where, unknown.group(1)) if p), [".".join(p for p in (where, k) if p) for k in known]
        )
        return f"unknown field '{path}'.{did} Valid fields there: {', '.join(known)}."
    return f"field '{where}': {text}." if where else f"{text}."


def _fields_at(type_: Any, path: str) -> list[str]:
    import typing

    for part in [p for p in path.split(".") if p]:
        hints = typing.get_type_hints(type_) if isinstance(type_, type) and issubclass(type_, msgspec.Struct) else {}
        type_ = hints.get(part)
    if isinstance(type_, type) and issubclass(type_, msgspec.Struct):
        return list(type_.__struct_fields__)
    return []


def to_builtins(spec: msgspec.Struct) -> dict[str, Any]:
    return msgspec.to_builtins(spec)
