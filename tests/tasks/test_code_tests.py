"""Code judged by its outputs (flowrl/tasks/code_tests.py): tests are parsed, the sandboxed code only
computes, and the verdict is made here -- for asserts of MBPP and HumanEval form, property asserts,
stdin/stdout tests, and (explicitly forgeable) asserts run inside the sandbox."""

from __future__ import annotations

import random
import shutil

import pytest

from flowrl.algorithms.ops import code_reward
from flowrl.contract.data import Prompt
from flowrl.tasks.code_tests import Call, TestError, groups, judge, parse_assert, parse_tests, run_asserts
from flowrl.tasks.sandbox import Limits, code_of

LIMITS = Limits(wall_s=3, cpu_s=2)
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def test_an_assert_is_parsed_into_the_calls_the_sandbox_makes():
    test = parse_assert("assert f(1) - f(0) == 1", where="p")
    assert test.calls == (Call("f", "(1, )", "{}"), Call("f", "(0, )", "{}"))
    mbpp = parse_assert("assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)", where="p")
    assert mbpp.calls == (Call("similar_elements", "((3, 4, 5, 6), (5, 7, 4, 10), )", "{}"),)
    keyword = parse_assert("assert math.isclose(area(r=2), 12.566, rel_tol=0.001)", where="p")
    assert keyword.calls == (Call("area", "()", "{'r': 2}"),)


@pytest.mark.parametrize(
    ("test", "why"),
    [
        ("for i in range(3): assert f(i) == i", "not one assert"),
        ("assert f(g(1)) == 2", "an argument that calls a function under test"),
        ("assert f(x) == 2", "calls a function under test"),
        ("assert __import__('os').system('id') == 0", "call of"),
        ("assert f(1).real == 1", "Attribute"),
        ("assert (lambda: f(1))() == 1", "call of"),
        ("assert f(1) is 1", "'is' compares only"),
        ("assert f(1) ==", "not Python"),
        ("assert math.system(1)", "math.system"),
        ("assert f(*[1]) == 1", "'*'"),
        ("assert f(1) == next(iter([1]))", "next\\(...\\) is a built-in function"),
        ("assert print(f(1)) is None", "print\\(...\\) is a built-in function"),
        ("assert f(" * 2000 + ")" * 2000, "nested too deeply|not Python"),
    ],
)
def test_an_assert_that_cannot_be_judged_outside_is_refused_naming_it(test, why):
    with pytest.raises(TestError, match=why) as err:
        parse_assert(test, where="prompt 'p' test 3")
    assert "prompt 'p' test 3" in str(err.value)


def test_tests_mixing_kinds_or_shaped_wrong_are_refused_naming_the_prompt():
    with pytest.raises(TestError, match="mixes asserts"):
        parse_tests(["assert f(1) == 1", {"input": "", "output": ""}], where="prompt 'p'")
    with pytest.raises(TestError, match="test 0: .*exactly 'input' and 'output'"):
        parse_tests([{"input": "1"}], where="prompt 'p'")
    with pytest.raises(TestError, match="no tests"):
        parse_tests([], where="prompt 'p'")


def test_mbpp_asserts_are_judged_by_value_outside_the_sandbox():
    code = "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n"
    tests = parse_tests(
        [
            "assert similar_elements((3, 4, 5, 6), (5, 7, 4, 10)) == (4, 5)",
            "assert set(similar_elements((1, 2, 3, 4), (5, 4, 3, 7))) == set([3, 4])",
            "assert similar_elements((11, 12), (17, 13)) == ()",
            "assert len(similar_elements((1,), (1,))) == 1 and similar_elements((1,), (1,))[0] == 1",
            "assert similar_elements((1,), (2,)) != [], 'a list is not a tuple'",
            "assert not similar_elements((1,), (2,))",
        ],
        where="mbpp 2",
    )
    assert judge(code, tests, LIMITS).passed == (True,) * 6
    wrong = judge("def similar_elements(a, b):\n    return list(set(a) & set(b))\n", tests, LIMITS)
    assert wrong.passed == (False, True, False, True, False, True)  # a list where a tuple is expected


