"""Reward execution (flowrl/runtime/rewardpool.py, nodes._pooled): calls of a reward function run by
forked worker processes or awaited (async def) score exactly what one call in the driver scores; a
call that raises, hangs past reward.timeout_s, returns a non-number or kills its worker gets the reward
reward.on_error defines, is counted, and does not stop the pool; on_error=fail names the function and
the rows. Node options, the task, numpy/tensor scores and metrics reach the workers; the pool survives
an interrupted batch, a worker dead while idle, Ctrl-C reaching a worker and a second reward function."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flowrl.errors import ConfigError, GraphError
from flowrl.runtime.nodes import _pooled
from flowrl.runtime.rewardpool import RewardRunner


def _run(fn, texts, groups, runner, options=None, task=None):
    rt = SimpleNamespace(rewards=runner, task=task)
    seqs = SimpleNamespace(texts=texts, prompt_index=torch.tensor(groups), reward_texts=lambda: list(texts))
    return _pooled(rt, SimpleNamespace(fn=fn.__name__), fn, [None] * len(texts), seqs, dict(options or {}))


def _score(fn, texts, groups, options=None, task=None, **reward):
    runner = RewardRunner(**reward)
    try:
        return _run(fn, texts, groups, runner, options, task)
    finally:
        runner.close()


# ---------------------------------------------------------------- reward functions (module level: forked)


def length_reward(prompts, responses, task):
    return [float(len(r)) for r in responses], {"calls": 1.0}


def moody_reward(prompts, responses, task):
    """Hangs on 'hang', raises on 'boom', kills its process on 'die'; else the length."""
    for r in responses:
        if r == "hang":
            time.sleep(600)
        if r == "boom":
            raise ValueError("cannot score 'boom'")
        if r == "die":
            os._exit(3)
    return [float(len(r)) for r in responses]


async def async_length(prompts, responses, task):
    async_length.live += 1
    async_length.most = max(async_length.most, async_length.live)
    await asyncio.sleep(0.2 if "hang" not in responses else 600)
    async_length.live -= 1
    return [float(len(r)) for r in responses]


def rv_tensor_with_options(prompts, responses, task, scale=1.0, bonus=0.0):
    scores = torch.tensor([float(len(r)) * scale + bonus for r in responses])
    return scores, {"pid": float(os.getpid()), "task_size": float(task["size"])}


def rv_numpy(prompts, responses, task):
    return np.array([float(len(r)) for r in responses])


def rv_group_fails(prompts, responses, task):
    if any(r.startswith("bad") for r in responses):
        raise RuntimeError("verifier crashed")
    return [float(len(r)) for r in responses]


def rv_strings(prompts, responses, task):
    return ["n/a" if r == "bad" else 1.0 for r in responses]


def rv_exact(prompts, responses, task):
    s = [float(r == "a") for r in responses]
    return s, {"exact": sum(s) / len(s)}


def rv_numpy_metric(prompts, responses, task):
    return [1.0] * len(responses), {"np32": np.float32(0.25), "t0": torch.tensor(0.5)}


def rv_one(prompts, responses, task):
    return [1.0] * len(responses)


def rv_slow_one(prompts, responses, task):
    if "warm" not in responses:
        time.sleep(1.5)
    return [1.0] * len(responses)


def rv_two(prompts, responses, task):
    return [2.0] * len(responses)


async def rv_async_raises(prompts, responses, task):
    await asyncio.sleep(0.01)
    raise ConnectionError("verifier unreachable")


async def rv_async_own_timeout(prompts, responses, task):
    await asyncio.sleep(0.01)
    raise TimeoutError("the verifier's HTTP client timed out")


# ---------------------------------------------------------------- calls and their errors


def test_pooled_calls_score_what_one_call_in_the_driver_scores():
    texts = [f"r{'x' * i}" for i in range(7)]
    scores, metrics = _score(length_reward, texts, [0] * 7, workers=2, rows_per_call=3)
    assert scores == length_reward(None, texts, None)[0]
    assert metrics == {"calls": 1.0, "errors": 0, "timeouts": 0}  # the calls' metrics averaged


@pytest.mark.slow
def test_a_hung_call_times_out_scores_zero_and_its_worker_is_replaced():
    runner = RewardRunner(workers=2, rows_per_call=1, timeout_s=1.0, on_error="zero")
    try:
        scores, metrics = _run(moody_reward, ["ab", "hang", "abc", "a"], [0, 0, 1, 1], runner)
        assert scores == [2.0, 0.0, 3.0, 1.0] and metrics["timeouts"] == 1 and metrics["errors"] == 1
        pool = runner.pool
        assert pool is not None and all(w.process.is_alive() for w in pool.workers)  # the hung one was replaced
        again, _ = _run(moody_reward, ["x", "yy", "zzz"], [0, 0, 0], runner)
        assert again == [1.0, 2.0, 3.0]  # the pool goes on
    finally:
        runner.close()


def test_a_call_that_raises_or_kills_its_worker_is_dropped_to_its_groups_mean():
    texts = ["abcd", "boom", "ab", "die", "abcdef", "a"]
    scores, metrics = _score(moody_reward, texts, [0, 0, 0, 1, 1, 1], workers=2, on_error="drop")
    assert scores == [4.0, 3.0, 2.0, 3.5, 6.0, 1.0]  # each failed row: the mean of its prompt's other rows
    assert metrics["errors"] == 2 and metrics["timeouts"] == 0


def test_on_error_fail_names_the_function_the_error_and_the_rows():
    with pytest.raises(GraphError, match=r"reward function 'moody_reward' failed: ValueError: cannot score 'boom' on "
                       r"responses 1\.\.1 .*reward\.on_error=zero or drop"):  # fmt: skip
        _score(moody_reward, ["ok", "boom"], [0, 0], workers=1)


def test_a_wrong_number_of_scores_from_a_call_is_an_error_of_that_call():
    def two_per_row(prompts, responses, task):
        return [0.0] * (2 * len(responses))

    scores, metrics = _score(two_per_row, ["a", "b"], [0, 0], workers=1, on_error="zero")
    assert scores == [0.0, 0.0] and metrics["errors"] == 2


@pytest.mark.slow
def test_async_rewards_are_awaited_within_the_concurrency_limit_and_time_out():
    async_length.live = async_length.most = 0
    texts = [f"{'y' * i}" for i in range(1, 9)]
    scores, _ = _score(async_length, texts, [0] * 8, concurrency=3)
    assert scores == [float(i) for i in range(1, 9)] and async_length.most == 3
    async_length.live = 0
    scores, metrics = _score(async_length, ["a", "hang"], [0, 0], timeout_s=0.5, on_error="zero")
    assert scores == [1.0, 0.0] and metrics["timeouts"] == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("workers", -1),
        ("workers", 257),
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("rows_per_call", 0),
        ("concurrency", 0),
    ],
)
def test_the_reward_settings_are_checked_naming_the_field(field, value):
    import msgspec

    from flowrl.specs import RewardConfig, RunConfig

    with pytest.raises((ConfigError, ValueError, msgspec.ValidationError), match=f"reward.{field}"):
        RunConfig(reward=RewardConfig(**{field: value}))


def test_an_unknown_on_error_is_refused():
    import msgspec

    from flowrl.specs import RewardConfig

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"on_error": "ignore"}, RewardConfig)


def test_tensor_scores_tuple_metrics_node_options_and_the_task_reach_the_worker():
    (scores, metrics) = _score(
        rv_tensor_with_options,
        ["ab", "abc"],
        [0, 0],
        options={"scale": 2.0, "bonus": 1.0},
        task={"size": 7},
        workers=2,
    )
    assert scores == [5.0, 7.0]
    assert metrics["pid"] != float(os.getpid())  # scored in a worker
    assert metrics["task_size"] == 7.0 and metrics["errors"] == 0


def test_numpy_scores_from_a_worker():
    scores, metrics = _score(rv_numpy, ["a", "abc", "ab"], [0, 0, 1], workers=2, rows_per_call=2)
    assert scores == [1.0, 3.0, 2.0] and metrics["errors"] == 0


def test_drop_when_every_row_of_a_group_fails_scores_that_group_zero_and_keeps_the_others():
    scores, metrics = _score(rv_group_fails, ["bad1", "bad2", "ok", "okk"], [0, 0, 1, 1], workers=2, on_error="drop")
    assert scores == [0.0, 0.0, 2.0, 3.0]
    assert metrics["errors"] == 2


def test_async_reward_that_raises_is_counted_and_scored_by_on_error():
    scores, metrics = _score(rv_async_raises, ["a", "b"], [0, 0], on_error="zero")
    assert scores == [0.0, 0.0] and metrics["errors"] == 2 and metrics["timeouts"] == 0
    with pytest.raises(GraphError, match="rv_async_raises.*ConnectionError"):
        _score(rv_async_raises, ["a"], [0])


def test_closing_the_runner_leaves_no_worker_process_behind():
    runner = RewardRunner(workers=2)
    _run(rv_one, ["a", "b"], [0, 0], runner)
    procs = [w.process for w in runner.pool.workers]
    assert all(p.is_alive() for p in procs)
    runner.close()
    assert not any(p.is_alive() for p in procs)


def test_non_numeric_score_from_a_worker_gets_on_error():
    scores, metrics = _score(rv_strings, ["bad", "ok"], [0, 0], workers=1, on_error="zero")
    assert scores == [0.0, 1.0] and metrics["errors"] == 1


@pytest.mark.slow
def test_the_pool_still_scores_after_a_call_raised_in_the_driver():
    code = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_reward_pool import rv_strings, _run
        from flowrl.runtime.rewardpool import RewardRunner
        runner = RewardRunner(workers=2, on_error="zero")
        try:
            _run(rv_strings, ["bad", "ok"], [0, 0], runner)
        except Exception:
            pass
        print(_run(rv_strings, ["a", "b", "c"], [0, 0, 0], runner)[0])
        runner.close()
        """
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the second batch never finished: the pool is wedged")
    assert "[1.0, 1.0, 1.0]" in out.stdout, out.stderr


