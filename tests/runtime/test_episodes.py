"""Multi-turn environment episodes (flowrl.runtime.episodes), tool results and EpisodeText rewards.

Most tests drive `Episodes` / `StepRollout` directly with the char-level tokenizer and a fake
engine (every model turn is fixed or drawn from a seeded RNG), so they are exact and quick; two
whole runs on the local backend (the default tiny char model, task calc) check the masks, the
turns and the errors end to end, and a CLI run resumes episodes in flight."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from flowrl import api
from flowrl.contract.data import EpisodeText, Prompt, Turn
from flowrl.errors import GraphError
from flowrl.planner.space import RolloutPolicy
from flowrl.runtime.episodes import Episodes
from flowrl.runtime.rollout import Row, StepRollout, rows_to_rollout
from flowrl.tasks.environments import Step
from flowrl.tasks.tokenizer import build_tokenizer

TOK = build_tokenizer()
EOS = TOK.eos_token_id
P = [Prompt(text="12*34:", answer="408"), Prompt(text="56*78:", answer="4368")]

#: a chat template over the char tokenizer's own characters (tool messages included)
CHAR_TOOL_TEMPLATE = (
    "{% if tools %}tools:{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}|{% endif %}"
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# ------------------------------------------------------------------ helpers


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class FakeGen:
    """An engine whose every model turn is ``turn`` then EOS (cut at max_new_tokens); it records
    whether each call was asked to decode greedily."""

    version = 0

    def __init__(self, turn: str = "12", seed: int | None = None) -> None:
        self.turn, self.calls = turn, []
        self.rng = None if seed is None else random.Random(seed)

    def _new(self) -> list[int]:
        if self.rng is None:
            return ids(self.turn) + [EOS]
        new = ids("123"[: self.rng.randint(1, 3)])
        return new + [EOS] if self.rng.random() < 0.5 else new

    def _out(self, rows, greedy, max_new_tokens):
        for r in rows:
            new = self._new()[:max_new_tokens]
            r.tokens += new
            r.logprobs += [-1.0] * len(new)
            r.versions += [0] * len(new)
            r.finished = new[-1] == EOS
            r.text = TOK.decode(r.tokens, skip_special_tokens=True)
        return rows_to_rollout(rows, 0, greedy)

    def generate(self, prompts, n, greedy, generator, max_new_tokens=None):
        self.calls.append(("generate", greedy))
        rows = [Row(group=i, prompt_ids=TOK.encode(p.text)) for i, p in enumerate(prompts) for _ in range(n)]
        return self._out(rows, greedy, max_new_tokens)

    def resume(self, rollout, generator, max_new_tokens=None):
        self.calls.append(("resume", rollout.greedy))
        s, rows = rollout.sequences, []
        for i in range(len(s)):
            toks = s.response_ids[i][s.response_mask[i].bool()].tolist()
            prompt = s.prompt_ids[i][s.prompt_mask[i].bool()].tolist()
            rows.append(
                Row(group=i, prompt_ids=prompt, tokens=toks, logprobs=[-1.0] * len(toks), versions=[0] * len(toks))
            )
        return self._out(rows, rollout.greedy, max_new_tokens)


class FnEnv:
    """An environment whose episodes answer each turn with ``fn(episode, turn)`` (the episode counts
    its steps in ``n`` and holds its ``prompt``)."""

    def __init__(self, fn, tools=None) -> None:
        self.fn = fn
        if tools is not None:
            self.tools = tools

    def episode(self, prompt):
        fn = self.fn

        class Ep:
            n = 0

            def step(self, turn):
                self.n += 1
                return fn(self, turn)

        ep = Ep()
        ep.prompt = prompt
        return ep


def episodes(fn, *, turns=3, budget=30, turn_tokens=4, env_tokens=None, template=None, tools=None) -> Episodes:
    return Episodes("gen", "probe", FnEnv(fn, tools), turns, TOK, budget, turn_tokens, env_tokens, template)


def row(text: str, *, eos: bool = False, finished: bool | None = None) -> Row:
    toks = ids(text) + ([EOS] if eos else [])
    return Row(
        group=0, prompt_ids=[1], tokens=toks, logprobs=[-1.0] * len(toks), versions=[0] * len(toks),
        finished=eos if finished is None else finished, multi=True, action=[1.0] * len(toks), text=text,
    )  # fmt: skip


def step_rollout(fn, *, greedy=False, mode="sync", turns=3, budget=30, turn_tokens=4, n=2, gen=None, draw=None):
    eps = episodes(fn, turns=turns, budget=budget, turn_tokens=turn_tokens)
    policy = RolloutPolicy(
        mode=mode, partial="partial" in mode, staleness=0 if mode == "sync" else 1, overprovision=1.0
    )
    return StepRollout(
        model="actor", generator=gen or FakeGen(), n=1 if greedy else n, greedy=greedy, policy=policy,
        prompts_per_step=2, chunk_tokens=3, stream_groups=1, pad_id=0, draw=draw or (lambda k: P[:k]), episodes=eps,
    )  # fmt: skip


def drive(sr: StepRollout, step: int, prompts=None):
    gen = sr.run(step, 0, prompts, torch.Generator())
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        return stop.value


def turn_view(turns):
    return [(t.role, t.text, t.tokens) for t in turns]


# ------------------------------------------------------------------ episodes, turns and budgets


def test_a_greedy_generate_node_with_an_environment_decodes_greedily_in_sync_mode():
    """A greedy generate node with an environment decodes greedily in every mode: its episodes' first
    call and every resume too."""
    sr = step_rollout(lambda ep, t: Step(text="ab"), greedy=True, mode="async")
    drive(sr, 0, P)
    assert {g for _, g in sr.generator.calls} == {True}  # chunked modes: greedy, as asked
    sr = step_rollout(lambda ep, t: Step(text="ab"), greedy=True, mode="sync")
    sr._sample(P, torch.Generator())
    assert {g for _, g in sr.generator.calls} == {True}, sr.generator.calls


def test_an_episode_restored_from_a_checkpoint_keeps_its_own_environment_episode():
    """A row restored from a checkpoint keeps its episode number (`Row.episode`), and the resumed run's
    fresh rows never take it: the env writes its prompt's first two characters and its step count, so a
    row answered by another prompt's episode shows."""
    from flowrl.runtime import checkpoint

    stream = iter([Prompt(text=f"{a}*{a + 1}:", answer="") for a in range(10, 60)])
    draw = lambda k: [next(stream) for _ in range(k)]  # noqa: E731
    tag = lambda ep, t: Step(text=ep.prompt.text[:2] + str(ep.n) + "|")  # noqa: E731

    def make():
        return step_rollout(tag, mode="partial", turns=8, budget=80, turn_tokens=6, gen=FakeGen(seed=8), draw=draw)

    def wrong(res):
        out = []
        for i, turns in enumerate(res.sequences.episodes):
            prompt = res.prompts[int(res.sequences.prompt_index[i])].text
            env = [t.text for t in turns if t.role != "assistant" and t.tokens]
            if env != [prompt[:2] + str(k + 1) + "|" for k in range(len(env))]:
                out.append((prompt, env))
        return out

    first = make()
    assert wrong(drive(first, 0)) == []
    assert any(not r.finished for r in first.buffer.rows)  # episodes in flight at the checkpoint
    tensors: dict = {}
    restored = checkpoint.decode(checkpoint.encode(first.buffer, tensors), tensors)  # as runstate saves it
    resumed = make()  # a new process: a new Episodes
    resumed.buffer = restored
    assert wrong(drive(resumed, 1)) + wrong(drive(resumed, 2)) == []


