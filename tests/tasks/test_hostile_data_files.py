"""Hostile data files, chat templates and model output: each is refused with one paragraph naming
the file, line, row, field or template at fault (exit 2 from the CLI), or handled safely, and no
single input costs unbounded time or memory (`flowrl.tasks.bounded`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
from helpers import run_cli, write_jsonl

from flowrl.errors import ConfigError
from flowrl.specs import build_config
from flowrl.tasks import bounded
from flowrl.tasks.dataset import load

ROWS = [{"prompt": f"what is {a}+{a}", "answer": str(2 * a)} for a in range(4)]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
SILENT_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def cfg_for(train: str, model: str | None = None, **data) -> object:
    return build_config({"model": model, "data": {"train": train, **data}})


def refused(cfg) -> str:
    with pytest.raises(ConfigError) as err:
        load(cfg)
    return " ".join(str(err.value).split())


def cli_refuses(capsys, tmp_path, *args: str) -> str:
    code, _, err = run_cli(capsys, "run", "grpo", *args, "--steps", "1", "--out", str(tmp_path / "out"))
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("flowrl: error:")
    return err


@pytest.fixture
def quick_renders(monkeypatch):
    """A render's time limit of half a second (the limit's number, not the machine's speed, is what is tested)."""
    monkeypatch.setattr(bounded, "RENDER_SECONDS", 0.5)


# ---------------------------------------------------------------- JSON nesting


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_a_row_nested_past_the_depth_limit_is_refused_naming_file_and_line(tmp_path, depth):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + '{"prompt": ' + "[" * depth + "]" * depth + ', "answer": "1"}\n')
    message = refused(cfg_for(str(path)))
    assert "deep.jsonl" in message and "line 2" in message and f"nested more than {bounded.MAX_JSON_DEPTH}" in message


def test_a_deeply_nested_json_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    message = refused(cfg_for(str(path)))
    assert "deep.json" in message and "nested more than 64" in message


def test_the_depth_limit_counts_arrays_and_objects_but_not_brackets_in_strings():
    at_limit = "[" * bounded.MAX_JSON_DEPTH + "]" * bounded.MAX_JSON_DEPTH
    assert bounded.loads(at_limit) is not None
    with pytest.raises(bounded.JSONRefused, match="nested more than 64"):
        bounded.loads("[" + at_limit + "]")
    assert bounded.loads(json.dumps({"text": "[" * 10_000})) == {"text": "[" * 10_000}
    assert bounded.json_depth('{"a": [{"b": "]]]"}, [1]]}') == 3


def test_a_deeply_nested_row_through_the_cli_is_exit_2_naming_the_file(tmp_path, capsys):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "1"}\n')
    err = cli_refuses(capsys, tmp_path, "--data", str(path))
    assert "deep.jsonl" in err and "line 1" in err


@pytest.mark.parametrize("nested_as_string", [False, True])
def test_a_tool_call_with_deeply_nested_arguments_is_a_malformed_call(nested_as_string):
    from flowrl.tasks.tools import parse_tool_calls

    deep = "[" * 100_000 + "]" * 100_000
    args = json.dumps(deep) if nested_as_string else deep
    good = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    text = f'<tool_call>{{"name": "add", "arguments": {args}}}</tool_call>{good}'
    calls, bad = parse_tool_calls(text)
    assert bad == 1 and [c.name for c in calls] == ["add"]


def test_an_episode_goes_on_past_a_deeply_nested_tool_call_as_past_any_malformed_one():
    from flowrl.contract.data import Turn
    from flowrl.tasks.environments import arithmetic
    from flowrl.tasks.tools import parse_tool_calls

    env = arithmetic(None, penalty=-1.0)
    text = '<tool_call>{"name": "add", "arguments": ' + "{" * 50_000 + "</tool_call>"
    calls, bad = parse_tool_calls(text)
    step = env.episode(None).step(Turn(role="assistant", text=text, tool_calls=calls, tokens=1))
    assert bad == 1 and step.done and step.reward == -1.0  # as a turn with only a malformed call


# ---------------------------------------------------------------- long lines and big files


