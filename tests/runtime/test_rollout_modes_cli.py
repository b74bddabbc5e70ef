"""Rollout modes (README "Rollout modes") as a user meets them: every mode from
the CLI and the API on each shipped algorithm, bad inputs, the metrics each step reports, the
same seed giving the same run, no prompt lost or trained twice, small and odd sizes, `plan
--explain` and plan files. Seven bugs found by trying them are fixed; their tests stay.

Tiny sizes (4 prompts x 2 samples, 2-3 steps): the whole module runs in well under a minute.
No Ray session is started: the two cluster tests only plan for the Ray backend.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import yaml

from flowrl import api
from flowrl.cli import main
from flowrl.contract.data import Rollout, Sequences
from flowrl.errors import ConfigError, PlanError
from flowrl.planner.passes import PassResults
from flowrl.planner.space import RolloutPolicy
from flowrl.plugins.manager import registry, set_registry
from flowrl.runtime.batch import ragged
from flowrl.runtime.executor import PlanExecutor, run_dir
from flowrl.runtime.rollout import StepRollout
from flowrl.tasks.builtin import make_task

ROOT = Path(__file__).resolve().parents[2]
PPS, SPP = 4, 2  # prompts per step, samples per prompt
TINY = [
    "seed=0",
    "progress=false",
    "checkpoint=false",
    "task=repeat",
    f"rollout.prompts_per_step={PPS}",
    f"rollout.samples_per_prompt={SPP}",
    "rollout.chunk_tokens=4",
    "rollout.stream_groups=1",
]
TIMING = ("step_seconds", "tokens_per_s", "spans")
IS_KEYS = ("offpolicy_frac", "is_mean", "is_max", "is_clipfrac")


def quiet(_: str) -> None:
    pass


# ------------------------------------------------------------------ running a plan in this process


def run_mode(out: Path, mode: str | None, *extra: str, steps: int = 3, graph: str = "grpo"):
    """Plan and run ``graph`` locally with ``rollout.mode=mode``: (plan, executor, metrics records)."""
    overrides = [*TINY, f"steps={steps}", f"out={out}", *extra]
    if mode is not None:
        overrides.append(f"rollout.mode={mode}")
    g, plan = api.plan(graph, overrides=overrides, emit=quiet)
    executor = PlanExecutor(registry())
    executor.check(g, plan)
    result = executor.run(g, plan, run_dir(str(out), graph))
    records = [json.loads(line) for line in (result.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert records == result.metrics  # what the file holds is what the run returned
    return plan, executor, records


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs memoised for the module (several tests read the same run)."""
    cache: dict[tuple[Any, ...], Any] = {}
    out = tmp_path_factory.mktemp("modes")

    def get(mode: str | None, *extra: str, steps: int = 3, graph: str = "grpo", rep: int = 0):
        key = (graph, mode, extra, steps, rep)
        if key not in cache:
            cache[key] = run_mode(out, mode, *extra, steps=steps, graph=graph)
        return cache[key]

    return get


