"""Verifiers score a response against a dataset row's ground truth: `math` (final answer, numeric
and symbolic equivalence; math-verify where it imports, else sympy), `exact` and `regex`. An
unreadable ground truth scores 0 and is counted, never fatal."""

from __future__ import annotations

import threading

import pytest

from flowrl.errors import ConfigError
from flowrl.tasks import verifiers as v

HAS_MATH_VERIFY = v._math_verify() is not None


@pytest.fixture(params=["math_verify", "sympy"])
def backend(request, monkeypatch):
    """Each math case runs on both paths: math-verify and the sympy fallback."""
    if request.param == "math_verify":
        if not HAS_MATH_VERIFY:
            pytest.skip("math-verify is not installed")
    else:
        monkeypatch.setattr(v, "_math_verify", lambda: None)
    return request.param


def unparsed_during(fn):
    before = v.counts()
    result = fn()
    after = v.counts()
    return result, after.unparsed - before.unparsed, after.calls - before.calls


# ------------------------------------------------------------------ ground truth


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
        ("He saves 1,000 + 234 = <<1000+234=1234>>1,234 dollars.\n#### 1,234", "1234"),
        ("#### -5", "-5"),
        ("12,345,678", "12345678"),
        (42, "42"),
        (3.0, "3"),
        (0.25, "0.25"),
        (None, ""),
        ("  7 ", "7"),
        ("(1,2)", "(1,2)"),  # a tuple, not a thousands separator
    ],
)
def test_ground_truth_of_an_answer_column(raw, want):
    assert v.ground_truth(raw) == want


def test_ground_truth_keeps_a_regex_as_written():
    assert v.ground_truth(r"\d{1,3}(,\d{3})* #### x", kind="regex") == r"\d{1,3}(,\d{3})* #### x"


# ------------------------------------------------------------------ the final answer


@pytest.mark.parametrize(
    ("response", "want"),
    [
        (r"first \boxed{3}, then \boxed{\frac{\sqrt{2}}{2}} done", r"\frac{\sqrt{2}}{2}"),
        (r"so \boxed{\{1, \{2\}\}}", r"\{1, \{2\}\}"),
        (r"\boxed{a_{n+1}^{2}}", r"a_{n+1}^{2}"),
        ("work 3 + 4 = 7\n#### 7\nmore text", "7"),
        ("The answer is 42.", "42"),
        ("Thus the final answer is: 3.5. Done", "3.5"),
        ("I got 3 apples, then 12 more: 15 in all", "15"),
        ("It is -3", "-3"),
        ("2 minus 5 gives -3.25 here", "-3.25"),
        ("nothing numeric", None),
    ],
)
def test_the_final_answer_of_a_response(response, want):
    assert v.final_answer(response) == want


# ------------------------------------------------------------------ math

RIGHT = [
    (r"so the result is \boxed{42}", "42"),
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{0.50}", "1/2"),
    ("The answer is 0.5", r"\frac{1}{2}"),
    ("The answer is 42.", "42"),
    ("The answer is 42 apples.", "42"),
    ("Natalia sold 72 clips.\n#### 72", "reasoning <<48/2=24>>\n#### 72"),
    ("#### 1,234", "He earned 1,234 dollars.\n#### 1,234"),
    ("it costs $1,000.", "1000"),
    ("The answer is -7", "-7"),
    ("The temperature drops to -3.25 degrees", "-3.25"),
    ("The answer is 50%", "50"),
    ("The answer is 0.5", "50%"),
    (r"\boxed{1+x}", "x+1"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"\boxed{\dfrac{3}{4}}", "0.75"),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{\sqrt2}{2}"),
    ("we get 3/4 of the cake", "0.75"),
    (r"\boxed{5}", r"$5$"),
]
WRONG = [
    (r"\boxed{41}", "42"),
    ("The answer is 0.33", "1/3"),
    (r"\boxed{x+2}", "x+1"),
    ("The answer is -7", "7"),
    ("no number at all", "7"),
    (r"first \boxed{42}, then on reflection \boxed{41}", "42"),  # the last box counts
]


@pytest.mark.parametrize(("response", "answer"), RIGHT)
def test_math_accepts_equivalent_answers(backend, response, answer):
    score, unparsed, calls = unparsed_during(lambda: v.verify("math", response, answer))
    assert score == 1.0
    assert (unparsed, calls) == (0, 1)


