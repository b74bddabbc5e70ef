"""Verifiers: rule-based rewards of a response against a dataset row's ground truth.

A dataset task (``data.verifier``) scores each response with one of:

- ``math``: the response's final answer — the last ``\\boxed{...}`` (nested braces), else ``#### X``,
  else "the answer is X", else the last number — against the ground truth, equal when numerically
  (``1/2`` == ``0.5`` == ``0.50``, ``$1,000`` == ``1000``, ``50%`` == ``50`` == ``0.5``) or
  symbolically (``x+1`` == ``1+x``) equivalent. It uses the ``math-verify`` package where it
  imports, else sympy (a whitelisted expression syntax, parsed by ``parse_expr``).
- ``exact``: equal after normalising both (strip, collapse whitespace, casefold, no trailing period,
  no thousands separators).
- ``regex``: the row's answer is a regular expression; 1.0 when ``re.search(answer, response)`` matches.

Each returns a reward in [0, 1]. A ground truth the verifier cannot read (prose for ``math``, a bad
pattern for ``regex``) is not fatal: it scores 0 and is counted (:func:`counts`, per thread), so the
task can report it as the metric ``unparsed_answers``.

Reward functions may run in worker threads: math-verify's timeouts use ``signal.alarm``, which
works only in the main thread, so elsewhere (and while another timer is pending) they are off;
answers longer than :data:`MAX_ANSWER_CHARS` are not parsed, which bounds the work instead.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flowrl.errors import ConfigError, did_you_mean

#: Final answers and ground truths longer than this are not parsed (they score 0).
MAX_ANSWER_CHARS = 400
#: math-verify's per-operation timeout (seconds) in the main thread; off elsewhere (signal.alarm).
MATH_VERIFY_TIMEOUT_S = 5


# ------------------------------------------------------------------ counting


class _Counts(threading.local):
    calls = 0
    unparsed = 0


_COUNTS = _Counts()


@dataclass(frozen=True)
class VerifyCounts:
    """Verifier calls and unparseable ground truths in the calling thread since it started; a
    caller takes the difference of two readings around its scoring."""

    calls: int
    unparsed: int


def counts() -> VerifyCounts:
    """This thread's verifier calls and unparseable ground truths so far."""
    return VerifyCounts(calls=_COUNTS.calls, unparsed=_COUNTS.unparsed)


def _unparsed() -> float:
    """Count a ground truth the verifier cannot read; its reward is 0."""
    _COUNTS.unparsed += 1
    return 0.0


# ------------------------------------------------------------------ ground truth

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _no_thousands(text: str) -> str:
    """``1,234,567`` -> ``1234567`` (a comma between digits followed by exactly three digits)."""
    return _THOUSANDS.sub("", text)


def ground_truth(raw: Any, kind: str = "math") -> str:
    """A dataset's answer column as the ground truth a verifier compares with: GSM8K's
    ``"reasoning ... #### 1,234"`` -> ``"1234"`` (the text after the last ``####``, thousands
    separators dropped), numbers as text (``3.0`` -> ``"3"``), None -> ``""``. For ``regex`` the
    answer is a pattern and is kept as written."""
    if raw is None:
        return ""
    if isinstance(raw, bool):
        return str(raw)
    if isinstance(raw, int):
        return str(raw)
    if isinstance(raw, float):
        if math.isfinite(raw) and raw == int(raw):
            return str(int(raw))
        return repr(raw)
    text = str(raw)
    if kind == "regex":
        return text
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    return _no_thousands(text.strip())


# ------------------------------------------------------------------ the response's final answer

_NUMBER = (
    r"(?:(?<![\w)\]])-)?"  # a sign, not a minus between two terms
    r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?"  # 1,234.5 or 3/4
    r"(?:\s*\\?%)?"
    r"|(?:(?<![\w)\]])-)?\.\d+"  # .5
)
_NUMBER_RE = re.compile(_NUMBER)
_ANSWER_IS = re.compile(r"(?:final\s+)?answer\s+is\s*:?\s*(.*)", re.IGNORECASE)
_HASHES = re.compile(r"####\s*(.*)")
_SENTENCE_END = re.compile(r"^(.*?)(?:\.(?=\s|$)|$)", re.DOTALL)


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """The contents of the brace group opening at ``text[start]`` (nested braces balanced), and the
    index after it; None when it does not close."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\":  # an escaped character (\\{ is a literal brace)
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, with nested braces;
    ``\\boxed 5`` gives ``5``; None when there is none."""
    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)\b\s*", text))):
        end = match.end()
        if end < len(text) and text[end] == "{":
            inner = _braced(text, end)
            if inner is not None:
                return inner[0].strip()
        else:
            word = re.match(r"[^\s$]+", text[end:])
            if word:
                return word.group(0)
    return None


