"""Judging model-written code by its outputs: the sandboxed process computes, the trusted parent decides.

A prompt's tests (``prompt.meta["tests"]``) come in two forms:

- **Function-call tests**, written as asserts the way MBPP and HumanEval write them:
  ``assert f(2, [1, 3]) == 4``, ``assert f(1) - f(0) == 1``, ``assert math.isclose(area(2), 12.56, rel_tol=1e-3)``,
  ``assert not is_prime(9)``. Each is parsed (`parse_assert`, with :mod:`ast`, never run): every call of a
  function under test with literal arguments (or arguments computed here without the code:
  ``f([0] * 3)``, ``f(float('inf'))``, sent as plain data) is sent to the sandbox, which returns the value as plain data
  (numbers, strings, lists, tuples, sets, dicts, bytes -- never an object with code or its own ``__eq__``),
  and the rest of the expression -- the comparison, arithmetic, ``len``, ``sorted``, ``isclose`` ... -- is
  evaluated here over those values (`evaluate`), with the expected values never leaving this process.
  Whatever came back, that evaluation stays small: every value it builds or compares weighs at most
  `MAX_WEIGHT` (its tree size, shared elements counted each time: ``[f(1)] * 10**6`` of a long list is
  refused), integers stay under `MAX_INT_BITS`, and ``sum`` of lists, ``round`` to huge negative digits
  and ``%`` formatting of strings, which Python would run for hours or fill memory with, are bounded or
  refused -- the test then fails.
- **Stdin/stdout tests**, as competitive-programming judges run them: ``{"input": "1 2\\n", "output": "3\\n"}``.
  The program reads the input and prints; its output is compared here, line by line with trailing
  whitespace and trailing blank lines ignored.

A test that is neither (an assert that loops, defines things or calls a function with computed arguments)
is refused naming it, unless the caller asks for ``forgeable=True``: then every test is exec'd after the
code in the sandboxed process and the process reports pass or fail itself -- for trusted code only,
since code under test can forge that report.
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import operator
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flowrl.tasks import sandbox
from flowrl.tasks.bounded import json_depth
from flowrl.tasks.sandbox import DEFAULT_LIMITS, Limits

#: functions a test's expression may use around the calls under test, evaluated here on plain values
SAFE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs,
    "all": all,
    "any": any,
    "bool": bool,
    "dict": dict,
    "float": float,
    "frozenset": frozenset,
    "int": int,
    "isclose": math.isclose,
    "len": len,
    "list": list,
    "max": max,
    "min": min,
    "reversed": lambda x: list(reversed(x)),
    "round": round,
    "set": set,
    "sorted": sorted,
    "str": str,
    "sum": sum,
    "tuple": tuple,
    "type": lambda x: type(x),  # one argument: the values here are built-in plain data only
    "isinstance": isinstance,
    "range": lambda *a: _range(*a),
    "divmod": divmod,
    "chr": chr,
    "ord": ord,
    "hex": hex,
    "bin": bin,
    "oct": oct,
    "repr": repr,
}
#: built-in names a test cannot call: not functions under test (the code does not define them)
_BUILTINS = frozenset(name for name in dir(builtins) if not name.startswith("_")) - set(SAFE_FUNCTIONS)


def _range(*args: int) -> range:
    made = range(*args)
    if len(made) > MAX_WEIGHT:
        raise OverflowError("a range too long")
    return made


#: the type names a test may use (``type(f(1)) == int``, ``isinstance(f(1), list)``)
_TYPES: dict[str, type] = {t.__name__: t for t in (bool, bytes, dict, float, frozenset, int, list, set, str, tuple)}
_MATH = {"isclose": math.isclose, "fabs": math.fabs, "sqrt": math.sqrt, "floor": math.floor, "ceil": math.ceil}
_NAMES = {"True": True, "False": False, "None": None}
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.BitAnd: operator.and_,  # sets and integers: no larger than what they combine
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
MAX_TEST_CHARS = 20_000
MAX_WEIGHT = 2_000_000  # the tree size of a value a test may build or compare (`_Weights`)
MAX_INT_BITS = 65_536  # the widest integer a test may build or compare
MAX_DEPTH = 64  # nesting of a returned value


class TestError(ValueError):
    """A test that cannot be judged outside the sandbox (or not at all), naming it."""

    __test__ = False  # not a pytest test class


#: a Call's arguments when it is no call but a read of a value the code defines (``assert out``)
READ = ""


@dataclass(frozen=True)
class Call:
    """One call of a function under test, as the sandbox makes it (or, with arguments `READ`, one value
    the code defines, read from its namespace)."""

    name: str
    args: str  # a Python literal tuple: "(1, [2, 3])" (or, computed, a test expression: "([0] * 3, )")
    kwargs: str  # a Python literal dict: "{'k': 1}" (or, computed, a test expression)
    computed: bool = False  # the arguments are computed here (`evaluate`) and sent as plain data


@dataclass(frozen=True)
class CallTest:
    """An assert: an expression over calls of the functions under test, evaluated here."""

    text: str
    expr: ast.expr
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class StdioTest:
    """A program's stdin and the stdout it must print."""

    input: str
    output: str


