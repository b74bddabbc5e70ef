"""A ``--model`` folder as untrusted input: a tiny valid HF folder (the tiny chat model) with one thing
broken per case -- tokenizer files missing, garbage, deeply nested or oversized; tokenizer_config.json,
generation_config.json and config.json of the wrong types, NaN, negative or huge sizes, missing fields;
model.safetensors truncated, empty, with a header claiming terabytes or nested deeply, tensors of the
wrong shape or dtype, missing or extra; the folder a link loop -- is refused by `flowrl plan` and
`flowrl run` with exit 2 and one paragraph naming the folder or file, never a traceback."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import SMALL_RUN, run_cli

from flowrl.contract import model as model_contract

SETS = [a for s in SMALL_RUN for a in ("--set", s)]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _deep(n: int = 100_000) -> str:
    return "[" * n + "]" * n


def _write(name: str, content: str | bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())


def _json(name: str, **fields) -> Callable[[Path], None]:
    def change(d: Path) -> None:
        data = json.loads((d / name).read_text())
        data.update(fields)
        (d / name).write_text(json.dumps(data))

    return change


def _drop_field(name: str, key: str) -> Callable[[Path], None]:
    def change(d: Path) -> None:
        data = json.loads((d / name).read_text())
        del data[key]
        (d / name).write_text(json.dumps(data))

    return change


def _raw_field(key: str, raw: str) -> Callable[[Path], None]:
    """config.json with ``key``'s value written as ``raw`` JSON text (NaN, a 5000-digit number)."""

    def change(d: Path) -> None:
        data = json.loads((d / "config.json").read_text())
        data[key] = "@@"
        (d / "config.json").write_text(json.dumps(data).replace('"@@"', raw))

    return change


def _remove(*names: str) -> Callable[[Path], None]:
    return lambda d: [(d / n).unlink() for n in names if (d / n).exists()]


def _header(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


def _tensors(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})

    return edit


def _embed(tensors: dict) -> str:
    return next(k for k in tensors if "embed_tokens" in k)


def _drop_mlp(t: dict) -> None:
    t.pop(next(k for k in t if "mlp" in k))


def _wrong_shape(t: dict) -> None:
    t[_embed(t)] = t[_embed(t)][:5, :7].contiguous()


