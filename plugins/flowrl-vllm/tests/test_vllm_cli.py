"""The vLLM generation engine (plugins/flowrl-vllm) as a user meets it from the CLI and the Python
API: the plugin is listed, bad combinations are refused as one paragraph, a partial+async run
resumed from a mid-run checkpoint repeats the uninterrupted run exactly, and runs leave no
shared-memory files behind. (The tiny model's default heads are 32 since commit 231e01a; HEADS
pins them anyway.)

Bugs found: the sampler's log-probs disagreed with the trainer's for top_p < 1 (fixed: raw log-probs
at temperature 1; refused at other temperatures), for temperature < 0.01 (fixed: refused, vLLM
clamps it), and for greedy rows at temperature != 1 (fixed: vLLM does not scale greedy logits by the
temperature, so a logits processor does); a partial rollout reaching max_position_embeddings crashed (fixed).

Whole runs go through the CLI in subprocesses (one in-process vLLM engine per process); the log-prob
probes at temperature 0.5 sample and decode greedily with one engine, in one subprocess; one run on a
model of 12 positions at top_p 0.7 serves the top-p and the position-limit tests. Runs the engine
refuses before it starts vLLM run the CLI in the test's process."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm"),
]  # whole runs in subprocesses, each starting a vLLM engine

ROOT = Path(__file__).resolve().parents[3]
GRPO = str(ROOT / "graphs" / "grpo.py")
HEADS = ["tiny_model.num_heads=2", "tiny_model.num_kv_heads=1"]
SMALL = ["progress=false", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"]


def _sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _flowrl(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flowrl", *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "FLOWRL_PLUGINS": "vllm"},
    )  # fmt: skip


@pytest.fixture
def flowrl_here(monkeypatch, capsys):
    """``flowrl ARGS`` in this process, for runs refused before a vLLM engine starts (the engine
    checks its settings before it imports vLLM): their exit status and output, as `_flowrl` gives them."""
    from flowrl.cli import main
    from flowrl.plugins.manager import set_registry

    def run(*args: str) -> SimpleNamespace:
        monkeypatch.setenv("FLOWRL_PLUGINS", "vllm")
        set_registry(None)  # this folder has no registry-resetting conftest: load it under the env above
        try:
            rc = main(list(args))
        finally:
            set_registry(None)
        out = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)

    return run


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _shm() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if p.name.startswith("flowrl-vllm")} if shm.is_dir() else set()


# ------------------------------------------------------------------ verified behaviour


def test_flowrl_plugins_lists_the_vllm_generation_engine():
    done = _flowrl("plugins", timeout=60)
    assert done.returncode == 0, done.stderr
    engines = [x for x in done.stdout.splitlines() if x.strip().startswith("vllm ") and "from vllm" in x]
    assert engines and "vLLM" in engines[0]


def test_an_unsupported_head_size_is_refused_with_advice_and_no_traceback(tmp_path, flowrl_here):
    sets = _sets(*SMALL, "generation.engine=vllm", "tiny_model.num_heads=4", "tiny_model.num_kv_heads=2")
    done = flowrl_here("run", GRPO, "--steps", "1", "--out", str(tmp_path), *sets)
    assert done.returncode == 2
    err = " ".join((done.stdout + done.stderr).split())
    assert "heads of size 16" in err and "tiny_model.num_heads=2" in err
    assert "Traceback" not in done.stderr


def test_bf16_sampling_needs_a_separate_generation_engine(tmp_path, flowrl_here):
    done = flowrl_here("run", GRPO, "--steps", "1", "--out", str(tmp_path), *_sets(*SMALL, "generation.dtype=bfloat16"))
    assert done.returncode == 2
    assert "generation.dtype" in done.stderr and "Traceback" not in done.stderr


def test_partial_async_resume_from_a_mid_run_checkpoint_repeats_the_run_exactly(tmp_path):
    """Checkpoints hold the unfinished rows; vLLM continues them from the restored state bit-exactly."""
    before = _shm()
    sets = _sets(*SMALL, *HEADS, "generation.engine=vllm", "rollout.mode=partial+async", "keep_checkpoints=10")
    done = _flowrl("run", GRPO, "--steps", "4", "--save-every", "2", "--out", str(tmp_path / "a"), *sets)
    assert done.returncode == 0, done.stderr[-3000:]
    full = tmp_path / "a" / "grpo"
    assert "log-prob gap" in done.stdout
    import shutil

    cut = tmp_path / "b" / "grpo"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-000003")  # as if killed after the step-1 checkpoint
    done = _flowrl("run", GRPO, "--resume", str(cut), "--steps", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "continued at step 2" in done.stdout

    def strip(rows):
        keep = ("reward", "kl", "rollout/tokens", "rollout/recycled_tokens", "train_actor/loss", "sample")
        return [{k: r.get(k) for k in ("step", *keep)} for r in rows]

    assert strip(_metrics(cut)) == strip(_metrics(full))
    assert _metrics(full)[0]["logprob_gap"] < 1e-5  # step 0: sampled by the trainer's current weights
    assert _shm() <= before  # no shared-memory weight files left behind


# ------------------------------------------------------------------ bugs


@pytest.fixture(scope="module")
def short_model_top_p_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One run for two checks: partial rollouts on a model of 12 positions (its responses reach its
    length), sampled at top_p 0.7 (every step-0 token's log-prob is compared with the trainer's)."""
    out = tmp_path_factory.mktemp("short-top-p")
    sets = _sets(*SMALL, *HEADS, "generation.engine=vllm", "rollout.mode=partial", "rollout.top_p=0.7",
                 "tiny_model.max_position_embeddings=12", "rollout.max_new_tokens=16")  # fmt: skip
    return _flowrl("run", GRPO, "--steps", "2", "--out", str(out), *sets), out / "grpo"