def without_timing(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def check_records(plan, records: list[dict[str, Any]], steps: int, samples: int = PPS * SPP) -> None:
    """What README says each step's metrics report, and what must hold of them."""
    eta = plan.layout.rollout.staleness
    assert [r["step"] for r in records] == list(range(steps))  # contiguous, one line per step
    for r in records:
        assert r["rollout/samples"] == samples
        hist = [r[f"rollout/staleness_{a}"] for a in range(eta + 1)]
        assert all(0.0 <= h <= 1.0 for h in hist)
        assert sum(hist) == pytest.approx(1.0, abs=1e-3), r
        assert f"rollout/staleness_{eta + 1}" not in r
        assert 0 <= r["rollout/staleness_max"] <= eta
        assert 0.0 <= r["rollout/staleness_mean"] <= r["rollout/staleness_max"]
        assert 0.0 <= r["rollout/recycled_tokens"] <= 1.0
        assert r["rollout/restarted"] >= 0
        for key in IS_KEYS:
            assert f"train_actor/{key}" in r, key
        assert 0.0 <= r["train_actor/offpolicy_frac"] <= 1.0
        assert 0.0 <= r["train_actor/is_clipfrac"] <= 1.0
        if r["rollout/staleness_max"] == 0:  # every token sampled by the trained weights: weights exactly 1
            assert r["train_actor/offpolicy_frac"] == 0.0
            assert r["train_actor/is_mean"] == 1.0 and r["train_actor/is_max"] == 1.0


def check_prompts(executor, steps: int, prompts: int = PPS) -> None:
    """No prompt lost or trained twice: drawn = taken + in flight."""
    buf = executor.sources["rollout"].buffer
    in_flight = buf.groups()
    assert len(buf.taken) == len(set(buf.taken)) == steps * prompts
    assert not set(buf.taken) & set(in_flight)
    assert buf.drawn == len(buf.taken) + len(in_flight)
    assert set(range(buf.drawn)) == set(buf.taken) | set(in_flight)


# ------------------------------------------------------------------ every mode, every algorithm


@pytest.mark.parametrize(
    ("graph", "mode"),
    [
        ("ppo", "streaming"),  # the critic's values forward runs on streamed parts, gathered before GAE
        ("ppo", "partial+async"),
        ("ppo", "one_step_off"),
        ("rloo", "partial+async"),
        ("reinforce_pp", "streaming+async"),
        ("grpo", "one_step_off+partial+streaming"),
    ],
)
@pytest.mark.slow
def test_each_algorithm_runs_in_each_mode(runs, graph, mode):
    plan, executor, records = runs(mode, graph=graph)
    check_records(plan, records, 3)
    check_prompts(executor, 3)
    if "streaming" in mode:  # scoring nodes ran on parts
        assert all("reward/parts" in r for r in records)
        if graph == "ppo":
            assert all("values/parts" in r for r in records)
    if "partial" in mode:
        assert any(r["rollout/recycled_tokens"] > 0 for r in records)


def test_sync_is_on_policy_everywhere(runs):
    plan, executor, records = runs("sync")
    assert plan.layout.rollout.staleness == 0 and plan.layout.rollout.lead == 0
    check_records(plan, records, 3)
    check_prompts(executor, 3)
    assert all(r["rollout/staleness_0"] == 1.0 and r["train_actor/is_mean"] == 1.0 for r in records)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "partial+async", "streaming+async", "partial"])
def test_same_seed_gives_the_same_metrics(runs, mode):
    """Interleavings of generation chunks and training are part of the plan, not of timing."""
    _, _, a = runs(mode)
    _, _, b = runs(mode, rep=1)
    assert without_timing(a) == without_timing(b)


@pytest.mark.slow
def test_partial_streaming_runs_from_the_cli(tmp_path, capsys):
    rc = main(
        [
            "run",
            str(ROOT / "graphs/grpo.py"),
            "--steps",
            "2",
            "--out",
            str(tmp_path),
            "--quiet",
            *[x for s in TINY for x in ("--set", s)],
            "--set",
            "rollout.mode=partial+streaming",
        ]
    )
    assert rc == 0
    assert "flowrl: done." in capsys.readouterr().out


# ------------------------------------------------------------------ small and odd sizes


@pytest.mark.slow
def test_partial_without_overprovision_carries_nothing(runs):
    plan, executor, records = runs("partial", "rollout.overprovision=0")
    assert plan.layout.rollout.partial and plan.layout.rollout.overprovision == 0.0
    check_records(plan, records, 3)
    check_prompts(executor, 3)
    buf = executor.sources["rollout"].buffer
    assert buf.drawn == len(buf.taken) == 3 * PPS and buf.groups() == []
    assert all(r["rollout/recycled_tokens"] == 0.0 and r["rollout/carried"] == 0 for r in records)


@pytest.mark.parametrize("mode", ["partial+async", "streaming"])
@pytest.mark.slow
def test_response_budget_below_the_chunk_is_kept(runs, mode):
    plan, executor, records = runs(mode, "rollout.max_new_tokens=2", "rollout.chunk_tokens=8", steps=2)
    check_records(plan, records, 2)
    check_prompts(executor, 2)
    assert all(0 < r["rollout/response_length"] <= 2 for r in records)


@pytest.mark.slow
def test_one_sample_per_prompt_streams(runs):
    plan, executor, records = runs("streaming", "rollout.samples_per_prompt=1", steps=2)
    check_records(plan, records, 2, samples=PPS)
    check_prompts(executor, 2)


@pytest.mark.slow
def test_one_prompt_per_step_partial_async(runs):
    plan, executor, records = runs("partial+async", "rollout.prompts_per_step=1", steps=3)
    check_records(plan, records, 3, samples=SPP)
    check_prompts(executor, 3, prompts=1)


@pytest.mark.slow
def test_restarted_rows_lose_no_prompt(runs):
    """eta=1 with 200% overprovision and 1-token chunks: rows carried twice are restarted."""
    plan, executor, records = runs(
        "partial", "rollout.staleness=1", "rollout.overprovision=2", "rollout.chunk_tokens=1", steps=3
    )
    check_records(plan, records, 3)
    check_prompts(executor, 3)
    assert executor.sources["rollout"].buffer.restarts == sum(r["rollout/restarted"] for r in records) > 0


