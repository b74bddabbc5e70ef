"""Random ``--set`` overrides and random small graph files: ``flowrl show`` and ``flowrl plan`` exit
with 0 or 2 (one ``flowrl: error:`` paragraph), never another code, a traceback or an exception
out of ``main``.

Overrides take keys from RunConfig's fields (and unknown ones) with values of every type: small
and huge integers, nan/inf and extreme floats, booleans, null, text, lists. Graph files are random
models and nodes, or the GRPO graph with one statement mutated, with random ``DEFAULTS``. Nothing
runs a model. A show/plan still running after LIMIT_S seconds fails as a hang. HYPOTHESIS_PROFILE=explore
searches with more, random examples.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import signal
import threading
import traceback
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flowrl.cli import main
from flowrl.specs import RunConfig

#: seconds one show/plan may take before it counts as a hang
LIMIT_S = 20
#: the small rollout every plan starts from (random overrides come after, so they win)
SMALL = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "progress=false"]


def _fields(struct: type, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> type of every field of ``struct``, nested specs included (``train.lr``, ...)."""
    out = {}
    hints = typing.get_type_hints(struct)
    for name in struct.__struct_fields__:
        tp = hints[name]
        if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            out.update(_fields(tp, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = tp
    return out


FIELD_TYPES = _fields(RunConfig)
KNOWN_KEYS = sorted(FIELD_TYPES)
SECTIONS = ["rollout", "train", "algo", "tiny_model", "generation", "task_options"]
TYPOS = ["train.lrr", "rollout.temprature", "stpes", "algo.kl", "Train.lr", "train.lr.x", "../train.lr", "a..b"]

# ------------------------------------------------------------------ override strategies

small_ints = st.integers(min_value=-3, max_value=64)
huge_ints = st.one_of(
    st.integers(min_value=10**15, max_value=2**80), st.integers(min_value=-(2**80), max_value=-(10**15))
)
floats = st.one_of(
    st.floats(min_value=-10, max_value=10),
    st.sampled_from(["nan", ".nan", "inf", ".inf", "-.inf", "1e400", "1e-400", "1e300", "-1e300", "1e-300", "-0.0"]),
)
words = st.sampled_from(
    ["", "null", "~", "yes", "no", "true", "false", "local", "nosuch", "cpu", "cuda:0", "auto", "k1", "k4", "clip"]
    + ["sync", "async", "one_step_off", "partial", "streaming", "partial+async", "sync+async", "+", "copy", "add"]
)
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r\x00"), max_size=12)
scalars = st.one_of(small_ints.map(str), huge_ints.map(str), floats.map(str), words, texts)
lists = st.lists(st.one_of(small_ints.map(str), floats.map(str), words.filter(bool)), max_size=3).map(
    lambda items: "[" + ", ".join(items) + "]"
)
mappings = st.dictionaries(st.sampled_from(["a", "lr", "x"]), small_ints, max_size=2).map(
    lambda d: "{" + ", ".join(f"{k}: {v}" for k, v in d.items()) + "}"
)
values = st.one_of(scalars, scalars, lists, mappings)
keys = st.one_of(
    st.sampled_from(KNOWN_KEYS),
    st.sampled_from(KNOWN_KEYS),
    st.sampled_from(SECTIONS + TYPOS),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.-/0123456789", min_size=1, max_size=12),
)


def _plausible(tp: Any) -> st.SearchStrategy[str]:
    """Values a field of type ``tp`` might well accept (so that deeper checks run too)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Literal:
        return st.sampled_from([str(a) for a in args])
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return st.one_of(st.just("null"), _plausible(rest[0]) if len(rest) == 1 else st.just("x"))
    if tp is bool:
        return st.sampled_from(["true", "false"])
    if tp is int:
        return st.integers(min_value=1, max_value=8).map(str)
    if tp is float:
        return st.floats(min_value=0.01, max_value=0.99).map(lambda f: f"{f:.3g}")
    if typing.get_origin(tp) is tuple:
        return st.just("[0.9, 0.99]")
    if typing.get_origin(tp) is dict:
        return st.just("{}")
    return words


plausible = st.sampled_from(KNOWN_KEYS).flatmap(lambda key: _plausible(FIELD_TYPES[key]).map(lambda v: f"{key}={v}"))
override = st.one_of(
    plausible,
    plausible,
    plausible,
    st.tuples(keys, values).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.sampled_from(["train.lr", "=3", ".=1", "=", "train.lr==1"]),  # malformed
)
overrides = st.lists(override, max_size=5)


# ------------------------------------------------------------------ graph strategies

MODEL_NAMES = ["actor", "critic", "ref", "rm", "m"]
NODE_NAMES = ["rollout", "score", "advantages", "train_actor", "old_logprobs", "x", "", "a b", "../n"]
KEYS = ["prompts", "responses", "rewards", "advantages", "old_logprobs", "values", "returns", "k", "bad-key", "1x"]
key_lists = st.one_of(st.lists(st.sampled_from(KEYS), max_size=4), st.sampled_from(KEYS + ["", "responses rewards"]))

model_calls = st.builds(
    lambda name, role, trainable, init: f"g.model({name!r}, {role!r}, trainable={trainable!r}, init_from={init!r})",
    st.sampled_from(MODEL_NAMES),
    st.sampled_from(["actor", "critic", "reference", "reward", "cost", "judge"]),
    st.sampled_from([None, True, False]),
    st.sampled_from([None, *MODEL_NAMES]),
)
node_calls = st.one_of(
    st.builds(
        lambda name, model, reads, writes, n, greedy: (
            f"g.generate({name!r}, model={model!r}, reads={reads!r}, writes={writes!r}, n={n!r}, greedy={greedy!r})"
        ),
        st.sampled_from(NODE_NAMES),
        st.sampled_from(MODEL_NAMES),
        key_lists,
        key_lists,
        st.integers(min_value=-1, max_value=4),
        st.booleans(),
    ),
    st.builds(
        lambda name, model, output, reads, writes: (
            f"g.forward({name!r}, model={model!r}, output={output!r}, reads={reads!r}, writes={writes!r})"
        ),
        st.sampled_from(NODE_NAMES),
        st.sampled_from(MODEL_NAMES),
        st.sampled_from(["logprobs", "values", "scores", "entropy"]),
        key_lists,
        key_lists,
    ),
    st.builds(
        lambda name, fn, reads, writes: f"g.reward({name!r}, fn={fn!r}, reads={reads!r}, writes={writes!r})",
        st.sampled_from(NODE_NAMES),
        st.sampled_from(["task", "nosuch"]),
        key_lists,
        key_lists,
    ),
    st.builds(
        lambda name, fn, reads, writes: f"g.compute({name!r}, fn={fn!r}, reads={reads!r}, writes={writes!r})",
        st.sampled_from(NODE_NAMES),
        st.sampled_from(["grpo", "gae", "rloo", "remax", "reinforce_pp", "nosuch"]),
        key_lists,
        key_lists,
    ),
    st.builds(
        lambda name, model, loss, reads, writes: (
            f"g.train({name!r}, model={model!r}, loss={loss!r}, reads={reads!r}, writes={writes!r})"
        ),
        st.sampled_from(NODE_NAMES),
        st.sampled_from(MODEL_NAMES),
        st.sampled_from(["ppo", "value", "nosuch"]),
        key_lists,
        st.one_of(st.just(()), key_lists),
    ),
)

GRPO = [
    'g.model("actor", "actor")',
    'g.model("ref", "reference", init_from="actor")',
    'g.generate("rollout", model="actor", reads="prompts", writes="responses", n=2)',
    'g.forward("old_logprobs", model="actor", output="logprobs", reads="responses", writes="old_logprobs")',
    'g.forward("ref_logprobs", model="ref", output="logprobs", reads="responses", writes="ref_logprobs")',
    'g.reward("reward", fn="task", reads="prompts responses", writes="rewards")',
    'g.compute("advantages", fn="grpo", reads="rewards responses", writes="advantages")',
    'g.train("train_actor", model="actor", loss="ppo", reads="responses old_logprobs ref_logprobs advantages")',
]


@st.composite
def mutated_grpo(draw: st.DrawFn) -> list[str]:
    """GRPO with one statement replaced by a random one, one dropped, or one added."""
    lines = list(GRPO)
    i = draw(st.integers(min_value=0, max_value=len(lines) - 1))
    how = draw(st.sampled_from(["replace", "drop", "add", "keep"]))
    random_line = draw(st.one_of(model_calls, node_calls))
    if how == "replace":
        lines[i] = random_line
    elif how == "drop":
        del lines[i]
    elif how == "add":
        lines.insert(i, random_line)
    return lines


graph_bodies = st.one_of(
    mutated_grpo(),
    mutated_grpo(),
    st.tuples(st.lists(model_calls, max_size=3), st.lists(node_calls, max_size=6)).map(lambda mn: mn[0] + mn[1]),
)
graph_names = st.sampled_from(["g", "g", "g", "../up", "", "a/b"])
#: a graph file's DEFAULTS (None: it defines none): config overrides of any shape
leaf = st.one_of(small_ints, huge_ints, st.floats(), st.booleans(), st.none(), texts, st.lists(small_ints, max_size=2))
defaults = st.one_of(
    st.none(),
    st.dictionaries(
        st.sampled_from(["steps", "seed", "name", "train", "rollout", "algo", "tiny_model", "stepz", "task"]),
        st.one_of(leaf, st.dictionaries(st.sampled_from(["lr", "prompts_per_step", "mode", "x"]), leaf, max_size=2)),
        max_size=3,
    ),
    st.sampled_from([[], 5, "x"]),
)


def graph_source(name: str, body: list[str], defaults: Any = None) -> str:
    lines = [f"g = Graph({name!r})", *body, "return g"]
    head = "from flowrl.graph import Graph\n\n"
    if defaults is not None:
        head += f"DEFAULTS = {defaults!r}\n"
    return head + "\ndef build(cfg):\n" + "".join(f"    {line}\n" for line in lines)


# ------------------------------------------------------------------ the harness


class Hung(BaseException):
    pass


def _hung(signum: int, frame: Any) -> None:
    raise Hung(f"still running after {LIMIT_S} s")


def cli(argv: list[str]) -> tuple[int | None, str, str | None]:
    """(exit code, stderr, what escaped main or None). A watchdog thread signals SIGUSR1 after
    LIMIT_S (flowrl's own graph-import limit uses SIGALRM)."""
    err = io.StringIO()
    old = signal.signal(signal.SIGUSR1, _hung)
    watchdog = threading.Timer(LIMIT_S, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    watchdog.start()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        return code, err.getvalue(), None
    except SystemExit as exc:
        return None, err.getvalue(), f"SystemExit({exc.code!r}) escaped main"
    except BaseException:  # noqa: BLE001 - anything out of main is the failure we look for
        return None, err.getvalue(), traceback.format_exc()
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGUSR1, old)


def assert_clean(argv: list[str]) -> int:
    code, err, escaped = cli(argv)
    report = f"argv: {argv}\nexit: {code}\nstderr:\n{err}\n{escaped or ''}"
    assert escaped is None, report
    assert code in (0, 2), report
    assert "Traceback" not in err, report
    if code == 2:
        assert err.startswith("flowrl: error: "), report
    event(f"{argv[0]} exit {code}")
    return code


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path / "flowrl_home"))
    return tmp_path


#: 60 examples (seconds); HYPOTHESIS_PROFILE=explore searches with that profile's count
EXAMPLES = 60 if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else settings.default.max_examples
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.slow
@SETTINGS
@given(sets=overrides, command=st.sampled_from(["show", "plan"]))
def test_random_overrides_exit_0_or_2(isolated: Path, sets: list[str], command: str) -> None:
    base = [f"--set={s}" for s in SMALL] if command == "plan" else []
    assert_clean([command, "grpo", *base, *[f"--set={s}" for s in sets]])


_counter = itertools.count()


@pytest.mark.slow
@SETTINGS
@given(name=graph_names, body=graph_bodies, defaults=defaults, sets=st.lists(override, max_size=2))
def test_random_graph_files_exit_0_or_2(
    isolated: Path, name: str, body: list[str], defaults: Any, sets: list[str]
) -> None:
    # a fresh file name per example: a module re-imported from the same path could hit a stale .pyc
    path = isolated / f"graph_{next(_counter)}.py"
    path.write_text(graph_source(name, body, defaults))
    code = assert_clean(["show", str(path)])
    if code == 0:  # a graph that builds: plan it too, small, and with random overrides
        assert_clean(["plan", str(path), *[f"--set={s}" for s in [*SMALL, *sets]]])