@pytest.mark.parametrize("cap", [None, 1 << 20], ids=["default-cap", "1-mib-cap"])
def test_a_50_mb_line_is_refused_naming_the_line_having_held_no_more_than_the_cap(tmp_path, monkeypatch, cap):
    import datasets  # noqa: F401  (imported before the measure: its import is not the line's cost)

    if cap is not None:
        monkeypatch.setattr(bounded, "MAX_LINE_BYTES", cap)
    path = tmp_path / "long.jsonl"
    with path.open("wb") as f:
        f.write(json.dumps(ROWS[0]).encode() + b"\n")
        f.write(b'{"prompt": "' + b"x" * (50 << 20) + b'", "answer": "1"}\n')
    cfg = cfg_for(str(path))
    tracemalloc.start()
    try:
        message = refused(cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "long.jsonl" in message and "line 2 is longer than" in message
    # a few copies of the cap (the buffered readline's), never the 50 MB line
    assert peak < 4 * bounded.MAX_LINE_BYTES + (1 << 20) < (50 << 20)


def test_bounded_lines_stop_a_long_line_at_the_cap(tmp_path):
    path = tmp_path / "lines.jsonl"
    path.write_bytes(b"short\n" + b"y" * 5000 + b"\nafter\n")
    with path.open("rb") as f:
        lines = bounded.lines(f, limit=1000)
        assert next(lines) == (1, b"short\n")
        with pytest.raises(bounded.JSONRefused, match="line 2 is longer"):
            next(lines)
        assert f.tell() <= 6 + 1001


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_a_prompt_past_the_character_cap_in_any_format_is_refused_before_tokenizing(tmp_path, monkeypatch, suffix):
    import datasets

    monkeypatch.setattr(bounded, "MAX_PROMPT_CHARS", 1000)
    path = tmp_path / f"rows.{suffix}"
    table = datasets.Dataset.from_list([*ROWS, {"prompt": "x" * 1001, "answer": "1"}])
    table.to_parquet(str(path)) if suffix == "parquet" else table.to_csv(str(path), index=False)
    message = refused(cfg_for(str(path)))
    assert f"rows.{suffix}' row 5: the prompt is 1,001 characters, over the 1,000" in message


def test_a_json_file_over_the_cap_is_refused_and_told_to_use_jsonl(tmp_path, monkeypatch):
    monkeypatch.setattr(bounded, "MAX_JSON_FILE_BYTES", 1000)
    path = tmp_path / "big.json"
    path.write_text(json.dumps(ROWS * 20))
    message = refused(cfg_for(str(path)))
    assert "big.json" in message and "jsonl" in message and "MAX_JSON_FILE_BYTES" in message


def test_a_json_file_under_the_cap_is_read(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS))
    assert len(load(cfg_for(str(path))).train) == len(ROWS)


# ---------------------------------------------------------------- rows


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            b'{"prompt": ' + b"9" * 5000 + b', "answer": "1"}\n',
            "line 1 is not valid JSON (Exceeds the limit (4300 digits)",
        ),
        (b'{"prompt": 1e30, "answer": "1"}\n', "row 1: the prompt ('prompt') is float"),
        (b'{"prompt": {"text": "hi"}, "answer": "1"}\n', "row 1: the prompt ('prompt') is dict"),
        (b'{"prompt": [{"role": 3, "content": "hi"}], "answer": "1"}\n', "message 1 of 'prompt' must have text 'role'"),
        (
            b'{"prompt": [{"role": "user"}], "answer": "1"}\n',
            "message 1 of 'prompt' must have text 'role' and 'content'",
        ),
        (b'{"prompt": [{"role": "tool", "content": "x"}], "answer": "1"}\n', "have no user turn"),
        (
            b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n',
            "line 2 is not UTF-8 text (byte 0xe9",
        ),
        (b'{"prompt": "a\x00b", "answer": "1"}\n', "line 1 is not valid JSON (Invalid control character"),
        (b'{"prompt": "a", "answer": "1"}\x00\n', "line 1 is not valid JSON (Extra data"),
        (b'"just text"\n', "line 1 is not a JSON object of columns (it is a JSON str"),
        (b"[1, 2]\n", "line 1 is not a JSON object of columns (it is a JSON list"),
        (b"", "is empty"),
        (b"\n  \n\n", "holds no rows"),
        (
            b'{"prompt": "a", "prompt": "b", "answer": "1"}\n',
            "line 1 is not valid JSON (the key 'prompt' appears twice",
        ),
        (b'{"prompt": "a", "answer": NaN}\n', "line 1 is not valid JSON (NaN is not a JSON number"),
    ],
    ids=[
        "huge-integer",
        "huge-float",
        "dict-prompt",
        "role-not-text",
        "turn-without-content",
        "no-user-turn",
        "invalid-utf8",
        "raw-nul-in-string",
        "nul-after-row",
        "row-is-text",
        "row-is-list",
        "empty-file",
        "blank-file",
        "duplicate-keys",
        "nan",
    ],
)
def test_a_bad_row_is_refused_naming_file_and_line(tmp_path, content, expected):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    message = refused(cfg_for(str(path)))
    assert "rows.jsonl" in message and expected in message