def test_humaneval_candidate_without_an_entry_point_is_refused_not_failed_for_every_response():
    prompt = Prompt(text="p", answer="", meta={"tests": ["assert candidate(2) == 4"]})
    with pytest.raises(TestError, match="names no entry point"):
        code_reward([prompt], ["def double(x):\n    return 2 * x"], None)


def test_humaneval_candidate_is_the_entry_point():
    prompt = Prompt(text="p", answer="", meta={"tests": ["assert candidate(2) == 4"], "entry_point": "double"})
    scores, _ = code_reward(
        [prompt, prompt], ["def double(x):\n    return 2 * x", "def double(x):\n    return x"], None
    )
    assert scores == [1.0, 0.0]


def test_floats_sets_dicts_bytes_and_none_come_back_as_plain_values():
    code = (
        "def f(k):\n    return {'nan': float('nan'), 'set': {1, 2}, 'dict': {'a': (1, 2)}, 'bytes': b'ab', "
        "'none': None, 'float': 0.1 + 0.2}[k]"
    )
    tests = parse_tests(
        [
            "assert f('nan') != f('nan')",
            "assert f('set') == {2, 1}",
            "assert f('dict') == {'a': (1, 2)}",
            "assert f('bytes') == b'ab'",
            "assert f('none') is None",
            "assert math.isclose(f('float'), 0.3)",
            "assert f('float') == 0.3",
        ],
        where="p",
    )
    assert judge(code, tests, LIMITS).passed == (True,) * 6 + (False,)


def test_stdin_stdout_tests_compare_what_the_program_prints():
    tests = parse_tests(
        [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2", "output": "4   \n\n"}, {"input": "0 0", "output": "1"}],
        where="p",
    )
    code = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)"
    assert judge(code, tests, LIMITS).passed == (True, True, False)
    assert judge("print(input())\nraise SystemExit(3)", tests, LIMITS).passed == (False,) * 3  # a failing exit
    assert judge("def broken(:", tests, LIMITS).passed == (False,) * 3


@pytest.mark.slow
def test_a_slow_test_fails_alone_and_the_ones_before_it_keep_their_verdict():
    tests = parse_tests(["assert f(1) == 1", "assert f(2) == 2", "assert f(0) == 0"], where="p")
    verdict = judge("def f(x):\n    while x == 0:\n        pass\n    return x", tests, Limits(wall_s=2, cpu_s=1))
    assert verdict.passed == (True, True, False) and verdict.status in ("timeout", "crashed")


def test_an_expression_over_returned_values_cannot_build_something_huge():
    tests = parse_tests(["assert f(1) * 10**9 == 'x'", "assert 2 ** f(2) > 0"], where="p")
    assert judge("f = lambda x: 'ab' if x == 1 else 10", tests, LIMITS).passed == (False, True)
    assert judge("f = lambda x: 'ab' if x == 1 else 10**8", tests, LIMITS).passed == (False, False)  # 2**10**8


def test_the_forgeable_option_runs_asserts_in_the_sandbox_and_says_so():
    asserts = ["assert f(1) == 1", "assert [f(i) for i in range(3)] == [0, 1, 2]", "assert f(2) == 3"]
    verdict = run_asserts("def f(x):\n    return x", asserts, LIMITS)
    assert verdict.passed == (True, True, False) and verdict.status == "ok"
    early = run_asserts("import os\nos._exit(0)", ["assert False"], LIMITS)
    assert early.passed == (False,) and early.status == "forged"
    prompt = Prompt(text="p", answer="", meta={"tests": ["for i in range(3): assert f(i) == i"]})
    with pytest.raises(TestError, match="forgeable=True"):
        code_reward([prompt], ["f = lambda x: x"], None)
    scores, _ = code_reward([prompt], ["f = lambda x: x"], None, forgeable=True)
    assert scores == [1.0]


def test_the_code_reward_scores_the_fraction_of_tests_each_response_passes():
    prompt = Prompt(text="double", answer="", meta={"tests": "assert f(1) == 2\nassert f(2) == 4"})
    responses = ["x * 2", "```python\nx + 1\n```", "while True: pass"]  # the last: not an expression
    scores, metrics = code_reward([prompt] * 3, responses, None, template="f = lambda x: {response}", wall_s=2.0)
    assert scores == [1.0, 0.5, 0.0]
    assert metrics == {"all_passed": round(1 / 3, 4), "timeouts": 0, "crashed": 0, "forged": 0, "sandbox_runs": 3}