@dataclass(frozen=True)
class Verdict:
    passed: tuple[bool, ...]  # per test
    status: str  # ok | timeout | output | crashed | forged
    output: str  # what the code printed (cut at the cap)


Test = CallTest | StdioTest


# ------------------------------------------------------------------ parsing


def parse_tests(tests: Any, *, where: str, rename: Mapping[str, str] | None = None) -> list[Test]:
    """A prompt's tests (a list, or asserts one per line) as judged tests, or a TestError naming ``where``
    and the test. ``rename`` maps a name the tests call to the name the code defines (HumanEval's
    ``candidate`` -> its entry point)."""
    if isinstance(tests, str):
        tests = split_tests(tests)
    if not isinstance(tests, list | tuple) or not tests:
        raise TestError(f"{where}: no tests (meta 'tests': a list of asserts or of {{input, output}} objects)")
    out: list[Test] = []
    for i, test in enumerate(tests):
        if isinstance(test, str):
            out.append(parse_assert(test, where=f"{where} test {i}", rename=rename))
        elif isinstance(test, Mapping) and set(test) == {"input", "output"}:
            if not all(isinstance(test[k], str) for k in ("input", "output")):
                raise TestError(f"{where} test {i}: 'input' and 'output' must be strings")
            out.append(StdioTest(input=test["input"], output=test["output"]))
        else:
            raise TestError(
                f"{where} test {i}: a test is an assert (a string) or an object with exactly 'input' and 'output' "
                f"strings, not {type(test).__name__}"
            )
    if len({type(t) for t in out}) > 1:
        raise TestError(f"{where}: mixes asserts and stdin/stdout tests; give one kind per prompt")
    return out


def split_tests(text: str) -> list[str]:
    """Asserts given as one text: its statements (an assert may span lines inside brackets), else, for a
    text that is not Python as a whole, its non-blank lines (each then judged, or refused, alone).
    HumanEval's form -- ``def check(candidate):`` holding the asserts, beside a ``METADATA = {...}`` -- is
    read as the statements inside ``check``."""
    if len(text) <= MAX_TEST_CHARS * 64:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            tree = None
        if tree is not None and tree.body:
            statements: list[ast.stmt] = []
            for stmt in tree.body:
                if isinstance(stmt, ast.FunctionDef) and stmt.name == "check" and len(stmt.args.args) == 1:
                    statements += [s for s in stmt.body if not _is_docstring(s)]
                elif not (isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets) == "METADATA"):
                    statements.append(stmt)
            segments = [ast.get_source_segment(text, stmt) for stmt in statements]
            if segments and all(segments):
                return [str(seg) for seg in segments]
    return [t for t in text.splitlines() if t.strip()]


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


_FORGEABLE = (
    "; such a test can only run in the sandboxed process, where the code under test can forge its result "
    "(forgeable=True, for trusted code)"
)