def final_answer(response: str) -> str | None:
    """The final answer a response states: the last ``\\boxed{...}``, else the text after the last
    ``####``, else after the last "the answer is" (to the end of its sentence), else the last
    number; None when it states none."""
    boxed = last_boxed(response)
    if boxed:
        return boxed
    for pattern in (_HASHES, _ANSWER_IS):
        hits = [m.group(1) for m in pattern.finditer(response)]
        if hits:
            line = hits[-1].strip()
            sentence = _SENTENCE_END.match(line)
            candidate = (sentence.group(1) if sentence else line).strip().rstrip(".").strip()
            candidate = _before_words(candidate.replace("**", "").replace("__", "").strip())
            if candidate:
                return candidate
    numbers = _NUMBER_RE.findall(response)
    return numbers[-1].strip() if numbers else None


# ------------------------------------------------------------------ math

#: Words a mathematical answer may hold (besides LaTeX commands and one-letter symbols).
_MATH_WORDS = frozenset(
    "sin cos tan cot sec csc arcsin arccos arctan sinh cosh tanh log ln exp sqrt pi inf infty oo "
    "mod gcd lcm min max abs det".split()
)


def _clean(text: str) -> str:
    """Delimiters and currency off a final answer: ``$...$``, ``\\(...\\)``, ``\\$``, thousands
    separators, a trailing period."""
    text = text.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : -len(right)].strip()
    text = text.replace("\\$", "").replace("$", "")
    return _no_thousands(text).strip()


def _before_words(text: str) -> str:
    """A stated answer without the words after it: ``18 dollars`` -> ``18``, ``18, since 9*2=18`` ->
    ``18``, ``\\frac{1}{2} cup`` -> ``\\frac{1}{2}``; text that opens with words stays (the verifier
    reads it or calls it prose)."""
    bare = re.sub(r"\\[a-zA-Z]+", lambda m: " " * len(m.group(0)), text)  # LaTeX commands are not words
    words = [m for m in re.finditer(r"[A-Za-z]{2,}", bare) if m.group(0).lower() not in _MATH_WORDS]
    if not words or words[0].start() == 0:
        return text
    lead = text[: words[0].start()].strip().rstrip(",;:").strip()
    return lead if any(c.isdigit() or c == "\\" for c in lead) else text


def _is_prose(text: str) -> bool:
    """Words, not mathematics: no digit, and a word of two letters or more that is no function name
    (``blue``, ``True``; not ``x+1``, ``\\sqrt{2}``, ``sin(x)``)."""
    if any(c.isdigit() for c in text):
        return False
    bare = re.sub(r"\\[a-zA-Z]+", " ", text)
    return any(w.lower() not in _MATH_WORDS for w in re.findall(r"[A-Za-z]{2,}", bare))


@functools.lru_cache(maxsize=1)
def _math_verify() -> Any:
    """The math_verify module, or None where it does not import (sympy is used then)."""
    try:
        import math_verify
    except Exception:  # not installed, or a broken install: fall back to sympy
        return None

    class _QuietTimeoutWarning(logging.Filter):  # we switch the signal timeout off in threads on purpose
        def filter(self, record: logging.LogRecord) -> bool:
            return "Timeout is disabled" not in record.getMessage()

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_QuietTimeoutWarning())
    return math_verify