def test_a_final_text_with_done_that_exactly_fills_the_environment_budget_is_written():
    """With env_tokens=E the response budget is turns * turn_tokens + E (`Graph.generate`): a last reply
    with done=True that fills the budget exactly is written, not counted as env_truncated."""
    eps = episodes(
        lambda ep, t: Step(text="abc", reward=1.0, done=True), turns=1, budget=7, turn_tokens=4, env_tokens=3
    )
    r = row("1234", finished=False)  # the model used its whole turn
    eps.advance([r], lambda r: P[0], 0)
    assert r.ended
    assert turn_view(r.turns) == [("assistant", "1234", 4), ("env", "abc", 3)], turn_view(r.turns)
    assert r.tokens[4:] == ids("abc") and r.action == [1.0] * 4 + [0.0] * 3


@pytest.mark.parametrize(
    "step",
    [Step(text=5), Step(text="ab", reward=None), Step(text="ab", reward="high")],
    ids=["text-int", "reward-none", "reward-str"],
)
def test_a_step_with_wrongly_typed_fields_is_a_graph_error_naming_node_and_environment(step):
    """`Step` is a msgspec Struct, unchecked when built: its fields' types are checked where the episode
    takes it, naming the node and the environment (not a raw error from the tokenizer or float())."""
    eps = episodes(lambda ep, t: step)
    with pytest.raises(GraphError, match=r"node 'gen'.*environment 'probe'"):
        eps.advance([row("12", eos=True)], lambda r: P[0], 0)


