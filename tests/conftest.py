"""Test isolation: no installed plugin leaks into a test, property tests are seeded, and no
result depends on the machine's speed.

Entry-point plugins are blocked for every test (``FLOWRL_PLUGINS=""``, inherited by CLI
subprocesses too); a test that exercises entry points sets ``FLOWRL_PLUGINS`` itself with
monkeypatch. Hypothesis runs derandomized (the same examples on every run and machine) with
no per-example deadline (a loaded CI box is slow); ``HYPOTHESIS_PROFILE=explore`` searches
randomly with more examples. The auto-tuner's search budget (``--budget``, ``budget_s``) is
wall-clock time; in this process its clock is a counter (``PlannerClock``), so a budget buys
the same candidates on every machine. CLI subprocesses keep the real clock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings

# tests/helpers.py, shared by test modules (imported as ``helpers``)
sys.path.insert(0, os.path.dirname(__file__))
from helpers import TOOL_TEMPLATE  # noqa: E402 - after the path that finds it

os.environ["FLOWRL_PLUGINS"] = ""
# this machine's `flowrl profile` calibration (~/.flowrl) must not steer a test's plan (generation.engine=auto)
os.environ["FLOWRL_HOME"] = tempfile.mkdtemp(prefix="flowrl-test-home-")
# one OpenMP thread in the processes tests start (CLI runs, vLLM engines; Ray workers get the plan's
# threads): under `pytest -n 2` two test processes share two cores, and each op's threads would
# wait on the other process's
os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("explore", deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _ray_module(item: pytest.Item) -> bool:
    return item.path.parent.name == "ray" and item.path.parent.parent.name == "tests"


def _e2e_module(item: pytest.Item) -> bool:
    return item.path.parent.name == "e2e" and item.path.parent.parent.name == "tests"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """How `pytest -n 2` shares the work (pyproject: ``--dist loadfile --no-loadscope-reorder``): a
    module's tests stay together on one worker (its module fixtures are built once), and the longest
    work is handed out first -- the Ray modules taken in turn with the whole-run modules of tests/e2e
    (Ray modules run one at a time, tests/ray/conftest.py: two in a row would leave the second
    worker waiting on the first's lock), then the modules with slow tests, then the quick modules,
    which fill the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    modules: dict = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    ray = [m for m, its in modules.items() if _ray_module(its[0])]
    e2e = [m for m, its in modules.items() if _e2e_module(its[0]) and m in slow]
    first: list = []
    for i in range(max(len(ray), len(e2e))):
        first += ray[i : i + 1] + e2e[i : i + 1]
    rank = {m: i for i, m in enumerate(first)}
    items.sort(key=lambda item: (0, rank[item.path]) if item.path in rank else (1 if item.path in slow else 2, 0))


class PlannerClock:
    """``time`` for flowrl.planner.autotune: every read of ``perf_counter`` advances ``TICK``
    seconds. The search reads it once per candidate, so a budget of B seconds simulates about
    B / TICK candidates (0.7 B / TICK on the greedy path), and ``TuneResult.seconds`` counts
    reads. TICK is a slow machine's cost of a candidate (a 2-core box takes 13-60 ms), and a power
    of two, so that differences of readings are exact wherever the counter stands."""

    TICK = 1 / 16

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.TICK
        return self.now


@pytest.fixture(scope="session", autouse=True)
def _deterministic_planner_clock():
    """The tuner's budget in candidates, not seconds, for every test and module fixture (a test may
    install its own clock over it with monkeypatch)."""
    from flowrl.planner import autotune

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autotune, "time", PlannerClock())
        yield


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tests run tiny models: one intra-op thread is as fast, and far faster on a loaded 2-core box,
    where two threads wait on each other at every op. (Subprocesses read OMP_NUM_THREADS, set above.)"""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_registry():
    """Each test starts from a registry loaded under its own environment."""
    from flowrl.plugins.manager import set_registry

    set_registry(None)
    yield
    set_registry(None)


@pytest.fixture(scope="module")
def ray_session(request):
    """One private Ray (2 CPUs, or the module's ``RAY_CPUS``, on loopback) shared by a test module, with
    the Ray backend plugin enabled; executors join it instead of starting their own. Shut down after
    the module."""
    import ray

    old = os.environ.get("FLOWRL_PLUGINS")
    os.environ["FLOWRL_PLUGINS"] = "ray"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cpus = getattr(request.module, "RAY_CPUS", 2)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
    if old is None:
        os.environ.pop("FLOWRL_PLUGINS", None)
    else:
        os.environ["FLOWRL_PLUGINS"] = old


@pytest.fixture
def start_flowrl() -> Callable[..., subprocess.Popen]:
    """Start ``python -m flowrl run ARGS`` as a process of its own (so signals can reach it), with
    text pipes for its output."""

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "flowrl", "run", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    return start


#: A ChatML template, as instruct models ship it (SmolLM2, Qwen).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_model(
    folder: os.PathLike[str] | str, *, template: bool = True, hidden: int = 32, context: int = 256
) -> str:
    """A tiny Llama with a byte-level BPE tokenizer trained on the fly (with ``tokenizers``) and,
    with ``template``, a ChatML chat template: an HF folder like an instruct model's, made locally."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [f"What is {a} + {b}? The answer is {a + b}. #### {a + b}" for a in range(40) for b in range(0, 40, 7)]
    corpus += ["Answer the question step by step, then give the final number.", "hello world"] * 5
    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus, trainer)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if template:
        tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The folder of a tiny chat model (BPE tokenizer with a ChatML template), built once a session."""
    return build_chat_model(tmp_path_factory.mktemp("chat-model"))


TOOL_CALL = '<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>'


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny chat model (head size 32, as vLLM's CPU kernels need) taught, by a few hundred steps of
    supervised training here, to answer a chat prompt offering the ``mul`` tool with the call
    ``TOOL_CALL``, and to answer "42" after the tool's result: a model that really calls tools, made
    locally. Returns its folder, the template file and a data file of such prompts."""
    import json

    import torch
    import transformers

    from flowrl.tasks.tools import tool_text

    root = tmp_path_factory.mktemp("tool-model")
    folder = build_chat_model(root / "model", hidden=64, context=512)
    (root / "tools.jinja").write_text(TOOL_TEMPLATE)
    rows = [{"prompt": f"What is {a} * {b}?", "answer": str(a * b)} for a in range(2, 9) for b in (3, 7)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    schema = [transformers.utils.get_json_schema(mul)]
    after = tool_text(tok, TOOL_TEMPLATE, ["42"], True)
    seqs = []
    for r in rows:
        msgs = [{"role": "user", "content": r["prompt"]}]
        prompt = tok.apply_chat_template(msgs, tools=schema, tokenize=False, add_generation_prompt=True,
                                         chat_template=TOOL_TEMPLATE)  # fmt: skip
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        first = tok(TOOL_CALL + "<|im_end|>", add_special_tokens=False)["input_ids"]
        env = tok(after, add_special_tokens=False)["input_ids"]
        last = tok("42<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = p + first + env + last
        labels = [-100] * len(p) + first + [-100] * len(env) + last
        seqs.append((ids, labels))
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(300):
        ids, labels = seqs[step % len(seqs)]
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(folder)
    return {"model": folder, "template": str(root / "tools.jinja"), "data": str(root / "train.jsonl")}
