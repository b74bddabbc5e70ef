"""The code sandbox (flowrl/tasks/sandbox.py, bubblewrap) and the `code` reward: model-written Python
passes or fails its tests, and every way out an attacker would try is contained -- the network,
the project's files, writes outside the scratch folder, fork bombs and subprocesses, infinite loops,
huge output, memory, killing its parent, and exiting early to fake a pass."""

from __future__ import annotations

import os
import random
import time

import pytest

from flowrl.algorithms.ops import code_reward
from flowrl.contract.data import Prompt
from flowrl.tasks.sandbox import Limits, code_of, run_tests

LIMITS = Limits(wall_s=3, cpu_s=2)
SECRET = os.path.abspath(__file__)  # a project file the code must not read
REPO = os.path.dirname(os.path.dirname(os.path.dirname(SECRET)))

# (attempt, code, the test that passes only if the attempt got out, how the run must end)
ESCAPES = [
    ("network", "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n    out = True\n"
     "except OSError:\n    out = False", "assert out", {"ok"}),
    ("read the project's files", f"try:\n    open({SECRET!r}).read()\n    out = True\nexcept OSError:\n    out = False",
     "assert out", {"ok"}),
    ("see the project's folder", f"import os\nout = os.path.exists({REPO!r})", "assert out", {"ok"}),
    ("write outside the scratch folder", "try:\n    open('/usr/escaped', 'w').write('x')\n    out = True\n"
     "except OSError:\n    out = False", "assert out", {"ok"}),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
     "assert True", {"crashed", "timeout"}),
    ("a subprocess", "import subprocess\ntry:\n    subprocess.run(['true'])\n    out = True\nexcept OSError:\n"
     "    out = False", "assert out", {"ok"}),
    ("an infinite loop", "while True:\n    pass", "assert True", {"timeout", "crashed"}),
    ("huge output", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "assert True",
     {"ok", "crashed", "output", "timeout"}),  # writes past the file-size limit fail (Python ignores SIGXFSZ)
    ("all the memory", "x = bytearray(8 * 2**30)\nout = True", "assert out", {"ok"}),
    ("kill its parent", "import os, signal\nfor pid in (os.getppid(), 1):\n    try:\n"
     "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\nout = False", "assert out",
     {"ok", "crashed"}),
    ("exit early to fake a pass", "import os\nos._exit(0)", "assert False", {"forged"}),
]  # fmt: skip


def test_code_passes_and_fails_its_tests_one_by_one():
    result = run_tests("def double(x):\n    return 2 * x", ["assert double(2) == 4", "assert double(3) == 7"], LIMITS)
    assert result.status == "ok" and result.passed == (True, False)
    broken = run_tests("def double(x) return", ["assert double(1) == 2"], LIMITS)
    assert broken.passed == (False,)  # a syntax error fails every test


def test_what_the_code_prints_is_kept_apart_from_the_results():
    result = run_tests("print('1')\nprint('hello')", ["assert False"], LIMITS)
    assert result.passed == (False,) and "hello" in result.output


@pytest.mark.parametrize(("attempt", "code", "test", "endings"), ESCAPES, ids=[e[0] for e in ESCAPES])
def test_every_escape_is_contained(attempt, code, test, endings):
    t0 = time.monotonic()
    result = run_tests(code, [test], LIMITS)
    assert result.passed == (False,), (attempt, result)
    assert result.status in endings, (attempt, result)
    assert len(result.output) <= LIMITS.output_bytes  # what it printed, cut at the cap
    assert os.getpid() and not os.path.exists("/usr/escaped")  # this process and the host are untouched
    assert time.monotonic() - t0 < 60  # bounded (the limits are 3 s wall, 2 s CPU): a hang would never end


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
    from flowrl.algorithms.ops import code_reward
    from flowrl.tasks.builtin import Expr

    task = Expr()
    p = task.sample(random.Random(0))
    responses = [p.answer, "x", "import os; os._exit(0)", "(lambda: [0]*10**10)()"]
    scores, metrics = code_reward([p] * 4, responses, task, template=task.TEMPLATE)
    assert scores[0] == 1.0 and 0 < scores[1] < 1 and scores[2] == 0.0 and scores[3] == 0.0
    assert metrics["sandbox_runs"] == 4 and metrics["all_passed"] == 0.25
    assert task.score(p, p.answer) == 1.0


def test_the_expr_task_scores_a_fenced_answer_as_the_code_reward_does():
    """The expr task's own score reads a response's fenced block as the code reward does."""
    from flowrl.algorithms.ops import code_reward
    from flowrl.tasks.builtin import Expr

    task = Expr(ops=("add",))
    p = task.sample(random.Random(1))
    fenced = f"```python\n{p.answer}\n```"
    scores, _ = code_reward([p], [fenced], task, template=task.TEMPLATE)
    assert scores == [1.0]
    assert task.score(p, fenced) == scores[0]