def test_tool_results_given_as_one_string_are_not_split_into_a_message_per_character():
    """Step(tool_results="42") (a str, not a tuple) is refused naming the environment or taken as one
    result, never rendered as one tool message per character."""
    prompt = Prompt(text="x", answer="42", templated=True, messages=({"role": "user", "content": "6*7"},))
    eps = episodes(lambda ep, t: Step(tool_results="42"), template=CHAR_TOOL_TEMPLATE, budget=200, turn_tokens=8)
    r = row("12", eos=True)
    try:
        eps.advance([r], lambda r: prompt, 0)
    except GraphError as exc:
        assert "probe" in str(exc)
        return
    tool = [t.text for t in r.turns if t.role == "tool"]
    assert tool == ["|tool:42|assistant:"], tool  # one result, not '|tool:4|tool:2|assistant:'


def test_an_async_environment_works_when_the_caller_already_runs_an_event_loop():
    """Async steps are awaited on a thread of their own when the caller runs an event loop (a notebook, an
    async driver), as the reward pool does (`rewardpool.run_async`)."""

    async def later(ep, turn):
        await asyncio.sleep(0)
        return Step(text="ab", reward=0.5)

    eps = episodes(later)
    r = row("12", eos=True)

    async def driver():
        eps.advance([r], lambda r: P[0], 0)

    asyncio.run(driver())
    assert turn_view(r.turns) == [("assistant", "12", 3), ("env", "ab", 2)]


def test_env_truncated_counts_only_text_the_budget_refused():
    """``env_truncated`` counts only text a budget refused: after the last allowed model turn the
    environment's text is not written (no turn would read it) and not counted."""
    roomy = episodes(lambda ep, t: Step(text="ab"), turns=1, budget=20, turn_tokens=4)
    roomy.advance([row("1234", finished=False)], lambda r: P[0], 0)
    full = episodes(lambda ep, t: Step(text="ab"), turns=1, budget=4, turn_tokens=4)
    full.advance([row("1234", finished=True)], lambda r: P[0], 0)
    assert roomy.counts.get("env_truncated", 0) == 0
    assert full.counts.get("env_truncated", 0) == 0, full.counts


def test_a_step_with_no_text_that_is_not_done_lets_the_model_take_its_next_turn():
    """A step that gives only a turn reward (done=False, no text) lets the model take its next turn, the
    reward kept on the turn; only `Step.done` ends the episode."""
    sr = step_rollout(lambda ep, t: Step(reward=0.5), turns=3, budget=30)
    seqs, _ = sr._sample(P, torch.Generator())
    roles = [t.role for t in seqs.episodes[0]]
    assert roles.count("assistant") == 3, turn_view(seqs.episodes[0])
    assert EpisodeText(seqs.texts[0], seqs.episodes[0]).env_reward == 1.5


def test_a_replay_restart_leaves_no_environment_episode_behind():
    """When a restored row's replay answers differently, the row restarts and the replayed environment
    episode is dropped: no episode is left behind under -1 or its old number."""
    eps = episodes(lambda ep, t: Step(text="zz"))
    r = row("12", eos=True)
    r.tokens += ids("ab") + ids("5")
    r.logprobs, r.versions = [-1.0] * len(r.tokens), [0] * len(r.tokens)
    r.action = [1.0] * 3 + [0.0] * 2 + [1.0]
    r.turns, r.turn_start, r.finished, r.episode = (
        [Turn(role="assistant", text="12", tokens=3), Turn(role="env", text="ab", tokens=2)],
        5,
        False,
        7,
    )
    eps.advance([r], lambda r: P[0], 0)
    assert eps.counts.get("replay_restarts") == 1 and r.tokens == []
    assert -1 not in eps.live and len(eps.live) <= 1, eps.live


