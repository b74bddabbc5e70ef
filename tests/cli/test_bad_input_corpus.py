"""A corpus of bad inputs to the flowrl command: each exits with status 2 and one paragraph that
names the field, file, node or key at fault, and never prints a traceback.

Every case is a row of ``CASES``: an argv builder (given a :class:`Ctx` that writes files under
``tmp_path``) and the substrings the error must contain. ``main(argv)`` is called in-process; the
cwd is ``tmp_path`` and ``FLOWRL_HOME`` points into it, so nothing is written into the repository
or the user's home. Almost every case stops before a model is built (``show`` / ``plan``, or a
``run`` that fails while loading); the few real runs are one step of the smallest rollout.

Cases that fail today are listed in ``FAILING_TODAY`` (xfail, strict) with what happens instead:
delete an entry when it is fixed.
The last section holds features being added (``--resume``, ``--force``, ``save_every``, ...).
"""

from __future__ import annotations

import re
import shutil
import signal
import sys
import textwrap
import threading
import traceback
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from flowrl.cli import main

#: the smallest settings a real run may use (one step of 2 prompts x 2 samples, 2 new tokens)
SMALL = [
    "--set", "progress=false",
    "--set", "checkpoint=false",
    "--set", "rollout.prompts_per_step=2",
    "--set", "rollout.samples_per_prompt=2",
    "--set", "rollout.max_new_tokens=2",
    "--set", "train.mini_batches=1",
]  # fmt: skip
RUN1 = ["--steps", "1", "--quiet", *SMALL]

#: cases that expect CUDA to be missing
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
#: a case still running after this many seconds is stopped and fails (none should take more than a few)
CASE_TIMEOUT_S = 30

GRAPH_HEAD = "from flowrl.graph import Graph\n\n\ndef build(cfg):\n"

#: a graph whose reward node calls the registered reward function FN (see Ctx.user_functions)
REWARD_GRAPH = """\
g = Graph("user_fn")
g.model("actor", "actor")
g.generate("rollout", model="actor", reads="prompts", writes="responses", n=cfg.rollout.samples_per_prompt)
g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
g.reward("score", fn="FN", reads="prompts responses", writes="rewards")
g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
return g
"""

#: a valid graph body (GRPO without a reference)
GOOD_BODY = REWARD_GRAPH.replace('"FN"', '"task"').replace('"user_fn"', '"good"')


# ---------------------------------------------------------------------------- user reward functions


def _boom(prompts: list[Any], responses: list[str], task: Any) -> list[float]:
    raise ValueError("my reward broke")


def _nan(prompts: list[Any], responses: list[str], task: Any) -> list[float]:
    return [float("nan")] * len(responses)


def _inf(prompts: list[Any], responses: list[str], task: Any) -> list[float]:
    return [float("-inf")] * len(responses)


def _short(prompts: list[Any], responses: list[str], task: Any) -> list[float]:
    return [0.0] * (len(responses) - 1)


def _strings(prompts: list[Any], responses: list[str], task: Any) -> list[str]:
    return ["good"] * len(responses)


def _none(prompts: list[Any], responses: list[str], task: Any) -> None:
    return None


def _bad_metrics(prompts: list[Any], responses: list[str], task: Any) -> Any:
    return [0.0] * len(responses), 5  # (scores, metrics) with metrics not a mapping


def _object_metric(prompts: list[Any], responses: list[str], task: Any) -> Any:
    return [0.0] * len(responses), {"mood": object()}


def _exits(prompts: list[Any], responses: list[str], task: Any) -> list[float]:
    sys.exit(3)


def _mask(inputs: dict[str, Any]) -> Any:
    return next(v for v in inputs.values() if hasattr(v, "response_mask")).response_mask


def _nan_adv(inputs: dict[str, Any], algo: Any) -> dict[str, Any]:
    return {"advantages": torch.full(_mask(inputs).shape, float("nan"))}


def _misshapen_adv(inputs: dict[str, Any], algo: Any) -> dict[str, Any]:
    rows, width = _mask(inputs).shape
    return {"advantages": torch.zeros(rows + 1, width + 3)}


def _list_adv(inputs: dict[str, Any], algo: Any) -> dict[str, Any]:
    return {"advantages": [0.0] * _mask(inputs).shape[0]}


def _no_adv(inputs: dict[str, Any], algo: Any) -> dict[str, Any]:
    return {}


def _scalar_adv(inputs: dict[str, Any], algo: Any) -> int:
    return 5


def _boom_loss(logprobs: Any, batch: Any, algo: Any) -> Any:
    raise ValueError("my loss broke")


def _nan_loss(logprobs: Any, batch: Any, algo: Any) -> Any:
    return (logprobs * float("nan")).sum(), {}


def _float_loss(logprobs: Any, batch: Any, algo: Any) -> Any:
    return 0.5, {}


USER_COMPUTE = {
    "nan_adv": _nan_adv,
    "misshapen_adv": _misshapen_adv,
    "list_adv": _list_adv,
    "no_adv": _no_adv,
    "scalar_adv": _scalar_adv,
}
USER_LOSSES = {"boom_loss": _boom_loss, "nan_loss": _nan_loss, "float_loss": _float_loss}

USER_REWARDS = {
    "boom": _boom,
    "nan_reward": _nan,
    "inf_reward": _inf,
    "short_reward": _short,
    "string_reward": _strings,
    "none_reward": _none,
    "bad_metrics": _bad_metrics,
    "object_metric": _object_metric,
    "exit_reward": _exits,
}


# ---------------------------------------------------------------------------- the context a case builds in


