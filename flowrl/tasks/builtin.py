"""Verifiable toy tasks with rule-based rewards.

A task is a frozen ``msgspec.Struct`` whose fields are its options. It draws prompts
from a ``random.Random`` (deterministic given the rng state) and scores a response
against the prompt's reference answer with :func:`char_score`, which gives partial
credit per matching character and 1.0 only for an exact answer.

Built-in tasks (every prompt and answer is made of :data:`flowrl.tasks.tokenizer.CHARS`):

- ``add``: ``"7+8="`` -> ``"5"``, the sum of two digits modulo ``modulo``.
- ``copy``: ``"cab>"`` -> ``"cab"``, copy a short string of letters.
- ``repeat``: ``"b*7="`` -> ``"bbbbbbb"``, with a long-tailed count distribution.
- ``calc``: ``"37*58:"`` -> ``"2146"``, answered with a calculator environment.
- ``expr``: ``"add 3>"`` -> a Python expression in ``x`` (``"x+3"``) that passes the prompt's asserts,
  run in the code sandbox (`flowrl.tasks.sandbox`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec

from flowrl.contract.data import Completion, Prompt
from flowrl.errors import TaskError
from flowrl.specs import Spec

LETTERS = "abcdefghijklmnopqrstuvwxyz"


@runtime_checkable
class Task(Protocol):
    """What the rest of flowrl needs from a task."""

    name: ClassVar[str]
    description: ClassVar[str]

    def max_new_tokens(self) -> int: ...

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]: ...

    def score(self, prompt: Prompt, response: str) -> float: ...


def char_score(answer: str, response: str) -> float:
    """Partial-credit reward in [0, 1].

    1.0 for an exact match. Otherwise 0.9 times the fraction of positions where the
    response agrees with the answer, over the longer of the two (so missing and extra
    characters both cost); an empty response scores 0.
    """
    if response == answer:
        return 1.0
    if not response:
        return 0.0
    matches = sum(1 for a, r in zip(answer, response) if a == r)
    return 0.9 * matches / max(len(answer), len(response))


class TaskBase(Spec, frozen=True, kw_only=True):
    """Shared behaviour of the built-in tasks: scoring and the draw loop."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def max_new_tokens(self) -> int:
        raise NotImplementedError

    def sample(self, rng: random.Random) -> Prompt:
        """Draw one prompt."""
        raise NotImplementedError

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """Draw ``n`` prompts; deterministic given the rng state."""
        if n < 0:
            raise TaskError(f"task {self.name!r}: cannot draw a negative number of prompts ({n})")
        return [self.sample(rng) for _ in range(n)]

    def score(self, prompt: Prompt, response: str) -> float:
        """Rule-based reward in [0, 1]; 1.0 only for the exact answer."""
        return char_score(prompt.answer, response)

    def completions(self, prompt: Prompt) -> tuple[Completion, ...]:
        """A demonstration of ``prompt`` for an offline source (supervised fine-tuning): its correct
        answer, then the end-of-text token, all trained (a built-in task's answer is a full response)."""
        return (Completion(pieces=(prompt.answer,), trained=(True,), eos=True),)

    def pairs(self, prompt: Prompt) -> tuple[Completion, Completion]:
        """A preference pair for ``prompt`` (an offline source with ``rows="pairs"``): the correct answer
        chosen, a plausible wrong one (`wrong_answer`) rejected, each then the end-of-text token. The
        wrong answer is drawn from the prompt's text, so a prompt always has the same pair (and a run's
        pairs follow from its seed, as its prompts do)."""
        rng = random.Random(f"flowrl-pairs:{self.name}:{prompt.text}")
        wrong = self.wrong_answer(prompt, rng)
        if wrong == prompt.answer:
            raise TaskError(f"task {self.name!r}: its wrong answer to {prompt.text!r} is the right one ({wrong!r}).")
        return (
            Completion(pieces=(prompt.answer,), trained=(True,), eos=True),
            Completion(pieces=(wrong,), trained=(True,), eos=True),
        )

    def wrong_answer(self, prompt: Prompt, rng: random.Random) -> str:
        """A plausible wrong answer: one character of the right one changed to another of its kind
        (a digit to another digit, a letter to another letter); tasks override it with their own slips."""
        answer = prompt.answer
        if not answer:
            return "a"
        at = rng.randrange(len(answer))
        kind = "0123456789" if answer[at].isdigit() else LETTERS if answer[at].isalpha() else answer[at] + "a"
        other = rng.choice([c for c in kind if c != answer[at]])
        return answer[:at] + other + answer[at + 1 :]

    def _check(self, option: str, ok: bool, requirement: str) -> None:
        if not ok:
            value = getattr(self, option)
            raise TaskError(f"task {self.name!r}: option {option!r} must be {requirement}, got {value!r}")