def parse_assert(text: str, *, where: str, rename: Mapping[str, str] | None = None) -> CallTest:
    """``assert EXPR`` (or a bare ``EXPR``) as a CallTest: the calls of the functions under test (any name
    that is not a safe function) with literal arguments, and the expression around them."""
    if len(text) > MAX_TEST_CHARS:
        raise TestError(f"{where}: longer than {MAX_TEST_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise TestError(f"{where}: not Python ({type(e).__name__}): {text[:80]!r}") from None
    body = tree.body
    if len(body) == 1 and isinstance(body[0], ast.Assert):
        expr = body[0].test
    elif len(body) == 1 and isinstance(body[0], ast.Expr):
        expr = body[0].value
    else:
        raise TestError(f"{where}: not one assert statement: {text[:80]!r}{_FORGEABLE}")
    calls: list[Call] = []
    try:
        _check(expr, calls, dict(rename or {}))
    except RecursionError:
        raise TestError(f"{where}: nested too deeply") from None
    except TestError as e:
        raise TestError(f"{where}: {e} in {text[:120]!r}{_FORGEABLE}") from None
    if not calls:  # a constant test (``assert True``): it passes where the code loads and it holds
        calls.append(LOADED)
    if any(c.name == "candidate" for c in calls) and "candidate" not in (rename or {}):
        raise TestError(
            f"{where}: calls 'candidate' (HumanEval's name for the function under test) but the prompt names no "
            f"entry point (meta 'entry_point': the name the code defines): {text[:80]!r}"
        )
    return CallTest(text=text, expr=expr, calls=tuple(dict.fromkeys(calls)))


#: read by a test that calls nothing: its value comes back only where the code loaded
LOADED = Call("__name__", READ, READ)


def _literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _literal_call(node: ast.Call) -> bool:
    return all(_literal(a) for a in node.args) and all(_literal(k.value) for k in node.keywords)


def _call_of(node: ast.Call) -> Call:
    assert isinstance(node.func, ast.Name)
    return Call(node.func.id, _args_literal(node), _kwargs_literal(node), computed=not _literal_call(node))


def _args_literal(node: ast.Call) -> str:
    return "(" + "".join(ast.unparse(a) + ", " for a in node.args) + ")"


def _kwargs_literal(node: ast.Call) -> str:
    return "{" + ", ".join(f"{k.arg!r}: {ast.unparse(k.value)}" for k in node.keywords) + "}"


def _check(node: ast.expr, calls: list[Call], rename: dict[str, str]) -> None:
    """Raise TestError unless ``node`` is an expression `evaluate` can compute; collect its calls."""
    if isinstance(node, ast.Constant):
        return
    if isinstance(node, ast.Name):
        if node.id in _NAMES or node.id in _TYPES and node.id not in rename:
            return
        if node.id.startswith("__") or node.id in SAFE_FUNCTIONS:
            raise TestError(f"the name {node.id!r} is not a value the code defines")
        calls.append(Call(node.id, READ, READ))  # a value the code defines (``out``): read, never called
        return
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        for e in node.elts:
            _check(e, calls, rename)
        return
    if isinstance(node, ast.Dict):
        for k in node.keys:
            if k is None:
                raise TestError("'**' in a dict")
            _check(k, calls, rename)
        for v in node.values:
            _check(v, calls, rename)
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub | ast.UAdd | ast.Invert):
        _check(node.operand, calls, rename)
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check(node.left, calls, rename)
        _check(node.right, calls, rename)
        return
    if isinstance(node, ast.BoolOp):
        for v in node.values:
            _check(v, calls, rename)
        return
    if isinstance(node, ast.Compare) and all(type(o) in _COMPARE for o in node.ops):
        for op, right in zip(node.ops, node.comparators):
            singleton = (isinstance(right, ast.Constant) and any(right.value is v for v in (None, True, False))) or (
                isinstance(right, ast.Name) and right.id in _TYPES
            )
            if isinstance(op, ast.Is | ast.IsNot) and not singleton:
                raise TestError("'is' compares only with None, True, False or a type (int, list ...)")
            _check(right, calls, rename)
        _check(node.left, calls, rename)
        return
    if isinstance(node, ast.Subscript):
        _check(node.value, calls, rename)
        _check(node.slice, calls, rename)
        return
    if isinstance(node, ast.Slice):
        for part in (node.lower, node.upper, node.step):
            if part is not None:
                _check(part, calls, rename)
        return
    if isinstance(node, ast.Call):
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            raise TestError("'*' or '**' arguments")
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math":
            if func.attr not in _MATH:
                raise TestError(f"math.{func.attr} is not a function a test may use")
        elif isinstance(func, ast.Name) and func.id in SAFE_FUNCTIONS and func.id not in rename:
            pass
        elif isinstance(func, ast.Name) and func.id in _BUILTINS and func.id not in rename:
            raise TestError(
                f"{func.id}(...) is a built-in function a test may not use (it would be called in the sandbox as a "
                f"function under test, and fail); those it may: {', '.join(sorted(SAFE_FUNCTIONS))}"
            )
        elif isinstance(func, ast.Name):
            if not _literal_call(node):  # computed here: ``f([0] * 3)``, ``f(float('inf'))``, not ``f(g(1))``
                inner: list[Call] = []
                for a in [*node.args, *(k.value for k in node.keywords)]:
                    _check(a, inner, rename)
                if inner:
                    raise TestError(f"{func.id}(...) is called with an argument that calls a function under test")
            func.id = rename.get(func.id, func.id)  # HumanEval's candidate: the entry point's name
            calls.append(_call_of(node))
            return
        else:
            raise TestError(f"a call of {ast.unparse(func)[:40]!r}")
        for a in node.args:
            _check(a, calls, rename)
        for k in node.keywords:
            _check(k.value, calls, rename)
        return
    raise TestError(f"{type(node).__name__} is not something a test may use")


# ------------------------------------------------------------------ evaluating


class _Weights:
    """The tree size of values (`MAX_WEIGHT` at most): a container counts its elements as often as they
    occur -- ``[x] * 1000`` weighs a thousand ``x`` -- so a comparison, sort or ``str`` of any value allowed
    costs at most about that many steps. Each container is weighed once (by identity, held alive here)."""

    def __init__(self, known: _Weights | None = None) -> None:
        self.known: dict[int, tuple[Any, int]] = {}
        self.parent = known

    def of(self, value: Any) -> int:
        t = type(value)
        if t is int:
            if value.bit_length() > MAX_INT_BITS:
                raise OverflowError("an integer too large to compare")
            return 1 + value.bit_length() // 64
        if t is str or t is bytes:
            return 1 + len(value) // 16
        if t is range:
            return 1 + len(value)
        if t not in (list, tuple, set, frozenset, dict):
            return 1
        for table in (self.known, self.parent.known if self.parent else {}):
            if id(value) in table:
                return table[id(value)][1]
        if len(value) > MAX_WEIGHT:
            raise OverflowError("a value too large to compare")
        total = 1
        for item in value.items() if t is dict else value:
            total += self.of(item[0]) + self.of(item[1]) if t is dict else self.of(item)
            if total > MAX_WEIGHT:
                raise OverflowError("a value too large to compare")
        self.known[id(value)] = (value, total)
        return total

    def check(self, value: Any) -> Any:
        self.of(value)
        return value


