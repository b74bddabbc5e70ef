"""The verifiers and openenv agents' loading, validation and prompt conversion (their episodes need flowrl's
endpoint; the example environments in examples/environments are what they play)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import needs

from flowrl.errors import AgentError

pytestmark = [pytest.mark.slow, needs("verifiers.v1", "openenv.core")]  # imports verifiers and OpenEnv: seconds

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "environments"
REVERSE = str(EXAMPLES / "vf_reverse.py")
ECHO = f"{EXAMPLES / 'openenv_echo.py'}:EchoEnvironment"


def test_verifiers_prompts_are_the_environments_tasks_in_order():
    from flowrl.agents.verifiers_env import verifiers_prompts

    prompts = verifiers_prompts(REVERSE, {"count": 5, "seed": 3})
    assert len(prompts) == 5
    for i, p in enumerate(prompts):
        word = p.text.removeprefix("reverse: ")
        assert p.answer == word[::-1]
        assert p.messages == ({"role": "user", "content": p.text},)
        assert p.meta == {"vf_idx": i, "vf_env": REVERSE}
    assert [p.text for p in verifiers_prompts(REVERSE, {"count": 5, "seed": 3})] == [p.text for p in prompts]


def test_verifiers_environment_not_installed_is_named():
    from flowrl.agents.verifiers_env import verifiers_agent

    with pytest.raises(AgentError, match="'owner/no-such-env-xyz' is not installed.*downloads nothing"):
        verifiers_agent(None, environment="owner/no-such-env-xyz")


def test_verifiers_missing_file_and_bad_env_args_are_named():
    from flowrl.agents.verifiers_env import verifiers_agent

    with pytest.raises(AgentError, match="'nowhere/env.py' does not exist"):
        verifiers_agent(None, environment="nowhere/env.py")
    with pytest.raises(AgentError, match=r"vf_reverse.py'.*env_args do not fit its config: .*count"):
        verifiers_agent(None, environment=REVERSE, env_args={"count": "many"})
    with pytest.raises(AgentError, match="sampling_args"):
        verifiers_agent(None, environment=REVERSE, sampling_args={"temperature": "hot"})


def test_verifiers_prompt_of_another_task_must_fit_the_task_data():
    from flowrl.agents.verifiers_env import verifiers_agent

    agent = verifiers_agent(None, environment=REVERSE, env_args={"count": 2})
    messages = [{"role": "user", "content": "reverse: ab"}]
    with pytest.raises(AgentError, match="ReverseData.*answer"):  # no answer: the task data needs one
        asyncio.run(
            agent(base_url="http://127.0.0.1:9/v1", api_key="k", model="m", messages=messages, answer="", meta={})
        )
    with pytest.raises(AgentError, match="vf_idx 7 is no task of it"):
        asyncio.run(
            agent(
                base_url="http://127.0.0.1:9/v1",
                api_key="k",
                model="m",
                messages=messages,
                answer="",
                meta={"vf_idx": 7},
            )
        )


def test_verifiers_failed_episode_is_an_agent_error_naming_the_environment():
    from flowrl.agents.verifiers_env import verifiers_agent, verifiers_prompts

    prompt = verifiers_prompts(REVERSE, {"count": 2})[0]
    agent = verifiers_agent(None, environment=REVERSE, env_args={"count": 2})
    with pytest.raises(AgentError, match="vf_reverse.py'.*the episode failed"):  # nothing listens on port 9
        asyncio.run(
            agent(base_url="http://127.0.0.1:9/v1", api_key="k", model="m", messages=[], answer="", meta=prompt.meta)
        )


def test_openenv_options_and_classes_are_checked():
    from flowrl.agents.openenv_env import openenv_agent

    with pytest.raises(AgentError, match="give one of environment="):
        openenv_agent(None)
    with pytest.raises(AgentError, match="has no attribute 'Nope'"):
        openenv_agent(None, environment=f"{EXAMPLES / 'openenv_echo.py'}:Nope")
    with pytest.raises(AgentError, match="is not an OpenEnv Environment subclass"):
        openenv_agent(None, environment=f"{EXAMPLES / 'openenv_echo.py'}:EchoAction")
    with pytest.raises(AgentError, match=r"EchoEnvironment\(\*\*\{'colour': 1\}\) failed"):
        openenv_agent(None, environment=ECHO, env_kwargs={"colour": 1})


def test_openenv_reply_becomes_the_action():
    from flowrl.agents.openenv_env import parse_action, render

    schema = {"properties": {"text": {"type": "string"}, "metadata": {"type": "object"}}}
    assert parse_action(" abc\n", schema, "env") == {"text": "abc"}
    assert parse_action('{"text": "x"}', schema, "env") == {"text": "x"}
    with pytest.raises(AgentError, match="not a JSON object"):
        parse_action("abc", {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}, "env")
    assert render({"prompt": "say: ab"}) == "say: ab"
    assert render({"prompt": "", "board": [1, 2]}) == '{"board": [1, 2], "prompt": ""}'


def test_openenv_launched_environment_plays_over_its_client():
    from openenv.core.generic_client import GenericEnvClient

    from flowrl.agents.openenv_env import launch

    server = launch(ECHO)
    assert launch(ECHO) is server  # one server per environment and arguments

    async def episode() -> tuple[str, float, bool]:
        async with GenericEnvClient(base_url=server.url) as client:
            first = await client.reset(seed=1)
            word = first.observation["prompt"].removeprefix("say: ")
            done = await client.step({"text": word})
            return word, done.reward, done.done

    word, reward, done = asyncio.run(episode())
    assert word and set(word) <= set("abcd") and reward == 1.0 and done


def test_verifiers_task_draws_the_environments_tasks_from_the_runs_rng():
    import random

    from flowrl.tasks.verifiers_task import VerifiersTask

    task = VerifiersTask.from_options({"environment": REVERSE, "env_args": {"count": 6, "max_len": 2}})
    assert task.max_new_tokens() == 3  # the longest answer (2 letters) and EOS
    drawn = task.prompts(random.Random(4), 20)
    assert [p.text for p in drawn] == [p.text for p in task.prompts(random.Random(4), 20)]
    assert {p.meta["vf_idx"] for p in drawn} <= set(range(6)) and len({p.meta["vf_idx"] for p in drawn}) > 1
    assert all(p.answer == p.text.removeprefix("reverse: ")[::-1] for p in drawn)
    budget = VerifiersTask.from_options({"environment": REVERSE, "env_args": {"count": 6}, "max_new_tokens": 9})
    assert budget.max_new_tokens() == 9


def test_verifiers_task_refuses_task_scoring_and_bad_options():
    from flowrl.errors import TaskError
    from flowrl.tasks.verifiers_task import VerifiersTask

    task = VerifiersTask.from_options({"environment": REVERSE, "env_args": {"count": 2}})
    with pytest.raises(TaskError, match="fn='agent'"):
        task.score(task.tasks[0], "ab")
    with pytest.raises(TaskError, match="names no verifiers environment"):
        VerifiersTask.from_options({})
    with pytest.raises(TaskError, match="bad option.*envirnoment"):
        VerifiersTask.from_options({"envirnoment": REVERSE})
    with pytest.raises(TaskError, match="task 'verifiers'.*does not exist"):
        VerifiersTask.from_options({"environment": "nowhere/env.py"})


def test_openenv_task_is_seeded_episodes_and_the_agent_resets_with_them():
    import random

    from flowrl.agents.openenv_env import episode_seed
    from flowrl.errors import TaskError
    from flowrl.tasks.builtin import make_task
    from flowrl.tasks.openenv_task import OpenEnvSeeds

    task = make_task("openenv", {"seeds": 5, "max_new_tokens": 6}, registry={"openenv": OpenEnvSeeds})
    assert task.max_new_tokens() == 6
    drawn = task.prompts(random.Random(1), 10)
    assert [p.meta["seed"] for p in drawn] == [p.meta["seed"] for p in task.prompts(random.Random(1), 10)]
    assert all(0 <= p.meta["seed"] < 5 and p.text == f"seed {p.meta['seed']}" for p in drawn)
    assert episode_seed(drawn[0].text, drawn[0].meta) == drawn[0].meta["seed"]
    assert episode_seed("7+8=", {}) == episode_seed("7+8=", {}) != episode_seed("7+9=", {})  # any task's prompt
    with pytest.raises(TaskError, match="fn='agent'"):
        task.score(drawn[0], "abc")
    with pytest.raises(TaskError, match="'seeds' must be at least 1"):
        make_task("openenv", {"seeds": 0}, registry={"openenv": OpenEnvSeeds})