def test_top_p_sampler_logprobs_match_the_trainer(short_model_top_p_run):
    """Fixed: at temperature 1 the engine asks vLLM for raw log-probs (before top-p), the trainer's."""
    done, run = short_model_top_p_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert _metrics(run)[0]["logprob_gap"] < 1e-4


PROBE = """
import json, torch
from flowrl import api
from flowrl.contract import EngineContext, Prompt
from flowrl_vllm.engine import VLLMEngine
graph, plan = api.plan("grpo", overrides=%r, emit=lambda s: None)
trainers, _ = api.check(graph, plan).engines(graph, plan)
actor = trainers["actor"]
engine = VLLMEngine(EngineContext(decl=graph.models["actor"], spec=plan.model_run("actor"), device="cpu", source=actor))
def gap(greedy):
    out = engine.generate([Prompt(text="abc>", answer="abc"), Prompt(text="ba>", answer="ba")], n=2, greedy=greedy,
                          generator=torch.Generator().manual_seed(0))
    seqs = out.sequences
    return float(((actor.forward(seqs, "logprobs", 0) - out.logprobs) * seqs.response_mask).abs().max())
gaps = {"sampled": gap(False), "greedy": gap(True)}
engine.close()
print(json.dumps(gaps))
"""


@functools.cache
def _probe_gaps(temperature: float) -> dict[str, float]:
    """The sampler-vs-trainer log-prob gaps of one engine at ``temperature``, sampled and greedy rows
    (one subprocess, one engine: the tests of one temperature share it)."""
    overrides = ["progress=false", *HEADS, "rollout.max_new_tokens=8", f"rollout.temperature={temperature}"]
    done = subprocess.run(
        [sys.executable, "-c", PROBE % (overrides,)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "FLOWRL_PLUGINS": "vllm"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sampled_logprobs_at_temperature_half_match_the_trainer():
    assert _probe_gaps(0.5)["sampled"] < 1e-4


def test_greedy_logprobs_at_temperature_half_match_the_trainer():
    """Fixed: vLLM decodes greedy rows from unscaled logits (their log-probs were log_softmax(logits), a gap of
    ~0.42 at T=0.5); `flowrl_vllm.tempered` divides them by T first, keeping the greedy tokens."""
    assert _probe_gaps(0.5)["greedy"] < 1e-4


def test_a_temperature_below_a_hundredth_is_refused_not_clamped(tmp_path, flowrl_here):
    """Fixed: vLLM would silently raise it to 0.01 and sample another policy; the engine refuses it."""
    sets = _sets(*SMALL, *HEADS, "generation.engine=vllm", "rollout.temperature=0.005")
    done = flowrl_here("run", GRPO, "--steps", "1", "--out", str(tmp_path), *sets)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "rollout.temperature=0.005 is below 0.01" in " ".join(done.stderr.split())


def test_top_p_below_one_at_another_temperature_is_refused_with_advice(tmp_path, flowrl_here):
    sets = _sets(*SMALL, *HEADS, "generation.engine=vllm", "rollout.top_p=0.7", "rollout.temperature=0.8")
    done = flowrl_here("run", GRPO, "--steps", "1", "--out", str(tmp_path), *sets)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "rollout.top_p=0.7" in done.stderr and "rollout.top_p=1" in done.stderr


def test_partial_rollouts_reaching_the_position_limit_do_not_crash(short_model_top_p_run):
    done, run = short_model_top_p_run
    assert "Traceback" not in done.stderr
    assert done.returncode == 0, done.stderr[-3000:]  # fixed: responses end at the model's length
