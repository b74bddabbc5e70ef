"""What one untrusted input may cost: JSON nesting, a line's length, a file's size, and a chat
template's rendering (its time and the size of what it makes).

Dataset files, a ``datasets`` folder's JSON, a model folder's JSON, chat templates and the tool calls
a model writes are all untrusted. Every reader of them goes through here, so that one bad input is
one error naming where it is, never a RecursionError, a hang or a process killed for memory:

- JSON is nested at most `MAX_JSON_DEPTH` (64) levels (a row of 100,000 ``[`` is refused before
  Python's parser recurses into it);
- a jsonl line is at most `MAX_LINE_BYTES` (8 MiB): `lines` reads with a bounded ``readline``, so a
  longer line is refused having held no more than the cap in memory;
- a prompt, from any file format (csv, parquet, a saved folder), is at most `MAX_PROMPT_CHARS`
  (8 Mi characters) before a tokenizer sees it;
- a .json file (one JSON document, parsed whole) is at most `MAX_JSON_FILE_BYTES` (64 MiB): bigger
  data goes in a jsonl file, which is read a row at a time; a JSON metadata file (state.json,
  config.json, ...) at most `MAX_META_BYTES` (16 MiB); a chat template file `MAX_TEMPLATE_BYTES` (1 MiB);
- a chat template renders in Jinja's immutable sandbox (as transformers renders it) within
  `RENDER_SECONDS` (10 s) and `MAX_RENDER_CHARS` (32 Mi characters): the time is checked at every
  loop iteration, call, filter, attribute and operator of the template and every piece of output,
  and each value the template makes (``'x' * n``, ``a ~ b``, ``s.replace(...)``, ``xs|join``,
  ``'%9999d' % n``, ``2 ** n``, ...) is weighed before it is made, where its size follows from its
  inputs, and after otherwise. The checks read a thread-local deadline, so rendering is bounded in
  any thread (no signals).
"""

from __future__ import annotations

import functools
import json
import math
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from flowrl.errors import ConfigError

#: JSON nested deeper than this (arrays and objects) is refused
MAX_JSON_DEPTH = 64
#: a jsonl line longer than this (bytes, its newline included) is refused before it is parsed
MAX_LINE_BYTES = 8 << 20
#: a prompt (its turns' text, from any file format) longer than this is refused before it is tokenized
MAX_PROMPT_CHARS = 8 << 20
#: a .json file (one document) larger than this is refused: give the rows as jsonl
MAX_JSON_FILE_BYTES = 64 << 20
#: a JSON metadata file (a datasets folder's state.json, a model's config.json) larger than this is refused
MAX_META_BYTES = 16 << 20
#: a chat template file larger than this is refused
MAX_TEMPLATE_BYTES = 1 << 20
#: one render of a chat template stops after this many seconds
RENDER_SECONDS = 10.0
#: one render's output, and any one value a template makes, is at most this many characters
MAX_RENDER_CHARS = 32 << 20
#: an integer a template makes is at most this many bits
MAX_INT_BITS = 1 << 16


class JSONRefused(ValueError):
    """Text that is not JSON this module accepts: its message says why (no file or line: the caller
    names those)."""


# ---------------------------------------------------------------- JSON

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str, limit: int | None = None) -> int:
    """How deeply the arrays and objects of JSON ``text`` nest (counting stops past ``limit``,
    `MAX_JSON_DEPTH` by default)."""
    limit = MAX_JSON_DEPTH if limit is None else limit
    shape = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = deepest = 0
    for char in shape:
        depth += 1 if char in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JSONRefused(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"{name} is not a JSON number")