def _extra(t: dict) -> None:
    import torch

    t["model.bogus.weight"] = torch.zeros(3)


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _a_folder(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


def _index_escape(d: Path) -> None:
    (d / "model.safetensors").rename(d / "part-1.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../../../etc/passwd"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_garbage(d: Path) -> None:
    (d / "model.safetensors").rename(d / "part-1.safetensors")
    (d / "model.safetensors.index.json").write_text("{not json")


#: case -> (how the folder is broken, a text the error names besides the folder)
RUN_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "no tokenizer files": (_remove("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"), "tokenizer"),
    "tokenizer.json garbage": (_write("tokenizer.json", "{not json"), "tokenizer"),
    "tokenizer.json binary": (_write("tokenizer.json", bytes(range(256)) * 4), "tokenizer"),
    "tokenizer.json nested deeply": (_write("tokenizer.json", _deep()), "tokenizer"),
    "tokenizer.json a list": (_write("tokenizer.json", "[]"), "tokenizer"),
    "tokenizer_config.json garbage": (_write("tokenizer_config.json", "{nope"), "tokenizer"),
    "tokenizer_config.json nested deeply": (_write("tokenizer_config.json", '{"a": ' + _deep() + "}"), "tokenizer"),
    "an eos_token that is a number": (_json("tokenizer_config.json", eos_token=5), "tokenizer"),
    "an eos_token that is a list": (_json("tokenizer_config.json", eos_token=[1, 2]), "tokenizer"),
    "a model_max_length that is a word": (_json("tokenizer_config.json", model_max_length="big"), "model_max_length"),
    "generation_config.json a list": (_write("generation_config.json", "[1]"), ""),
    "generation_config.json nested deeply": (_write("generation_config.json", '{"a": ' + _deep() + "}"), ""),
    "model.safetensors empty": (_write("model.safetensors", b""), ""),
    "model.safetensors truncated": (_truncate, ""),
    "a header claiming terabytes": (_write("model.safetensors", struct.pack("<Q", 1 << 42) + b"{}"), ""),
    "a header nested deeply": (_write("model.safetensors", _header(('{"a": ' + _deep(50_000) + "}").encode())), ""),
    "a header that is not JSON": (_write("model.safetensors", _header(b"\xff\xfe not json")), ""),
    "offsets past the end": (
        _write(
            "model.safetensors", _header(b'{"w": {"dtype": "F32", "shape": [300, 32], "data_offsets": [0, 38400]}}')
        ),
        "",
    ),
    "a shape of 10^18 elements": (
        _write(
            "model.safetensors",
            _header(b'{"w": {"dtype": "F32", "shape": [1000000000000, 1000000], "data_offsets": [0, 4]}}', b"\0" * 4),
        ),  # fmt: skip
        "",
    ),
    "a missing tensor": (_tensors(_drop_mlp), ""),
    "a tensor of another shape": (_tensors(_wrong_shape), ""),
    "model.safetensors a folder": (_a_folder, ""),
    "an index that is not JSON": (_index_garbage, ""),
    "an index naming a file outside": (_index_escape, ""),
}


@pytest.fixture
def broken(chat_model, tmp_path) -> Callable[[Callable[[Path], None]], Path]:
    def make(change: Callable[[Path], None]) -> Path:
        folder = Path(shutil.copytree(chat_model, tmp_path / "model"))
        change(folder)
        return folder

    return make


def _refused(capsys, folder: Path, argv: list[str], needle: str) -> str:
    code, _, err = run_cli(capsys, *argv)
    assert "Traceback" not in err, err
    assert code == 2, err
    assert needle in err, err
    if needle != "GiB":  # the memory check names the sizes and the group, not the folder
        assert str(folder) in err, err
    return err


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_a_broken_model_folder_is_refused_by_run_naming_it(case, broken, tmp_path, capsys):
    change, needle = RUN_CASES[case]
    folder = broken(change)
    argv = ["run", "grpo", "--model", str(folder), "--steps", "1", "--out", str(tmp_path / "runs"), *SETS]
    _refused(capsys, folder, argv, needle)
    assert not list((tmp_path / "runs").glob("*/metrics.jsonl"))


#: case -> (how config.json is broken, the field the error names)
PLAN_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "a negative hidden_size": (_json("config.json", hidden_size=-32), "hidden"),
    "a NaN hidden_size": (_raw_field("hidden_size", "NaN"), "hidden_size"),
    "a fractional hidden_size": (_json("config.json", hidden_size=32.5), "hidden_size"),
    "a hidden_size that is a string": (_json("config.json", hidden_size="32"), "hidden_size"),
    "a num_hidden_layers that is a bool": (_json("config.json", num_hidden_layers=True), "num_hidden_layers"),
    "a billion layers": (_json("config.json", num_hidden_layers=10**9), "GiB"),
    "a vocabulary of 10^12": (_json("config.json", vocab_size=10**12), "GiB"),
    "a 5000-digit hidden_size": (_raw_field("hidden_size", "9" * 5000), "config.json"),
    "no num_hidden_layers": (_drop_field("config.json", "num_hidden_layers"), "num_hidden_layers"),
    "config.json nested deeply": (_write("config.json", '{"a": ' + _deep() + "}"), "config.json"),
    "config.json garbage": (_write("config.json", "{nope"), "config.json"),
    "heads that do not divide": (_json("config.json", num_attention_heads=3, head_dim=None), "heads"),
    "zero kv heads": (_json("config.json", num_key_value_heads=0), "kv_heads"),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_a_broken_config_json_is_refused_by_plan_naming_the_field(case, broken, capsys):
    change, needle = PLAN_CASES[case]
    folder = broken(change)
    _refused(capsys, folder, ["plan", "grpo", "--model", str(folder)], needle)


@pytest.mark.parametrize(
    ("name", "cap"),
    [
        ("tokenizer.json", "MAX_VOCAB_FILE_BYTES"),
        ("tokenizer_config.json", "MAX_CONFIG_FILE_BYTES"),
        ("config.json", "MAX_CONFIG_FILE_BYTES"),
        ("generation_config.json", "MAX_CONFIG_FILE_BYTES"),
    ],
)
def test_an_oversized_file_is_refused_before_it_is_parsed(name, cap, broken, monkeypatch, capsys):
    folder = broken(lambda d: None)
    size = max(9000, (folder / name).stat().st_size)
    with (folder / name).open("a") as fh:
        fh.write(" " * (size - (folder / name).stat().st_size + 1))  # still valid: JSON's trailing space
    monkeypatch.setattr(model_contract, cap, size)
    err = _refused(capsys, folder, ["plan", "grpo", "--model", str(folder)], name)
    assert f"more than flowrl reads for it ({size} bytes)" in err


def test_a_model_folder_that_is_a_link_loop_is_refused(tmp_path, capsys):
    loop = tmp_path / "model"
    loop.symlink_to(loop)
    code, _, err = run_cli(capsys, "plan", "grpo", "--model", str(loop))
    assert code == 2 and "Traceback" not in err and str(loop) in err, err


@pytest.mark.slow
def test_a_generation_config_transformers_calls_invalid_is_kept_and_checkpointed(broken, tmp_path, capsys):
    folder = broken(_json("generation_config.json", temperature=0.7, top_k=5))  # sampling flags, do_sample unset
    code, _, err = run_cli(
        capsys, "run", "grpo", "--model", str(folder), "--steps", "1", "--out", str(tmp_path / "runs"), *SETS
    )
    assert code == 0, err
    saved = next((tmp_path / "runs").glob("*/checkpoints/step-000000/models/actor/generation_config.json"))
    assert json.loads(saved.read_text())["top_k"] == 5