def test_a_prompt_without_tests_is_an_error_naming_it():
    with pytest.raises(ValueError, match="has no tests"):
        code_reward([Prompt(text="p", answer="")], ["1"], None)


def test_the_code_of_a_response_is_its_fenced_block():
    assert code_of("x = 1") == "x = 1"
    assert code_of("Here:\n```python\ndef f():\n    return 1\n```\nDone.") == "def f():\n    return 1\n"


def test_the_code_reward_scores_expr_answers_in_the_sandbox():
    from flowrl.tasks.builtin import Expr

    task = Expr()
    p = task.sample(random.Random(0))
    responses = [p.answer, "x", "import os; os._exit(0)", "(lambda: [0]*10**10)()"]
    scores, metrics = code_reward([p] * 4, responses, task, template=task.TEMPLATE)
    assert scores[0] == 1.0 and 0 < scores[1] < 1 and scores[2] == 0.0 and scores[3] == 0.0
    assert metrics["sandbox_runs"] == 4 and metrics["all_passed"] == 0.25
    assert task.score(p, p.answer) == 1.0


def test_the_expr_task_scores_a_fenced_answer_as_the_code_reward_does():
    from flowrl.tasks.builtin import Expr

    task = Expr(ops=("add",))
    p = task.sample(random.Random(1))
    fenced = f"```python\n{p.answer}\n```"
    scores, _ = code_reward([p], [fenced], task, template=task.TEMPLATE)
    assert scores == [1.0]
    assert task.score(p, fenced) == scores[0]


def _finishes(fn, seconds: float = 60.0):
    """fn() run in a thread: its result, or a failure if it has not finished in ``seconds`` (a hang)."""
    import threading

    box: list = []
    worker = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert box, "the judge hung evaluating what the sandbox returned"
    return box[0]


@pytest.mark.parametrize(
    ("code", "test", "passes"),
    [
        ("f = lambda x: 10**4000", "assert round(f(1), -10**8) == 0", True),  # 10**(10**8) in the parent
        ("f = lambda x: True", "assert round(f(1), -10**8) == 0", True),  # a bool is an int to round, too
        ("f = lambda x: 10**4000", "assert round(f(1), -2) == f(1)", True),
        ("f = lambda x: [[0]] * 300000", "assert sum(f(1), []) == [0] * 300000", True),  # quadratic list sum
        ("f = lambda x: [[1], [2]]", "assert sum(f(1), [0]) == [0, 1, 2] and sum(f(1)[0]) == 1", True),
        ("f = lambda x: [(1,), [2]]", "assert sum(f(1), ()) == (1, 2)", False),  # Python: TypeError
        ("f = lambda x: [0] * 2000", "assert [f(1)] * 1000000 == [f(2)] * 1000000", False),  # shared 2e9 cells
        ("f = lambda x: [0] * 2000", "assert sorted([f(1)] * 1000000) == []", False),
        ("f = lambda x: [0] * 2000", "assert [f(1)] * 3 == [[0] * 2000] * 3", True),
        ("f = lambda x: 'a' * 4000", "assert str([f(1)] * 1000000) == ''", False),  # a 4 GB string
        ("f = lambda x: 1", "assert '%0999999999d' % f(1) == '1'", False),  # a 1 GB string
        ("f = lambda x: 2", "assert f(1) ** 100000 > 0", False),
        ("f = lambda x: 2", "assert f(1) << 10**9 > 0", False),
        ("f = lambda x: 2", "assert f(1) << 3 == 16 and f(1) >> 1 == 1 and ~f(1) == -3 and f(1) ^ 3 == 1", True),
        ("f = lambda x: [1, 2, 3]", "assert set(f(1)) & {2, 5} == {2} and set(f(1)) | {4} == {1, 2, 3, 4}", True),
        ("f = lambda x: '9' * 100", "assert int(f(1) * 300000) > 0", False),  # quadratic where the limit is lifted
        ("f = lambda x: '9' * 100", "assert int(f(1)) > 0 and int(f(1), 16) > 0", True),
    ],
)
@pytest.mark.slow
def test_what_the_sandbox_returns_cannot_make_the_judge_hang_or_build_something_huge(code, test, passes):
    tests = parse_tests([test], where="p")
    assert _finishes(lambda: judge(code, tests, LIMITS)).passed == (passes,)