def _repeat(weights: _Weights, a: Any, b: Any) -> Any:
    """``a * b``, refused before it builds a repeat heavier than `MAX_WEIGHT`."""
    for seq, count in ((a, b), (b, a)):
        if isinstance(seq, str | bytes | list | tuple) and type(count) in (int, bool):
            if count > 0 and count * weights.of(seq) > MAX_WEIGHT:
                raise OverflowError("a repeat too large")
    return a * b


def _power(weights: _Weights, a: Any, b: Any) -> Any:
    if type(a) in (int, bool) and type(b) in (int, bool) and b > 0 and max(a.bit_length(), 1) * b > MAX_INT_BITS:
        raise OverflowError("a power too large")
    return a**b


def _shift(weights: _Weights, a: Any, b: Any) -> Any:
    if type(a) in (int, bool) and type(b) in (int, bool) and b > MAX_INT_BITS:
        raise OverflowError("a shift too large")
    return a << b


def _modulo(weights: _Weights, a: Any, b: Any) -> Any:
    if isinstance(a, str | bytes):  # '%0999999999d' % x would print a gigabyte
        raise TypeError("'%' formatting in a test")
    return a % b


def _sum(weights: _Weights, items: Any, start: Any = 0) -> Any:
    """``sum``, without Python's quadratic copying when it adds lists or tuples."""
    if type(start) in (list, tuple):
        out = list(start)
        for item in items:
            if type(item) is not type(start):
                raise TypeError(f"can only concatenate {type(start).__name__} to {type(start).__name__}")
            out.extend(item)
            if len(out) > MAX_WEIGHT:
                raise OverflowError("a sum too large")
        return out if type(start) is list else tuple(out)
    return sum(items, start)


def _round(weights: _Weights, number: Any, ndigits: Any = None) -> Any:
    if isinstance(number, int) and isinstance(ndigits, int) and ndigits < -MAX_INT_BITS:  # 10 ** -ndigits, bool too
        return 0
    return round(number) if ndigits is None else round(number, ndigits)


def _int(weights: _Weights, value: Any = 0, *base: Any) -> int:
    if isinstance(value, str | bytes) and len(value.strip()) > 4300 and base in ((), (10,)):
        # Python's default digit limit, kept even where a library lifted it: the conversion is quadratic
        raise ValueError("int() of more than 4300 digits")
    return int(value, *base)


_BINARY_GUARDED = {ast.Mult: _repeat, ast.Pow: _power, ast.Mod: _modulo, ast.LShift: _shift}
_FUNCTIONS_GUARDED = {"sum": _sum, "round": _round, "int": _int}


def evaluate(node: ast.expr, values: Mapping[Call, Any], weights: _Weights | None = None) -> Any:
    """The value of a checked test expression, with each call under test replaced by what it returned;
    every value built on the way weighs at most `MAX_WEIGHT` (else OverflowError)."""
    w = weights if weights is not None else _Weights()
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in _NAMES:
            return _NAMES[node.id]
        if node.id in _TYPES:
            return _TYPES[node.id]
        value = values[Call(node.id, READ, READ)]
        if isinstance(value, _Failed):
            raise RuntimeError(value.why)
        return value
    if isinstance(node, ast.List):
        return w.check([evaluate(e, values, w) for e in node.elts])
    if isinstance(node, ast.Tuple):
        return w.check(tuple(evaluate(e, values, w) for e in node.elts))
    if isinstance(node, ast.Set):
        return w.check({evaluate(e, values, w) for e in node.elts})
    if isinstance(node, ast.Dict):
        return w.check({evaluate(k, values, w): evaluate(v, values, w) for k, v in zip(node.keys, node.values) if k})
    if isinstance(node, ast.UnaryOp):
        v = evaluate(node.operand, values, w)
        if isinstance(node.op, ast.Invert):
            return ~v
        return not v if isinstance(node.op, ast.Not) else -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp):
        a, b = evaluate(node.left, values, w), evaluate(node.right, values, w)
        guarded = _BINARY_GUARDED.get(type(node.op))
        return w.check(guarded(w, a, b) if guarded else _BINARY[type(node.op)](a, b))
    if isinstance(node, ast.BoolOp):
        result: Any = None
        for v in node.values:
            result = evaluate(v, values, w)
            if isinstance(node.op, ast.And) and not result or isinstance(node.op, ast.Or) and result:
                return result
        return result
    if isinstance(node, ast.Compare):
        left = evaluate(node.left, values, w)
        for op, right_node in zip(node.ops, node.comparators):
            right = evaluate(right_node, values, w)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Subscript):
        return w.check(evaluate(node.value, values, w)[evaluate(node.slice, values, w)])
    if isinstance(node, ast.Slice):
        parts = (node.lower, node.upper, node.step)
        return slice(*(None if p is None else evaluate(p, values, w) for p in parts))
    assert isinstance(node, ast.Call)
    args = [evaluate(a, values, w) for a in node.args]
    kwargs = {k.arg: evaluate(k.value, values, w) for k in node.keywords if k.arg}
    func = node.func
    if isinstance(func, ast.Attribute):
        return w.check(_MATH[func.attr](*args, **kwargs))
    assert isinstance(func, ast.Name)
    call = _call_of(node)
    if call not in values:
        guarded = _FUNCTIONS_GUARDED.get(func.id)
        return w.check(guarded(w, *args, **kwargs) if guarded else SAFE_FUNCTIONS[func.id](*args, **kwargs))
    value = values[call]
    if isinstance(value, _Failed):
        raise RuntimeError(value.why)
    return value