def test_async_reward_raising_its_own_timeout_error_gets_on_error():
    scores, metrics = _score(rv_async_own_timeout, ["a", "b"], [0, 0], on_error="zero")
    assert scores == [0.0, 0.0] and metrics["errors"] == 2 and metrics["timeouts"] == 0


def test_a_worker_that_died_while_idle_is_replaced():
    runner = RewardRunner(workers=1, on_error="zero")
    try:
        assert _run(rv_one, ["a"], [0], runner)[0] == [1.0]
        w = runner.pool.workers[0]
        w.process.kill()
        w.process.join(5)
        scores, metrics = _run(rv_one, ["a", "b"], [0, 0], runner)
        assert scores == [1.0, 1.0]
    finally:
        runner.close()


def test_metrics_over_calls_of_unequal_size_are_row_weighted_as_one_driver_call():
    texts, groups = ["a", "a", "a", "b", "b"], [0, 0, 1, 1, 2]
    _, whole = _score(rv_exact, texts, groups, workers=1, rows_per_call=5)  # one call of all rows
    _, parts = _score(rv_exact, texts, groups, workers=2, rows_per_call=2)
    assert whole["exact"] == pytest.approx(0.6) and parts["exact"] == pytest.approx(0.6)


def test_numpy_and_tensor_scalar_metrics_survive_the_pool():
    _, metrics = _score(rv_numpy_metric, ["a", "b"], [0, 0], workers=1)
    assert metrics.get("np32") == pytest.approx(0.25) and metrics.get("t0") == pytest.approx(0.5)