def _timeout() -> int | None:
    """math-verify's signal-based timeout: only in the main thread (signal.alarm fails elsewhere), and
    only while no other timer is pending (its alarm would replace and then cancel that one)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return None
    if not hasattr(signal, "getitimer") or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None
    return MATH_VERIFY_TIMEOUT_S


def _mv_parse(mv: Any, text: str) -> list[Any]:
    """math-verify's parse of one answer (wrapped in ``\\boxed{}``, so LaTeX and plain forms both
    parse); only the parsed (sympy) objects."""
    from sympy import Basic, MatrixBase

    parsed = mv.parse(f"\\boxed{{{text}}}", parsing_timeout=_timeout())
    return [p for p in parsed if isinstance(p, (Basic, MatrixBase))]


def _math_score(response: str, answer: str) -> float:
    gold_text = _clean(ground_truth(answer))
    boxed = last_boxed(gold_text)
    gold_text = _clean(boxed) if boxed is not None else gold_text
    if not gold_text or len(gold_text) > MAX_ANSWER_CHARS or _is_prose(gold_text):
        return _unparsed()
    mv = _math_verify()
    if mv is not None:
        gold = _mv_parse(mv, gold_text)
        if not gold:
            return _unparsed()
        said = final_answer(response)
        if said is None or len(said) > MAX_ANSWER_CHARS:
            return 0.0
        pred = _mv_parse(mv, _clean(said))
        return 1.0 if pred and mv.verify(gold, pred, timeout_seconds=_timeout()) else 0.0
    gold_values = _sympy_values(gold_text)
    if not gold_values:
        return _unparsed()
    said = final_answer(response)
    if said is None or len(said) > MAX_ANSWER_CHARS:
        return 0.0
    pred_values = _sympy_values(_clean(said))
    if not pred_values:  # "42 apples": the leading number
        lead = _NUMBER_RE.match(_clean(said))
        pred_values = _sympy_values(lead.group(0)) if lead else []
    return 1.0 if any(_sympy_equal(g, p) for g in gold_values for p in pred_values) else 0.0


# ------------------------------------------------------------------ the sympy fallback

#: Names a whitelisted expression may use (one-letter names are symbols).
_SYMPY_NAMES = ("sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp", "oo")
_SAFE_TEXT = re.compile(r"^[0-9A-Za-z+\-*/().\s]*$")


def _latex_to_plain(text: str) -> str | None:
    """A LaTeX answer in plain expression syntax (``\\frac{1}{2}`` -> ``((1)/(2))``), or None when it
    uses something the fallback does not read."""
    text = re.sub(r"\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|\\mbox\{[^{}]*\}", "", text)  # units
    text = re.sub(r"\\(?:left|right|displaystyle|!|,|;|:| )", "", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = text.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/").replace("\\pi", " pi ")
    text = text.replace("\\infty", " oo ")
    text = re.sub(r"\\frac\s*(\d)\s*(\d)", r"((\1)/(\2))", text)  # \frac12
    text = re.sub(r"\\sqrt\s*(\d|[A-Za-z](?![A-Za-z]))", r"sqrt(\1)", text)  # \sqrt2
    while True:
        m = re.search(r"\\(frac|sqrt)\s*", text)
        if m is None:
            break
        first = _braced(text, m.end()) if m.end() < len(text) and text[m.end()] == "{" else None
        if first is None:
            return None
        if m.group(1) == "sqrt":
            text = f"{text[: m.start()]}sqrt({first[0]}){text[first[1] :]}"
            continue
        second = _braced(text, first[1]) if first[1] < len(text) and text[first[1]] == "{" else None
        if second is None:
            return None
        text = f"{text[: m.start()]}(({first[0]})/({second[0]})){text[second[1] :]}"
    if "\\" in text:
        return None
    return text.replace("{", "(").replace("}", ")").replace("^", "**")


def _sympy_values(text: str) -> list[Any]:
    """The values an answer may mean, parsed with sympy from a whitelisted syntax: one, or for a
    percentage both the number and its fraction (``50%`` -> 50 and 1/2). Empty when it does not parse."""
    text = _clean(text)
    percent = bool(re.search(r"\\?%\s*$", text))
    text = re.sub(r"\\?%\s*$", "", text)
    text = re.sub(r"^[A-Za-z]\s*=\s*", "", text)  # x = 3
    plain = _latex_to_plain(text)
    if plain is None:
        return []
    value = _parse_plain(plain.strip())
    if value is None:
        return []
    return [value, value / 100] if percent else [value]


def _parse_plain(text: str) -> Any:
    """``text`` as a sympy expression, when it is made only of numbers, one-letter symbols, the
    names in :data:`_SYMPY_NAMES`, operators and parentheses (what reaches sympy's parser — which
    evaluates its translation — is checked first), with at most one power; else None."""
    if not text or len(text) > MAX_ANSWER_CHARS or not _SAFE_TEXT.match(text):
        return None
    words = re.findall(r"[A-Za-z]+", text)
    if any(len(w) > 1 and w not in _SYMPY_NAMES for w in words) or text.count("**") > 1:
        return None
    if re.search(r"\*\*\s*\(?\s*\d{4,}", text):  # 2**100000: too large to compare
        return None
    import sympy
    from sympy.parsing.sympy_parser import (
        auto_number,
        factorial_notation,
        implicit_multiplication,
        parse_expr,
    )

    names: dict[str, Any] = {
        "Integer": sympy.Integer,
        "Float": sympy.Float,
        "Rational": sympy.Rational,
        "Symbol": sympy.Symbol,
        "sqrt": sympy.sqrt,
        "pi": sympy.pi,
        "sin": sympy.sin,
        "cos": sympy.cos,
        "tan": sympy.tan,
        "log": sympy.log,
        "ln": sympy.log,
        "exp": sympy.exp,
        "oo": sympy.oo,
        "__builtins__": {},
    }
    symbols = {w: sympy.Symbol(w) for w in words if len(w) == 1}
    try:
        return parse_expr(
            text,
            local_dict=symbols,
            global_dict=names,
            transformations=(auto_number, factorial_notation, implicit_multiplication),
        )
    except Exception:  # SyntaxError, TypeError, TokenError, ...: not an answer sympy reads
        return None


def _sympy_equal(a: Any, b: Any) -> bool:
    """Numbers equal to a relative 1e-6; expressions whose difference simplifies to 0."""
    import sympy

    try:
        if a.is_number and b.is_number:
            x, y = complex(sympy.N(a)), complex(sympy.N(b))
            return abs(x - y) <= 1e-6 * max(1.0, abs(y))
        diff = sympy.simplify(sympy.nsimplify(a - b, rational=True))
        return bool(diff == 0)
    except Exception:  # a comparison sympy cannot decide is not a match
        return False


# ------------------------------------------------------------------ exact, regex


def vote_key(kind: str | None, response: str) -> str:
    """The answer a majority vote counts for ``response``, as verifier ``kind`` reads it: ``math``'s
    final answer without its delimiters ("$18." is "18"), ``exact``'s normalised text ("1,000." is
    "1000"); for others (and tasks without a verifier) the text with whitespace collapsed, casefolded."""
    if kind == "math":
        found = final_answer(response)
        return response.strip() if found is None else (_clean(found) or found)
    if kind == "exact":
        return normalise(response)
    return " ".join(response.split()).casefold()


def normalise(text: str) -> str:
    """How ``exact`` compares: stripped, whitespace collapsed, casefolded, no trailing period, no
    thousands separators."""
    text = " ".join(str(text).split()).casefold()
    return _no_thousands(text.rstrip(".").rstrip())


def _exact_score(response: str, answer: str) -> float:
    return 1.0 if normalise(response) == normalise(answer) else 0.0


@functools.lru_cache(maxsize=4096)
def _pattern(answer: str) -> re.Pattern[str] | None:
    try:
        return re.compile(answer)
    except (re.error, RecursionError, OverflowError):
        return None


def _regex_score(response: str, answer: str) -> float:
    pattern = _pattern(answer)
    if pattern is None:
        return _unparsed()
    return 1.0 if pattern.search(response) else 0.0


# ------------------------------------------------------------------ the registry

VERIFIERS: dict[str, Callable[[str, str], float]] = {
    "math": _math_score,
    "exact": _exact_score,
    "regex": _regex_score,
}


def verifier(kind: str) -> Callable[[str, str], float]:
    """The verifier ``kind`` names (``data.verifier``); a ConfigError naming the known ones otherwise."""
    fn = VERIFIERS.get(kind) if isinstance(kind, str) else None
    if fn is None:
        hint = did_you_mean(str(kind), list(VERIFIERS))
        raise ConfigError(
            f"data.verifier = {kind!r} is not a verifier; use one of {', '.join(sorted(VERIFIERS))}.{hint}"
        )
    return fn


def verify(kind: str, response: str, answer: str) -> float:
    """The reward in [0, 1] of ``response`` against the ground truth ``answer`` (see
    :func:`ground_truth`) by verifier ``kind`` (``math``, ``exact`` or ``regex``). An unparseable
    ground truth scores 0 and is counted (:func:`counts`)."""
    fn = verifier(kind)
    _COUNTS.calls += 1
    return float(fn(str(response), str(answer)))