@dataclass(frozen=True)
class _Failed:
    why: str


# ------------------------------------------------------------------ plain data back from the sandbox

_WHITESPACE = re.compile(r"[ \t\r\n]*")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _bounded_int(digits: str) -> int:
    if len(digits) > 4300:  # Python's own limit, kept even where a library lifted it: int() is quadratic
        raise ValueError("an integer of more than 4300 digits")
    return int(digits)


def decode_row(text: str) -> list[Any]:
    """One row the sandbox sent, as strict JSON: a list, nested at most MAX_DEPTH deep (else ValueError)."""
    if json_depth(text, MAX_DEPTH + 4) > MAX_DEPTH + 4:
        raise ValueError("nested too deeply")
    row = json.loads(text, parse_constant=_reject_constant, parse_int=_bounded_int)
    if not isinstance(row, list) or len(row) != 3 or type(row[0]) is not int or not isinstance(row[1], str):
        raise ValueError("not a row")
    return row


def untag(value: Any) -> Any:
    """A tagged plain value (`sandbox._HARNESS`'s ``tag``) as a Python value built only of built-in types."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [untag(v) for v in value]
    if type(value) is dict and len(value) == 1:
        ((kind, body),) = value.items()
        if kind == "t" and type(body) is list:
            return tuple(untag(v) for v in body)
        if kind == "s" and type(body) is list:
            return set(untag(v) for v in body)
        if kind == "fs" and type(body) is list:
            return frozenset(untag(v) for v in body)
        if kind == "i" and type(body) is str and len(body) <= MAX_INT_BITS // 4 + 1:
            return int(body, 16)
        if kind == "d" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {untag(k): untag(v) for k, v in body}
        if kind == "f" and body in ("nan", "inf", "-inf"):
            return float(body)
        if kind == "b" and type(body) is str:
            return bytes.fromhex(body)
    raise ValueError("not a tagged plain value")


# ------------------------------------------------------------------ judging


def _same_output(printed: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(printed) == lines(expected)


def judge(
    code: str,
    tests: Sequence[Test],
    limits: Limits = DEFAULT_LIMITS,
    *,
    forgeable: bool = False,
    isolate: bool | None = None,
) -> Verdict:
    """Run ``code`` in sandboxes and judge each test here: pass or fail per test.

    In one process the code can read every test's arguments (or inputs) -- and one test's argument may be
    another's expected value (``enc('abc') == 'xyz'`` beside ``dec('xyz') == 'abc'``). So by default
    (``isolate=None``) tests run together only where none of them expects a value that another one hands
    the code (`groups`), each group in a sandbox of its own; ``isolate=True`` runs every test alone (a
    sandbox start each, a few tens of milliseconds), ``isolate=False`` all in one (trusted tests only)."""
    if forgeable:
        raise TestError("judge(forgeable=True) takes the tests' texts: use run_asserts")
    parts = (
        [list(range(len(tests)))]
        if isolate is False
        else [[i] for i in range(len(tests))]
        if isolate
        else groups(tests)
    )
    if len(parts) > 1:
        passed: list[bool] = [False] * len(tests)
        status, output = "ok", ""
        for part in parts:
            verdict = _judge_together(code, [tests[i] for i in part], limits)
            for i, ok in zip(part, verdict.passed):
                passed[i] = ok
            status = status if verdict.status == "ok" else verdict.status if status == "ok" else status
            output += verdict.output
        return Verdict(passed=tuple(passed), status=status, output=output[: limits.output_bytes])
    return _judge_together(code, tests, limits)


# ------------------------------------------------------------------ which tests may share a process

MAX_LEAVES = 4096  # sub-values of one test's arguments or expected values compared; more: the test runs alone


def _key(value: Any) -> Any:
    """A hashable key under which values equal by Python's ``==`` (1 == 1.0 == True; a set and a frozenset)
    meet; containers by their elements' keys."""
    t = type(value)
    if t is bool or t is int:
        return ("n", int(value))
    if t is float:
        return ("n", int(value)) if value.is_integer() else ("n", value) if value == value else ("nan", id(value))
    if t in (list, tuple):
        return (t.__name__, tuple(_key(v) for v in value))
    if t in (set, frozenset):
        return ("set", frozenset(_key(v) for v in value))
    if t is dict:
        return ("dict", frozenset((_key(k), _key(v)) for k, v in value.items()))
    return (t.__name__, value)


