"""Tool-calling episodes: the tool schema through the chat template, tool calls parsed from the
model's turn and run, their results rendered by the template, the turns given to reward functions,
per-turn and environment budgets, in every rollout mode on the local backend.

The model is `tool_model` (tests/conftest.py): a tiny chat model taught here to call ``mul``."""

from __future__ import annotations

import pytest
import torch

from flowrl import api
from flowrl.contract.data import EpisodeText, Prompt, ToolCall, Turn
from flowrl.errors import ConfigError
from flowrl.tasks import tools

GRAPH = '''
from flowrl import register
from flowrl.graph import Graph
from flowrl.tasks.tools import ToolEnvironment


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


@register.environment("mul_tools")
def mul_tools(task, penalty=0.0):
    return ToolEnvironment([mul], penalty=penalty)


@register.reward("turns_seen")
def turns_seen(prompts, responses, task):
    """1 for an episode whose turns are assistant (with a parsed call), tool (the result), assistant."""
    scores, called = [], 0
    for r in responses:
        roles = [t.role for t in r.turns]
        calls = r.turns[0].tool_calls if r.turns else ()
        called += bool(calls)
        ok = roles[:3] == ["assistant", "tool", "assistant"] and bool(calls) and calls[0].name == "mul"
        scores.append(float(ok and "<tool_response>42</tool_response>" in r.turns[1].text))
    return scores, {"called": called / max(len(responses), 1)}


def build(cfg):
    g = Graph("tools")
    g.model("actor", "actor")
    g.generate("episodes", model="actor", n=2, env="mul_tools", turns=2, turn_tokens=TURN, env_tokens=ENV)
    g.forward("old_logprobs", model="actor", output="logprobs", writes="old_logprobs")
    g.reward("reward", fn="turns_seen", writes="rewards")
    g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
'''


def graph_file(tmp_path, turn=96, env=64):
    path = tmp_path / "tools_graph.py"
    path.write_text(GRAPH.replace("TURN", str(turn)).replace("ENV", str(env)))
    return str(path)


def overrides(tool_model, tmp_path, *extra):
    return [
        f"model={tool_model['model']}", f"data.train={tool_model['data']}",
        f"data.chat_template={tool_model['template']}", "data.verifier=none", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.temperature=0.7", "progress=false", "checkpoint=false", "seed=0",
        f"out={tmp_path}", "train.lr=1e-5", *extra,
    ]  # fmt: skip


def run(tool_model, tmp_path, *extra, steps=2, turn=96, env=64, out="runs"):
    graph, plan = api.plan(
        graph_file(tmp_path, turn, env),
        overrides=overrides(tool_model, tmp_path / out, *extra),
        flags={"steps": steps},
        emit=lambda s: None,
    )
    return plan, api.run(graph, plan)


# ------------------------------------------------------------------ the format


def test_tool_calls_are_parsed_from_the_hermes_blocks_and_bad_ones_counted():
    text = (
        'I will call. <tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
    )
    calls, bad = tools.parse_tool_calls(text)
    assert calls == (ToolCall(name="mul", arguments={"a": 6, "b": 7}), ToolCall(name="add", arguments={"a": 1, "b": 2}))
    assert bad == 2
    assert tools.parse_tool_calls("no call at all") == ((), 0)


@pytest.mark.slow
def test_tool_results_render_as_the_template_writes_them(tool_model):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tool_model["model"])
    template = open(tool_model["template"]).read()
    after_eos = "\n<|im_start|>user\n<tool_response>42</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tools.tool_text(tok, template, ["42"], True) == after_eos
    assert tools.tool_text(tok, template, ["42"], False) == "<|im_end|>" + after_eos  # the turn was cut: close it
    two = tools.tool_text(tok, template, ["1", "2"], True)
    assert two.count("<tool_response>") == 2 and two.endswith("<|im_start|>assistant\n")


def test_a_template_that_ignores_tools_is_refused(chat_model):
    import transformers

    from flowrl.tasks.environments import arithmetic

    tok = transformers.AutoTokenizer.from_pretrained(chat_model)  # plain ChatML: no tools in it
    p = Prompt(text="x", answer="1", templated=True, messages=({"role": "user", "content": "2 * 3?"},))
    with pytest.raises(ConfigError, match="does not render tools"):
        tools.with_tools(p, arithmetic(None).tools, tok, None)
    with pytest.raises(ConfigError, match="not rendered by a chat template"):
        tools.with_tools(Prompt(text="2*3:", answer="6"), arithmetic(None).tools, tok, None)


