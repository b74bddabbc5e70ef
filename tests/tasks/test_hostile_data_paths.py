"""Hostile --data and chat template paths and files (formats, special files, odd names, odd rows):
each is exit 2 from the CLI with one paragraph naming the file, or read as the user meant."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from helpers import SMALL_RUN, run_cli, write_jsonl

from flowrl.errors import ConfigError
from flowrl.specs import build_config
from flowrl.tasks import dataset
from flowrl.tasks.dataset import load

ROWS = [{"prompt": "ab", "answer": "ab"}, {"prompt": "cd", "answer": "cd"}]


def cfg_for(train: str, **data) -> object:
    return build_config({"data": {"train": train, "verifier": "exact", **data}})


def refused(cfg) -> str:
    with pytest.raises(ConfigError) as err:
        load(cfg)
    return " ".join(str(err.value).split())


def plan_refuses(capsys, *args: str) -> str:
    """`flowrl plan grpo ARGS` (the data is read at plan time): exit 2 with one error paragraph."""
    sets = [a for s in SMALL_RUN for a in ("--set", s)]
    code, _, err = run_cli(capsys, "plan", "grpo", "--set", "data.verifier=exact", *sets, *args)
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("flowrl: error:")
    assert "crashed" not in err, err
    return err


# ---------------------------------------------------------------- paths


def test_a_data_path_too_long_for_the_file_system_is_refused_naming_it(capsys):
    err = plan_refuses(capsys, "--data", "a" * 5000 + ".jsonl")
    assert "data.train file" in err and "cannot be read" in err


def test_an_empty_data_path_is_refused_rather_than_reading_the_current_folder(capsys):
    err = plan_refuses(capsys, "--data", "")
    assert "data.train names an empty path" in err


def test_a_chat_template_path_too_long_is_refused_naming_the_setting(tmp_path, capsys):
    path = write_jsonl(tmp_path / "ok.jsonl", ROWS)
    err = plan_refuses(capsys, "--data", path, "--set", "data.chat_template=" + "t" * 5000)
    assert "data.chat_template" in err and "is not a file" in err


def test_a_data_path_with_a_newline_is_read(tmp_path):
    path = write_jsonl(tmp_path / "new\nline.jsonl", ROWS)
    assert len(load(cfg_for(path)).train) == 2


def test_a_symlink_loop_is_refused_naming_the_loop(tmp_path):
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    assert "loop.jsonl' cannot be read (Too many levels of symbolic links)" in refused(cfg_for(str(loop)))


def test_a_dangling_symlink_is_refused_as_missing(tmp_path):
    link = tmp_path / "gone.jsonl"
    link.symlink_to(tmp_path / "nowhere" / "x.jsonl")
    assert "does not exist" in refused(cfg_for(str(link)))


def test_a_path_through_a_file_is_refused_naming_it(tmp_path):
    path = write_jsonl(tmp_path / "ok.jsonl", ROWS)
    assert "ok.jsonl/x.jsonl' cannot be read (Not a directory)" in refused(cfg_for(path + "/x.jsonl"))


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_device_linked_as_a_data_file_is_refused_unread(tmp_path, device):
    link = tmp_path / "rows.jsonl"
    link.symlink_to(device)
    assert device in refused(cfg_for(str(link)))


def test_a_fifo_as_a_data_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    assert "is empty" in refused(cfg_for(str(fifo)))


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_a_chat_template_that_is_no_regular_file_is_refused_unread(tmp_path, kind):
    path = write_jsonl(tmp_path / "ok.jsonl", ROWS)
    template = tmp_path / "chat.jinja"
    if kind == "fifo":
        os.mkfifo(template)
    elif kind == "device":
        template.symlink_to("/dev/zero")
    else:
        template.mkdir()
    assert "is not a file" in refused(cfg_for(path, chat_template=str(template)))


@pytest.mark.parametrize("template", ["", "{# renders nothing #}"])
def test_a_chat_template_that_renders_no_text_is_refused_naming_the_row(tmp_path, template):
    path = write_jsonl(tmp_path / "ok.jsonl", ROWS)
    (tmp_path / "chat.jinja").write_text(template)
    err = refused(cfg_for(path, chat_template=str(tmp_path / "chat.jinja")))
    assert "ok.jsonl' row 1" in err and "renders it as no text" in err


def test_an_empty_folder_or_a_folder_named_like_a_file_is_no_saved_dataset(tmp_path):
    (tmp_path / "rows.jsonl").mkdir()
    assert "is not a datasets.save_to_disk folder" in refused(cfg_for(str(tmp_path / "rows.jsonl")))


def test_the_root_folder_as_data_is_refused_without_walking_it(monkeypatch):
    walked = []
    monkeypatch.setattr(Path, "rglob", lambda self, *a: walked.append(self) or iter(()))
    assert "is not a datasets.save_to_disk folder" in refused(cfg_for("/"))
    assert not walked


def test_a_data_folder_is_stamped_from_two_levels_only_and_a_dangling_link_does_not_break_it(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "deep").mkdir()
    (tmp_path / "train" / "state.json").write_text("{}")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = dataset._stamp(str(tmp_path))
    (tmp_path / "train" / "deep" / "big").write_bytes(b"x" * 1000)  # a third level: not looked at
    assert dataset._stamp(str(tmp_path)) == before
    (tmp_path / "train" / "state.json").write_text('{"a": 1}')
    assert dataset._stamp(str(tmp_path)) != before


def test_a_folder_of_many_entries_is_never_taken_as_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(dataset, "_STAMP_ENTRIES", 3)
    for i in range(5):
        (tmp_path / f"f{i}").write_text("x")
    assert dataset._stamp(str(tmp_path)) != dataset._stamp(str(tmp_path))


# ---------------------------------------------------------------- formats and rows


def _write(tmp_path: Path, name: str, content: str | bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


FORMAT_CASES = [
    ("h.csv", "prompt,answer\n", "cannot be read as csv"),
    ("ws.csv", "   \n\n  \n", "cannot be read as csv"),
    ("rag.csv", "prompt,answer\nab,ab,zz,yy\ncd\n", "row 2: the prompt ('prompt') is NoneType"),
    ("num.csv", "prompt,answer\n1,2\n", "row 1: the prompt ('prompt') is int 1"),
    ("lat.csv", b"prompt,answer\n\xe9\xe9,x\n", "save the file as UTF-8"),
    ("bin.csv", bytes(range(256)) * 20, "cannot be read as csv"),
    ("x.jsonl.gz", gzip.compress(b'{"prompt":"ab","answer":"ab"}\n', mtime=0), "unknown format '.gz'"),
    ("x.arrow", b"\x00" * 100, "unknown format '.arrow'"),
    ("nosuffix", '{"prompt":"ab"}\n', "unknown format ''"),
    ("a.json", "[1,2,3]", "item 1 is not an object of columns"),
    ("e.json", "[]", "holds no rows"),
    ("s.json", "42", "line 1 is not a JSON object of columns"),
    ("n.json", "null", "line 1 is not a JSON object of columns"),
    ("ws.json", "   \n \n", "holds no rows"),
    ("ws.jsonl", "   \n \n\t\n", "holds no rows"),
    ("sur.jsonl", b'{"prompt":"\xed\xa0\x80","answer":"a"}\n', "line 1 is not UTF-8"),
    ("u16.jsonl", '{"prompt":"ab","answer":"a"}\n'.encode("utf-16"), "line 1 is not UTF-8"),
    ("hi.jsonl", '{"prompt":"ab","answer":"a","x":' + "9" * 5000 + "}\n", "line 1 is not valid JSON"),
    ("nan.jsonl", '{"prompt":"ab","answer":NaN}\n', "line 1 is not valid JSON"),
    ("inf.jsonl", '{"prompt":"ab","answer":"a","x":Infinity}\n', "line 1 is not valid JSON"),
    ("cr.jsonl", '{"prompt":"ab","answer":"a"}\r{"prompt":"cd","answer":"c"}\r', "line 1 is not valid JSON"),
    ("pd.jsonl", '{"prompt":{"a":1},"answer":"a"}\n', "row 1: the prompt ('prompt') is dict"),
    ("pl.jsonl", '{"prompt":["a","b"],"answer":"a"}\n', "row 1: the prompt ('prompt') is list"),
    ("mr.jsonl", '{"prompt":[{"role":5,"content":"x"}],"answer":"a"}\n', "message 1 of 'prompt'"),
    ("g.parquet", bytes(range(256)) * 16, "cannot be read as parquet"),
    ("m.parquet", b"PAR1PAR1", "cannot be read as parquet"),
]


@pytest.mark.parametrize(("name", "content", "expected"), FORMAT_CASES, ids=[c[0] for c in FORMAT_CASES])
def test_a_hostile_file_of_any_format_is_refused_naming_it(tmp_path, name, content, expected):
    err = refused(cfg_for(_write(tmp_path, name, content)))
    assert name in err and expected in err, err


@pytest.mark.parametrize(
    "rows",
    [
        [{"prompt": "ab", "answer": {"x": 1}}],
        [{"prompt": "ab", "answer": None}],
        [{"prompt": "ab", "answer": "a"}, {"prompt": "ab", "answer": 5}, {"prompt": "ab", "answer": [1]}],
        [{"": "ab", "prompt": "ab", "answer": "a"}],
        [{"prompt": "ab", "answer": "a", "x": 1}, {"prompt": "ab", "answer": "a", "y": "s"}],
    ],
)
def test_odd_but_valid_rows_are_read(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(load(cfg_for(str(path))).train) == len(rows)


def test_a_nul_in_a_csv_cell_is_read(tmp_path):
    assert len(load(cfg_for(_write(tmp_path, "nul.csv", b"prompt,answer\nab\x00,cd\n"))).train) == 1