def test_budgets_of_multi_turn_episodes_need_an_environment_and_are_refused_by_name():
    from flowrl.graph import Graph

    g = Graph("x")
    g.model("actor", "actor")
    with pytest.raises(GraphError, match=r"node 'gen': turn_tokens .* needs env=NAME"):
        g.generate("gen", model="actor", turn_tokens=8)
    with pytest.raises(GraphError, match=r"node 'gen2': env_tokens=4 needs turn_tokens"):
        g.generate("gen2", model="actor", env="calculator", env_tokens=4)
    with pytest.raises(GraphError, match=r"node 'gen3': turns=2 needs an environment"):
        g.generate("gen3", model="actor", turns=2)


def test_done_with_final_text_writes_it_and_ends_the_episode():
    sr = step_rollout(lambda ep, t: Step(text="ok", reward=1.0, done=True), turns=3)
    seqs, _ = sr._sample(P, torch.Generator())
    for i, turns in enumerate(seqs.episodes):
        assert turn_view(turns) == [("assistant", "12", 3), ("env", "ok", 2)]
        assert seqs.texts[i] == "12ok" and seqs.action_mask[i, :5].tolist() == [1.0] * 3 + [0.0] * 2
        assert seqs.logprobs[i, 3:5].tolist() == [0.0, 0.0]


def test_a_turn_cut_by_a_decode_chunk_keeps_to_turn_tokens_and_the_turns_sum_to_the_response():
    gen = FakeGen(turn="123456789")  # every turn runs past turn_tokens
    sr = step_rollout(lambda ep, t: Step(text="ab"), mode="partial+async", turns=3, budget=30, turn_tokens=4, gen=gen)
    res = drive(sr, 0)
    seqs = res.sequences
    assert len(seqs) == 4 and sorted(seqs.prompt_index.tolist()) == [0, 0, 1, 1]
    for i, turns in enumerate(seqs.episodes):
        n = int(seqs.response_mask[i].sum())
        assert sum(t.tokens for t in turns) == n
        assert [t.tokens for t in turns if t.role == "assistant"] == [4, 4, 4]
        assert seqs.texts[i] == "".join(t.text for t in turns) == "1231ab1231ab1231"  # two chunks of "123", cut at 4


def test_environment_errors_are_graph_errors_naming_node_and_environment():
    def raises(ep, t):
        raise ValueError("boom")

    async def async_raises(ep, t):
        raise KeyError("async boom")

    for fn, where in (
        (raises, "ValueError in step"),
        (async_raises, "KeyError in step"),
        (lambda ep, t: "x", "returned str"),
    ):
        with pytest.raises(GraphError, match=rf"node 'gen': environment 'probe'.*{where}"):
            episodes(fn).advance([row("12", eos=True)], lambda r: P[0], 0)


GRAPH = """
import asyncio
from flowrl import register
from flowrl.graph import Graph
from flowrl.tasks.environments import Step

SEEN, REWARDS = [], []


class Ep:
    def __init__(self, mode, prompt):
        self.mode, self.prompt, self.n = mode, prompt, 0

    def step(self, turn):
        self.n += 1
        if self.mode == "raise":
            raise ValueError("boom in step")

        async def later():
            await asyncio.sleep(0)
            return Step(text=self.prompt.text[:2] + str(self.n) + "|", reward=0.5)
        return later()


class Env:
    def __init__(self, mode):
        self.mode = mode

    def episode(self, prompt):
        return Ep(self.mode, prompt)


@register.environment("probe")
def probe(task, mode="async"):
    return Env(mode)


@register.reward("look_reward")
def look_reward(prompts, responses, task):
    REWARDS.append(list(responses))
    return [float(r.env_reward) for r in responses], {}


@register.estimator("look_adv", needs=("rewards", "responses"), gives=("advantages",))
def look_adv(inputs, algo):
    from flowrl.runtime.batch import sequences_in
    import torch

    seqs = sequences_in(inputs, "look_adv")
    SEEN.append(seqs)
    return {"advantages": torch.zeros(seqs.response_ids.shape)}


def build(cfg):
    g = Graph("probe")
    g.model("actor", "actor")
    g.generate("episodes", model="actor", n=2, env="probe", turns=3, turn_tokens=4, env_tokens=8, mode=MODE)
    g.forward("old_logprobs", model="actor", output="logprobs", writes="old_logprobs")
    g.reward("reward", fn="look_reward", writes="rewards")
    g.compute("advantages", fn="look_adv", reads="rewards responses", writes="advantages")
    g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs advantages")
    return g
"""


