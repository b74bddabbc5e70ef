"""Reward execution (flowrl/runtime/rewardpool.py, nodes._pooled): calls of a reward function run by
forked worker processes or awaited (async def) score exactly what one call in the driver scores; a
call that raises, hangs past reward.timeout_s or kills its worker gets the reward reward.on_error
defines, is counted, and does not stop the pool; on_error=fail names the function and the rows."""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace

import pytest
import torch

from flowrl.errors import ConfigError, GraphError
from flowrl.runtime.nodes import _pooled
from flowrl.runtime.rewardpool import RewardRunner


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


def _batch(texts, groups):
    seqs = SimpleNamespace(texts=texts, prompt_index=torch.tensor(groups), reward_texts=lambda: list(texts))
    return [None] * len(texts), seqs


def _score(fn, texts, groups, **reward):
    runner = RewardRunner(**reward)
    rt = SimpleNamespace(rewards=runner, task=None)
    node = SimpleNamespace(fn=fn.__name__)
    rows, seqs = _batch(texts, groups)
    try:
        return _pooled(rt, node, fn, rows, seqs, {}), runner
    finally:
        runner.close()


def test_pooled_calls_score_what_one_call_in_the_driver_scores():
    texts = [f"r{'x' * i}" for i in range(7)]
    (scores, metrics), _ = _score(length_reward, texts, [0] * 7, workers=2, rows_per_call=3)
    assert scores == length_reward(None, texts, None)[0]
    assert metrics == {"calls": 1.0, "errors": 0, "timeouts": 0}  # the calls' metrics averaged


def test_a_hung_call_times_out_scores_zero_and_its_worker_is_replaced():
    texts = ["ab", "hang", "abc", "a"]
    runner = RewardRunner(workers=2, rows_per_call=1, timeout_s=1.0, on_error="zero")
    rt, node = SimpleNamespace(rewards=runner, task=None), SimpleNamespace(fn="moody_reward")
    rows, seqs = _batch(texts, [0, 0, 1, 1])
    try:
        scores, metrics = _pooled(rt, node, moody_reward, rows, seqs, {})
        assert scores == [2.0, 0.0, 3.0, 1.0] and metrics["timeouts"] == 1 and metrics["errors"] == 1
        pool = runner.pool
        assert pool is not None and all(w.process.is_alive() for w in pool.workers)  # the hung one was replaced
        again, _ = _pooled(rt, node, moody_reward, rows[:1] * 3, _batch(["x", "yy", "zzz"], [0, 0, 0])[1], {})
        assert again == [1.0, 2.0, 3.0]  # the pool goes on
    finally:
        runner.close()


def test_a_call_that_raises_or_kills_its_worker_is_dropped_to_its_groups_mean():
    texts = ["abcd", "boom", "ab", "die", "abcdef", "a"]
    (scores, metrics), _ = _score(moody_reward, texts, [0, 0, 0, 1, 1, 1], workers=2, on_error="drop")
    assert scores == [4.0, 3.0, 2.0, 3.5, 6.0, 1.0]  # each failed row: the mean of its prompt's other rows
    assert metrics["errors"] == 2 and metrics["timeouts"] == 0


def test_on_error_fail_names_the_function_the_error_and_the_rows():
    with pytest.raises(GraphError, match=r"reward function 'moody_reward' failed: ValueError: cannot score 'boom' on "
                       r"responses 1\.\.1 .*reward\.on_error=zero or drop"):  # fmt: skip
        _score(moody_reward, ["ok", "boom"], [0, 0], workers=1)


def test_a_wrong_number_of_scores_from_a_call_is_an_error_of_that_call():
    def two_per_row(prompts, responses, task):
        return [0.0] * (2 * len(responses))

    (scores, metrics), _ = _score(two_per_row, ["a", "b"], [0, 0], workers=1, on_error="zero")
    assert scores == [0.0, 0.0] and metrics["errors"] == 2


def test_async_rewards_are_awaited_within_the_concurrency_limit_and_time_out():
    async_length.live = async_length.most = 0
    texts = [f"{'y' * i}" for i in range(1, 9)]
    (scores, _), _ = _score(async_length, texts, [0] * 8, concurrency=3)
    assert scores == [float(i) for i in range(1, 9)] and async_length.most == 3
    async_length.live = 0
    (scores, metrics), _ = _score(async_length, ["a", "hang"], [0, 0], timeout_s=0.5, on_error="zero")
    assert scores == [1.0, 0.0] and metrics["timeouts"] == 1


def test_the_reward_settings_are_checked_naming_the_field():
    import msgspec

    from flowrl.specs import RewardConfig, RunConfig

    with pytest.raises((ConfigError, ValueError), match="reward.workers"):
        RunConfig(reward=RewardConfig(workers=-1))
    with pytest.raises((ConfigError, ValueError), match="reward.timeout_s"):
        RunConfig(reward=RewardConfig(timeout_s=0))
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"on_error": "ignore"}, RewardConfig)


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