def test_a_byte_order_mark_is_read_past(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in ROWS).encode())
    task = load(cfg_for(str(path)))
    assert [p.text for p in task.train] == [r["prompt"] for r in ROWS]


def test_an_escaped_nul_in_a_prompt_is_kept_as_text(tmp_path):
    task = load(cfg_for(write_jsonl(tmp_path / "nul.jsonl", [{"prompt": "a\x00b", "answer": "1"}])))
    assert task.train[0].text == "a\x00b"


def test_a_bad_row_through_the_cli_is_exit_2_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    err = cli_refuses(capsys, tmp_path, "--data", str(path))
    assert "bad.jsonl" in err and "line 2 is not UTF-8" in err


# ---------------------------------------------------------------- arrow, parquet, save_to_disk folders


def _dataset():
    import datasets

    return datasets.Dataset.from_list(ROWS * 50)


def test_a_truncated_parquet_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "rows.parquet"
    _dataset().to_parquet(str(path))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = refused(cfg_for(str(path)))
    assert "rows.parquet" in message and "cannot be read" in message


def _saved(tmp_path: Path) -> Path:
    folder = tmp_path / "saved"
    _dataset().save_to_disk(str(folder))
    return folder


def test_a_save_to_disk_folder_is_read(tmp_path):
    assert len(load(cfg_for(str(_saved(tmp_path)))).train) == len(ROWS) * 50


def test_a_truncated_arrow_file_in_a_saved_folder_is_refused_naming_the_folder(tmp_path):
    folder = _saved(tmp_path)
    arrow = next(folder.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    message = refused(cfg_for(str(folder)))
    assert "data.train folder" in message and "saved" in message and "cannot be read" in message


def _state(folder: Path) -> dict:
    return json.loads((folder / "state.json").read_text())


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda f: (f / "state.json").write_text("{not json"), "state.json' is not valid JSON"),
        (lambda f: (f / "state.json").write_bytes(b"\xff\xfe{}"), "state.json' is not UTF-8"),
        (lambda f: (f / "state.json").write_text("[1, 2]"), "state.json is a JSON list, not an object"),
        (lambda f: (f / "state.json").write_text('{"_data_files": "x.arrow"}'), "'_data_files' is str, not list"),
        (lambda f: (f / "state.json").write_text('{"_data_files": [{"filename": 7}]}'), "names the data file 7"),
        (lambda f: (f / "state.json").write_text('{"_data_files": []}'), "names no data files"),
        (
            lambda f: (f / "state.json").write_text(json.dumps({**_state(f), "_format_kwargs": 5})),
            "'_format_kwargs' is int, not dict",
        ),
        (
            lambda f: (f / "state.json").write_text(
                json.dumps({**_state(f), "_data_files": [{"filename": "gone.arrow"}]})
            ),
            "the data file 'gone.arrow' that state.json names is not in the folder",
        ),
        (
            lambda f: (f / "state.json").write_text(
                json.dumps({**_state(f), "_data_files": [{"filename": "../../etc/passwd"}]})
            ),
            "names the data file '../../etc/passwd', which is not a file name in the folder",
        ),
        (
            lambda f: (f / "state.json").write_text(
                json.dumps({**_state(f), "_data_files": [{"filename": "/etc/passwd"}]})
            ),
            "names the data file '/etc/passwd', which is not a file name in the folder",
        ),
        (lambda f: (f / "state.json").write_text("[" * 100_000), "nested more than 64"),
        (lambda f: (f / "dataset_info.json").write_text("{oops"), "dataset_info.json' is not valid JSON"),
        (lambda f: (f / "dataset_info.json").write_text('"text"'), "dataset_info.json is not a JSON object"),
        (lambda f: (f / "state.json").unlink(), "is not a datasets.save_to_disk folder"),
    ],
    ids=[
        "state-not-json",
        "state-not-utf8",
        "state-not-object",
        "data-files-wrong-type",
        "filename-wrong-type",
        "no-data-files",
        "format-kwargs-wrong-type",
        "missing-data-file",
        "path-outside-the-folder",
        "absolute-path",
        "state-deeply-nested",
        "info-not-json",
        "info-not-object",
        "no-state",
    ],
)
def test_a_malformed_save_to_disk_folder_is_refused_naming_it(tmp_path, edit, expected):
    folder = _saved(tmp_path)
    edit(folder)
    message = refused(cfg_for(str(folder)))
    assert "data.train folder" in message and "saved" in message and expected in message