def _leaves(value: Any, out: set[Any], depth: int = 0) -> None:
    """``value`` and every value inside it, as `_key`s, into ``out`` (OverflowError past MAX_LEAVES)."""
    if len(out) > MAX_LEAVES or depth > MAX_DEPTH:
        raise OverflowError("too many values to compare")
    out.add(_key(value))
    if isinstance(value, list | tuple | set | frozenset):
        for v in value:
            _leaves(v, out, depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            _leaves(k, out, depth + 1)
            _leaves(v, out, depth + 1)


def _under_test(node: ast.AST, test: CallTest) -> bool:
    """Whether ``node`` holds a call of a function under test."""
    names = {c.name for c in test.calls}
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in names
        or isinstance(n, ast.Name)
        and n.id in names
        for n in ast.walk(node)
    )


def _expected(node: ast.AST, test: CallTest, out: set[Any]) -> None:
    """The values of the test's parts with no call under test (what a call's value is held against)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {c.name for c in test.calls}:
        return  # a call under test: its arguments are given, not expected
    if isinstance(node, ast.expr) and not _under_test(node, test):
        try:
            _leaves(evaluate(node, {}, _Weights()), out)
        except OverflowError:
            raise
        except Exception:  # noqa: BLE001 - a part that does not compute alone expects nothing of its own
            pass
        return
    for child in ast.iter_child_nodes(node):
        _expected(child, test, out)


def _given(test: CallTest, out: set[Any], values: list[Any] | None = None) -> None:
    """Every value the test's calls hand the code (as `_key`s into ``out``; the values into ``values``)."""
    for call in test.calls:
        if call.args == READ:
            continue
        weights = _Weights()
        for text in (call.args, call.kwargs):
            value = evaluate(ast.parse(text, mode="eval").body, {}, weights)
            _leaves(value, out)
            if values is not None:
                values.append(value)


MAX_CANDIDATES = 512  # forms of another test's arguments tried as a call's value; more: the test runs alone
#: values code can return without reading anything: a test passing with one of them is guessed, not forged
_GUESSES: tuple[Any, ...] = (None, True, False, 0, 1, -1, 2, 0.0, "", b"", [], (), {}, set())


def _forms(value: Any, out: list[Any], depth: int = 0) -> None:
    """``value``, every value inside it, and the forms code could turn each into without solving anything
    (another type of container, reversed, sorted, negated, a string's case, words or number, bytes), into
    ``out`` (OverflowError past MAX_CANDIDATES)."""
    if len(out) > MAX_CANDIDATES or depth > MAX_DEPTH:
        raise OverflowError("too many values to try")
    t = type(value)
    out.append(value)
    if t is int or t is float:
        out += [-value, str(value)]
    elif t is str:
        out += [value[::-1], value.upper(), value.lower(), value.strip(), value.encode("utf-8", "replace")]
        words = value.split()
        if len(words) > 1:
            out += [" ".join(words), *words]
        try:
            out.append(int(value) if len(value) <= 100 else 0)
            out.append(float(value) if len(value) <= 100 else 0)
        except ValueError:
            pass
    elif t is bytes:
        out += [value.decode("utf-8", "replace"), value[::-1]]
    elif t in (list, tuple, set, frozenset, dict):
        items = list(value)
        out += [items, tuple(items), items[::-1], tuple(items[::-1])]
        try:
            out += [set(items), sorted(items)]
        except TypeError:
            pass
        if t is dict:
            out += [list(value.values()), list(value.items())]
            for k, v in value.items():
                _forms(k, out, depth + 1)
                _forms(v, out, depth + 1)
        else:
            for v in items:
                _forms(v, out, depth + 1)


#: seconds `groups` may spend trying values on one test (a test's expression can be slow on large
#: values within the size budget, e.g. sorting a million-element list): past it, the test runs alone
GROUPING_BUDGET_S = 0.5