def test_type_and_isinstance_judge_as_python_does():
    tests = parse_tests(
        [
            "assert type(f(1)) == list",
            "assert isinstance(f(1)[0], int) and not isinstance(f(1)[0], (str, float))",
            "assert type(f(1)) == 'list'",  # Python: a type is not its name
            "assert type(f(1)[1]) is str",
        ],
        where="p",
    )
    assert judge("f = lambda x: [1, 'a']", tests, LIMITS).passed == (True, True, False, True)


def test_asserts_in_one_text_may_span_lines():
    text = "assert f(1) == 1\nassert (f(2) ==\n        2)\n\n# a comment\nassert f(3) == [\n    3,\n]  # done\n"
    tests = parse_tests(text, where="p")
    assert len(tests) == 3
    assert judge("f = lambda x: x if x < 3 else [x]", tests, LIMITS).passed == (True, True, True)
    prompt = Prompt(text="p", answer="", meta={"tests": text})
    assert code_reward([prompt], ["f = lambda x: x if x < 3 else [x]"], None)[0] == [1.0]
    with pytest.raises(TestError, match="test 0: not one assert"):
        parse_tests("for i in range(3):\n    assert f(i) == i\n", where="p")  # one statement, refused whole


def test_a_row_with_a_huge_integer_is_dropped_even_where_the_digit_limit_is_lifted():
    import sys

    from flowrl.tasks.code_tests import decode_row

    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(ValueError, match="4300 digits"):
            decode_row('[0, "ok", ' + "9" * 100_000 + "]")
        assert decode_row('[0, "ok", ' + "9" * 4300 + "]")[2] == int("9" * 4300)
    finally:
        sys.set_int_max_str_digits(before)


CARELESS = (
    "def f(x=0, y=0):\n    return {1: 1, 2: 0.5, 3: [2, 1], 4: 'a', 5: True, 6: None, 7: (1, 2), 8: {1, 2}, "
    "9: {'a': 1}, 10: frozenset([1]), 12: 1.0, 13: 0, 14: [1, [2, (3,)]], 15: b'x', 16: 3.0000001}.get(x, x + y)\n"
)


@pytest.mark.parametrize(
    "test",
    [
        "assert f(1) == 1.0", "assert abs(f(2) - 0.5) < 1e-6", "assert f(3) == [2,1]", "assert f(3) == [1, 2]",
        "assert f(4) == 'a'", "assert f(x=1)", "assert f(-1) == -1", "assert f(5) is True", "assert f(1) is True",
        "assert 0 < f(1) <= 1 < 2", "assert f(1) != None", "assert f(6) is None", "assert f(7) == (1, 2)",
        "assert f(7) == [1, 2]", "assert f(8) == {2, 1}", "assert f(9) == {'a': 1}", "assert f(10) == frozenset({1})",
        "assert f(10) == {1}", "assert f(1) == 1  # a comment", "assert(f(1) == 1)", "assert (f(1) ==\n 1)",
        "assert f(12) == 1", "assert f(5) == 1", "assert f(13) == False", "assert f(14) == [1, [2, (3,)]]",
        "assert f(14) == [1, [2, [3]]]", "assert f(15) == b'x'", "assert f(16) == 3", "assert round(f(16), 2) == 3.0",
        "assert f(x=20, y=1) == 21", "assert f(1, y=2) == 1", "assert f(2) == 1/2", "assert f(True) == 1",
        "assert f(3)[::-1] == [1, 2]", "assert f(4) in 'abc'", "assert f(1) == 1, 'message'", "assert not f(13)",
        "assert f(3) == [1, 2] or f(1) == 1", "assert f(5) == True == 1", "assert set(f(3)) == {1, 2}",
        "assert isinstance(f(2), float)", "assert math.isclose(f(2), 0.5)", "assert f(0x10) == 16",
        "assert f(1e3) == 1000", "assert f(8) == set([1, 2])", "assert f(9) == dict(a=1)", "assert f(1) == 1;",
        "assert f(1) is not None", "assert f(-2.5) == -2.5", "assert f((1, 2), y=(3,)) == (1, 2, 3)",
    ],
)  # fmt: skip
def test_a_careless_authors_asserts_judge_as_python_would(test):
    import math

    space: dict = {"math": math}
    exec(CARELESS, space)
    try:
        exec(test, space)
        python = True
    except AssertionError:
        python = False
    assert judge(CARELESS, parse_tests([test], where="p"), LIMITS).passed == (python,)