@pytest.mark.slow
def test_one_step_off_partial_keeps_carried_responses(tmp_path):
    try:
        _, _, records = run_mode(
            tmp_path, "one_step_off+partial", "rollout.staleness=1", "rollout.overprovision=1", steps=4
        )
    except PlanError as exc:  # refusing the combination, naming the field, is as good
        assert "rollout.staleness" in str(exc)
        return
    later = records[2:]
    assert not all(r["rollout/carried"] > 0 and r["rollout/restarted"] == SPP * r["rollout/carried"] for r in later)


@pytest.mark.slow
def test_every_mode_reports_carried(runs):
    for mode in ("sync", "one_step_off"):
        _, _, records = runs(mode, graph="ppo" if mode == "one_step_off" else "grpo")
        assert all("rollout/carried" in r for r in records), mode


# ------------------------------------------------------------------ the buffer keeps rows and prompts together


class TaggingEngine:
    """Generation without a model: a row's prompt ids spell its prompt's text (so the prompt a
    trained row came from is checkable); responses end at random after 1..limit tokens."""

    resumable = True

    def __init__(self, seed: int, limit: int = 9) -> None:
        self.rng, self.limit, self.version = random.Random(seed), limit, 0

    def _extend(self, seqs: Sequences, logprobs: torch.Tensor, finished: torch.Tensor, budget: int) -> Rollout:
        rows = []
        for i in range(len(seqs)):
            have = int(seqs.response_mask[i].sum())
            toks, done = seqs.response_ids[i, :have].tolist(), bool(finished[i])
            for _ in range(budget):
                if done:
                    break
                toks.append(7)
                done = self.rng.random() < 0.3 or len(toks) >= self.limit
            rows.append((toks, done))
        width = max([len(t) for t, _ in rows] + [0])
        ids = ragged([t for t, _ in rows], width, 0, torch.long)
        mask = ragged([[1.0] * len(t) for t, _ in rows], width, 0.0, torch.float32)
        out = Sequences(
            prompt_ids=seqs.prompt_ids,
            prompt_mask=seqs.prompt_mask,
            response_ids=ids,
            response_mask=mask,
            prompt_index=seqs.prompt_index,
            texts=tuple("x" * len(t) for t, _ in rows),
        )
        return Rollout(sequences=out, logprobs=-mask, finished=torch.tensor([d for _, d in rows]))

    def generate(self, prompts, *, n, greedy, generator, max_new_tokens=None):
        texts = [p.text for p in prompts for _ in range(n)]
        width = max(len(t) for t in texts)
        ids = torch.zeros(len(texts), width, dtype=torch.long)
        mask = torch.zeros(len(texts), width, dtype=torch.long)
        for i, t in enumerate(texts):
            ids[i, width - len(t) :] = torch.tensor([ord(c) for c in t])
            mask[i, width - len(t) :] = 1
        empty = torch.zeros(len(texts), 0, dtype=torch.long)
        seqs = Sequences(
            prompt_ids=ids,
            prompt_mask=mask,
            response_ids=empty,
            response_mask=empty.float(),
            prompt_index=torch.arange(len(prompts)).repeat_interleave(n),
            texts=("",) * len(texts),
        )
        return self._extend(seqs, empty.float(), torch.zeros(len(texts), dtype=torch.bool), max_new_tokens or 99)

    def resume(self, rollout, *, generator, max_new_tokens=None):
        return self._extend(rollout.sequences, rollout.logprobs, rollout.finished, max_new_tokens or 99)