def _passes(test: CallTest, call: Call, tries: Sequence[Any], deadline: float | None = None) -> bool:
    """Whether the test holds with some value of ``tries`` as what ``call`` returned (TimeoutError past
    ``deadline``, a `time.monotonic` reading)."""
    import time

    values: dict[Call, Any] = {LOADED: "__main__"}
    for value in tries:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("trying values took too long")
        values[call] = value
        try:
            if _truthy(evaluate(test.expr, values, _Weights())):
                return True
        except Exception:  # noqa: BLE001 - a value the test cannot use: it fails with it
            pass
    return False


def groups(tests: Sequence[Test]) -> list[list[int]]:
    key = tuple(tests)
    if key not in _GROUPS:
        if len(_GROUPS) >= 64:
            _GROUPS.clear()
        _GROUPS[key] = _groups(key)
    return [list(part) for part in _GROUPS[key]]


_GROUPS: dict[tuple[Test, ...], list[list[int]]] = {}


def _groups(tests: Sequence[Test]) -> list[list[int]]:
    """The tests (their indices) that may run in one process: none of a group expects a value that another
    test of the group hands the code (a call's argument, a program's input), nor passes with a form of one
    (`_forms`: reversed, negated, its words ... -- tried as the value of a test's only call, where no value
    the code could return without reading, nor a form of its own arguments, passes it); a test whose values
    are too many to compare runs alone. A test whose only call passes with a constant (`_GUESSES`: ``True``,
    ``0``, ``[]`` ...) expects nothing worth reading; tests with two calls or more are compared by their values
    only. Kept for the last tests judged (a prompt's responses share them)."""
    import time

    given: list[set[Any] | None] = []
    expected: list[set[Any] | None] = []
    forms: list[list[Any] | None] = []
    solo: list[Call | None] = []  # the one call whose value decides the test, where it is not guessed
    for t in tests:
        g: set[Any] = set()
        e: set[Any] = set()
        f: list[Any] = []
        only: Call | None = None
        try:
            if isinstance(t, CallTest):
                handed: list[Any] = []
                _given(t, g, handed)
                _expected(t.expr, t, e)
                for value in handed:
                    _forms(value, f)
                decisive = [c for c in t.calls if c != LOADED]
                deadline = time.monotonic() + GROUPING_BUDGET_S
                if len(decisive) == 1 and _passes(t, decisive[0], _GUESSES, deadline):
                    e = set()  # passed by a constant (``is_prime(7) == True``): nothing to read from others
                elif len(decisive) == 1 and not _passes(t, decisive[0], f, deadline):
                    only = decisive[0]
            else:
                g, e = {t.input}, {t.output.strip()} if t.output.strip() else set()
        except Exception:  # noqa: BLE001 - too many values (or ones that do not compute): alone
            g = e = f = None  # type: ignore[assignment]
        given.append(g)
        expected.append(e)
        forms.append(f)
        solo.append(only)

    def clash(i: int, j: int) -> bool:  # test j expects what test i gives
        gi, ej = given[i], expected[j]
        if gi is None or ej is None:
            return True
        tj = tests[j]
        if isinstance(tj, StdioTest):
            words = [" ".join(text.split()) for text in gi if isinstance(text, str)]
            return any(out in text or " ".join(out.split()) in w for out in ej for text in gi for w in words)
        only = solo[j]
        try:
            if only is not None and isinstance(tj, CallTest):
                if _passes(tj, only, forms[i] or (), time.monotonic() + GROUPING_BUDGET_S):
                    return True
        except TimeoutError:
            return True
        return not gi.isdisjoint(ej)

    parts: list[list[int]] = []
    for j in range(len(tests)):
        for part in parts:
            if given[j] is not None and not any(clash(i, j) or clash(j, i) for i in part):
                part.append(j)
                break
        else:
            parts.append([j])
    return parts


def _judge_together(code: str, tests: Sequence[Test], limits: Limits) -> Verdict:
    """Run ``code`` in one sandbox for all of ``tests`` and judge each here."""
    if tests and isinstance(tests[0], StdioTest):
        stdio = [t for t in tests if isinstance(t, StdioTest)]
        run = sandbox.run_job({"mode": "stdio", "code": code, "inputs": [t.input for t in stdio]}, limits)
        printed: dict[int, str] = {}
        for text in run.rows:
            try:
                i, status, out = decode_row(text)
            except (ValueError, RecursionError):
                continue
            if status == "ok" and isinstance(out, str) and 0 <= i < len(stdio) and i not in printed:
                printed[i] = out
        passed = tuple(i in printed and _same_output(printed[i], t.output) for i, t in enumerate(stdio))
        return Verdict(passed=passed, status=_ending(run), output=run.output)
    call_tests = [t for t in tests if isinstance(t, CallTest)]
    calls = list(dict.fromkeys(c for t in call_tests for c in t.calls))
    values: dict[Call, Any] = {}
    sent: list[list[Any]] = []
    for c in calls:
        try:
            sent.append([c.name, *_arguments(c)])
        except Exception:  # noqa: BLE001 - an argument Python could not compute either: the call fails
            values[c] = _Failed("its arguments could not be computed")
            sent.append([c.name, "()", "{}"])
    job = {"mode": "calls", "code": code, "calls": sent}
    run = sandbox.run_job(job, limits)
    for text in run.rows:
        try:
            i, status, body = decode_row(text)
            if not 0 <= i < len(calls) or calls[i] in values:  # the first row for a call counts
                continue
            values[calls[i]] = untag(body) if status == "ok" else _Failed(f"the call raised {body}")
        except (ValueError, TypeError, RecursionError, OverflowError):
            continue
    returned = _Weights()  # each returned value weighed once, for every test
    for c in calls:
        values.setdefault(c, _Failed("no value came back (the run ended first)"))
        try:
            returned.of(values[c])
        except (OverflowError, RecursionError):
            values[c] = _Failed("the value that came back is too large to compare")
    passed = []
    for t in call_tests:
        try:
            loaded = LOADED not in t.calls or not isinstance(values[LOADED], _Failed)
            passed.append(loaded and _truthy(evaluate(t.expr, values, _Weights(returned))))
        except Exception:  # noqa: BLE001 - any error evaluating over the returned values fails that test
            passed.append(False)
    return Verdict(passed=tuple(passed), status=_ending(run), output=run.output)