@pytest.mark.slow
def test_ctrl_c_reaching_a_worker_does_not_fail_its_reward_call():
    runner = RewardRunner(workers=1, on_error="zero")
    try:
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a script
        try:
            _run(rv_slow_one, ["warm"], [0], runner)  # fork the worker
            pid = runner.pool.workers[0].process.pid
            # only the worker gets the signal here (a terminal sends it to the driver too)
            timer = threading.Timer(0.5, os.kill, (pid, signal.SIGINT))
            timer.start()
            scores, metrics = _run(rv_slow_one, ["a"], [0], runner)
            timer.join()
        finally:
            signal.signal(signal.SIGINT, previous)
        assert metrics["errors"] == 0 and scores == [1.0]
    finally:
        runner.close()


@pytest.mark.slow
def test_a_second_reward_function_does_not_kill_a_batch_in_flight():
    runner = RewardRunner(workers=1, on_error="zero")
    out = {}
    try:
        t = threading.Thread(target=lambda: out.update(first=_run(rv_slow_one, ["a"], [0], runner)))
        t.start()
        time.sleep(0.5)
        second = _run(rv_two, ["b"], [0], runner)
        t.join(20)
        assert second[0] == [2.0]
        assert out["first"][1]["errors"] == 0 and out["first"][0] == [1.0]
    finally:
        runner.close()