def whole_run(tmp_path, mode, env_mode, steps):
    path = tmp_path / "probe_graph.py"
    path.write_text(GRAPH.replace("MODE", repr(env_mode)))
    graph, plan = api.plan(
        str(path),
        overrides=[
            "task=calc",
            "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2",
            "progress=false",
            "checkpoint=false",
            "seed=0",
            f"out={tmp_path / 'out'}",
            f"rollout.mode={mode}",
        ],  # fmt: skip
        flags={"steps": steps},
        emit=lambda s: None,
    )
    return plan, api.run(graph, plan)


def test_an_async_environment_in_a_partial_async_run_masks_what_it_wrote_and_gives_rewards_its_turns(tmp_path):
    from flowrl.plugins.manager import registry

    plan, result = whole_run(tmp_path, "partial+async", "async", steps=2)
    assert plan.layout.rollout.partial and plan.layout.rollout.mode == "async"
    g = registry().get("compute_functions", "look_adv").__globals__
    assert len(g["SEEN"]) == 2
    budget = 3 * 4 + 8
    for seqs, responses in zip(g["SEEN"], g["REWARDS"]):
        assert len(seqs) == 4 and sorted(seqs.prompt_index.tolist()) == [0, 0, 1, 1]  # no row lost or doubled
        for i, turns in enumerate(seqs.episodes):
            n = int(seqs.response_mask[i].sum())
            action, logprobs = seqs.action_mask[i, :n].tolist(), seqs.logprobs[i, :n].tolist()
            assert sum(t.tokens for t in turns) == n <= budget
            assert sum(t.tokens for t in turns if t.role != "assistant") <= 8
            at = 0
            for t in turns:
                sampled = t.role == "assistant"
                assert action[at : at + t.tokens] == [float(sampled)] * t.tokens
                assert sampled or logprobs[at : at + t.tokens] == [0.0] * t.tokens
                assert not sampled or t.tokens <= 4
                at += t.tokens
            assert seqs.texts[i] == "".join(t.text for t in turns)
        for r in responses:
            assert isinstance(r, EpisodeText) and r.turns and r.turns[0].role == "assistant"
            assert r.final == next(t.text for t in reversed(r.turns) if t.role == "assistant")
            assert r.env_reward == 0.5 * sum(t.role == "env" for t in r.turns)
    assert all(m["episodes/env_tokens"] > 0 for m in result.metrics)


def test_an_environment_that_raises_in_a_whole_run_is_a_graph_error_naming_node_and_environment(tmp_path):
    with pytest.raises(GraphError, match=r"node 'episodes': environment 'probe' raised ValueError in step\(\): boom"):
        whole_run(tmp_path, "streaming", "raise", steps=1)


@pytest.mark.slow  # two `flowrl run` subprocesses
def test_the_cli_resumes_a_partial_tool_use_run_with_episodes_in_flight(tmp_path):
    """`flowrl run graphs/tool_use.py --save-every 1 --set rollout.mode=partial`, then `--resume`:
    every step once, each with its full batch of episodes."""
    import json
    import subprocess
    import sys

    small = [
        "--set",
        "rollout.mode=partial",
        "--set",
        "rollout.prompts_per_step=2",
        "--set",
        "rollout.samples_per_prompt=2",
    ]
    cli = [sys.executable, "-m", "flowrl", "run"]
    args = ["graphs/tool_use.py", "--steps", "2", "--save-every", "1", *small, "--out", str(tmp_path), "--quiet"]
    first = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    args = ["graphs/tool_use.py", "--resume", str(tmp_path / "tool_use"), "--steps", "3", "--quiet"]
    again = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "tool_use" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["episodes/samples"] == 4 and r["episodes/turns"] >= 1 for r in records)