def test_a_data_file_linked_from_outside_the_folder_is_refused(tmp_path):
    folder = _saved(tmp_path)
    arrow = next(folder.glob("*.arrow"))
    outside = tmp_path / "outside.arrow"
    arrow.rename(outside)
    arrow.symlink_to(outside)
    message = refused(cfg_for(str(folder)))
    assert f"the data file '{arrow.name}' that state.json names is not in the folder" in message


def test_a_dataset_dict_naming_a_split_outside_the_folder_is_refused(tmp_path):
    import datasets

    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": _dataset()}).save_to_disk(str(folder))
    assert len(load(cfg_for(str(folder))).train) == len(ROWS) * 50
    (folder / "dataset_dict.json").write_text('{"splits": ["../train"]}')
    message = refused(cfg_for(str(folder)))
    assert "names the split '../train', which is not a folder inside it" in message


# ---------------------------------------------------------------- chat templates


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (b"\xff\xfe{{ messages }}\x00", "is not UTF-8 text (byte 0xff"),
        (b"{{ messages }}\x00", "holds NUL bytes"),
        (b"{% for m in messages %}{{ m.content }}", "is not a valid Jinja template: line 1"),
        (LOOP.encode(), "ran past the 0.5 s a render may take"),
        (SILENT_LOOP.encode(), "ran past the 0.5 s a render may take"),
        (b"{{ 'x' * 10**10 }}", "'*' repetition would hold about 10,000,000,000 characters"),
        (b"{{ 10 ** (10 ** 10) }}", "has over 65536 bits"),
        (b"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
        (
            b"{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "'~' concatenation would hold about",
        ),
        (b"{{ 'x'.ljust(10000000000) }}", "an integer argument of 10,000,000,000 is over"),
        (b"{{ '%099999999999d' % 1 }}", "'%' format would hold about"),
        (b"{{ (range(100)|list)|join('y' * 1000000) }}", "a join would hold about"),
        (b"{{ raise_exception('no tools here') }}", "could not render it: no tools here"),
    ],
    ids=[
        "binary",
        "nul",
        "syntax-error",
        "endless-loop",
        "endless-silent-loop",
        "huge-string",
        "huge-number",
        "recursive-macro",
        "doubling-concat",
        "huge-width",
        "huge-format-width",
        "huge-join",
        "raise-exception",
    ],
)
def test_a_hostile_chat_template_is_refused_naming_the_file(tmp_path, chat_model, quick_renders, template, expected):
    path = tmp_path / "chat.jinja"
    path.write_bytes(template)
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    message = refused(cfg_for(train, chat_model, chat_template=str(path)))
    assert f"data.chat_template '{path}'" in message and expected in message


def test_a_template_that_loops_for_minutes_through_the_cli_is_exit_2(tmp_path, chat_model, capsys, quick_renders):
    path = tmp_path / "loop.jinja"
    path.write_text(LOOP)
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    err = cli_refuses(capsys, tmp_path, "--model", chat_model, "--data", train, "--set", f"data.chat_template={path}")
    assert "loop.jinja" in err and "row 1" in err and "ran past" in err


def test_a_render_is_bounded_in_any_thread(quick_renders):
    outcome: list[BaseException] = []

    def work() -> None:
        try:
            bounded.render(SILENT_LOOP, {}, "thread")
        except ConfigError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and outcome and "ran past" in str(outcome[0])


def test_the_bounded_render_writes_what_transformers_writes(chat_model):
    from helpers import TOOL_TEMPLATE
    from transformers import AutoTokenizer

    from flowrl.tasks.environments import add, multiply
    from flowrl.tasks.tools import ToolEnvironment

    tok = AutoTokenizer.from_pretrained(chat_model)
    tools = ToolEnvironment([multiply, add]).tools
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "tool", "content": "4"}]
    for template in (tok.chat_template, TOOL_TEMPLATE):
        for kw in ({"add_generation_prompt": True}, {"add_generation_prompt": False, "tools": tools}):
            ours = bounded.render_chat(tok, template, messages, **kw)
            assert ours == tok.apply_chat_template(messages, tokenize=False, chat_template=template, **kw)