@pytest.mark.parametrize(("response", "answer"), WRONG)
def test_math_scores_wrong_answers_zero(backend, response, answer):
    score, unparsed, _ = unparsed_during(lambda: v.verify("math", response, answer))
    assert score == 0.0
    assert unparsed == 0  # a wrong or missing answer is not an unreadable ground truth


@pytest.mark.parametrize("answer", ["blue", "True", "", "two", r"\frac{1}{", "x" * (v.MAX_ANSWER_CHARS + 1)])
def test_math_counts_a_ground_truth_it_cannot_read_and_scores_it_zero(backend, answer):
    score, unparsed, calls = unparsed_during(lambda: v.verify("math", f"the answer is {answer}", answer))
    assert score == 0.0
    assert (unparsed, calls) == (1, 1)


def test_math_accepts_a_set_in_any_order_with_math_verify():
    if not HAS_MATH_VERIFY:
        pytest.skip("math-verify is not installed")
    assert v.verify("math", r"\boxed{\{2, 1\}}", r"\{1,2\}") == 1.0


def test_math_runs_in_worker_threads(backend):
    """math-verify's signal-based timeouts only work in the main thread: off it they are off."""
    results: list[object] = []

    def work():
        try:
            results.append((v.verify("math", r"\boxed{\frac{1}{2}}", "0.5"), v.verify("math", "#### 3", "4")))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert results == [(1.0, 0.0)]


def test_counts_are_per_thread():
    seen: list[v.VerifyCounts] = []
    before = v.counts()
    thread = threading.Thread(target=lambda: (v.verify("regex", "x", "("), seen.append(v.counts())))
    thread.start()
    thread.join(60)
    assert seen[0].calls == 1 and seen[0].unparsed == 1
    assert v.counts() == before  # the worker's count is its own


def test_the_sympy_fallback_never_evaluates_python():
    for text in ["__import__('os').system('true')", "().__class__", "a.b", "lambda: 1", "x**2**3", "2**99999"]:
        assert v._sympy_values(text) == []


# ------------------------------------------------------------------ exact, regex


@pytest.mark.parametrize(
    ("response", "answer", "want"),
    [
        ("Paris", "paris", 1.0),
        ("  Paris.  ", "Paris", 1.0),
        ("New   York\ncity", "new york city", 1.0),
        ("STRASSE", "straße", 1.0),  # casefolded
        ("1,234", "1234", 1.0),
        ("Paris, France", "Paris", 0.0),
        ("", "Paris", 0.0),
    ],
)
def test_exact_compares_normalised_strings(response, answer, want):
    assert v.verify("exact", response, answer) == want


def test_regex_searches_the_response():
    assert v.verify("regex", "The capital is Paris.", r"\bParis\b") == 1.0
    assert v.verify("regex", "The capital is Lyon.", r"\bParis\b") == 0.0
    assert v.verify("regex", "answer: 1,234", r"^answer: \d{1,3}(,\d{3})*$") == 1.0


def test_a_bad_pattern_is_counted_and_scores_zero():
    score, unparsed, _ = unparsed_during(lambda: v.verify("regex", "anything", "(unclosed"))
    assert (score, unparsed) == (0.0, 1)


# ------------------------------------------------------------------ the registry


def test_verifiers_are_named_in_one_table():
    assert set(v.VERIFIERS) == {"math", "exact", "regex"}
    assert v.VERIFIERS["exact"]("a", "A") == 1.0


@pytest.mark.parametrize("kind", ["maths", "", "EXACT2", None])
def test_an_unknown_verifier_is_a_config_error_naming_the_field_and_the_known_ones(kind):
    with pytest.raises(ConfigError) as err:
        v.verify(kind, "1", "1")
    message = str(err.value)
    assert "data.verifier" in message and all(name in message for name in ("math", "exact", "regex"))
    if kind == "maths":
        assert "Did you mean 'math'?" in message


def test_math_leaves_a_pending_timer_alone():
    """math-verify's alarm would replace a caller's timer and cancel it: with one pending, it is off."""
    import signal

    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        assert v._timeout() is None
        assert v.verify("math", r"\boxed{\frac{1}{2}}", "0.5") == 1.0
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0  # still pending
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert v._timeout() == v.MATH_VERIFY_TIMEOUT_S and not fired


@pytest.mark.parametrize(
    "response",
    ["The answer is 18 dollars.", "The answer is **18**.", "#### 18 dollars", "So the answer is 18, since 9*2=18."],
)
def test_the_math_verifier_reads_a_stated_number_followed_by_words(response):
    assert v.verify("math", response, "18") == 1.0