def test_builtins_a_test_may_use_are_computed_here_and_others_are_refused_not_sent_as_calls():
    tests = parse_tests(
        [
            "assert f(5) == list(range(5))",
            "assert f(3) != range(3)",  # Python: a list is not a range
            "assert divmod(len(f(7)), 2) == (3, 1) and chr(97 + len(f(1))) == 'b'",
            "assert sum(range(len(f(4)))) == 6 and ord(str(len(f(2)))) == 50",
            "assert len(list(range(10**9))) == len(f(0))",  # refused before it builds a billion-long list
        ],
        where="p",
    )
    assert all(c.name == "f" for t in tests for c in t.calls)
    verdict = _finishes(lambda: judge("f = lambda x: list(range(x))", tests, LIMITS))
    assert verdict.passed == (True, True, True, True, False)


@pytest.mark.parametrize(
    "code",
    [
        "a, b = map(int, open(0).read().split())\nprint(a + b)",  # the input on fd 0, the idiom of judges
        "import os\na, b = map(int, os.read(0, 100).split())\nos.write(1, b'%d\\n' % (a + b))",
        "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a + b, file=sys.__stdout__)",
        "import sys\nfor line in sys.stdin:\n    print(sum(map(int, line.split())))",
    ],
)
def test_a_program_may_read_fd_0_and_write_fd_1_as_judges_let_it(code):
    tests = parse_tests([{"input": "1 2\n", "output": "3\n"}, {"input": "20 22\n", "output": "42\n"}], where="p")
    assert judge(code, tests, LIMITS).passed == (True, True)


def test_printing_too_much_or_closing_its_output_fails_that_input_alone():
    tests = parse_tests([{"input": f"{i}\n", "output": f"{i}\n"} for i in (1, 2, 3)], where="p")
    flood = "x = input()\nif x == '2':\n    while True:\n        print('y' * 10**6)\nprint(x)"
    assert judge(flood, tests, LIMITS).passed == (True, False, True)
    closes = "import os\nx = input()\nif x == '1':\n    os.close(0)\n    os.close(1)\nprint(x)"
    assert judge(closes, tests, LIMITS).passed == (False, True, True)


def test_frozensets_and_integers_past_the_decimal_digit_limit_come_back_as_they_were():
    tests = parse_tests(
        [
            "assert type(f(1)) == frozenset and {f(1)} == {frozenset([1])}",  # hashable, as in Python
            "assert f(5) == {frozenset({1}): 2}",
            "assert f(2) == 2**20000 and f(2) - 1 == 2**20000 - 1",  # more than 4300 decimal digits
            "assert f(3) == -2**60 and f(3) + 1 == -1152921504606846975",
            "assert f(4) > 0",  # past the widest integer a test compares
        ],
        where="p",
    )
    code = "f = lambda x: {1: frozenset([1]), 2: 2**20000, 3: -2**60, 4: 2**70000, 5: {frozenset([1]): 2}}[x]"
    assert judge(code, tests, LIMITS).passed == (True, True, True, True, False)


def test_humaneval_test_text_is_read_as_the_asserts_inside_check():
    text = (
        "\n\nMETADATA = {\n    'author': 'jt',\n    'dataset': 'test'\n}\n\n\ndef check(candidate):\n"
        "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
        "    assert candidate([1.0, 2.0,\n                      5.9], 0.8) == False\n"
        "    assert candidate([], 1.0) == False\n\n"
    )
    prompt = Prompt(text="p", answer="", meta={"tests": text, "entry_point": "has_close_elements"})
    right = (
        "def has_close_elements(xs, t):\n    return any(abs(a - b) < t for i, a in enumerate(xs) for b in xs[i + 1:])"
    )
    scores, _ = code_reward([prompt, prompt], [right, "def has_close_elements(xs, t):\n    return True"], None)
    assert scores == [1.0, 1 / 3]


