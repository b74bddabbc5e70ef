"""The docs' generated reference pages: the CLI from ``flowrl``'s argument parser, the config from the
msgspec specs in ``flowrl/specs.py`` (fields, types, defaults and the comments that document them).

mkdocs calls ``on_page_markdown`` for every page (``hooks:`` in mkdocs.yml); a page that holds the line
``<!-- generated: cli -->`` or ``<!-- generated: config -->`` gets the reference in its place, built from
the code at build time, so it cannot go stale.
"""

from __future__ import annotations

import argparse
import ast
import html
import inspect
import io
import tokenize
from typing import Any

import msgspec

CLI_MARK = "<!-- generated: cli -->"
CONFIG_MARK = "<!-- generated: config -->"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    if CONFIG_MARK in markdown:
        markdown = markdown.replace(CONFIG_MARK, config_reference())
    return markdown


# --- the CLI -------------------------------------------------------------------------------------------


def cli_parser() -> argparse.ArgumentParser:
    """``flowrl``'s parser with the commands the built-in plugins add (no installed plugin's)."""
    from flowrl.cli import build_parser
    from flowrl.plugins.manager import load_plugins

    parser = build_parser()
    sub = _subcommands(parser)
    for entry in load_plugins(entry_points=False, kinds=("cli_commands",))[1].entries("cli_commands"):
        p = sub.add_parser(entry.name, help=entry.meta.get("help", ""))
        entry.obj(p)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(f"`{s}`" for s in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (action.dest.upper() if not action.choices else "{" + ",".join(action.choices) + "}")
    return f"{names} `{metavar}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS):
        return ""
    return _code(str(action.default))


def cli_reference() -> str:
    parser = cli_parser()
    sub = _subcommands(parser)
    helps = {a.dest: a.help or "" for a in sub._choices_actions}
    out = [f"```text\n{parser.format_usage().strip()}\n```", ""]
    for name, p in sub.choices.items():
        out += [f"## flowrl {name}", "", _cell(helps.get(name, "")), ""]
        out += [f"```text\n{p.format_usage().strip()}\n```", ""]
        rows = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
        if rows:
            out += ["| argument | default | what it does |", "|---|---|---|"]
            for a in rows:
                out.append(f"| {_option(a)} | {_default(a)} | {_cell(a.help or '')} |")
            out.append("")
    return "\n".join(out)


# --- the config ----------------------------------------------------------------------------------------


def _field_comments(cls: type) -> dict[str, str]:
    """field -> its comment in the class's source: the comment lines right above it and the one after it."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        text = " ".join([*above, comments.get(node.lineno, "")]).strip()
        out[node.target.id] = text
    return out


def _annotations(cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(cls)).body[0]
    return {
        n.target.id: ast.unparse(n.annotation)
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def _struct_type(annotation: Any) -> type | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct) else None


def _value(field: msgspec.structs.FieldInfo) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return msgspec.NODEFAULT


def _code(text: str) -> str:
    """Inline code that survives a table cell: HTML-escaped, its pipes as entities."""
    return "<code>" + html.escape(text).replace("|", "&#124;") + "</code>"


def _show(value: Any) -> str:
    if value is msgspec.NODEFAULT:
        return "(required)"
    if isinstance(value, tuple):
        value = list(value)
    return _code(msgspec.json.encode(value).decode())


def _sections(cls: type, prefix: str) -> list[tuple[str, type]]:
    out = [(prefix, cls)]
    for f in msgspec.structs.fields(cls):
        sub = _struct_type(f.type)
        if sub is not None:
            out += _sections(sub, f"{prefix}.{f.name}" if prefix else f.name)
    return out


def config_reference() -> str:
    from flowrl.specs import RunConfig

    out: list[str] = []
    for path, cls in _sections(RunConfig, ""):
        title = f"`{path}`" if path else "Top level"
        out += [f"## {title}", ""]
        doc = inspect.getdoc(cls)
        if doc and cls.__doc__ is not None and "__doc__" in vars(cls):
            out += [" ".join(doc.split()), ""]
        comments, types = _field_comments(cls), _annotations(cls)
        out += ["| field | type | default | what it sets |", "|---|---|---|---|"]
        for f in msgspec.structs.fields(cls):
            key = f"{path}.{f.name}" if path else f.name
            if _struct_type(f.type) is not None:
                out.append(f"| `{key}` | section | | see [`{key}`](#{key.replace('.', '')}) |")
                continue
            out.append(
                f"| `{key}` | {_code(types.get(f.name, ''))} | {_show(_value(f))} | {_cell(comments.get(f.name, ''))} |"
            )
        out.append("")
    return "\n".join(out)