def _ending(run: sandbox.Run) -> str:
    """How a run ended: its own status, or ``forged`` where it exited cleanly before the harness was done
    (an early exit: what it sent is judged all the same)."""
    if run.status == "ok" and '[-1, "done", null]' not in run.rows:
        return "forged"
    return run.status


def _arguments(call: Call) -> tuple[Any, Any]:
    """What the sandbox gets for a call's arguments: their literal texts, or, computed here, plain data
    tagged as the sandbox tags what it returns (``{"v": ...}``)."""
    if call.args == READ:  # a value the code defines
        return call.args, call.kwargs
    if not call.computed:  # literals: sent as plain data (the sandbox then needs no parser), else as texts
        try:
            return _arguments(Call(call.name, call.args, call.kwargs, computed=True))
        except Exception:  # noqa: BLE001 - a literal plain data cannot carry (1j, ...): its text
            return call.args, call.kwargs
    weights = _Weights()
    args = evaluate(ast.parse(call.args, mode="eval").body, {}, weights)
    kwargs = evaluate(ast.parse(call.kwargs, mode="eval").body, {}, weights)
    weights.check([args, kwargs])
    return {"v": _tag(list(args))}, {"v": _tag(kwargs)}


def _tag(value: Any, depth: int = 0) -> Any:
    """``value`` as the sandbox's tagged plain data (`sandbox._HARNESS`'s ``tag``), for arguments."""
    if depth > MAX_DEPTH:
        raise ValueError(f"an argument nested deeper than {MAX_DEPTH}")
    t = type(value)
    if value is None or t in (bool, str):
        return value
    if t is int:
        return value if -(2**53) < value < 2**53 else {"i": f"{value:x}"}
    if t is float:
        return value if value - value == 0 else {"f": repr(value)}
    if t in (list, tuple, set, frozenset):
        items = [_tag(v, depth + 1) for v in value]
        return items if t is list else {{tuple: "t", set: "s", frozenset: "fs"}[t]: items}
    if t is dict:
        return {"d": [[_tag(k, depth + 1), _tag(v, depth + 1)] for k, v in value.items()]}
    if t is bytes:
        return {"b": value.hex()}
    raise TypeError(f"an argument of type {t.__name__} cannot be sent")


def _truthy(value: Any) -> bool:
    """Truth as an assert sees it, for the built-in plain types only."""
    if value is None or type(value) in (bool, int, float, str, bytes, list, tuple, set, frozenset, dict):
        return bool(value)
    return False


def run_asserts(code: str, tests: Sequence[str], limits: Limits = DEFAULT_LIMITS) -> Verdict:
    """FORGEABLE, for trusted code only: exec ``code`` then each test in one sandboxed interpreter, which
    reports pass or fail itself (a secret line after the last test catches an early exit, but code that
    finds its way into the harness can still forge the report). The sandbox still protects the machine."""
    nonce = secrets.token_hex(16)
    run = sandbox.run_job({"mode": "asserts", "code": code, "tests": list(tests), "nonce": nonce}, limits)
    rows = []
    for text in run.rows:
        try:
            rows.append(decode_row(text))
        except (ValueError, RecursionError):
            rows.append([-2, "garbled", None])
    status = run.status
    if status in ("ok", "crashed") and not (rows and rows[-1] == [-1, "end", nonce]):
        status = "forged" if run.returncode == 0 else "crashed"
    if status != "ok":
        return Verdict(passed=(False,) * len(tests), status=status, output=run.output)
    results = [r[1] == "ok" for r in rows[: len(tests)]]
    return Verdict(passed=tuple(results + [False] * (len(tests) - len(results))), status=status, output=run.output)