def test_arguments_computed_without_the_code_are_computed_here_and_sent_as_plain_data():
    tests = parse_tests(
        [
            "assert f(float('inf')) == ('float', float('inf'))",
            "assert f([1] * 3) == ('list', [1, 1, 1])",
            "assert f(set([1])) == ('set', {1})",
            "assert f(y=1, x=frozenset({2})) == ('frozenset', frozenset([2]))",
            "assert f(tuple(range(3))) == ('tuple', (0, 1, 2)) and f(-(2**70)) == ('int', -(2**70))",
            "assert f(1 / 0) == ('float', 0)",  # Python raises: the test fails
            "assert f(list(range(10**8))) == ('list', [])",  # too large to send: fails
        ],
        where="p",
    )
    assert [c.computed for c in tests[0].calls] == [True]
    code = "f = lambda x=0, y=0: (type(x).__name__, x)"
    assert judge(code, tests, LIMITS).passed == (True,) * 5 + (False, False)


def test_code_cannot_answer_one_test_with_another_tests_argument():
    """Tests where one expects what another hands the code run in sandboxes of their own."""
    tests = parse_tests(["assert enc('abc') == 'xyz'", "assert dec('xyz') == 'abc'"], where="p")
    assert groups(tests) == [[0], [1]]
    forger = (
        "import ast, sys\ncalls = sys.modules['__main__'].job['calls']\n"
        "arg = {n: a['v'][0] if isinstance(a, dict) else ast.literal_eval(a)[0] for n, a, k in calls}\n"
        "enc = lambda s: arg['dec']\ndec = lambda s: arg['enc']\n"
    )
    assert judge(forger, tests, LIMITS).passed == (False, False)
    assert judge(forger, tests, LIMITS, isolate=False).passed == (True, True)  # what one process would allow
    right = "enc = lambda s: {'abc': 'xyz'}.get(s)\ndec = lambda s: {'xyz': 'abc'}.get(s)"
    assert judge(right, tests, LIMITS).passed == (True, True)


@pytest.mark.parametrize(
    ("tests", "parts"),
    [
        (["assert f(1) == 2", "assert f(3) == 4", "assert f(5) == 6"], [[0, 1, 2]]),
        (["assert f(1) == 7", "assert f(7) == 3"], [[0], [1]]),  # f(7) hands the code 7, which f(1) expects
        (["assert f([1, 2]) == 3", "assert g(3) == [1, 2]"], [[0], [1]]),  # containers and their elements
        (["assert f(1) == 7.0", "assert g(7) == 8"], [[0], [1]]),  # 7 == 7.0, as Python compares
        (["assert is_prime(7) == True", "assert is_prime(1) == False"], [[0, 1]]),  # a constant is guessed
        # a test passing with a form of another's argument: offset, reversed, negated, bytes, case, words
        (["assert f(3) + 2 == 7", "assert g(5) == 0"], [[0], [1]]),
        (["assert out + 1 == 6", "assert g(5) == 0"], [[0], [1]]),
        (["assert f(1)[::-1] == 'cba'", "assert g('abc') == 0"], [[0], [1]]),
        (["assert f(1) == -5", "assert g(5) == 0"], [[0], [1]]),
        (["assert f(1) == b'abc'", "assert g('abc') == 0"], [[0], [1]]),
        (["assert f(1) == 'ABC'", "assert g('abc') == 0"], [[0], [1]]),
        (["assert f(1) == '123'", "assert g(123) == 0"], [[0], [1]]),
        (["assert sum(f(1)) == 17", "assert g([9, 8]) == 0"], [[0], [1]]),
        ([{"input": "x\n", "output": "1 2 3\n"}, {"input": "1  2   3\n", "output": "0\n"}], [[0], [1]]),
        ([{"input": "x\n", "output": "1\n2\n"}, {"input": "1 2\n", "output": "0\n"}], [[0], [1]]),
        (["assert f(0) == 3", "assert f(1) - f(0) == 1", "assert f(2) == 3 + 2", "assert f(5) == 3 + 5"],
         [[0, 1, 2], [3]]),  # f(2) expects 5, which f(5) hands over
        ([{"input": "1 2", "output": "3"}, {"input": "3 4", "output": "7"}], [[0], [1]]),
        ([{"input": "1 2", "output": "3"}, {"input": "5 4", "output": "9"}], [[0, 1]]),
    ],
)  # fmt: skip
def test_tests_share_a_sandbox_only_where_none_expects_what_another_hands_the_code(tests, parts):
    assert groups(parse_tests(tests, where="p")) == parts