class Ctx:
    """Writes a case's files under ``tmp_path``; ``{tmp}`` in expected substrings is its path."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
        self.tmp = tmp_path
        self.monkeypatch = monkeypatch
        self.request = request

    def path(self, name: str) -> str:
        return str(self.tmp / name)

    def file(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return str(path)

    def dir(self, name: str) -> str:
        path = self.tmp / name
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def blocker(self) -> str:
        """A plain file where a folder is needed."""
        return self.file("blocker", "not a folder")

    def graph(self, body: str, name: str = "g.py") -> str:
        """A graph file whose build(cfg) has ``body``."""
        return self.file(name, GRAPH_HEAD + textwrap.indent(textwrap.dedent(body), "    "))

    def plan(self, *edits: tuple[str, str] | Callable[[str], str], keep_id: bool = False, source: str = "grpo") -> str:
        """A valid plan for ``source`` (tiny, runs into tmp), then hand-edited: each edit replaces
        the first occurrence of old by new (it must occur), or is a function of the text."""
        path = self.tmp / "plan.yaml"
        argv = ["plan", source, "--steps", "1", "--set", f"out={self.tmp / 'runs'}", *SMALL, "--out", str(path)]
        assert main(argv) == 0, "could not make the plan to edit"
        text = path.read_text()
        for edit in edits:
            if callable(edit):
                text = edit(text)
            else:
                old, new = edit
                assert old in text, f"edit {old!r} not in the plan"
                text = text.replace(old, new, 1)
        if not keep_id:
            text = re.sub(r"^id: .*\n", "", text, flags=re.M)
        path.write_text(text)
        return str(path)

    def model_dir(self, name: str = "model") -> Path:
        """A copy of a real tiny HF model directory (config, weights, tokenizer)."""
        src = self.request.getfixturevalue("tiny_hf_model")
        dst = self.tmp / name
        shutil.copytree(src, dst)
        return dst

    def user_functions(self, reward: str = "task", compute: str = "grpo", loss: str = "ppo") -> str:
        """Register USER_REWARDS, USER_COMPUTE and USER_LOSSES in the process registry (as a plugin
        would); a graph file whose reward, compute and train nodes call ``reward``, ``compute``, ``loss``."""
        from flowrl.plugins.hookspecs import hookimpl
        from flowrl.plugins.manager import load_plugins, set_registry

        module = types.ModuleType("user_functions")
        module.register_reward_functions = hookimpl(
            lambda register: [register(name, obj) for name, obj in USER_REWARDS.items()]
        )
        module.register_advantage_estimators = hookimpl(
            lambda register: [
                register(name, obj, needs=("rewards", "responses"), gives=("advantages",))
                for name, obj in USER_COMPUTE.items()
            ]
        )
        module.register_losses = hookimpl(
            lambda register: [
                register(name, obj, needs=("old_logprobs", "advantages"), output="logprobs")
                for name, obj in USER_LOSSES.items()
            ]
        )
        set_registry(load_plugins(entry_points=False, extra=[("user_functions", module)])[1])
        body = REWARD_GRAPH.replace("FN", reward).replace('fn="grpo"', f'fn="{compute}"')
        return self.graph(body.replace('loss="ppo"', f'loss="{loss}"'), name="user_fn.py")

    def fast_profile(self) -> None:
        """`flowrl profile` without its measurements (seconds of matmuls): only writing is tested."""
        from flowrl.backends.local import profile

        self.monkeypatch.setattr(profile, "peak_flops", lambda *a, **k: 1e11)
        self.monkeypatch.setattr(profile, "bandwidth", lambda *a, **k: 1e10)
        self.monkeypatch.setattr(profile, "measure_ops", lambda *a, **k: {})
        self.monkeypatch.setattr(profile, "fit", lambda *a, **k: (1e-5, 0.5))

    def env(self, name: str, value: str) -> None:
        self.monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flowrl.backends.local.models import build_causal_lm, load_tokenizer, model_config, save_hf
    from flowrl.specs import TinyModelConfig

    path = tmp_path_factory.mktemp("tiny_hf_model")
    tok = load_tokenizer(None)
    model = build_causal_lm(None, model_config(None, TinyModelConfig(), tok), seed=0)
    save_hf(model, path)
    tok.save_pretrained(str(path))
    return path


# ---------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Ctx], Sequence[str]]
    needles: tuple[str, ...]  # each must appear in stderr ({tmp}: the case's tmp_path)
    absent: tuple[str, ...] = ()  # none of these may appear in stderr
    usage: bool = False  # an argparse usage error (SystemExit(2) with "usage:"), not flowrl's paragraph
    marks: tuple[Any, ...] = field(default=())
    timeout_s: float = CASE_TIMEOUT_S


def C(
    id: str,
    argv: Callable[[Ctx], Sequence[str]],
    *needles: str,
    absent: Sequence[str] = (),
    usage: bool = False,
    marks: Sequence[Any] = (),
    timeout_s: float = CASE_TIMEOUT_S,
) -> Case:
    return Case(id, argv, tuple(needles), tuple(absent), usage, tuple(marks), timeout_s)


def show_config(name: str, content: str | bytes) -> Callable[[Ctx], list[str]]:
    return lambda t: ["show", "grpo", "--config", t.file(name, content)]


def show_set(*overrides: str) -> Callable[[Ctx], list[str]]:
    return lambda t: ["show", "grpo", *[a for o in overrides for a in ("--set", o)]]


def plan_set(*overrides: str) -> Callable[[Ctx], list[str]]:
    return lambda t: ["plan", "grpo", *[a for o in overrides for a in ("--set", o)]]


def show_graph(body: str) -> Callable[[Ctx], list[str]]:
    return lambda t: ["show", t.graph(body)]


def show_module(source: str | bytes, name: str = "g.py") -> Callable[[Ctx], list[str]]:
    return lambda t: ["show", t.file(name, source)]


def run_plan(*edits: Any, keep_id: bool = False) -> Callable[[Ctx], list[str]]:
    return lambda t: ["run", "--plan", t.plan(*edits, keep_id=keep_id)]


def plan_model(files: dict[str, str | bytes]) -> Callable[[Ctx], list[str]]:
    """A model folder with these files (and placeholder weights: planning reads only config.json)."""

    def build(t: Ctx) -> list[str]:
        model = t.dir("model")
        for name, content in {"model.safetensors": b"placeholder", **files}.items():
            t.file(f"model/{name}", content)
        return ["plan", "grpo", "--model", model]

    return build


def run_model(change: Callable[[Path], None]) -> Callable[[Ctx], list[str]]:
    def build(t: Ctx) -> list[str]:
        model = t.model_dir()
        change(model)
        return ["run", "grpo", "--model", str(model), "--out", t.path("runs"), *RUN1]

    return build


def run_user(**functions: str) -> Callable[[Ctx], list[str]]:
    """A one-step run of a graph calling the user's functions (reward=, compute=, loss=)."""
    return lambda t: ["run", t.user_functions(**functions), "--out", t.path("runs"), *RUN1]


def run_reward(fn: str) -> Callable[[Ctx], list[str]]:
    return run_user(reward=fn)


def plan_cluster(spec: str, *more: str) -> Callable[[Ctx], list[str]]:
    return lambda t: ["plan", "grpo", "--cluster", spec, "--model", "llama-7b", *more]


def plan_cluster_file(content: str) -> Callable[[Ctx], list[str]]:
    return lambda t: ["plan", "grpo", "--cluster", t.file("cluster.yaml", content), "--model", "llama-7b"]


def plan_workload(content: str | bytes, name: str = "workload.yaml") -> Callable[[Ctx], list[str]]:
    return lambda t: [
        "plan", "grpo", "--cluster", "8xA100-80G", "--model", "llama-7b", "--workload", t.file(name, content),
    ]  # fmt: skip


def profile_to(target: Callable[[Ctx], str]) -> Callable[[Ctx], list[str]]:
    def build(t: Ctx) -> list[str]:
        t.fast_profile()
        t.env("FLOWRL_HOME", t.path("home"))
        return ["profile", "--out", target(t)]

    return build


def _home_blocked(t: Ctx) -> list[str]:
    t.fast_profile()
    t.env("FLOWRL_HOME", t.blocker())
    return ["profile", "--out", t.path("cpu.yaml")]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:64] = b"\xff" * 56  # the JSON header of a safetensors file
    path.write_bytes(bytes(data))


def _remove_tokenizer(model: Path) -> None:
    for p in model.iterdir():
        if p.name.startswith(("tokenizer", "special_tokens")):
            p.unlink()


def _set_model_type(model: Path) -> None:
    cfg = model / "config.json"
    cfg.write_text(re.sub(r'"model_type": "\w+"', '"model_type": "nosucharch"', cfg.read_text()))