def test_the_tool_environment_runs_calls_and_reports_errors_as_results():
    from flowrl.tasks.environments import arithmetic

    ep = arithmetic(None, penalty=-0.5).episode(Prompt(text="q", answer="a"))
    call = Turn(role="assistant", text="...", tool_calls=(ToolCall(name="multiply", arguments={"a": 6, "b": 7}),))
    assert ep.step(call).tool_results == ("42",)
    bad = ep.step(Turn(role="assistant", text="", tool_calls=(ToolCall(name="divide", arguments={}),)))
    assert bad.reward == -0.5 and "no tool named 'divide'" in bad.tool_results[0]
    wrong = ep.step(Turn(role="assistant", text="", tool_calls=(ToolCall(name="add", arguments={"a": 1}),)))
    assert wrong.reward == -0.5 and wrong.tool_results[0].startswith("error: TypeError")
    final = ep.step(Turn(role="assistant", text="42"))
    assert final.done and not final.tool_results


def test_episode_text_carries_its_turns_to_reward_functions_and_pool_workers():
    import pickle

    turns = (Turn(role="assistant", text="a", tokens=1), Turn(role="tool", text="b", reward=0.5, tokens=1),
             Turn(role="assistant", text="c", tokens=1))  # fmt: skip
    r = EpisodeText("abc", turns)
    back = pickle.loads(pickle.dumps(r))
    assert back == "abc" and back.turns == turns and back.final == "c" and back.env_reward == 0.5


# ------------------------------------------------------------------ whole runs on the local backend


@pytest.mark.parametrize("mode", ["sync", "partial+async", "streaming"])
@pytest.mark.slow
def test_a_tool_calling_episode_runs_in_every_rollout_mode(tool_model, tmp_path, mode):
    plan, result = run(tool_model, tmp_path, f"rollout.mode={mode}")
    policy = plan.layout.rollout
    assert (policy.partial, policy.mode == "async", policy.streaming) == (
        "partial" in mode,
        "async" in mode,
        mode == "streaming",
    )
    m = result.metrics
    assert all(r["episodes/tool_calls"] > 0 for r in m), [r["episodes/tool_calls"] for r in m]
    assert max(r["reward/called"] for r in m) > 0
    assert max(r["reward"] for r in m) > 0  # an episode with the call, its result, and a second turn
    assert all(r["episodes/env_tokens"] > 0 for r in m)
    assert all(r["episodes/turns"] > 1 for r in m)


@pytest.mark.slow
def test_the_budgets_of_turns_and_environment_text_are_kept_apart(tool_model, tmp_path):
    # a turn budget too small for the whole call: the call is cut, nothing parses, the episode ends
    _, result = run(tool_model, tmp_path, turn=8, out="short")
    assert all(r["episodes/tool_calls"] == 0 and r["episodes/turns"] == 1 for r in result.metrics)
    # an environment budget smaller than the tool result: the result is not written, the episode ends
    _, result = run(tool_model, tmp_path, env=2, out="noenv")
    m = result.metrics
    assert all(r["episodes/env_truncated"] > 0 and r["episodes/env_tokens"] == 0 for r in m)


def test_what_the_environment_wrote_is_read_but_not_trained(tool_model, tmp_path):
    from flowrl.plugins.manager import registry

    path = tmp_path / "look.py"
    path.write_text(
        GRAPH.replace("TURN", "96").replace("ENV", "64")
        + """
SEEN = []


@register.estimator("look_tools", needs=("rewards", "responses"), gives=("advantages",))
def look_tools(inputs, algo):
    from flowrl.runtime.batch import sequences_in
    import torch

    seqs = sequences_in(inputs, "look_tools")
    SEEN.append(seqs)
    return {"advantages": torch.zeros(seqs.response_ids.shape)}
""".replace("SEEN = []", "SEEN = []").replace('fn="grpo"', 'fn="look_tools"')
    )
    src = path.read_text().replace('g.compute("advantages", fn="grpo"', 'g.compute("advantages", fn="look_tools"')
    path.write_text(src)
    graph, plan = api.plan(
        str(path), overrides=overrides(tool_model, tmp_path), flags={"steps": 1}, emit=lambda s: None
    )
    api.run(graph, plan)
    seen = registry().get("compute_functions", "look_tools").__globals__["SEEN"]
    seqs = seen[-1]
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tool_model["model"])
    checked = 0
    for i, turns in enumerate(seqs.episodes):
        n = int(seqs.response_mask[i].sum())
        ids = seqs.response_ids[i, :n].tolist()
        action = seqs.action_mask[i, :n].tolist()
        at = 0
        for t in turns:  # each turn's tokens: sampled (1) for the model's, written (0) for the tool's
            assert action[at : at + t.tokens] == [1.0 if t.role == "assistant" else 0.0] * t.tokens
            if t.role == "tool" and t.tokens:
                assert tok.decode(ids[at : at + t.tokens]) == t.text
                checked += 1
            at += t.tokens
        assert at == n
        assert (seqs.logprobs[i, :n][torch.tensor(action) == 0] == 0).all()
    assert checked > 0