# ---------------------------------------------------------------- whole runs


GRAPH = """
import os

from flowrl import register
from flowrl.algorithms.ops import task_reward
from flowrl.graph import Graph

DRIVER = os.getpid()  # a forked worker inherits it


@register.reward("elsewhere")
def elsewhere(prompts, responses, task):
    scores, metrics = task_reward(prompts, responses, task)
    return scores, {**metrics, "in_worker": float(os.getpid() != DRIVER)}


def build(cfg):
    g = Graph("pooled")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="elsewhere", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""


@pytest.mark.slow
def test_a_graph_files_own_reward_runs_in_the_pools_workers_and_scores_as_in_the_driver(tmp_path):
    from flowrl import api

    src = tmp_path / "pooled.py"
    src.write_text(GRAPH)
    small = ["steps=2", "rollout.prompts_per_step=4", "progress=false", "checkpoint=false", f"out={tmp_path}"]
    runs = {}
    for name, extra in (("driver", []), ("pool", ["reward.workers=2", "reward.rows_per_call=3"])):
        graph, plan = api.plan(str(src), overrides=[*small, f"name={name}", *extra], emit=lambda s: None)
        runs[name] = api.run(graph, plan).metrics
    assert [m["reward/in_worker"] for m in runs["driver"]] == [0.0, 0.0]
    assert [m["reward/in_worker"] for m in runs["pool"]] == [1.0, 1.0]
    assert [m["reward"] for m in runs["pool"]] == [m["reward"] for m in runs["driver"]]  # the same run
    assert [m["train_actor/loss"] for m in runs["pool"]] == [m["train_actor/loss"] for m in runs["driver"]]
    assert all(m["reward/errors"] == 0 for m in runs["pool"])


PIPELINED_GRAPH = """
import os
import numpy as np
from flowrl import register
from flowrl.algorithms.ops import task_reward
from flowrl.graph import Graph

DRIVER = os.getpid()


@register.reward("rv_scaled")
def rv_scaled(prompts, responses, task, scale=1.0):
    scores, metrics = task_reward(prompts, responses, task)
    print("a reward that prints", flush=True)
    return np.asarray(scores.numpy()) * scale, {**metrics, "scale": scale, "in_worker": float(os.getpid() != DRIVER)}


def build(cfg):
    g = Graph("scaled")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="rv_scaled", reads="prompts responses", writes="rewards", scale=3.0)
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""

RAISING_GRAPH = """
from flowrl import register
from flowrl.graph import Graph


@register.reward("rv_always_raises")
def rv_always_raises(prompts, responses, task):
    raise RuntimeError("verifier down")


def build(cfg):
    g = Graph("raising")
    g.model("actor", "actor")
    g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)
    g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")
    g.reward("reward", fn="rv_always_raises", reads="prompts responses", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""


def _engine(tmp_path, source, name, extra, steps=2):
    from flowrl import api

    src = tmp_path / f"{name}_graph.py"
    src.write_text(source)
    small = [f"steps={steps}", "rollout.prompts_per_step=4", "progress=false", "checkpoint=false", f"out={tmp_path}"]
    graph, plan = api.plan(str(src), overrides=[*small, f"name={name}", *extra], emit=lambda s: None)
    return api.run(graph, plan).metrics


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["streaming", "partial+async"])
def test_node_options_and_numpy_scores_in_the_pool_under_pipelined_rollout_modes(tmp_path, mode):
    metrics = _engine(
        tmp_path, PIPELINED_GRAPH, "m", ["reward.workers=2", "reward.rows_per_call=3", f"rollout.mode={mode}"]
    )
    assert len(metrics) == 2
    assert all(m["reward/in_worker"] == 1.0 and m["reward/scale"] == 3.0 for m in metrics)
    assert all(m["reward/errors"] == 0 and m["reward/timeouts"] == 0 for m in metrics)


@pytest.mark.slow
def test_on_error_without_workers_is_applied_or_refused(tmp_path):
    try:
        metrics = _engine(tmp_path, RAISING_GRAPH, "r", ["reward.on_error=zero"], steps=1)
    except ConfigError as exc:
        assert "reward.on_error" in str(exc)
        return
    assert metrics[0]["reward/errors"] >= 1