def loads(text: str, *, unique_keys: bool = False) -> Any:
    """JSON ``text`` parsed, nested at most `MAX_JSON_DEPTH` levels (and, with ``unique_keys``, no key
    twice in one object); anything else raises `JSONRefused` saying why."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise JSONRefused(f"it is nested more than {MAX_JSON_DEPTH} levels deep (arrays or objects in each other)")
    try:
        return json.loads(text, object_pairs_hook=_unique if unique_keys else None, parse_constant=_no_constant)
    except JSONRefused:
        raise
    except json.JSONDecodeError as exc:
        raise JSONRefused(f"{exc.msg} at column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # an integer of more than 4300 digits, ...
        raise JSONRefused(str(exc).split(";")[0]) from None


def lines(stream: BinaryIO, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line of ``stream``, none held past ``limit`` bytes (`MAX_LINE_BYTES`
    by default): a longer line raises `JSONRefused` (``line N is longer than ...``) having read at most
    ``limit + 1`` bytes of it."""
    limit = MAX_LINE_BYTES if limit is None else limit
    number = 0
    while True:
        line = stream.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) > limit:
            raise JSONRefused(f"line {number} is longer than {_size(limit)} (flowrl.tasks.bounded.MAX_LINE_BYTES)")
        yield number, line


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def read_json_file(path: Path, what: str, limit: int | None = None) -> Any:
    """The JSON document in file ``path`` (named ``what`` in errors): at most ``limit`` bytes
    (`MAX_META_BYTES` by default) of UTF-8, nested at most `MAX_JSON_DEPTH` levels, no key twice."""
    limit = MAX_META_BYTES if limit is None else limit
    try:
        size = path.stat().st_size
        if size > limit:
            raise ConfigError(f"{what} '{path}' is {_size(size)}, over the {_size(limit)} a JSON file may hold.")
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(f"{what} '{path}' cannot be read ({exc.strerror or exc}).") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} '{path}' is not UTF-8 text (byte 0x{raw[exc.start]:02x} at {exc.start}).") from None
    try:
        return loads(text, unique_keys=True)
    except JSONRefused as exc:
        raise ConfigError(f"{what} '{path}' is not valid JSON: {exc}.") from None


# ---------------------------------------------------------------- chat templates

_RENDER = threading.local()  # .deadline: the running render's (None outside one)
_NAMES: dict[str, str] = {}  # template text -> where it came from, for errors
_DIGITS = re.compile(r"\d+")


class TemplateLimit(Exception):
    """A render went past a limit; the message says which (raised inside the template, caught by `render`)."""


def name_template(template: str, name: str) -> None:
    """Errors about ``template`` name it as ``name`` (e.g. ``data.chat_template 'chat.jinja'``)."""
    if len(_NAMES) > 64:
        _NAMES.clear()
    _NAMES[template] = name


def template_name(template: str) -> str:
    return _NAMES.get(template, "the chat template")