class Add(TaskBase, frozen=True, kw_only=True):
    """``"a+b="`` -> ``str((a + b) % modulo)`` for digits a, b in 0..9."""

    name: ClassVar[str] = "add"
    description: ClassVar[str] = "add two digits modulo `modulo`: '7+8=' -> '5'"

    modulo: int = 10

    def __post_init__(self) -> None:
        self._check("modulo", 2 <= self.modulo <= 10, "between 2 and 10")

    def max_new_tokens(self) -> int:
        return 1 + 2

    def sample(self, rng: random.Random) -> Prompt:
        a = rng.randrange(10)
        b = rng.randrange(10)
        return Prompt(text=f"{a}+{b}=", answer=str((a + b) % self.modulo))

    def wrong_answer(self, prompt: Prompt, rng: random.Random) -> str:
        """Another residue: the sum off by 1 .. modulo-1."""
        return str((int(prompt.answer) + rng.randrange(1, self.modulo)) % self.modulo)


class Copy(TaskBase, frozen=True, kw_only=True):
    """``s + ">"`` -> ``s`` for a string s over the first ``alphabet_size`` letters."""

    name: ClassVar[str] = "copy"
    description: ClassVar[str] = "copy a string of letters: 'cab>' -> 'cab'"

    alphabet_size: int = 4
    min_len: int = 1
    max_len: int = 4

    def __post_init__(self) -> None:
        self._check("alphabet_size", 1 <= self.alphabet_size <= len(LETTERS), "between 1 and 26")
        self._check("min_len", self.min_len >= 1, "at least 1")
        self._check("max_len", self.max_len >= self.min_len, f"at least min_len ({self.min_len})")

    def max_new_tokens(self) -> int:
        return self.max_len + 2

    def sample(self, rng: random.Random) -> Prompt:
        letters = LETTERS[: self.alphabet_size]
        length = rng.randint(self.min_len, self.max_len)
        s = "".join(rng.choice(letters) for _ in range(length))
        return Prompt(text=f"{s}>", answer=s)

    def wrong_answer(self, prompt: Prompt, rng: random.Random) -> str:
        """A copying slip: one letter changed to another of the alphabet (a letter added, with one letter)."""
        s, letters = prompt.answer, LETTERS[: self.alphabet_size]
        if len(letters) < 2:
            return s + letters[0]
        at = rng.randrange(len(s))
        return s[:at] + rng.choice([c for c in letters if c != s[at]]) + s[at + 1 :]


class Repeat(TaskBase, frozen=True, kw_only=True):
    """``"b*7="`` -> ``"bbbbbbb"``; the count is long-tailed (log-normal, clamped).

    ``count = clamp(round(lognormal(log(median), sigma)), 1, max_count)``: most answers
    are short, a few are several times the median.
    """

    name: ClassVar[str] = "repeat"
    description: ClassVar[str] = "write a letter n times, n long-tailed: 'b*7=' -> 'bbbbbbb'"

    median: int = 3
    sigma: float = 0.75
    max_count: int = 24
    alphabet_size: int = 4

    def __post_init__(self) -> None:
        self._check("median", self.median >= 1, "at least 1")
        self._check("sigma", 0.0 <= self.sigma <= 5.0, "between 0 and 5")
        self._check("max_count", self.max_count >= self.median, f"at least median ({self.median})")
        self._check("alphabet_size", 1 <= self.alphabet_size <= len(LETTERS), "between 1 and 26")

    def max_new_tokens(self) -> int:
        return self.max_count + 2

    def sample(self, rng: random.Random) -> Prompt:
        raw = rng.lognormvariate(math.log(self.median), self.sigma)
        count = min(max(round(raw), 1), self.max_count)
        letter = rng.choice(LETTERS[: self.alphabet_size])
        return Prompt(text=f"{letter}*{count}=", answer=letter * count)

    def wrong_answer(self, prompt: Prompt, rng: random.Random) -> str:
        """A miscount: the letter one time too few or too many."""
        s = prompt.answer
        return s[:-1] if len(s) > 1 and rng.random() < 0.5 else s + s[0]