@pytest.mark.parametrize(
    "policy",
    [
        RolloutPolicy(mode="async", staleness=1),
        RolloutPolicy(streaming=True),
        RolloutPolicy(staleness=1, partial=True, overprovision=1.0),
        RolloutPolicy(mode="async", staleness=2, partial=True, overprovision=0.5, streaming=True),
    ],
    ids=lambda p: p.describe(),
)
def test_every_trained_row_answers_the_prompt_its_index_names(policy):
    """Across parts, carried rows and steps, row i of the batch came from prompts[prompt_index[i]],
    each prompt has exactly its samples, and the parts concatenate to the batch."""
    task, stream = make_task("repeat", {}), random.Random(5)
    engine = TaggingEngine(seed=11)
    n, per_step = 2, 3
    source = StepRollout(
        model="actor",
        generator=engine,
        n=n,
        greedy=False,
        policy=policy,
        prompts_per_step=per_step,
        chunk_tokens=2,
        stream_groups=1,
        pad_id=0,
        draw=lambda k: task.prompts(stream, k),
    )
    for step in range(5):
        given = None if policy.partial else task.prompts(stream, per_step)
        engine.version = max(step - policy.lead, 0)
        coro = source.run(step, step, given, torch.Generator())
        while True:
            try:
                next(coro)
            except StopIteration as stop:
                result = stop.value
                prompts, seqs, parts = result.prompts, result.sequences, result.parts
                break
        prompts = prompts if policy.partial else given
        assert len(prompts) == per_step and len(seqs) == per_step * n
        assert sorted(seqs.prompt_index.tolist()) == sorted(list(range(per_step)) * n)
        for i in range(len(seqs)):
            ids = seqs.prompt_ids[i][seqs.prompt_mask[i].bool()].tolist()
            assert "".join(map(chr, ids)) == prompts[int(seqs.prompt_index[i])].text, (step, i)
        assert [t for p in parts for t in p.sequences.texts] == list(seqs.texts)
        assert seqs.logprobs is not None


# ------------------------------------------------------------------ bad inputs: exit 2, one paragraph naming the field


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def run_argv(tmp_path: Path, *sets: str, graph: str = "grpo") -> list[str]:
    argv = ["run", str(ROOT / f"graphs/{graph}.py"), "--steps", "2", "--out", str(tmp_path), "--quiet"]
    for s in (*TINY, *sets):
        argv += ["--set", s]
    return argv


def assert_user_error(rc: int, err: str, *names: str) -> None:
    assert rc == 2, err
    assert err.startswith("flowrl: error: "), err
    assert "Traceback" not in err
    assert "\n\n" not in err.strip()  # one paragraph
    for name in names:
        assert name in err, (name, err)


@pytest.mark.parametrize(
    ("setting", "names"),
    [
        ("rollout.mode=foo", ("rollout.mode", "'foo'", "partial")),
        ("rollout.mode=parital+async", ("rollout.mode", "Did you mean 'partial'")),
        ("rollout.mode=", ("rollout.mode",)),
        ("rollout.mode=+", ("rollout.mode",)),
        ("rollout.mode=sync+one_step_off", ("rollout.mode", "at most one")),
        ("rollout.mode=123", ("rollout.mode",)),
        ("rollout.staleness=-1", ("rollout.staleness", ">= 0")),
        ("rollout.staleness=1.5", ("rollout.staleness",)),
        ("rollout.overprovision=-1", ("rollout.overprovision", ">= 0")),
        ("rollout.chunk_tokens=0", ("rollout.chunk_tokens", ">= 1")),
        ("rollout.stream_groups=0", ("rollout.stream_groups", ">= 1")),
        ("algo.is_correction=bogus", ("algo.is_correction",)),
        ("algo.is_cap=0.5", ("algo.is_cap", ">= 1")),
        ("rollout.moed=async", ("rollout.moed", "rollout.mode")),
    ],
)
def test_bad_rollout_settings_are_refused_naming_the_field(tmp_path, setting, names):
    rc, out, err = cli(run_argv(tmp_path, setting))
    assert_user_error(rc, err, *names)
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_partial_needs_a_staleness_of_one(tmp_path):
    rc, _, err = cli(run_argv(tmp_path, "rollout.mode=partial+async", "rollout.staleness=0"))
    assert_user_error(rc, err, "rollout.staleness >= 1")


def test_a_repeated_mode_part_is_refused():
    for mode in ("partial+partial", "streaming+streaming"):
        with pytest.raises(ConfigError, match="rollout.mode"):
            api.load("grpo", overrides=[*TINY, f"rollout.mode={mode}"])


def test_is_correction_none_as_documented(tmp_path):
    # 'none' (not 'off', which YAML 1.1 reads as False) switches the correction off
    _, cfg = api.load("grpo", overrides=[*TINY, "algo.is_correction=none"])
    assert cfg.algo.is_correction == "none"
    config = tmp_path / "run.yaml"
    config.write_text("algo:\n  is_correction: none\n")
    rc, out, err = cli(["plan", "grpo", "--config", str(config), "--set", "task=repeat"])
    assert rc == 0, err


@pytest.mark.parametrize("correction", ["clip", "mask"])
def test_is_correction_values_load(correction):
    _, cfg = api.load("grpo", overrides=[f"algo.is_correction={correction}", "algo.is_cap=1"])
    assert cfg.algo.is_correction == correction and cfg.algo.is_cap == 1.0