def _tick() -> None:
    deadline = getattr(_RENDER, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateLimit(
            f"it ran past the {RENDER_SECONDS:g} s a render may take (flowrl.tasks.bounded.RENDER_SECONDS)"
        )


def weight(value: Any, limit: int = MAX_RENDER_CHARS, depth: int = 0) -> int:
    """About how many characters ``value`` holds (its text, its items'), counted up to just past ``limit``."""
    if isinstance(value, (str, bytes, bytearray)):
        return len(value)
    if isinstance(value, bool) or value is None:
        return 1
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if isinstance(value, range):
        return len(value)
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if depth > 8:
            return len(value)
        items = list(value.items()) if isinstance(value, dict) else value
        total = len(items)
        for item in items:
            total += weight(item, limit, depth + 1)
            if total > limit:
                break
        return total
    return 1


def _too_big(size: int, what: str) -> None:
    if size > MAX_RENDER_CHARS:
        raise TemplateLimit(
            f"{what} would hold about {size:,} characters, over the {MAX_RENDER_CHARS:,} a template may make "
            "(flowrl.tasks.bounded.MAX_RENDER_CHARS)"
        )


def _int_args(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """The largest integer among the arguments (0 without one); one over the limit is refused."""
    ints = [abs(a) for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    largest = max(ints, default=0)
    if largest > MAX_RENDER_CHARS:
        raise TemplateLimit(
            f"an integer argument of {largest:,} is over the {MAX_RENDER_CHARS:,} a template may use "
            "(flowrl.tasks.bounded.MAX_RENDER_CHARS)"
        )
    return largest


def _format_size(fmt: str, mark: str, args: Sequence[Any]) -> int:
    """A bound on what format string ``fmt`` (fields start with ``mark``) makes of ``args``: its text,
    the widths written in it, and each field filled with the largest argument."""
    widest = max((weight(a) for a in args), default=0)
    return len(fmt) + sum(len(d) and int(d[:12]) for d in _DIGITS.findall(fmt)) + fmt.count(mark) * widest


def _check_call(name: str, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Refuses a call whose result would be over the size limit, where its inputs say so."""
    largest = _int_args(args, kwargs)
    if not isinstance(target, str):
        return
    if name == "join":
        items = args[0] if args else kwargs.get("iterable", ())
        if isinstance(items, (list, tuple, set, frozenset, dict)):
            _too_big(weight(items) + len(target) * len(items), "a join")
    elif name == "replace" and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        count = target.count(old) if old else len(target) + 1
        _too_big(len(target) + count * len(new), "a replace")
    elif name in ("format", "format_map"):
        _too_big(_format_size(target, "{", [*args, *kwargs.values()]) + target.count("{") * largest, "a format")
    elif name == "expandtabs":
        _too_big(len(target) + target.count("\t") * largest, "expandtabs")
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        step = len(width) if isinstance(width, str) else int(width)
        _too_big(len(target) + (target.count("\n") + 1) * step, "an indent")
    else:
        _too_big(len(target) + largest, f"{name}()")


def _guard_filter(name: str, fn: Any) -> Any:
    """Filter ``fn`` with the time and size checks (its jinja pass-argument marks kept)."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        plain = [a for a in args if not _is_jinja_state(a)]
        if name == "join" and plain:  # join(items, d=""): the separator between every two items
            _check_call("join", plain[1] if len(plain) > 1 else str(kwargs.get("d", "")), plain[:1], {})
        elif name == "tojson" and plain:  # each line indented: about the value's size times the indent
            indent = kwargs.get("indent", plain[2] if len(plain) > 2 else None)
            step = len(indent) if isinstance(indent, str) else int(indent or 0)
            _too_big(weight(plain[0]) * (1 + 16 * step), "tojson")
        elif plain:
            _check_call(name, plain[0], plain[1:], kwargs)
        result = fn(*args, **kwargs)
        _too_big(weight(result), f"the filter '{name}'")
        return result

    return guarded


def _is_jinja_state(value: Any) -> bool:
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(value, (Environment, EvalContext, Context))


def _bounded_range(*args: int) -> range:
    from jinja2.sandbox import safe_range

    _int_args(args, {})
    return safe_range(*args)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    """transformers' ``tojson`` (no HTML escaping)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> Any:
    """The sandboxed environment templates render in: transformers' (trim_blocks, lstrip_blocks,
    loopcontrols, ``{% generation %}``, tojson, raise_exception, strftime_now) with the checks."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with it): its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    class Checked(NodeTransformer):
        """Every loop's items and every ``~`` concatenation go through the environment's checks."""

        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = nodes.Call(
                nodes.EnvironmentAttribute("bounded_loop"), [node.iter], [], None, None, lineno=node.lineno
            )
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            parts = nodes.Tuple(node.nodes, "load", lineno=node.lineno)
            return nodes.Call(nodes.EnvironmentAttribute("bounded_concat"), [parts], [], None, None, lineno=node.lineno)

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def _parse(self, source: str, name: Any, filename: Any) -> Any:
            return Checked().visit(super()._parse(source, name, filename))

        def bounded_loop(self, items: Any) -> Iterator[Any]:
            for item in items:
                _tick()
                yield item

        def bounded_concat(self, parts: tuple[Any, ...]) -> str:
            texts = [str(p) for p in parts]
            _too_big(sum(map(len, texts)), "a '~' concatenation")
            return "".join(texts)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _tick()
            bound = getattr(__obj, "__self__", None)
            if bound is None:  # the sandbox's str.format wrapper
                bound = getattr(getattr(__obj, "__wrapped__", None), "__self__", None)
            _check_call(getattr(__obj, "__name__", "call"), bound, args, kwargs)
            result = super().call(__context, __obj, *args, **kwargs)
            _too_big(weight(result), f"{getattr(__obj, '__name__', 'a call')}()")
            return result

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _tick()
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if math.log2(abs(left)) * right > MAX_INT_BITS:
                    raise TemplateLimit(f"{left} ** {right} has over {MAX_INT_BITS} bits")
            elif operator == "*" and isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise TemplateLimit(f"a product of over {MAX_INT_BITS} bits")
            elif operator == "*" and (isinstance(left, int) or isinstance(right, int)):
                count, seq = (left, right) if isinstance(left, int) else (right, left)
                _too_big(weight(seq) * max(int(count), 0), "a '*' repetition")
            elif operator == "+":
                _too_big(weight(left) + weight(right), "a '+'")
            elif operator == "%" and isinstance(left, str):
                values = right if isinstance(right, tuple) else (right,)
                _int_args(values, {})
                _too_big(_format_size(left, "%", values), "a '%' format")
            result = super().call_binop(context, operator, left, right)
            if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
                raise TemplateLimit(f"a number of over {MAX_INT_BITS} bits")
            return result

        def getattr(self, obj: Any, attribute: str) -> Any:
            _tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            _tick()
            return super().getitem(obj, argument)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.pop("lipsum", None)
    env.globals.update(range=_bounded_range, raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    return _environment().from_string(template)


def compile_template(template: str, name: str) -> Any:
    """``template`` compiled (cached), or a ConfigError naming ``name`` and the line of a syntax error."""
    from jinja2 import TemplateSyntaxError

    name_template(template, name)
    try:
        return _guarded(lambda: _compiled(template))
    except TemplateSyntaxError as exc:
        raise ConfigError(f"{name} is not a valid Jinja template: line {exc.lineno}: {exc.message}.") from None
    except (TemplateLimit, RecursionError, MemoryError) as exc:
        raise ConfigError(f"{name} cannot be compiled: {_reason(exc)}.") from None


def _guarded(work: Any, seconds: float | None = None) -> Any:
    outer = getattr(_RENDER, "deadline", None)
    _RENDER.deadline = time.monotonic() + (RENDER_SECONDS if seconds is None else seconds)
    try:
        return work()
    finally:
        _RENDER.deadline = outer


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "it recursed too deeply (a macro that calls itself without end?)"
    if isinstance(exc, MemoryError):
        return "it ran out of memory"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def render(template: str, variables: Mapping[str, Any], where: str = "") -> str:
    """``template`` rendered with ``variables``, within `RENDER_SECONDS` and `MAX_RENDER_CHARS`; a
    template that fails or goes past a limit is a ConfigError naming ``where`` and the template."""
    name = template_name(template)
    prefix = f"{where}: " if where else ""
    compiled = compile_template(template, name)

    def run() -> str:
        out, size = [], 0
        for piece in compiled.generate(**variables):
            _tick()
            size += len(piece)
            _too_big(size, "the rendered text")
            out.append(piece)
        return "".join(out)

    try:
        return _guarded(run)
    except ConfigError:
        raise
    except Exception as exc:  # a limit, the template's own errors (undefined names, raise_exception), RecursionError
        raise ConfigError(f"{prefix}{name} could not render it: {_reason(exc)}.") from None


def render_chat(
    tokenizer: Any,
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    where: str = "",
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """What ``tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template, ...)``
    writes (the same variables: messages, tools, documents, add_generation_prompt and the tokenizer's
    special tokens), rendered by `render` within the limits."""
    variables = {
        **dict(getattr(tokenizer, "special_tokens_map", None) or {}),
        "messages": [dict(m) for m in messages],
        "tools": [dict(t) for t in tools] if tools is not None else None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
    }
    return render(template, variables, where)


def read_template(path: Path, name: str) -> str:
    """The chat template in file ``path``: UTF-8 text of at most `MAX_TEMPLATE_BYTES` that compiles;
    errors name ``name`` (e.g. ``data.chat_template 'chat.jinja'``)."""
    try:
        size = path.stat().st_size
        if size > MAX_TEMPLATE_BYTES:
            raise ConfigError(
                f"{name} is {size:,} bytes, over the {MAX_TEMPLATE_BYTES >> 20} MiB a chat template may be "
                "(flowrl.tasks.bounded.MAX_TEMPLATE_BYTES)."
            )
        with path.open("rb") as f:
            raw = f.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{name} cannot be read ({exc.strerror or exc}).") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{name} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); a chat template is a "
            "Jinja text file."
        ) from None
    if "\x00" in text:
        raise ConfigError(f"{name} holds NUL bytes; a chat template is a Jinja text file.")
    compile_template(text, name)
    return text