def _small_vocab_model(t: Ctx) -> list[str]:
    """A consistent HF model whose embedding has 10 rows, with flowrl's 50-token tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flowrl.tasks.tokenizer import save_tokenizer

    path = t.tmp / "small_vocab"
    cfg = LlamaConfig(
        vocab_size=10,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    save_tokenizer(path)
    return ["run", "grpo", "--model", str(path), "--out", t.path("runs"), *RUN1]


def _drop_layout(text: str) -> str:
    return re.sub(r"^layout:\n(?:[ -].*\n)*", "layout: null\n", text, count=1, flags=re.M)


def _fingerprint(text: str) -> str:
    return re.sub(r"fingerprint: \w+", "fingerprint: deadbeefdeadbeef", text, count=1)


BINARY = bytes(range(256)) * 4

CASES: list[Case] = [
    # ------------------------------------------------------------ --config files
    C("config-yaml-malformed", show_config("run.yaml", "train: [1, 2\n"), "{tmp}/run.yaml", "not valid YAML"),
    C("config-yaml-tab-indent", show_config("run.yaml", "train:\n\tlr: 1\n"), "{tmp}/run.yaml", "YAML"),
    C(
        "config-yaml-duplicate-key",
        show_config("run.yaml", "seed: 1\nsteps: 2\nseed: 3\n"),
        "{tmp}/run.yaml",
        "seed",
    ),
    C(
        "config-yaml-duplicate-nested-key",
        show_config("run.yaml", "train:\n  lr: 0.1\n  lr: 0.2\n"),
        "{tmp}/run.yaml",
        "lr",
    ),
    C("config-toml-malformed", show_config("run.toml", "seed = \n"), "{tmp}/run.toml", "not valid TOML"),
    C("config-toml-duplicate-key", show_config("run.toml", "seed = 1\nseed = 2\n"), "{tmp}/run.toml", "line 2"),
    C("config-json-malformed", show_config("run.json", '{"seed": 1,'), "{tmp}/run.json", "not valid JSON"),
    C(
        "config-json-duplicate-key",
        show_config("run.json", '{"seed": 1, "seed": 2}'),
        "{tmp}/run.json",
        "seed",
    ),
    C("config-yaml-top-level-list", show_config("run.yaml", "- 1\n- 2\n"), "{tmp}/run.yaml", "mapping", "list"),
    C("config-yaml-top-level-scalar", show_config("run.yaml", "42\n"), "{tmp}/run.yaml", "mapping"),
    C("config-json-top-level-list", show_config("run.json", "[1, 2]"), "{tmp}/run.json", "mapping"),
    C("config-json-top-level-null", show_config("run.json", "null"), "{tmp}/run.json", "mapping"),
    C("config-toml-wrong-type", show_config("run.toml", 'seed = "x"\n'), "seed"),
    C(
        "config-unknown-field-did-you-mean",
        show_config("run.yaml", "rollout:\n  temprature: 0.7\n"),
        "rollout.temprature",
        "Did you mean 'rollout.temperature'",
    ),
    C("config-unknown-top-level-field", show_config("run.yaml", "stpes: 3\n"), "stpes", "Did you mean 'steps'"),
    C("config-wrong-type-int", show_config("run.yaml", "steps: many\n"), "steps"),
    C("config-section-is-a-scalar", show_config("run.yaml", "train: 5\n"), "train"),
    C("config-betas-is-a-scalar", show_config("run.yaml", "train:\n  betas: 0.9\n"), "train.betas"),
    C("config-float-for-int", show_config("run.json", '{"rollout": {"prompts_per_step": 1.5}}'), "prompts_per_step"),
    C("config-yaml-nan-seed", show_config("run.yaml", "seed: .nan\n"), "seed"),
    C(
        "config-non-string-key",
        show_config("run.yaml", "1: 2\n"),
        "{tmp}/run.yaml",
    ),
    C("config-task-options-not-a-dict", show_config("run.yaml", "task_options: 5\n"), "task_options"),
    C(
        "config-python-tag",
        show_config("run.yaml", "seed: !!python/object/apply:os.getpid []\n"),
        "{tmp}/run.yaml",
    ),
    C("config-missing-file", lambda t: ["show", "grpo", "--config", t.path("nope.yaml")], "{tmp}/nope.yaml"),
    C("config-is-a-directory", lambda t: ["show", "grpo", "--config", t.dir("cfg.yaml")], "{tmp}/cfg.yaml"),
    C("config-binary-yaml", show_config("run.yaml", BINARY), "{tmp}/run.yaml"),
    C("config-binary-toml", show_config("run.toml", BINARY), "{tmp}/run.toml"),
    C("config-binary-json", show_config("run.json", BINARY), "{tmp}/run.json"),
    C("config-unknown-extension", show_config("run.ini", "[x]\n"), "{tmp}/run.ini", "unknown format"),
    C("config-no-extension", show_config("runconfig", "seed: 1\n"), "{tmp}/runconfig"),
    C("config-name-not-a-string", show_config("run.yaml", "name: 5\n"), "name"),
    C("config-betas-three-values", show_config("run.yaml", "train:\n  betas: [0.9, 0.9, 0.9]\n"), "train.betas"),
    C("config-in-run", lambda t: ["run", "grpo", "--config", t.file("r.yaml", "rollout: {top_p: 2}\n")], "top_p"),
    # ------------------------------------------------------------ --set syntax and keys
    C("set-no-equals", show_set("train.lr"), "--set 'train.lr'", "key=value"),
    C("set-empty-key", show_set("=3"), "--set '=3'", "empty key"),
    C("set-dots-only-key", show_set(".=3"), "--set '.=3'"),
    C("set-unknown-key", show_set("nosuch=1"), "nosuch"),
    C("set-unknown-nested-key-did-you-mean", show_set("train.lrr=1"), "train.lrr", "Did you mean 'train.lr'"),
    C("set-into-a-scalar", show_set("train.lr.x=1"), "train.lr"),
    C("set-section-to-scalar", show_set("rollout=5"), "rollout"),
    C("set-unclosed-list", show_set("train.betas=[0.9,"), "train.betas"),
    C("set-path-traversal-key", show_set("../train.lr=1"), "'/train'"),  # refused, though not quoted as typed
    C("set-unicode-key", show_set("trâin.lr=1"), "trâin"),
    # ------------------------------------------------------------ --set values: types and ranges
    C("set-threads-negative", show_set("threads=-1"), "threads"),
    C("set-threads-zero", show_set("threads=0"), "threads"),
    C("set-seed-negative", show_set("seed=-1"), "seed"),
    C("set-seed-2**67", show_set(f"seed={2**67}"), "seed"),
    C("set-seed-float", show_set("seed=1e3"), "seed"),
    C("set-steps-negative", show_set("steps=-1"), "steps"),
    C("set-steps-fraction", show_set("steps=1.5"), "steps"),
    C("set-steps-word", show_set("steps=abc"), "steps"),
    C("set-steps-list", show_set("steps=[1]"), "steps"),
    C("set-steps-bool", show_set("steps=true"), "steps"),
    C(
        "set-steps-huge",
        show_set(f"steps={10**30}"),
        "steps",
    ),
    C("set-max-new-tokens-negative", show_set("rollout.max_new_tokens=-3"), "rollout.max_new_tokens"),
    C("set-max-new-tokens-zero", show_set("rollout.max_new_tokens=0"), "rollout.max_new_tokens"),
    C("set-prompts-per-step-zero", show_set("rollout.prompts_per_step=0"), "rollout.prompts_per_step"),
    C("set-samples-per-prompt-negative", show_set("rollout.samples_per_prompt=-2"), "rollout.samples_per_prompt"),
    C("set-temperature-inf", show_set("rollout.temperature=inf"), "rollout.temperature"),
    C("set-temperature-yaml-inf", show_set("rollout.temperature=.inf"), "rollout.temperature"),
    C("set-temperature-nan", show_set("rollout.temperature=.nan"), "rollout.temperature"),
    C("set-temperature-zero", show_set("rollout.temperature=0"), "rollout.temperature"),
    C("set-top-p-above-one", show_set("rollout.top_p=1.5"), "rollout.top_p"),
    C("set-top-p-nan", show_set("rollout.top_p=.nan"), "rollout.top_p"),
    C("set-lr-nan", show_set("train.lr=.nan"), "train.lr"),
    C("set-lr-inf", show_set("train.lr=.inf"), "train.lr"),
    C("set-lr-zero", show_set("train.lr=0"), "train.lr"),
    C("set-lr-string", show_set("train.lr=fast"), "train.lr"),
    C("set-betas-out-of-range", show_set("train.betas=[2,-1]"), "train.betas"),
    C("set-betas-one-value", show_set("train.betas=[0.9]"), "train.betas"),
    C("set-betas-nan", show_set("train.betas=[.nan, 0.9]"), "train.betas"),
    C("set-grad-clip-negative", show_set("train.grad_clip=-1"), "train.grad_clip"),
    C("set-grad-clip-nan", show_set("train.grad_clip=.nan"), "train.grad_clip"),
    C("set-weight-decay-negative", show_set("train.weight_decay=-5"), "train.weight_decay"),
    C("set-weight-decay-inf", show_set("train.weight_decay=.inf"), "train.weight_decay"),
    C("set-critic-lr-zero", show_set("train.critic_lr=0"), "train.critic_lr"),
    C("set-epochs-zero", show_set("train.epochs=0"), "train.epochs"),
    C("set-mini-batches-zero", show_set("train.mini_batches=0"), "train.mini_batches"),
    C("set-micro-batch-size-zero", show_set("train.micro_batch_size=0"), "train.micro_batch_size"),
    C("set-clip-low-negative", show_set("algo.clip_low=-1"), "algo.clip_low"),
    C("set-clip-high-zero", show_set("algo.clip_high=0"), "algo.clip_high"),
    C("set-dual-clip-below-one", show_set("algo.dual_clip=0.5"), "algo.dual_clip"),
    C("set-kl-coef-negative", show_set("algo.kl_coef=-1"), "algo.kl_coef"),
    C("set-gamma-above-one", show_set("algo.gamma=2"), "algo.gamma"),
    C("set-lam-negative", show_set("algo.lam=-0.1"), "algo.lam"),
    C("set-kl-estimator-unknown", show_set("algo.kl_estimator=k4"), "algo.kl_estimator"),
    C("set-is-correction-unknown", show_set("algo.is_correction=maybe"), "algo.is_correction"),
    C("set-is-cap-below-one", show_set("algo.is_cap=0.5"), "algo.is_cap"),
    C("set-mismatch-unknown", show_set("algo.mismatch=tsi"), "algo.mismatch"),
    C("set-mismatch-low-above-one", show_set("algo.mismatch_low=1.5"), "algo.mismatch_low"),
    C("set-mismatch-seq-high-below-one", show_set("algo.mismatch_seq_high=0.9"), "algo.mismatch_seq_high"),
    C("set-vf-coef-negative", show_set("algo.vf_coef=-1"), "algo.vf_coef"),
    C("set-memory-limit-zero", show_set("memory_limit_gib=0"), "memory_limit_gib"),
    C(
        "set-memory-limit-inf",
        plan_set("memory_limit_gib=.inf"),
        "memory_limit_gib",
    ),
    C(
        "set-memory-limit-huge",
        plan_set("memory_limit_gib=1e300"),
        "memory_limit_gib",
    ),
    C(
        "set-memory-limit-tiny",
        plan_set("memory_limit_gib=1e-12"),
        "memory_limit_gib",
    ),
    C("set-rollout-mode-unknown", show_set("rollout.mode=turbo"), "rollout.mode", "turbo"),
    C("set-rollout-mode-two-starts", show_set("rollout.mode=sync+async"), "rollout.mode"),
    C("set-rollout-mode-twice", show_set("rollout.mode=partial+partial"), "rollout.mode", "twice"),
    C("set-rollout-mode-empty", show_set("rollout.mode=+"), "rollout.mode"),
    C("set-staleness-negative", show_set("rollout.staleness=-1"), "rollout.staleness"),
    C("set-overprovision-negative", show_set("rollout.overprovision=-0.5"), "rollout.overprovision"),
    C(
        "set-overprovision-inf-partial",
        plan_set("rollout.overprovision=.inf", "rollout.mode=partial"),
        "rollout.overprovision",
    ),
    C(
        "set-staleness-huge-async",
        plan_set(f"rollout.staleness={10**20}", "rollout.mode=async"),
        "rollout.staleness",
        timeout_s=5,
    ),
    C("set-chunk-tokens-zero", show_set("rollout.chunk_tokens=0"), "rollout.chunk_tokens"),
    C("set-stream-groups-zero", show_set("rollout.stream_groups=0"), "rollout.stream_groups"),
    C("set-name-dotdot-slash", show_set("name=../evil"), "name"),
    C("set-name-dotdot", show_set("name=.."), "name"),
    C("set-out-through-a-file", lambda t: ["run", "grpo", "--set", f"out={t.blocker()}/x", *RUN1], "{tmp}/blocker"),
    C("set-checkpoint-not-bool", show_set("checkpoint=maybe"), "checkpoint"),
    C("set-progress-int", show_set("progress=2"), "progress"),
    C("set-device-unknown", plan_set("device=tpu"), "device", "tpu"),
    C(
        "set-device-cuda-on-cpu",
        plan_set("device=cuda:0"),
        "device",
        "cuda:0",
        marks=[NO_CUDA],
    ),
    C("set-tiny-hidden-size-zero", plan_set("tiny_model.hidden_size=0"), "tiny_model"),
    C("set-tiny-hidden-size-negative", plan_set("tiny_model.hidden_size=-64"), "tiny_model"),
    C("set-tiny-num-layers-zero", plan_set("tiny_model.num_layers=0"), "tiny_model"),
    C("set-tiny-kv-heads-not-dividing", plan_set("tiny_model.num_kv_heads=3"), "tiny_model"),
    C("set-tiny-vocab-too-small", plan_set("tiny_model.vocab_size=10"), "tiny_model.vocab_size"),
    C("set-tiny-hidden-size-huge", plan_set(f"tiny_model.hidden_size={2**40}"), "GiB", "group 'all'"),
    C(
        "set-prompts-per-step-huge",
        plan_set(f"rollout.prompts_per_step={10**12}"),
        "rollout.prompts_per_step",
    ),
    C("set-task-options-unknown", plan_set("task_options.nosuch=1"), "nosuch"),
    C("set-task-empty", plan_set("task="), "task"),
    C(
        "set-task-option-wrong-type",
        lambda t: ["plan", "grpo", "--task", "add", "--set", "task_options.modulo=x"],
        "modulo",
    ),
    C("set-model-missing-dir", plan_set("model=/no/such/model"), "/no/such/model"),
    # ------------------------------------------------------------ dedicated flags
    C("flag-steps-negative", lambda t: ["show", "grpo", "--steps", "-1"], "steps"),
    C("flag-steps-word", lambda t: ["show", "grpo", "--steps", "abc"], "--steps", usage=True),
    C("flag-seed-huge", lambda t: ["show", "grpo", "--seed", str(2**70)], "seed"),
    C("flag-name-traversal", lambda t: ["show", "grpo", "--name", "../../etc"], "name"),
    C("flag-format-unknown", lambda t: ["plan", "grpo", "--format", "xml"], "--format", usage=True),
    C(
        "flag-budget-nan",
        plan_cluster("8xA100-80G", "--budget", "nan"),
        "--budget",
    ),
    C(
        "flag-budget-negative",
        plan_cluster("8xA100-80G", "--budget", "-1"),
        "--budget",
    ),
    C("flag-budget-word", plan_cluster("8xA100-80G", "--budget", "everything"), "--budget all"),
    C("flag-budget-infinite", plan_cluster("8xA100-80G", "--budget", "inf"), "--budget is inf"),
    C("flag-model-preset-without-cluster", lambda t: ["plan", "grpo", "--model", "llama-7b"], "llama-7b"),
    C("flag-unknown-command", lambda t: ["nosuchcommand"], "nosuchcommand", usage=True),
    C("plan-out-unknown-suffix", lambda t: ["plan", "grpo", "--out", t.path("plan.txt")], "{tmp}/plan.txt"),
    C("plan-placement-without-cluster", lambda t: ["plan", "grpo", "--placement", "split"], "--cluster"),
    C("plan-workload-without-cluster", lambda t: ["plan", "grpo", "--workload", t.path("w.yaml")], "--workload"),
    C("run-address-on-local", lambda t: ["run", "grpo", "--address", "auto", *RUN1], "--address"),
    C("run-on-a-named-cluster", lambda t: ["run", "grpo", "--cluster", "8xA100-80G", *RUN1], "this cluster has 8"),
    C("run-placement-without-cluster", lambda t: ["run", "grpo", "--placement", "split", *RUN1], "--cluster"),
    C("show-dot-into-a-directory", lambda t: ["show", "grpo", "--dot", t.dir("dotdir")], "{tmp}/dotdir"),
    C("run-plan-with-steps", lambda t: ["run", "--plan", t.plan(), "--steps", "3"], "--plan"),
    C("run-plan-other-graph", lambda t: ["run", "ppo", "--plan", t.plan()], "was made for graph", "ppo"),
    # ------------------------------------------------------------ graph sources
    C("graph-none-given", lambda t: ["show"], "name a graph"),
    C("graph-unknown-algorithm", lambda t: ["show", "grpoo"], "grpoo", "Did you mean 'grpo'"),
    C("graph-missing-file", lambda t: ["show", t.path("nope.py")], "{tmp}/nope.py", "does not exist"),
    C("graph-is-a-directory", lambda t: ["show", t.dir("graphs")], "{tmp}/graphs"),
    C("graph-not-python-suffix", show_module("x = 1\n", name="g.txt"), "{tmp}/g.txt"),
    C("graph-syntax-error", show_module("def build(cfg)\n    return 1\n"), "{tmp}/g.py", "SyntaxError"),
    C("graph-binary-garbage", show_module(BINARY), "{tmp}/g.py"),
    C("graph-raises-on-import", show_module("x = 1\nraise ValueError('nope')\n"), "{tmp}/g.py", "line 2", "nope"),
    C("graph-missing-import", show_module("import flowrl_no_such_module\n"), "{tmp}/g.py", "flowrl_no_such_module"),
    C("graph-sys-exit-on-import", show_module("import sys\nsys.exit(3)\n"), "{tmp}/g.py", "sys.exit(3)"),
    C(
        "graph-base-exception-on-import",
        show_module("raise BaseException('x')\n"),
        "{tmp}/g.py",
    ),
    C("graph-no-build", show_module("DEFAULTS = {}\n"), "{tmp}/g.py", "build(cfg)"),
    C("graph-build-not-callable", show_module("build = 5\n"), "{tmp}/g.py", "build(cfg)"),
    C("graph-build-takes-no-args", show_module("def build():\n    pass\n"), "{tmp}/g.py", "TypeError"),
    C("graph-build-returns-none", show_graph("return None\n"), "{tmp}/g.py", "NoneType"),
    C("graph-build-returns-dict", show_graph("return {'nodes': []}\n"), "{tmp}/g.py", "dict"),
    C("graph-build-raises", show_graph("raise RuntimeError('cannot build')\n"), "{tmp}/g.py", "cannot build"),
    C(
        "graph-build-sys-exit",
        show_graph("import sys\nsys.exit(4)\n"),
        "{tmp}/g.py",
        "sys.exit",
    ),
    C("graph-build-recurses", show_graph("return build(cfg)\n"), "{tmp}/g.py", "RecursionError"),
    C("graph-defaults-not-dict", show_module("DEFAULTS = [1]\n" + GRAPH_HEAD + "    pass\n"), "DEFAULTS"),
    C("graph-defaults-unknown-field", show_module("DEFAULTS = {'stepz': 1}\n" + GRAPH_HEAD + "    pass\n"), "stepz"),
    C("graph-defaults-wrong-type", show_module("DEFAULTS = {'steps': 'x'}\n" + GRAPH_HEAD + "    pass\n"), "steps"),
    C("graph-name-traversal", show_graph("return Graph('../up')\n"), "../up"),
    C("graph-no-nodes", show_graph("return Graph('empty')\n"), "empty", "no nodes"),
    C(
        "graph-reads-unwritten-key",
        show_graph(GOOD_BODY.replace('reads="responses old_logprobs advantages"', 'reads="responses advantagez"')),
        "node 'train_actor'",
        "advantagez",
        "Did you mean 'advantages'",
    ),
    C(
        "graph-invalid-key-name",
        show_graph(GOOD_BODY.replace('writes="rewards")', 'writes="re-wards")')),
        "node 'score'",
        "re-wards",
    ),
    C(
        "graph-duplicate-node",
        show_graph(GOOD_BODY.replace('g.compute("advantages"', 'g.compute("score"')),
        "score",
        "declared twice",
    ),
    C(
        "graph-duplicate-model",
        show_graph(GOOD_BODY.replace('g.model("actor", "actor")', 'g.model("actor")\ng.model("actor")')),
        "actor",
        "declared twice",
    ),
    C("graph-unknown-role", show_graph('g = Graph("x")\ng.model("m", "judge")\n'), "'m'", "judge"),
    C(
        "graph-node-on-undeclared-model",
        show_graph(
            GOOD_BODY.replace('g.forward("old_logprobs", model="actor"', 'g.forward("old_logprobs", model="pi"')
        ),
        "node 'old_logprobs'",
        "'pi'",
    ),
    C(
        "graph-generate-n-zero",
        show_graph(GOOD_BODY.replace("n=cfg.rollout.samples_per_prompt", "n=0")),
        "node 'rollout'",
        "n must be",
    ),
    C(
        "graph-forward-output-unknown",
        show_graph(GOOD_BODY.replace('output="logprobs"', 'output="entropy"')),
        "node 'old_logprobs'",
        "entropy",
    ),
    C(
        "graph-init-from-unknown",
        show_graph(GOOD_BODY.replace('g.model("actor", "actor")', 'g.model("actor", "actor", init_from="base")')),
        "'actor'",
        "'base'",
    ),
    C(
        "graph-writes-an-input",
        show_graph(
            GOOD_BODY.replace('writes="rewards"', 'writes="prompts"').replace('"rewards responses"', '"responses"')
        ),
        "prompts",
        "read-only",
    ),
    C(
        "graph-reads-and-writes-same-key",
        show_graph(
            GOOD_BODY.replace(
                'reads="rewards responses", writes="advantages"',
                'reads="rewards responses", writes="rewards2 responses"',
            )
        ),
        "responses",
    ),
    C(
        "graph-trainable-without-train-node",
        show_graph(
            GOOD_BODY.replace('g.model("actor", "actor")', 'g.model("actor", "actor")\ng.model("critic", "critic")')
        ),
        "'critic'",
        "no train node",
    ),
    C(
        "graph-generate-with-critic",
        show_graph(GOOD_BODY.replace('g.model("actor", "actor")', 'g.model("actor", "critic")')),
        "'actor'",
    ),
    C(
        "graph-reward-reads-no-prompts",
        show_graph(
            GOOD_BODY.replace('reads="prompts responses", writes="rewards"', 'reads="responses", writes="rewards"')
        ),
        "node 'score'",
        "prompts",
    ),
    C(
        "graph-node-name-not-a-string",
        show_graph(GOOD_BODY.replace('g.compute("advantages"', "g.compute(5")),
        "5",
    ),
    C(
        "graph-duplicate-input",
        show_module(
            "from flowrl.graph import Graph\n\ndef build(cfg):\n    return Graph('x', inputs=['prompts', 'prompts'])\n"
        ),
        "prompts",
        "twice",
    ),
    C(
        "graph-advantage-missing-input",
        lambda t: ["plan", t.graph(GOOD_BODY.replace('reads="rewards responses"', 'reads="rewards"'))],
        "node 'advantages'",
        "responses",
    ),
    C(
        "graph-gae-without-values",
        lambda t: ["plan", t.graph(GOOD_BODY.replace('fn="grpo"', 'fn="gae"'))],
        "node 'advantages'",
        "values",
    ),
    C(
        "graph-ppo-loss-without-advantages",
        lambda t: [
            "plan",
            t.graph(
                GOOD_BODY.replace(
                    'reads="responses old_logprobs advantages"', 'reads="responses old_logprobs"'
                ).replace('g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")', "")
            ),
        ],
        "node 'train_actor'",
        "advantages",
    ),
    C(
        "graph-value-loss-on-actor",
        lambda t: ["plan", t.graph(GOOD_BODY.replace('loss="ppo"', 'loss="value"'))],
        "node 'train_actor'",
        "value",
    ),
    C(
        "graph-generate-n-huge",
        lambda t: ["plan", t.graph(GOOD_BODY.replace("n=cfg.rollout.samples_per_prompt", f"n={10**12}"))],
        "node 'rollout'",
    ),
    C(
        "graph-unknown-reward-fn",
        lambda t: ["plan", t.graph(GOOD_BODY.replace('fn="task"', 'fn="nosuchreward"'))],
        "nosuchreward",
    ),
    C(
        "graph-unknown-advantage-fn",
        lambda t: ["plan", t.graph(GOOD_BODY.replace('fn="grpo"', 'fn="nosuchadv"'))],
        "nosuchadv",
    ),
    C(
        "graph-unknown-loss",
        lambda t: ["plan", t.graph(GOOD_BODY.replace('loss="ppo"', 'loss="nosuchloss"'))],
        "nosuchloss",
    ),
    # ------------------------------------------------------------ --plan files
    C("plan-file-missing", lambda t: ["run", "--plan", t.path("nope.yaml")], "{tmp}/nope.yaml"),
    C("plan-file-garbage-yaml", lambda t: ["run", "--plan", t.file("p.yaml", "id: [\n")], "{tmp}/p.yaml"),
    C("plan-file-binary", lambda t: ["run", "--plan", t.file("p.yaml", BINARY)], "{tmp}/p.yaml"),
    C("plan-file-garbage-json", lambda t: ["run", "--plan", t.file("p.json", "{]")], "{tmp}/p.json"),
    C("plan-file-directory", lambda t: ["run", "--plan", t.dir("p.yaml")], "{tmp}/p.yaml"),
    C("plan-file-empty", lambda t: ["run", "--plan", t.file("p.yaml", "")], "{tmp}/p.yaml", "graph"),
    C("plan-file-top-level-list", lambda t: ["run", "--plan", t.file("p.yaml", "- 1\n")], "{tmp}/p.yaml"),
    C("plan-edited-keeping-id", run_plan(("  seed: 0\n", "  seed: 1\n"), keep_id=True), "{tmp}/plan.yaml", "edited"),
    C("plan-wrong-type", run_plan(("  steps: 1\n", "  steps: many\n")), "{tmp}/plan.yaml", "config.steps"),
    C("plan-unknown-field", run_plan(("  seed: 0\n", "  seed: 0\n  stepz: 3\n")), "config.stepz"),
    C("plan-unknown-top-level-field", run_plan(lambda s: s + "extra: 1\n"), "extra"),
    C("plan-invalid-config-value", run_plan(("    lr: 0.002\n", "    lr: -1.0\n")), "train.lr"),
    C("plan-mismatched-fingerprint", run_plan(_fingerprint), "grpo", "deadbeefdeadbeef"),
    C(
        "plan-device-cuda-on-cpu",
        run_plan(("  device: cpu\n", "  device: cuda:0\n")),
        "device",
        "cuda:0",
        marks=[NO_CUDA],
    ),
    C("plan-unknown-algorithm", run_plan(("  source: grpo\n", "  source: nosuchalgo\n")), "nosuchalgo"),
    C("plan-graph-file-missing", run_plan(("  source: grpo\n", "  source: /no/such/g.py\n")), "/no/such/g.py"),
    C("plan-unknown-executor", run_plan(("  executor: local\n", "  executor: nosuch\n")), "executor", "nosuch"),
    C(
        "plan-unknown-generation-engine",
        run_plan(("  generation:\n    engine: local\n", "  generation:\n    engine: nosuch\n")),
        "generation.engine",
    ),
    C("plan-no-layout", run_plan(_drop_layout), "plan"),
    C("plan-cluster-too-big", run_plan(("    nodes: 1\n", "    nodes: 16\n")), "16 devices"),
    C(
        "plan-workload-kind-unknown",
        run_plan(("kind: histogram", "kind: zipf")),
        "{tmp}/plan.yaml",
        "response_length",
    ),
    C("plan-node-rows-negative", run_plan(("  rows: ", "  rows: -")), "rows"),
    C(
        "plan-node-micro-batch-zero",
        run_plan(lambda s: re.sub(r"micro_batch_size: \d+", "micro_batch_size: 0", s, count=1)),
        "node 'rollout'",
    ),
    # ------------------------------------------------------------ --model folders
    C("model-missing-dir", lambda t: ["plan", "grpo", "--model", t.path("nope")], "{tmp}/nope", "does not exist"),
    C("model-empty-dir", lambda t: ["plan", "grpo", "--model", t.dir("empty")], "{tmp}/empty", "config.json"),
    C("model-is-a-file", lambda t: ["plan", "grpo", "--model", t.file("m.bin", b"\0")], "{tmp}/m.bin"),
    C(
        "model-config-without-weights",
        lambda t: ["plan", "grpo", "--model", str(Path(t.file("model/config.json", "{}")).parent)],
        "{tmp}/model",
    ),
    C("model-config-garbage", plan_model({"config.json": "{not json"}), "{tmp}/model/config.json"),
    C("model-config-binary", plan_model({"config.json": BINARY}), "{tmp}/model/config.json"),
    C("model-config-a-list", plan_model({"config.json": "[]"}), "{tmp}/model/config.json"),
    C("model-config-missing-field", plan_model({"config.json": '{"hidden_size": 64}'}), "num_hidden_layers"),
    C(
        "model-config-string-field",
        plan_model(
            {
                "config.json": '{"num_hidden_layers": "2", "hidden_size": 64, "num_attention_heads": 4, '
                '"intermediate_size": 128, "vocab_size": 50}'
            }
        ),
        "num_hidden_layers",
    ),  # fmt: skip
    C(
        "model-config-zero-heads",
        plan_model(
            {
                "config.json": '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 0, '
                '"intermediate_size": 128, "vocab_size": 50}'
            }
        ),
        "{tmp}/model/config.json",
    ),  # fmt: skip
    C("model-weights-corrupt", run_model(lambda m: _corrupt(m / "model.safetensors")), "{tmp}/model"),
    C("model-weights-truncated", run_model(lambda m: _truncate(m / "model.safetensors")), "{tmp}/model"),
    C("model-weights-missing", run_model(lambda m: (m / "model.safetensors").unlink()), "{tmp}/model"),
    C("model-tokenizer-missing", run_model(_remove_tokenizer), "{tmp}/model", "tokenizer"),
    C("model-type-unknown", run_model(_set_model_type), "{tmp}/model"),
    C(
        "model-vocab-smaller-than-tokenizer",
        _small_vocab_model,
        "{tmp}/small_vocab",
    ),
    # ------------------------------------------------------------ plugins: executors, engines, tasks, passes
    C("plugin-unknown-backend", lambda t: ["run", "grpo", "--backend", "nosuch", *RUN1], "executor", "nosuch"),
    C("plugin-unknown-task", lambda t: ["plan", "grpo", "--task", "nosuchtask"], "nosuchtask"),
    C("plugin-task-did-you-mean", lambda t: ["plan", "grpo", "--task", "coppy"], "coppy", "copy"),
    C("plugin-unknown-generation-engine", plan_set("generation.engine=nosuch"), "generation.engine"),
    C("plugin-unknown-train-engine", plan_set("train.engine=nosuch"), "train.engine"),
    C("plugin-unknown-pass", lambda t: ["plan", "grpo", "--pass", "nosuchpass"], "nosuchpass"),
    C("plugin-unknown-print-after", lambda t: ["plan", "grpo", "--print-after", "nosuchpass"], "nosuchpass"),
    C("plugin-unknown-cost-model", plan_cluster("8xA100-80G", "--cost-model", "nosuchcost"), "nosuchcost"),
    C("plugin-ray-not-enabled", lambda t: ["plan", "grpo", "--cluster", "cpu:2"], "cpu:2", "Ray"),
    # ------------------------------------------------------------ --cluster
    C("cluster-empty", plan_cluster(" "), "cluster"),
    C("cluster-garbage", plan_cluster("banana"), "banana"),
    C("cluster-zero-devices", plan_cluster("0xA100-80G"), "0xA100-80G"),
    C("cluster-unknown-preset", plan_cluster("16xB300"), "B300"),
    C("cluster-partial-nodes", plan_cluster("12xA100-80G"), "12xA100-80G"),
    C("cluster-node-too-big", plan_cluster("1x16xA100-80G"), "1x16xA100-80G"),
    C("cluster-no-count", plan_cluster("A100-80G"), "A100-80G", "device count"),
    C("cluster-cpu-zero", plan_cluster("cpu:0"), "cpu:0"),
    C("cluster-local-unprofiled", lambda t: ["plan", "grpo", "--cluster", "local"], "local", "flowrl profile"),
    C("cluster-missing-file", plan_cluster("/no/such/cluster.yaml"), "/no/such/cluster.yaml"),
    C("cluster-huge-count", plan_cluster(f"{8 * 10**18}xA100-80G"), "cluster"),
    C("cluster-needs-model", lambda t: ["plan", "grpo", "--cluster", "8xA100-80G"], "--model"),
    C(
        "cluster-model-unknown-preset",
        lambda t: ["plan", "grpo", "--cluster", "8xA100-80G", "--model", "llama-8b"],
        "llama-8b",
    ),
    C("cluster-file-garbage", plan_cluster_file("nodes: [\n"), "{tmp}/cluster.yaml"),
    C("cluster-file-unknown-field", plan_cluster_file("nodez: 2\nhardware: A100-80G\n"), "nodez"),
    C("cluster-file-unknown-preset", plan_cluster_file("hardware: B300\n"), "B300"),
    C("cluster-file-negative-nodes", plan_cluster_file("nodes: -1\nhardware: A100-80G\n"), "nodes"),
    C("cluster-file-hardware-incomplete", plan_cluster_file("hardware: {name: x}\n"), "{tmp}/cluster.yaml"),
    C("cluster-file-preset-not-a-name", plan_cluster_file("hardware: {preset: 5}\n"), "hardware.preset"),
    C(
        "cluster-file-negative-memory",
        plan_cluster_file("hardware: {preset: A100-80G, memory_bytes: -1}\n"),
        "memory_bytes",
    ),
    # ------------------------------------------------------------ --workload
    C(
        "workload-missing-file",
        lambda t: [*plan_cluster("8xA100-80G")(t), "--workload", t.path("w.yaml")],
        "{tmp}/w.yaml",
    ),
    C("workload-garbage", plan_workload("prompts_per_step: [\n"), "{tmp}/workload.yaml"),
    C("workload-top-level-list", plan_workload("- 1\n"), "{tmp}/workload.yaml"),
    C("workload-unknown-field", plan_workload("prompts_per_stepp: 4\n"), "prompts_per_stepp"),
    C("workload-prompts-zero", plan_workload("prompts_per_step: 0\n"), "prompts_per_step"),
    C("workload-kind-unknown", plan_workload("response_length: {kind: zipf}\n"), "response_length"),
    C(
        "workload-histogram-empty",
        plan_workload("response_length: {kind: histogram, lengths: [], weights: []}\n"),
        "lengths",
    ),
    C(
        "workload-histogram-negative-weight",
        plan_workload("response_length: {kind: histogram, lengths: [1, 2], weights: [1, -1]}\n"),
        "weights",
    ),
    C(
        "workload-histogram-nan-weight",
        plan_workload("response_length: {kind: histogram, lengths: [1, 2], weights: [.nan, 1]}\n"),
        "weights",
    ),
    C("workload-binary", plan_workload(BINARY, name="w.toml"), "{tmp}/w.toml"),
    # ------------------------------------------------------------ profile
    C("profile-unknown-flag", lambda t: ["profile", "--bogus"], "--bogus", usage=True),
    C("profile-extra-argument", lambda t: ["profile", "extra"], "extra", usage=True),
    C("profile-out-under-a-file", profile_to(lambda t: f"{t.blocker()}/cpu.yaml"), "{tmp}/blocker/cpu.yaml"),
    C("profile-out-is-a-directory", profile_to(lambda t: t.dir("outdir")), "{tmp}/outdir"),
    C("profile-home-is-a-file", _home_blocked, "{tmp}/blocker"),
    # ------------------------------------------------------------ reward functions failing inside a run
    C("reward-raises", run_reward("boom"), "node 'score'", "reward function 'boom'", "my reward broke"),
    C("reward-returns-nan", run_reward("nan_reward"), "node 'score'", "nan_reward", "finite"),
    C("reward-returns-inf", run_reward("inf_reward"), "node 'score'", "inf_reward", "finite"),
    C("reward-wrong-length", run_reward("short_reward"), "node 'score'", "short_reward", "3 scores for 4"),
    C("reward-returns-strings", run_reward("string_reward"), "node 'score'", "string_reward"),
    C("reward-returns-none", run_reward("none_reward"), "node 'score'", "none_reward"),
    C(
        "reward-metrics-not-a-mapping",
        run_reward("bad_metrics"),
        "node 'score'",
        "bad_metrics",
    ),
    C("reward-metric-not-a-number", run_reward("object_metric"), "node 'score'", "mood"),
    C(
        "reward-calls-sys-exit",
        run_reward("exit_reward"),
        "node 'score'",
        "exit_reward",
    ),
    # ------------------------------------------------------------ compute functions and losses failing inside a run
    C(
        "compute-misshapen-output",
        run_user(compute="misshapen_adv"),
        "misshapen_adv",
    ),
    C(
        "compute-list-output",
        run_user(compute="list_adv"),
        "list_adv",
    ),
    C("compute-missing-key", run_user(compute="no_adv"), "node 'advantages'", "advantages"),
    C("compute-not-a-mapping", run_user(compute="scalar_adv"), "node 'advantages'"),
    C(
        "loss-raises",
        run_user(loss="boom_loss"),
        "boom_loss",
        "my loss broke",
    ),
    C(
        "loss-returns-a-float",
        run_user(loss="float_loss"),
        "float_loss",
    ),
]

# ---------------------------------------------------------------------------- features being added
# (flowrl run --resume, --force, save_every, graph-source checks on --plan, import timeouts,
# train.skip_nonfinite). Expected wording is loose: the thing at fault must be named.


def _run_folder(t: Ctx, state: str | None = None) -> str:
    """A folder as a run leaves it before its first checkpoint (plan.yaml, metrics.jsonl), with
    ``state`` as the manifest of a checkpoint after step 0 when given."""
    run = Path(t.dir("runs/grpo"))
    plan = run / "plan.yaml"
    assert main(["plan", "grpo", "--steps", "2", "--set", f"out={t.path('runs')}", *SMALL, "--out", str(plan)]) == 0
    (run / "metrics.jsonl").write_text("")
    if state is not None:
        t.file("runs/grpo/checkpoints/step-000000/state.json", state)
    return str(run)


def _real_run(t: Ctx, damage: Callable[[Path], None]) -> list[str]:
    """A real one-step run with a checkpoint, damaged, then resumed for a second step."""
    argv = ["run", "grpo", "--out", t.path("runs"), *RUN1, "--set", "checkpoint=true", "--set", "save_every=1"]
    assert main(argv) == 0, "the run to resume failed"
    run = Path(t.path("runs/grpo"))
    (step,) = sorted((run / "checkpoints").glob("step-*"))
    damage(step)
    return ["run", "--resume", str(run), "--steps", "2", "--quiet"]


def _truncate_all_safetensors(step: Path) -> None:
    for p in step.rglob("*.safetensors"):
        _truncate(p)


def _plan_for_unnamed_graph_file(t: Ctx) -> list[str]:
    graph = t.graph(GOOD_BODY, name="mine.py")
    plan = t.path("plan.yaml")
    assert main(["plan", graph, "--steps", "1", "--set", f"out={t.path('runs')}", *SMALL, "--out", plan]) == 0
    Path(graph).rename(t.path("renamed.py"))
    Path(t.graph(GOOD_BODY.replace('"good"', '"other"'), name="mine.py"))  # a different file now sits there
    return ["run", "--plan", plan]


def _slow_import(name: str, stall: str) -> Callable[[Ctx], list[str]]:
    """A graph file that stalls for 3 s at import (``stall``), under FLOWRL_IMPORT_TIMEOUT=1."""

    def build(t: Ctx) -> list[str]:
        t.env("FLOWRL_IMPORT_TIMEOUT", "1")
        return ["show", t.file(name, f"import time\n{stall}\n{GRAPH_HEAD}{textwrap.indent(GOOD_BODY, '    ')}")]

    return build


def _import_timeout_env(value: str) -> Callable[[Ctx], list[str]]:
    def build(t: Ctx) -> list[str]:
        t.env("FLOWRL_IMPORT_TIMEOUT", value)
        return ["show", t.graph(GOOD_BODY)]

    return build


def _config_is_out(t: Ctx) -> list[str]:
    cfg = t.file("run.yaml", "seed: 1\n")
    return ["plan", "grpo", "--config", cfg, "--out", cfg]


NEW_FEATURES: list[Case] = [
    C("new-resume-missing-dir", lambda t: ["run", "--resume", t.path("nope")], "{tmp}/nope"),
    C("new-resume-a-file", lambda t: ["run", "--resume", t.file("notes.txt", "hi")], "{tmp}/notes.txt"),
    C("new-resume-not-a-run-folder", lambda t: ["run", "--resume", t.dir("random")], "{tmp}/random"),
    C("new-resume-with-settings", lambda t: ["run", "--resume", _run_folder(t), "--set", "seed=1"], "--resume"),
    C(
        "new-resume-checkpoint-manifest-garbage",
        lambda t: ["run", "--resume", _run_folder(t, state="{garbage"), "--quiet"],
        "{tmp}/runs/grpo",
    ),
    C(
        "new-resume-checkpoint-wrong-format",
        lambda t: ["run", "--resume", _run_folder(t, state='{"format": 99}'), "--quiet"],
        "{tmp}/runs/grpo",
    ),
    C(
        "new-resume-plan-garbage",
        lambda t: ["run", "--resume", str(Path(t.file("runs/x/plan.yaml", "id: [\n")).parent)],
        "{tmp}/runs/x",
    ),
    C(
        "new-resume-truncated-checkpoint",
        lambda t: _real_run(t, _truncate_all_safetensors),
        "{tmp}/runs/grpo",
    ),
    C(
        "new-resume-checkpoint-model-missing",
        lambda t: _real_run(t, lambda step: shutil.rmtree(step / "models")),
        "{tmp}/runs/grpo",
    ),
    C(
        "new-plan-out-exists-without-force",
        lambda t: ["plan", "grpo", "--out", t.file("plan.yaml", "keep me\n")],
        "{tmp}/plan.yaml",
        "--force",
    ),
    C("new-plan-config-is-out", _config_is_out, "{tmp}/run.yaml"),
    C("new-plan-config-is-out-forced", lambda t: [*_config_is_out(t), "--force"], "{tmp}/run.yaml"),
    C("new-save-every-negative", show_set("save_every=-1"), "save_every", absent=["unknown field"]),
    C("new-save-every-string", show_set("save_every=often"), "save_every", absent=["unknown field"]),
    C("new-keep-checkpoints-zero", show_set("keep_checkpoints=0"), "keep_checkpoints", absent=["unknown field"]),
    C(
        "new-skip-nonfinite-not-bool",
        show_set("train.skip_nonfinite=maybe"),
        "skip_nonfinite",
        absent=["unknown field"],
    ),
    C("new-plan-graph-file-not-named", _plan_for_unnamed_graph_file, "mine.py"),
    C("new-compute-nan-output", run_user(compute="nan_adv"), "node 'advantages'", "nan_adv", "skip_nonfinite"),
    C("new-loss-nan", run_user(loss="nan_loss"), "node 'train_actor'", "not finite", "train.skip_nonfinite"),
    C(
        "new-graph-import-timeout-env-garbage",
        _import_timeout_env("soon"),
        "FLOWRL_IMPORT_TIMEOUT",
    ),
    C("new-graph-import-timeout", _slow_import("slow.py", "time.sleep(3)"), "{tmp}/slow.py", "FLOWRL_IMPORT_TIMEOUT"),
    C(
        "new-graph-import-timeout-not-swallowed",
        _slow_import("swallow.py", "try:\n    time.sleep(3)\nexcept Exception:\n    pass"),
        "{tmp}/swallow.py",
        "FLOWRL_IMPORT_TIMEOUT",
    ),
]


# ---------------------------------------------------------------------------- cases that fail today
# Each is marked xfail(strict=True) with what happens instead: delete its line once it is fixed
# (a strict xfail that passes fails the run, so a fix cannot go unnoticed).

FAILING_TODAY: dict[str, str] = {
    # (a) existing features
}


# ---------------------------------------------------------------------------- the test


def squash(text: str) -> str:
    """Text without whitespace: error paragraphs are wrapped at 100 columns, paths included."""
    return "".join(text.split())


class Hung(BaseException):
    """Raised in the main thread when a case runs past its time limit."""


def _hung(signum: int, frame: Any) -> None:
    raise Hung("still running at its time limit")


def invoke(argv: Sequence[str], timeout_s: float = CASE_TIMEOUT_S) -> tuple[int | None, str | None]:
    """``main(argv)``: (exit code, None); (code, why) when SystemExit escapes it; (None, the
    traceback) when anything else escapes it, or it runs past ``timeout_s``. The limit is a
    watchdog thread that signals SIGUSR1 (flowrl's own graph-import limit uses SIGALRM)."""
    old = signal.signal(signal.SIGUSR1, _hung)
    watchdog = threading.Timer(timeout_s, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    watchdog.start()
    try:
        return main(list(argv)), None
    except SystemExit as exc:  # argparse usage errors exit; so may a user's code
        return (exc.code if isinstance(exc.code, int) else 1), f"SystemExit({exc.code!r}) escaped main"
    except BaseException:  # noqa: BLE001 - report anything that escapes, a hang too
        return None, traceback.format_exc()
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGUSR1, old)


#: cases that run a training step before they fail (half a second or more each): the full suite
#: runs them, the quick lane (-m "not slow") does not
SLOW_CASES = {
    "new-resume-checkpoint-model-missing",
    "new-resume-truncated-checkpoint",
    "new-resume-checkpoint-manifest-garbage",
    "new-resume-checkpoint-wrong-format",
    "new-loss-nan",
    "new-compute-nan-output",
    "new-graph-import-timeout",
    "new-graph-import-timeout-not-swallowed",
    "reward-metric-not-a-number",
    "reward-calls-sys-exit",
    "reward-returns-none",
    "reward-returns-nan",
    "reward-returns-inf",
    "reward-wrong-length",
    "reward-raises",
    "reward-returns-strings",
    "reward-metrics-not-a-mapping",
    "loss-returns-a-float",
    "loss-raises",
    "compute-not-a-mapping",
}


def _params(cases: list[Case]) -> list[Any]:
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    known = {c.id for c in (*CASES, *NEW_FEATURES)}
    assert SLOW_CASES <= known, SLOW_CASES - known
    out = []
    for c in cases:
        marks = c.marks
        if c.id in SLOW_CASES:
            marks += (pytest.mark.slow,)
        if c.id in FAILING_TODAY:
            marks += (pytest.mark.xfail(reason=FAILING_TODAY[c.id], strict=True),)
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


def check(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "flowrl_home"))
    ctx = Ctx(tmp_path, monkeypatch, request)
    argv = list(case.argv(ctx))
    capsys.readouterr()  # what building the case printed
    code, escaped = invoke(argv, case.timeout_s)
    out, err = capsys.readouterr()
    report = f"argv: {argv}\nexit: {code}\nstderr:\n{err}\nstdout tail:\n{out[-600:]}"
    if case.usage:
        assert code == 2 and "usage:" in err, report
    else:
        assert escaped is None, f"{report}\n{escaped}"
        assert code == 2, report
        assert err.startswith("flowrl: error: "), report
    assert "Traceback" not in err, report
    for needle in case.needles:
        needle = needle.replace("{tmp}", str(tmp_path))
        assert squash(needle) in squash(err), f"expected {needle!r} in stderr\n{report}"
    for word in case.absent:
        assert word not in err, f"did not expect {word!r} in stderr\n{report}"


@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request, capsys) -> None:
    check(case, tmp_path, monkeypatch, request, capsys)


@pytest.mark.parametrize("case", _params(NEW_FEATURES))
def test_bad_input_new_feature(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request, capsys) -> None:
    check(case, tmp_path, monkeypatch, request, capsys)


def test_the_corpus_is_large_and_its_marks_name_cases() -> None:
    assert len(CASES) + len(NEW_FEATURES) >= 90
    assert set(FAILING_TODAY) <= {c.id for c in CASES + NEW_FEATURES}