class Calc(TaskBase, frozen=True, kw_only=True):
    """``"37*58:"`` -> ``"2146"``: the product of two numbers in [low, high], too many to learn by
    heart, so a model answers by calling a calculator (environment ``calculator``): a turn that
    starts with ``=`` gets the reply ``"2146|"``, which the next turn can copy. The score is that
    of the text after the last ``|`` (the final answer), 1.0 only for the exact answer with a call."""

    name: ClassVar[str] = "calc"
    description: ClassVar[str] = "multiply two numbers with a calculator tool: '37*58:' -> '=', '2146|', '2146'"

    low: int = 32
    high: int = 99

    def __post_init__(self) -> None:
        self._check("low", 1 <= self.low <= 999, "between 1 and 999")
        self._check("high", self.low <= self.high <= 999, f"between low ({self.low}) and 999")

    def max_new_tokens(self) -> int:
        return 3 * (len(str(self.high * self.high)) + 1) + 2  # two turns and the reply between them

    def sample(self, rng: random.Random) -> Prompt:
        a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        return Prompt(text=f"{a}*{b}:", answer=str(a * b))

    def wrong_answer(self, prompt: Prompt, rng: random.Random) -> str:
        """An arithmetic slip: the product off by 1 .. 9 either way (never below 0)."""
        right = int(prompt.answer)
        off = rng.randint(1, 9) * (1 if rng.random() < 0.5 or right < 10 else -1)
        return str(right + off)

    def score(self, prompt: Prompt, response: str) -> float:
        """The final answer's score: 1.0 when exact; otherwise 0.1 for having used the calculator
        (its reply, the answer and ``|``, is in the response: agentic RL rewards a well-formed
        tool call) plus 0.9 of the answer's partial credit."""
        final = response.rsplit("|", 1)[-1]
        if final == prompt.answer:
            return 1.0
        return 0.1 * (f"{prompt.answer}|" in response) + 0.9 * char_score(prompt.answer, final)


_EXPR_TESTS = {  # per operation: asserts on f = lambda x: <response>, with k the prompt's number
    "add": ("f(0) == {k}", "f(1) - f(0) == 1", "f(2) == {k} + 2", "f(5) == {k} + 5"),
    "sub": ("f({k}) == 0", "f(1) - f(0) == 1", "f(2) == 2 - {k}", "f(9) == 9 - {k}"),
    "mul": ("f(0) == 0", "f(1) == {k}", "f(2) == 2 * {k}", "f(3) - f(2) == {k}"),
}
_EXPR_OPS = {"add": "+", "sub": "-", "mul": "*"}