@pytest.mark.parametrize("template", [LOOP, "{{ 'x' * 10**10 }}{{ messages }}"], ids=["loop", "huge"])
@pytest.mark.slow
def test_tool_renders_have_the_same_limits(chat_model, quick_renders, template):
    from transformers import AutoTokenizer

    from flowrl.contract.data import Prompt
    from flowrl.tasks.tools import tool_text, with_tools

    tok = AutoTokenizer.from_pretrained(chat_model)
    bounded.name_template(template, "data.chat_template 'tools.jinja'")
    with pytest.raises(ConfigError, match="the tool results: data.chat_template 'tools.jinja' could not render it"):
        tool_text(tok, template, ["42"], ended_at_eos=True)
    prompt = Prompt(text="q", answer="", meta={}, templated=True, messages=({"role": "user", "content": "q"},))
    with pytest.raises(ConfigError, match="data.chat_template 'tools.jinja' could not render it"):
        with_tools(prompt, [{"type": "function", "function": {"name": "f"}}], tok, template)


# ---------------------------------------------------------------- prompts longer than the context


def test_without_max_prompt_tokens_prompts_past_the_context_are_dropped_and_counted(tmp_path):
    rows = [*ROWS, {"prompt": "1+1 " * 100, "answer": "2"}]  # 400 characters: past the tiny model's 128 tokens
    task = load(cfg_for(write_jsonl(tmp_path / "r.jsonl", rows)))
    assert len(task.train) == len(ROWS) and task.report.dropped_long["train"] == 1
    assert "1 dropped as longer than the model's context (128 tokens)" in task.report.lines()[0]


def test_the_context_limit_leaves_room_for_the_response_budget(tmp_path):
    rows = [*ROWS, {"prompt": "1" * 100, "answer": "2"}]  # 101 tokens: under 128, over 128 - 64
    train = write_jsonl(tmp_path / "r.jsonl", rows)
    cfg = build_config({"data": {"train": train}, "rollout": {"max_new_tokens": 64}})
    task = load(cfg)
    assert task.report.dropped_long["train"] == 1 and "less the response budget: 64 tokens" in task.report.lines()[0]
    cut = load(build_config({"data": {"train": train, "overlong": "truncate"}, "rollout": {"max_new_tokens": 64}}))
    assert cut.report.truncated["train"] == 1 and cut.prompt_tokens() == 64


def test_a_model_folders_context_comes_from_its_config(tmp_path, chat_model):
    rows = [*ROWS, {"prompt": "hello world " * 200, "answer": "2"}]  # far past the folder's 256 positions
    task = load(cfg_for(write_jsonl(tmp_path / "r.jsonl", rows), chat_model, chat_template="none"))
    assert task.report.dropped_long["train"] == 1 and "context (256 tokens)" in task.report.lines()[0]


# ---------------------------------------------------------------- a model folder's own Python


def _with_auto_map(chat_model: str, tmp_path: Path, name: str) -> str:
    folder = tmp_path / "remote"
    shutil.copytree(chat_model, folder)
    config = json.loads((folder / name).read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None], "AutoConfig": "evil.Config"}
    (folder / name).write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text("raise SystemExit('the folder's code ran')\n")
    return str(folder)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json"])
def test_a_folder_with_its_own_code_is_refused_without_trust(tmp_path, chat_model, name):
    folder = _with_auto_map(chat_model, tmp_path, name)
    message = refused(cfg_for(write_jsonl(tmp_path / "r.jsonl", ROWS), folder))
    assert f"--model '{folder}'" in message and name in message and "--trust-remote-code" in message


def test_the_tokenizer_is_read_from_the_folder_only(chat_model, monkeypatch):
    import transformers

    from flowrl.tasks.dataset import load_tokenizer

    seen = {}
    real = transformers.AutoTokenizer.from_pretrained

    def spy(folder, **kw):
        seen.update(kw)
        return real(folder, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    load_tokenizer(chat_model)
    assert seen == {"trust_remote_code": False, "local_files_only": True}


@pytest.mark.slow
def test_a_folder_with_its_own_code_never_asks_on_the_terminal(tmp_path, chat_model):
    folder = _with_auto_map(chat_model, tmp_path, "tokenizer_config.json")
    train = write_jsonl(tmp_path / "r.jsonl", ROWS)
    done = subprocess.run(
        [sys.executable, "-m", "flowrl", "run", "grpo", "--model", folder, "--data", train, "--steps", "1",
         "--out", str(tmp_path / "out")],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--trust-remote-code" in done.stderr and "Traceback" not in done.stderr and "[y/N]" not in done.stdout