def test_code_cannot_pass_a_test_with_a_form_of_another_tests_argument():
    tests = parse_tests(["assert f(3) + 2 == 7", "assert g(5) == 0"], where="p")
    forger = (
        "import ast, sys\ncalls = sys.modules['__main__'].job['calls']\na = calls[-1][1]\n"
        "f = lambda x: a['v'][0] if isinstance(a, dict) else ast.literal_eval(a)[0]"
    )
    assert judge(forger, tests, LIMITS, isolate=False).passed[0]  # what one process would allow
    assert judge(forger, tests, LIMITS).passed[0] is False


def test_isolated_tests_see_only_their_own_arguments():
    forger = (
        "import ast, sys\ncalls = sys.modules['__main__'].job['calls']\n"
        "arg = {n: a['v'][0] if isinstance(a, dict) else ast.literal_eval(a)[0] for n, a, k in calls}\n"
        "enc = lambda s: arg.get('dec')\ndec = lambda s: arg.get('enc')\n"
    )
    prompt = Prompt(text="p", answer="", meta={"tests": ["assert enc('abc') == 'xyz'", "assert dec('xyz') == 'abc'"]})
    right = "enc = lambda s: {'abc': 'xyz'}.get(s)\ndec = lambda s: {'xyz': 'abc'}.get(s)"
    scores, metrics = code_reward([prompt, prompt], [forger, right], None, isolate=True)
    assert scores == [0.0, 1.0] and metrics["sandbox_runs"] == 2
    stdio = parse_tests([{"input": "1\n", "output": "1\n"}, {"input": "2\n", "output": "2\n"}], where="p")
    assert judge("print(input())", stdio, LIMITS, isolate=True).passed == (True, True)


def test_a_value_the_code_defines_is_read_and_judged_here():
    tests = parse_tests(
        ["assert out == 2", "assert len(table) == 3 and table[1] == 'b'", "assert f(2) == 4"], where="p"
    )
    assert judge("out = 2\ntable = ['a', 'b', 'c']\nf = lambda x: x * 2", tests, LIMITS).passed == (True, True, True)
    assert judge("out = 3\ntable = 'xyz'", tests, LIMITS).passed == (False, False, False)
    with pytest.raises(TestError, match="'__builtins__' is not a value the code defines"):
        parse_assert("assert __builtins__", where="p")


@pytest.mark.slow
def test_a_constant_test_passes_only_where_the_code_loads():
    tests = parse_tests(["assert True", "assert 1 + 1 == 3"], where="p")
    assert judge("x = 1", tests, LIMITS).passed == (True, False)
    assert judge("def broken(:", tests, LIMITS).passed == (False, False)
    assert judge("while True:\n    pass", tests, Limits(wall_s=1, cpu_s=1)).passed == (False, False)


def test_an_early_exit_is_named_and_judged_all_the_same():
    verdict = judge("import os\nf = lambda x: x\nos._exit(0)", parse_tests(["assert f(1) == 1"], where="p"), LIMITS)
    assert verdict.passed == (False,) and verdict.status == "forged"


def test_run_tests_judges_asserts_outside_the_sandbox():
    from flowrl.tasks.sandbox import run_tests

    result = run_tests("def double(x):\n    return 2 * x", ["assert double(2) == 4", "assert double(3) == 7"], LIMITS)
    assert result.status == "ok" and result.passed == (True, False)
    guesses = "".join(f'[0, "ok", {v}]\\n' for v in range(10))  # a forger does not know 4: it guesses
    forger = f"import os\ndouble = lambda x: 0\nfor fd in range(1, 9):\n    os.write(fd, b'{guesses}')"
    assert run_tests(forger, ["assert double(2) == 4"], LIMITS).passed == (False,)
    with pytest.raises(TestError, match="run_tests test 0"):
        run_tests("x = 1", ["for i in range(2): assert i"], LIMITS)