@pytest.mark.parametrize("mode", ["partial", "async", "streaming", "partial+async"])
def test_remax_refuses_chunked_modes_clearly(tmp_path, mode):
    rc, _, err = cli(run_argv(tmp_path, f"rollout.mode={mode}", graph="remax"))
    assert_user_error(rc, err, "remax", "rollout", "greedy", "one_step_off")


@pytest.mark.slow
def test_remax_runs_one_step_off(runs):
    plan, executor, records = runs("one_step_off", graph="remax", steps=2)
    check_records(plan, records, 2)
    assert all(r["greedy/staleness_max"] <= 1 for r in records)


# ------------------------------------------------------------------ plans: --explain, plan files, the tuner


def test_plan_explain_shows_the_pinned_mode():
    rc, out, err = cli(["plan", "grpo", "--set", "task=repeat", "--set", "rollout.mode=partial+async", "--explain"])
    assert rc == 0, err
    (winner,) = [line for line in out.splitlines() if line.startswith("winner:")]
    assert "| rollout async eta=2 partial+25% |" in winner, out


@pytest.mark.slow
def test_a_plan_file_with_a_mode_runs_as_planned(tmp_path):
    path = tmp_path / "plan.yaml"
    sets = [x for s in (*TINY, f"out={tmp_path / 'runs'}", "rollout.mode=partial+async") for x in ("--set", s)]
    rc, out, err = cli(["plan", str(ROOT / "graphs/grpo.py"), "--steps", "2", *sets, "--out", str(path)])
    assert rc == 0, err
    saved = yaml.safe_load(path.read_text())
    assert saved["layout"]["rollout"]["mode"] == "async" and saved["layout"]["rollout"]["partial"] is True
    rc, out, err = cli(["run", str(ROOT / "graphs/grpo.py"), "--plan", str(path), "--quiet"])
    assert rc == 0, err
    (run,) = (tmp_path / "runs").iterdir()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all("rollout/staleness_2" in r and "rollout/carried" in r for r in records)
    assert yaml.safe_load((run / "plan.yaml").read_text())["layout"]["rollout"] == saved["layout"]["rollout"]


@pytest.fixture
def ray_plugin(monkeypatch):
    """The Ray backend's plugin enabled, for planning only (no Ray session starts)."""
    pytest.importorskip("flowrl_ray")
    monkeypatch.setenv("FLOWRL_PLUGINS", "ray")
    set_registry(None)


def cluster_plan(graph: str, *extra: str, results: PassResults | None = None, **pins: str):
    overrides = [*TINY, "backend=ray", "device=cpu", *extra]
    _, cfg = api.load(graph, overrides=overrides)
    target = api.local_target(cfg, registry(), devices=2)
    options = {"budget_s": 1, **pins}
    return api.plan(
        graph, overrides=overrides, target=target, for_backend=True, options=options, results=results, emit=quiet
    )


def test_cluster_explain_shows_the_pinned_mode(ray_plugin):
    rc, out, err = cli(
        ["plan", "grpo", "--cluster", "cpu:2", "--set", "task=repeat", "--set", "rollout.mode=partial+async"]
        + ["--explain", "--budget", "1"]
    )
    assert rc == 0, err
    ranked = [line for line in out.splitlines() if "| rollout " in line]
    assert ranked and all("| rollout async eta=2 partial+25% |" in line for line in ranked), out


def test_the_tuner_only_picks_modes_the_executor_runs(ray_plugin):
    results = PassResults()
    g, plan = cluster_plan("remax", results=results, placement="colocate")
    chunked = {
        c.plan.rollout.describe()
        for c in results.place.tune.ranked
        if c.plan.rollout.partial or c.plan.rollout.streaming or c.plan.rollout.mode == "async"
    }
    assert not chunked, chunked  # the executor refuses every one of these for remax
    api.check(g, plan)  # today: PlanError "decodes in chunks for one generate node"


@pytest.mark.slow
def test_chunk_tokens_holds_when_the_tuner_chooses_the_mode(tmp_path):
    g, plan = api.plan("grpo", overrides=[*TINY, "steps=1", f"out={tmp_path}", "rollout.chunk_tokens=3"], emit=quiet)
    # the policy as the tuner's search space writes it (flowrl/planner/space.py skeletons)
    tuned = msgspec.structs.replace(
        plan,
        layout=msgspec.structs.replace(
            plan.layout, rollout=RolloutPolicy(staleness=1, partial=True, overprovision=0.25)
        ),
    )
    executor = PlanExecutor(registry())
    executor.run(g, tuned, run_dir(str(tmp_path), "grpo"))
    assert executor.sources["rollout"].chunk_tokens == 3