class Expr(TaskBase, frozen=True, kw_only=True):
    """Code RL in miniature: ``"add 3>"`` asks for the body of ``f = lambda x: ...`` that passes four
    asserts (``prompt.meta["tests"]``: ``assert f(0) == 3``, ``assert f(1) - f(0) == 1``, ...); ``"x+3"`` (or
    ``"3+x"``) passes all. Some asserts test a property (the slope), so a partly right expression
    (``"x"``, ``"3"``) passes some: the score is the fraction passed, run in the code sandbox
    (`flowrl.tasks.sandbox`, judged outside it by `flowrl.tasks.code_tests`) -- the built-in ``code`` reward with
    ``template="f = lambda x: {response}"`` scores alike."""

    name: ClassVar[str] = "expr"
    description: ClassVar[str] = "write a Python expression in x that passes asserts: 'add 3>' -> 'x+3'"

    ops: tuple[str, ...] = ("add", "sub", "mul")
    high: int = 9

    TEMPLATE: ClassVar[str] = "f = lambda x: {response}"

    def __post_init__(self) -> None:
        self._check(
            "ops", bool(self.ops) and set(self.ops) <= set(_EXPR_TESTS), f"a non-empty subset of {sorted(_EXPR_TESTS)}"
        )
        self._check("high", 1 <= self.high <= 9, "between 1 and 9")

    def max_new_tokens(self) -> int:
        return 3 + 2

    def sample(self, rng: random.Random) -> Prompt:
        op, k = rng.choice(self.ops), rng.randint(1, self.high)
        tests = ["assert " + t.format(k=k) for t in _EXPR_TESTS[op]]
        return Prompt(text=f"{op} {k}>", answer=f"x{_EXPR_OPS[op]}{k}", meta={"tests": tests})

    def wrong_answer(self, prompt: Prompt, rng: random.Random) -> str:
        """The right operation with another constant (1 .. 9)."""
        k = int(prompt.answer[2:])
        return f"{prompt.answer[:2]}{rng.choice([j for j in range(1, 10) if j != k])}"

    def score(self, prompt: Prompt, response: str) -> float:
        """The fraction of the prompt's asserts the response passes, run in the sandbox."""
        from flowrl.tasks import code_tests, sandbox

        tests = list(prompt.meta.get("tests", ()))
        if not tests:
            return char_score(prompt.answer, response)
        code = self.TEMPLATE.format(response=sandbox.code_of(response))  # a fenced answer as the code reward reads it
        parsed = code_tests.parse_tests(tests, where=f"expr prompt {prompt.text!r}")
        verdict = code_tests.judge(code, parsed, sandbox.Limits(wall_s=5.0, cpu_s=2))
        return sum(verdict.passed) / len(tests)


BUILTIN_TASKS: dict[str, type[TaskBase]] = {"add": Add, "copy": Copy, "repeat": Repeat, "calc": Calc, "expr": Expr}


def make_task(
    name: str,
    options: Mapping[str, Any] | None = None,
    registry: Mapping[str, type] | None = None,
) -> Any:
    """Build task ``name`` from ``options``; raise TaskError naming the task and option.

    ``registry`` maps names to task classes (default :data:`BUILTIN_TASKS`).
    """
    tasks: Mapping[str, type] = BUILTIN_TASKS if registry is None else registry
    cls = tasks.get(name)
    if cls is None:
        known = ", ".join(sorted(tasks))
        raise TaskError(f"unknown task {name!r}; known tasks: {known}")
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise TaskError(f"task {name!r}: options must be a mapping, got {type(options).__name__}")
    try:
        return msgspec.convert(dict(options), cls)
    except msgspec.ValidationError as e:
        message = str(e).replace("`$.", "`")
        fields = ", ".join(f.name for f in msgspec.structs.fields(cls)) if _is_struct(cls) else ""
        hint = f" (options: {fields})" if fields else ""
        raise TaskError(f"task {name!r}: bad option: {message}{hint}") from None


def task_for(cfg: Any, registry: Mapping[str, type] | None = None) -> Any:
    """The task of run config ``cfg``: a task class with a ``from_config(cfg)`` classmethod (the
    ``data`` task, which reads the run's files and tokenizer) is built from the whole config, any
    other from ``cfg.task_options`` (:func:`make_task`)."""
    tasks: Mapping[str, type] = BUILTIN_TASKS if registry is None else registry
    cls = tasks.get(cfg.task)
    if cls is not None and hasattr(cls, "from_config"):
        return cls.from_config(cfg)
    return make_task(cfg.task, cfg.task_options, registry=tasks)


def _is_struct(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, msgspec.Struct)


def length_stats(task: Task, rng: random.Random, n: int = 2000) -> dict[str, float]:
    """Answer-length statistics over ``n`` drawn prompts.

    Keys: ``p50``, ``p90``, ``max`` (nearest-rank, in characters = tokens), ``mean``,
    and ``prompt_max`` (the longest prompt).
    """
    if n < 1:
        raise TaskError(f"task {task.name!r}: length_stats needs n >= 1, got {n}")
    drawn = task.prompts(rng, n)
    lengths = sorted(len(p.answer) for p in drawn)

    def rank(q: float) -> int:
        return lengths[max(math.ceil(q * n) - 1, 0)]

    return {
        "p50": rank(0.5),
        "p90": rank(0.9),
        "max": lengths[-1],
        "mean": sum(lengths) / n,
        "prompt_max": max(len(p.text) for p in drawn),
    }
