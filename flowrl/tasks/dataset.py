"""The ``data`` task: prompts from the user's files, read through the ``datasets`` library.

``flowrl run GRAPH --data train.jsonl`` (``data.train`` in a config) trains on the rows of jsonl,
json, csv or parquet files or ``datasets.save_to_disk`` folders:

- ``data.prompt_key`` names the prompt column: text, or a list of ``{role, content}`` messages;
  ``data.answer_key`` the ground truth (GSM8K's ``... #### 42`` is read as ``42``); every other
  column of a row reaches reward functions as ``prompt.meta``.
- ``data.system_prompt`` is prepended as a system turn; the tokenizer's chat template renders the
  turns (``data.chat_template``: ``auto`` uses it when the tokenizer has one, ``none`` never, or a
  Jinja template file).
- Prompts longer than ``data.max_prompt_tokens`` are dropped (counted and reported) or truncated
  (``data.overlong``); without it, the limit is the model's context (``max_position_embeddings``
  of the folder's config.json, ``tiny_model.max_position_embeddings``) less the response budget,
  but never under half the context (the engine cuts a response at the context's end).
- The run walks the rows epoch by epoch, each epoch in its own seeded order; where it is is the
  prompt stream's cursor (``prompts_drawn``), which every checkpoint holds, so a resume mid-epoch
  loses and repeats no prompt.
- ``data.verifier`` (math | exact | regex, see `flowrl.tasks.verifiers`) scores a response
  against the row's ground truth.
- Offline rows (a graph with a source node, ``graphs/sft.py``): ``data.response_key`` names the
  column of each row's response (text), trained on after its prompt; a prompt column holding a
  conversation (messages with assistant turns) needs none: it is cut at its first assistant turn,
  and every assistant turn from there on is trained (`flowrl.contract.data.Completion`). A response
  longer than the response budget is dropped or truncated by ``data.overlong``, counted.
- Preference pairs (a source with ``rows="pairs"``, ``graphs/dpo.py``): ``data.chosen_key`` and
  ``data.rejected_key`` name the columns of each row's chosen and rejected response, each text or a
  list of messages (TRL's preference format: the assistant's turns after the prompt column's; or,
  without a prompt column, whole conversations whose shared first turns are the prompt). The prompt
  gets two completions, chosen then rejected; a row either of whose responses is longer than the
  response budget is dropped or truncated by ``data.overlong``, counted.

Every problem with the user's files is a ``ConfigError`` that names the file, row, column or
field at fault. Every file is untrusted (`flowrl.tasks.bounded` holds the limits): a jsonl line is
read with a bounded ``readline`` and refused past 8 MiB, JSON nested past 64 levels is refused
before it is parsed, a prompt of over 8 Mi characters (any format) before it is tokenized, a .json
file (parsed whole) is refused past 64 MiB (give jsonl), a ``save_to_disk`` folder's JSON is
checked (its data files are plain files in the folder: a path in state.json never reaches outside
it) before ``datasets`` reads it, and chat templates render within a time and size limit. A model
folder's tokenizer is read from its files only (``local_files_only``), and its own Python
(``auto_map``) runs only with ``--trust-remote-code``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from flowrl.contract.data import Completion, Prompt
from flowrl.errors import ConfigError, plain_name
from flowrl.specs import DATA_TASK, DataConfig, RunConfig, model_folders
from flowrl.tasks import bounded

#: The response budget when rollout.max_new_tokens is not set (a dataset has no answer lengths to go by).
DEFAULT_MAX_NEW_TOKENS = 256

#: File suffix -> the `datasets` builder that reads it.
BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

#: The split of a ``datasets.DatasetDict`` folder each of data.train and data.val reads, first found
#: first (a validation split never falls back to the training rows).
SPLIT_NAMES = {"train": ("train",), "val": ("val", "validation", "valid", "test")}

_LOADED: dict[Any, DataTask] = {}


@dataclass
class DataReport:
    """What loading kept and left out, per split (printed when a run starts and in ``data.json``)."""

    rows: dict[str, int] = field(default_factory=dict)  # rows read, per split
    kept: dict[str, int] = field(default_factory=dict)
    dropped_long: dict[str, int] = field(default_factory=dict)  # over the prompt limit
    truncated: dict[str, int] = field(default_factory=dict)
    long_responses: dict[str, int] = field(default_factory=dict)  # offline rows over the response budget
    same_pairs: dict[str, int] = field(default_factory=dict)  # preference rows whose two responses are one
    longest: dict[str, int] = field(default_factory=dict)  # the longest prompt kept, in tokens
    templated: bool = False
    evaluated: bool = True  # eval.every > 0 (data.val is read for evaluation only)
    limit: str = "data.max_prompt_tokens"  # what the prompt limit is (data.max_prompt_tokens or the context's)
    budget: int = 0  # the response budget offline rows are held to
    response_overlong: str = "drop"

    def lines(self) -> list[str]:
        out = []
        for split, rows in self.rows.items():
            text = f"data {split}: {self.kept[split]} prompts of {rows} rows"
            if self.dropped_long.get(split):
                text += f", {self.dropped_long[split]} dropped as longer than {self.limit}"
            if self.truncated.get(split):
                text += f", {self.truncated[split]} truncated to {self.limit}"
            if self.long_responses.get(split):
                verb = "dropped" if self.response_overlong == "drop" else "cut"
                text += f", {self.long_responses[split]} responses {verb} at the response budget ({self.budget} tokens)"
            if self.same_pairs.get(split):
                text += f", {self.same_pairs[split]} pairs dropped as their chosen and rejected responses are the same"
            text += " (chat template applied)" if self.templated else ""
            if split == "val" and not self.evaluated:
                text += "; not evaluated: eval.every is 0 (set eval.every=N to evaluate every N steps)"
            out.append(text)
        return out


class DataTask:
    """Prompts from data.train in seeded epochs; data.val for evaluation."""

    name: ClassVar[str] = DATA_TASK
    description: ClassVar[str] = (
        "prompts from your files: --data train.jsonl (jsonl, json, csv, parquet, datasets folder)"
    )

    def __init__(
        self,
        train: Sequence[Prompt],
        val: Sequence[Prompt],
        *,
        seed: int,
        shuffle: bool,
        verifier: str,
        budget: int,
        report: DataReport | None = None,
    ) -> None:
        if not train:
            raise ConfigError("data.train holds no prompts to train on.")
        self.train, self.val = list(train), list(val)
        self.seed, self.shuffle, self.verifier, self.budget = seed, shuffle, verifier, budget
        self.report = report or DataReport()
        self.template: str | None = None  # the chat template the prompts were rendered with
        self._orders: dict[int, list[int]] = {}
        self._fingerprint: str | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> DataTask:
        """The data task of run config ``cfg`` (loaded once per files, settings and tokenizer)."""
        return load(cfg)

    # ------------------------------------------------------------ the Task protocol
    def max_new_tokens(self) -> int:
        return self.budget

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` rows drawn with ``rng`` (the planner's look at prompt and answer lengths)."""
        return [self.train[rng.randrange(len(self.train))] for _ in range(n)]

    def completions(self, prompt: Prompt) -> tuple[Completion, ...]:
        """The row's given responses (read with data.response_key, or a conversation's turns)."""
        return prompt.completions

    def score(self, prompt: Prompt, response: str) -> float:
        from flowrl.tasks import verifiers

        if self.verifier == "none":
            raise ConfigError(
                "data.verifier is none, so the 'task' reward has no ground truth to compare responses with: set "
                "data.verifier (math, exact, regex) or score with a reward function of your own."
            )
        return verifiers.verify(self.verifier, response, prompt.answer)

    # ------------------------------------------------------------ the epoch walk
    def prompt_tokens(self) -> int:
        """The longest training prompt, in tokens (what the planner sizes prompts by)."""
        return self.report.longest.get("train", 1)

    def take(self, start: int, n: int) -> list[Prompt]:
        """The prompts at positions ``start .. start+n`` of the run's stream: epoch after epoch over
        data.train, each epoch in its own seeded order."""
        return [self.train[self._order(k // len(self.train))[k % len(self.train)]] for k in range(start, start + n)]

    def fingerprint(self) -> str:
        """The training prompts' hash (texts and answers, in file order): a checkpoint's cursor means
        the same prompts only over the same data."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for p in self.train:
                digest.update(msgspec.json.encode([p.text, p.answer]))
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    def position(self, drawn: int) -> dict[str, int]:
        """Where a stream that gave ``drawn`` prompts stands: its epoch and the index within it."""
        return {"epoch": drawn // len(self.train), "index": drawn % len(self.train), "rows": len(self.train)}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.train)))
            if self.shuffle:
                random.Random(f"flowrl-data:{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time: a stream moves forward
        return self._orders[epoch]


# ---------------------------------------------------------------- loading


def load(cfg: RunConfig) -> DataTask:
    """Read data.train and data.val of ``cfg`` into a DataTask (cached while the files are unchanged)."""
    data = cfg.data
    if not data.files("train"):
        raise ConfigError(
            f"task '{DATA_TASK}' reads data.train, which names no file: give --data FILE (jsonl, json, csv, parquet "
            "or a datasets folder)."
        )
    _check_verifier(cfg)
    _check_response_keys(data)
    folder = actor_folder(cfg.model)
    key = (
        cfg.trust_remote_code,
        cfg.tiny_model.max_position_embeddings,
        tuple(_stamp(f) for f in data.files("train")),
        tuple(_stamp(f) for f in data.files("val")),
        msgspec.json.encode(data),
        folder,
        cfg.seed,
        cfg.rollout.max_new_tokens,
    )
    if key not in _LOADED:
        _LOADED.clear()
        tokenizer = load_tokenizer(folder, cfg.trust_remote_code)
        template = chat_template(data, tokenizer)
        limit, what = prompt_limit(cfg, folder, tokenizer)
        budget = cfg.rollout.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        report = DataReport(templated=template is not None, limit=what, budget=budget, response_overlong=data.overlong)
        splits = {
            split: rows_to_prompts(split, data, read_rows(split, data), tokenizer, template, report, limit)
            if data.files(split)  # type: ignore[arg-type]
            else []
            for split in ("train", "val")
        }
        if not splits["train"]:
            raise ConfigError(nothing_left("train", data, report))
        _LOADED[key] = DataTask(
            splits["train"],
            splits["val"],
            seed=cfg.seed,
            shuffle=data.shuffle,
            verifier=data.verifier,
            budget=cfg.rollout.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            report=report,
        )
        _LOADED[key].template = template
    _LOADED[key].report.evaluated = cfg.eval.every > 0
    if cfg.eval.every > 0 and data.files("val") and not _LOADED[key].val:  # never the training rows instead
        raise ConfigError(nothing_left("val", data, _LOADED[key].report))
    return _LOADED[key]


def nothing_left(split: str, data: DataConfig, report: DataReport) -> str:
    """Why no prompt of ``split`` was kept, and what to change."""
    offline = data.response_key is not None or data.chosen_key is not None
    long = report.dropped_long.get(split, 0)
    causes = [f"{long} longer than {report.limit}"] if long else []
    fixes = ["raise data.max_prompt_tokens"] if long else []
    if not offline and long:  # an offline row's prompt is never cut
        fixes.append("set data.overlong=truncate")
    if report.long_responses.get(split):
        causes.append(
            f"{report.long_responses[split]} responses over the response budget ({report.budget} tokens, "
            "rollout.max_new_tokens)"
        )
        fixes.append("raise rollout.max_new_tokens or set data.overlong=truncate (responses cut at the budget)")
    if report.same_pairs.get(split):
        causes.append(f"{report.same_pairs[split]} pairs whose chosen and rejected responses are the same")
        fixes.append("give each pair two different responses")
    return (
        f"data.{split}: no prompt is left of {report.rows.get(split, 0)} rows ({'; '.join(causes) or 'none kept'}): "
        f"{' or '.join(fixes) or 'check the file'}."
    )


def _check_verifier(cfg: RunConfig) -> None:
    """data.verifier names a verifier (or none), and evaluation has one to score with: refused when the
    data is read (at plan time), not at the first reward or evaluation."""
    from flowrl.errors import did_you_mean
    from flowrl.tasks.verifiers import VERIFIERS

    kind = cfg.data.verifier
    known = [*VERIFIERS, "none"]
    if kind not in known:
        raise ConfigError(
            f"data.verifier = {kind!r} is not a verifier; use one of {', '.join(known)}.{did_you_mean(kind, known)}"
        )
    offline = cfg.data.response_key is not None or cfg.data.chosen_key is not None
    if kind == "none" and cfg.eval.every > 0 and not offline:  # offline rows: held-out loss or preferences
        raise ConfigError(
            f"eval.every={cfg.eval.every} evaluates responses with the task's verifier, and data.verifier is none: set "
            "data.verifier (math, exact, regex) for the evaluation, or set eval.every=0 (your reward functions still "
            "score the training)."
        )


def _check_response_keys(data: DataConfig) -> None:
    """Offline rows' columns: a response (data.response_key) or a preference pair (data.chosen_key and
    data.rejected_key, both), not both kinds."""
    pair = (data.chosen_key, data.rejected_key)
    if (pair[0] is None) != (pair[1] is None):
        given, missing = ("chosen_key", "rejected_key") if pair[0] is not None else ("rejected_key", "chosen_key")
        raise ConfigError(
            f"data.{given} is set and data.{missing} is not: a preference pair needs both columns (--set "
            "data.chosen_key=COLUMN data.rejected_key=COLUMN)."
        )
    if data.response_key is not None and pair[0] is not None:
        raise ConfigError(
            f"data.response_key ({data.response_key!r}) and data.chosen_key/rejected_key ({pair[0]!r}, {pair[1]!r}) "
            "are both set: give a response column (supervised fine-tuning, graphs/sft.py) or the chosen and rejected "
            "columns (preference pairs, graphs/dpo.py), not both (--set data.response_key=null, or "
            "data.chosen_key=null data.rejected_key=null)."
        )


def actor_folder(model: str | None) -> str | None:
    """The folder whose tokenizer renders the prompts: the actor's (``--model actor=DIR,...``) or the default."""
    default, named = model_folders(model)
    return named.get("actor", default)


def load_tokenizer(folder: str | None, trust_remote_code: bool = False) -> Any:
    """The tokenizer of model folder ``folder`` (its files only: never the Hub, and its own Python --
    ``auto_map`` -- only with ``trust_remote_code``); the character tokenizer of the tiny model without one."""
    if folder is None:
        from flowrl.tasks.tokenizer import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    if not trust_remote_code:
        _refuse_remote_code(Path(folder))
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        if "trust_remote_code" in str(exc):
            raise ConfigError(_remote_code_refused(folder, "its config")) from None
        raise ConfigError(f"--model '{folder}': no tokenizer could be read there ({_first_line(exc)}).") from None


def _refuse_remote_code(folder: Path) -> None:
    """A model folder whose tokenizer_config.json or config.json maps classes to its own Python
    (``auto_map``) is refused without --trust-remote-code (transformers would ask on the terminal)."""
    for name in ("tokenizer_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        value = bounded.read_json_file(path, f"--model '{folder}':")
        if not isinstance(value, dict):
            raise ConfigError(f"--model '{folder}': {name} is {type(value).__name__}, not a JSON object.")
        if value.get("auto_map"):
            raise ConfigError(_remote_code_refused(str(folder), name))


def _remote_code_refused(folder: str, where: str) -> str:
    return (
        f"--model '{folder}': {where} names Python code of the folder's own (auto_map), which runs only for a "
        "folder you trust: give --trust-remote-code (trust_remote_code=true) to run it, or use a folder without it."
    )


def prompt_limit(cfg: RunConfig, folder: str | None, tokenizer: Any) -> tuple[int | None, str]:
    """The longest prompt kept, in tokens, and what it is (for the report): data.max_prompt_tokens, or
    else the model's context less the response budget (at least half the context), or None when the
    model says nothing of its context."""
    if cfg.data.max_prompt_tokens is not None:
        return cfg.data.max_prompt_tokens, "data.max_prompt_tokens"
    context = cfg.tiny_model.max_position_embeddings if folder is None else model_context(folder, tokenizer)
    if context is None:
        return None, "data.max_prompt_tokens"
    budget = cfg.rollout.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    limit = max(context - budget, context // 2, 1)
    return limit, f"the model's context ({context} tokens) less the response budget: {limit} tokens"


#: config.json fields that give a model's context, first found first
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_context(folder: str, tokenizer: Any = None) -> int | None:
    """The context of the model in ``folder`` (prompt + response, in tokens): its config.json's (or its
    text_config's), else the tokenizer's model_max_length when that is a real one; None when unknown."""
    path = Path(folder) / "config.json"
    config = bounded.read_json_file(path, f"--model '{folder}':") if path.is_file() else {}
    for section in (config, config.get("text_config") if isinstance(config, dict) else None):
        if not isinstance(section, dict):
            continue
        for name in _CONTEXT_FIELDS:
            value = section.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    length = getattr(tokenizer, "model_max_length", None)
    return length if isinstance(length, int) and 0 < length < 1 << 24 else None


def chat_template(data: DataConfig, tokenizer: Any) -> str | None:
    """The Jinja chat template the prompts are rendered with, or None (the text goes as it is); it
    compiles (`flowrl.tasks.bounded.compile_template`) or is refused, naming where it came from."""
    choice = data.chat_template
    if choice == "none":
        return None
    if choice == "auto":
        template = getattr(tokenizer, "chat_template", None) or None
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()), None)
        if not isinstance(template, str):
            return None
        bounded.compile_template(template, "the tokenizer's chat template (data.chat_template=auto)")
        return template
    path = Path(choice)
    try:
        regular = path.is_file()
    except (OSError, ValueError):  # a name too long
        regular = False
    if not regular:
        raise ConfigError(
            f"data.chat_template '{choice}' is not a file; give auto (the tokenizer's template when it has one), "
            "none, or a Jinja template file."
        )
    return bounded.read_template(path, f"data.chat_template '{choice}'")


def read_rows(split: str, data: DataConfig) -> list[dict[str, Any]]:
    """Every row of the split's files, as plain dicts (each checked to have the prompt column)."""
    rows: list[dict[str, Any]] = []
    for name in data.files(split):  # type: ignore[arg-type]
        table = _read_file(split, name)
        columns = list(table.column_names)
        if len(table) == 0:
            raise ConfigError(f"data.{split} file '{name}' holds no rows.")
        if data.chosen_key is not None:
            _check_pair_columns(split, name, table, data)
        for column in (data.prompt_key,):
            if column not in columns and not (data.chosen_key is not None and _conversation_pairs(table, data)):
                raise ConfigError(
                    f"data.{split} file '{name}' has no column '{column}' (data.prompt_key); its columns: "
                    f"{', '.join(columns)}. Name the prompt column with --set data.prompt_key=COLUMN."
                )
        if data.response_key is not None and data.response_key not in columns and not _conversations(table, data):
            raise ConfigError(
                f"data.{split} file '{name}' has no column '{data.response_key}' (data.response_key), which holds "
                f"the responses to train on; its columns: {', '.join(columns)}. Name it with --set "
                "data.response_key=COLUMN, or give conversations (messages with assistant turns) in "
                f"'{data.prompt_key}'."
            )
        if data.answer_key not in columns and data.verifier != "none":
            raise ConfigError(
                f"data.{split} file '{name}' has no column '{data.answer_key}' (data.answer_key), which the "
                f"'{data.verifier}' verifier compares responses with; its columns: {', '.join(columns)}. Name it "
                "with --set data.answer_key=COLUMN."
            )
        try:
            rows.extend({**row, "__file__": name, "__row__": i + 1} for i, row in enumerate(table))
        except Exception as exc:  # a data file that is cut short or damaged shows when its rows are read
            raise ConfigError(f"data.{split} file '{name}' cannot be read: {_first_line(exc)}") from None
    return rows


def _check_pair_columns(split: str, name: str, table: Any, data: DataConfig) -> None:
    """A preference file has the chosen and the rejected column."""
    columns = list(table.column_names)
    for key, field_name in ((data.chosen_key, "chosen_key"), (data.rejected_key, "rejected_key")):
        if key not in columns:
            raise ConfigError(
                f"data.{split} file '{name}' has no column '{key}' (data.{field_name}), which holds each row's "
                f"{field_name[:-4]} response of a preference pair; its columns: {', '.join(columns)}. Name it with "
                f"--set data.{field_name}=COLUMN."
            )


def _conversation_pairs(table: Any, data: DataConfig) -> bool:
    """Whether a preference file without a prompt column holds whole conversations (the implicit prompt:
    their shared first turns) in its chosen column."""
    first = table[0][data.chosen_key] if len(table) else None
    return isinstance(first, list)


def _conversations(table: Any, data: DataConfig) -> bool:
    """Whether the first row's prompt column is a conversation with an assistant turn (offline rows)."""
    first = table[0][data.prompt_key] if len(table) else None
    return isinstance(first, list) and any(isinstance(t, Mapping) and t.get("role") == "assistant" for t in first)


def _read_file(split: str, name: str) -> Any:
    import datasets

    if not name.strip():
        raise ConfigError(
            f"data.{split} names an empty path; give a jsonl, json, csv or parquet file or a datasets folder."
        )
    path = Path(name)
    try:
        path.stat()
    except FileNotFoundError:
        raise ConfigError(f"data.{split} file '{name}' does not exist.") from None
    except (OSError, ValueError) as exc:  # a name too long, a link loop, a NUL byte
        raise ConfigError(
            f"data.{split} file '{name}' cannot be read ({getattr(exc, 'strerror', None) or exc})."
        ) from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a reader's failure is our one error paragraph
    if path.is_dir():
        _check_folder(split, path)
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as exc:  # pyarrow's, datasets' and json's errors of a damaged folder
            raise ConfigError(
                f"data.{split} folder '{name}' cannot be read as a datasets.save_to_disk folder ({_first_line(exc)})."
            ) from None
        if isinstance(loaded, datasets.DatasetDict):
            found = next((s for s in SPLIT_NAMES[split] if s in loaded), None)
            if found is None:
                raise ConfigError(
                    f"data.{split} folder '{name}' holds splits {', '.join(loaded)}, none of them "
                    f"{' or '.join(SPLIT_NAMES[split])}; name one split's folder ({path / next(iter(loaded))})."
                )
            loaded = loaded[found]
        return loaded
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ConfigError(
            f"data.{split} file '{name}': unknown format '{path.suffix}'; give .jsonl, .json, .csv, .parquet or a "
            "datasets.save_to_disk folder."
        )
    if path.stat().st_size == 0:
        raise ConfigError(f"data.{split} file '{name}' is empty.")
    if builder == "json":
        _check_json(split, path)
    try:
        return datasets.Dataset.from_json(str(path)) if builder == "json" else _from(builder, path)
    except Exception as exc:  # each reader has its own errors
        raise ConfigError(f"data.{split} file '{name}' cannot be read as {builder}: {_first_line(exc)}") from None


def _from(builder: str, path: Path) -> Any:
    import datasets

    return datasets.Dataset.from_csv(str(path)) if builder == "csv" else datasets.Dataset.from_parquet(str(path))


def _check_json(split: str, path: Path) -> None:
    """A malformed line of a jsonl file (or a json file that is not a list of rows), named before
    `datasets` fails on it with an error that does not say where. Lines are read with a bounded
    readline (`flowrl.tasks.bounded.lines`): one longer than MAX_LINE_BYTES is refused unparsed."""
    where = f"data.{split} file '{path}'"
    first = _first_char(path)
    if first == "":
        raise ConfigError(f"{where} holds no rows.")
    size = path.stat().st_size
    document = path.suffix.lower() == ".json" and first in "[{"
    if document and first == "[" and size > bounded.MAX_JSON_FILE_BYTES:
        raise ConfigError(
            f"{where} is {size >> 20} MiB, over the {bounded.MAX_JSON_FILE_BYTES >> 20} MiB a .json file (read whole) "
            "may hold (flowrl.tasks.bounded.MAX_JSON_FILE_BYTES): write the rows as jsonl, one JSON object a line."
        )
    if document and size <= bounded.MAX_JSON_FILE_BYTES:
        value = _document(where, path, strict=first == "[")
        if first == "[":
            if not isinstance(value, list):
                raise ConfigError(f"{where} is not a JSON list of rows.")
            bad = next((i for i, r in enumerate(value) if not isinstance(r, dict)), None)
            if bad is not None:
                raise ConfigError(f"{where}: item {bad + 1} is not an object of columns.")
            if not value:
                raise ConfigError(f"{where} holds no rows.")
            return
        if isinstance(value, dict) and _multiline(path):
            _one_object(split, path, value)
    seen = 0
    with path.open("rb") as f:
        try:
            for number, raw in bounded.lines(f):
                seen += _check_line(where, number, raw)
        except bounded.JSONRefused as exc:  # a line over the cap
            raise ConfigError(
                f"{where}: {exc}; a row that long is no prompt (split the file or leave the row out)."
            ) from None
    if not seen:
        raise ConfigError(f"{where} holds no rows.")


def _check_line(where: str, number: int, raw: bytes) -> int:
    """1 for line ``number`` of a jsonl file that holds a row object, 0 for a blank one; else refused."""
    try:
        text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{where}: line {number} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); save "
            "the file as UTF-8."
        ) from None
    if not text.strip():
        return 0
    try:
        row = bounded.loads(text, unique_keys=True)
    except bounded.JSONRefused as exc:
        raise ConfigError(
            f"{where}: line {number} is not valid JSON ({exc}); each line of a jsonl file holds one row as a JSON "
            "object."
        ) from None
    if not isinstance(row, dict):
        raise ConfigError(
            f"{where}: line {number} is not a JSON object of columns (it is a JSON {type(row).__name__}; one row "
            "a line)."
        )
    return 1


def _first_char(path: Path) -> str:
    """The first character of a file that is not white space (a UTF-8 BOM skipped), or "" for none."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            text = chunk.lstrip(b" \t\r\n").removeprefix(b"\xef\xbb\xbf").lstrip(b" \t\r\n")
            if text:
                return chr(text[0])
    return ""


def _multiline(path: Path) -> bool:
    with path.open("rb") as f:
        return sum(1 for _, line in bounded.lines(f, bounded.MAX_JSON_FILE_BYTES) if line.strip()) > 1


def _document(where: str, path: Path, strict: bool) -> Any:
    """A .json file parsed whole (its size checked by the caller): the value, or None for text that
    is not one JSON document (rows a line: the jsonl check names the bad line) unless ``strict``."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{where}: line {line} is not UTF-8 text (byte 0x{raw[exc.start]:02x}); save the file as UTF-8."
        ) from None
    try:
        return bounded.loads(text, unique_keys=True)
    except bounded.JSONRefused as exc:
        if not strict:
            return None
        raise ConfigError(f"{where} is not valid JSON: {exc}.") from None


def _one_object(split: str, path: Path, value: dict[str, Any]) -> None:
    """A .json file written as one (indented) object: rows nested under a key, or columns of lists,
    named as such rather than as a jsonl file whose first line is broken."""
    keys = ", ".join(list(value)[:8])
    if value and all(isinstance(v, list) for v in value.values()):
        shape = f"columns ({keys}), each a list"
    else:
        shape = f"one JSON object (keys: {keys})"
    raise ConfigError(
        f"data.{split} file '{path}' holds {shape}, not rows: give a list of row objects "
        '([{"prompt": ..., "answer": ...}, ...]) or a jsonl file with one row object per line.'
    )


#: the fields of a datasets.save_to_disk folder's state.json, and the types each may have
_STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "_data_files": (list,),
    "_fingerprint": (str, type(None)),
    "_format_columns": (list, type(None)),
    "_format_kwargs": (dict,),
    "_format_type": (str, type(None)),
    "_output_all_columns": (bool,),
    "_split": (str, type(None)),
}


def _check_folder(split: str, path: Path) -> None:
    """A ``datasets.save_to_disk`` folder's JSON, checked before ``datasets`` reads it: dataset_dict.json
    names split folders inside it; each split's state.json names data files that are plain files in
    its folder (no path in it reaches outside), and its dataset_info.json is a JSON object."""
    where = f"data.{split} folder '{path}'"
    listing = path / "dataset_dict.json"
    if listing.is_file():
        value = bounded.read_json_file(listing, f"{where}:")
        splits = value.get("splits") if isinstance(value, dict) else None
        if not isinstance(splits, list) or not splits or not all(isinstance(s, str) for s in splits):
            raise ConfigError(f'{where}: dataset_dict.json must hold {{"splits": [names of split folders]}}.')
        for name in splits:
            if not plain_name(name) or not _inside(path, path / name) or not (path / name).is_dir():
                raise ConfigError(
                    f"{where}: dataset_dict.json names the split {name!r}, which is not a folder inside it."
                )
            _check_split(f"{where}: split '{name}'", path / name)
        return
    if not (path / "state.json").is_file():
        raise ConfigError(
            f"{where} is not a datasets.save_to_disk folder (it has neither state.json nor dataset_dict.json)."
        )
    _check_split(where, path)


def _check_split(where: str, folder: Path) -> None:
    state = bounded.read_json_file(folder / "state.json", f"{where}:")
    if not isinstance(state, dict):
        raise ConfigError(f"{where}: state.json is a JSON {type(state).__name__}, not an object.")
    for key, types in _STATE_FIELDS.items():
        if key in state and not isinstance(state[key], types):
            raise ConfigError(
                f"{where}: state.json field {key!r} is {type(state[key]).__name__}, not "
                f"{' or '.join('null' if t is type(None) else t.__name__ for t in types)}."
            )
    files = state.get("_data_files")
    if not files:
        raise ConfigError(f"{where}: state.json names no data files ('_data_files').")
    for entry in files:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not plain_name(name):
            raise ConfigError(
                f"{where}: state.json names the data file {name if name is not None else entry!r}, which is not a "
                "file name in the folder (no '/', '\\' or '..': a saved dataset's files lie in its folder)."
            )
        if not (folder / name).is_file() or not _inside(folder, folder / name):
            raise ConfigError(f"{where}: the data file '{name}' that state.json names is not in the folder.")
    info = folder / "dataset_info.json"
    if info.is_file() and not isinstance(bounded.read_json_file(info, f"{where}:"), dict):
        raise ConfigError(f"{where}: dataset_info.json is not a JSON object.")


def _inside(folder: Path, path: Path) -> bool:
    """Whether ``path`` (links followed) lies in ``folder``."""
    return path.resolve().is_relative_to(folder.resolve())


def rows_to_prompts(
    split: str,
    data: DataConfig,
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    template: str | None,
    report: DataReport,
    limit: int | None = None,
) -> list[Prompt]:
    """Each row as a Prompt: the rendered text, the ground truth, the other columns as metadata; one
    longer than ``limit`` tokens dropped or truncated (data.overlong)."""
    from flowrl.tasks.verifiers import ground_truth

    prompts = []
    report.rows[split] = len(rows)
    report.dropped_long[split] = report.truncated[split] = 0
    report.long_responses[split] = report.same_pairs[split] = 0
    pairs = data.chosen_key is not None
    offline = data.response_key is not None or pairs
    for row in rows:
        where = f"data.{split} file '{row['__file__']}' row {row['__row__']}"
        value = row.get(data.prompt_key)
        later: list[dict[str, str]] = []  # offline rows: the turns after the prompt (the response's)
        sides: list[list[dict[str, str]]] = []  # preference pairs: the chosen turns, the rejected turns
        if pairs:
            value, sides = _pair_turns(where, data, row, value)
        elif offline:
            value, later = _split_conversation(where, data, row, value)
        turns = _turns(where, data, value)
        chars = sum(len(t["content"]) for t in turns)
        if chars > bounded.MAX_PROMPT_CHARS:  # before a tokenizer holds gigabytes for it
            raise ConfigError(
                f"{where}: the prompt is {chars:,} characters, over the {bounded.MAX_PROMPT_CHARS:,} a prompt may "
                "have (flowrl.tasks.bounded.MAX_PROMPT_CHARS); leave the row out."
            )
        kind = "regex" if data.verifier == "regex" else "math"  # a pattern is kept as written
        answer = ground_truth(row.get(data.answer_key), kind) if data.answer_key in row else ""
        skip = (data.prompt_key, data.answer_key, data.response_key, data.chosen_key, data.rejected_key)
        skip = (*skip, "__file__", "__row__")
        meta = {k: v for k, v in row.items() if k not in skip}
        text = render_turns(where, turns, tokenizer, template)
        count = _count(tokenizer, text, template)
        if count == 0:
            how = "the chat template renders it as no text" if template is not None and text == "" else "it is empty"
            raise ConfigError(
                f"{where}: the prompt is no tokens ({how}); a model needs at least one token to respond to: leave "
                "the row out" + (", or fix data.chat_template." if template is not None else ".")
            )
        if limit is not None and count > limit:
            if data.overlong == "drop" or offline:  # an offline row's response follows its whole prompt
                report.dropped_long[split] += 1
                continue
            text = _truncate(where, turns, tokenizer, template, limit, report.limit)
            report.truncated[split] += 1
            count = limit
        completions: tuple[Completion, ...] = ()
        if offline:
            completions = tuple(_completion(where, turns, side, tokenizer, template) for side in (sides or [later]))
            if pairs and completions[0] == completions[1]:  # a tie: its margin is 0 whatever the model does
                report.same_pairs[split] += 1
                continue
            if any(len(_tokens(tokenizer, c)) > report.budget for c in completions):
                report.long_responses[split] += 1
                if data.overlong == "drop":
                    continue
        report.longest[split] = max(report.longest.get(split, 0), count)
        messages = tuple(turns) if template is not None else ()  # re-rendered with an environment's tools
        prompts.append(
            Prompt(
                text=text,
                answer=answer,
                meta=meta,
                templated=template is not None,
                messages=messages,
                completions=completions,
            )
        )
    report.kept[split] = len(prompts)
    return prompts


def _split_conversation(
    where: str, data: DataConfig, row: Mapping[str, Any], value: Any
) -> tuple[Any, list[dict[str, str]]]:
    """An offline row as (its prompt, the turns trained after it): a conversation in the prompt column
    is cut at its first assistant turn; otherwise the response column's text is one assistant turn."""
    if isinstance(value, list) and any(isinstance(t, Mapping) and t.get("role") == "assistant" for t in value):
        first = next(i for i, t in enumerate(value) if isinstance(t, Mapping) and t.get("role") == "assistant")
        if first == 0:
            raise ConfigError(
                f"{where}: the conversation in '{data.prompt_key}' starts with an assistant turn; the turns before "
                "the first assistant turn are the prompt: begin it with a user turn."
            )
        later = _messages(value[first:], where, f"'{data.prompt_key}'", start=first)
        if not any(t["content"].strip() for t in later if t["role"] == "assistant"):
            raise ConfigError(f"{where}: the assistant turns of the conversation in '{data.prompt_key}' are empty.")
        return value[:first], later
    key = data.response_key
    if row.get(key) is None and isinstance(value, list):  # a conversation without an answer to train on
        raise ConfigError(
            f"{where}: the conversation in '{data.prompt_key}' has no assistant turn to train on (roles: "
            f"{', '.join(str(t.get('role')) if isinstance(t, Mapping) else type(t).__name__ for t in value) or 'none'}"
            f") and the row no '{key}' (data.response_key): give it the assistant's answer, or leave the row out."
        )
    if row.get(key) is None:  # a row without the column (`datasets` fills it with null)
        raise ConfigError(
            f"{where} has no '{key}' (data.response_key): every row needs a response to train on (or a "
            f"conversation with assistant turns in '{data.prompt_key}')."
        )
    response = row[key]
    if not isinstance(response, str):
        raise ConfigError(
            f"{where}: the response ('{key}') is {type(response).__name__} {response!r:.60}; it must be text."
        )
    if not response.strip():
        raise ConfigError(f"{where}: the response ('{key}') is empty; give every row a response, or leave it out.")
    if len(response) > bounded.MAX_PROMPT_CHARS:
        raise ConfigError(
            f"{where}: the response is {len(response):,} characters, over the {bounded.MAX_PROMPT_CHARS:,} a row may "
            "have (flowrl.tasks.bounded.MAX_PROMPT_CHARS); leave the row out."
        )
    return value, [{"role": "assistant", "content": response}]


def _pair_turns(
    where: str, data: DataConfig, row: Mapping[str, Any], value: Any
) -> tuple[Any, list[list[dict[str, str]]]]:
    """A preference row as (its prompt, [the chosen response's turns, the rejected's]). Each response is
    text (one assistant turn) or a list of messages: the turns after the prompt, or -- without a prompt
    column -- the whole conversation, whose turns before the first that differs (the two
    conversations' shared first turns, ending before an assistant turn) are the prompt."""
    sides = []
    for key, name in ((data.chosen_key, "chosen_key"), (data.rejected_key, "rejected_key")):
        response = row.get(key)
        column = f"'{key}' (data.{name})"
        if response is None:
            raise ConfigError(f"{where} has no {column}: every row of a preference file needs both responses.")
        if isinstance(response, str):
            if not response.strip():
                raise ConfigError(f"{where}: the response in {column} is empty; give every row both responses.")
            if len(response) > bounded.MAX_PROMPT_CHARS:
                raise ConfigError(
                    f"{where}: the response in {column} is {len(response):,} characters, over the "
                    f"{bounded.MAX_PROMPT_CHARS:,} a row may have (flowrl.tasks.bounded.MAX_PROMPT_CHARS)."
                )
            sides.append([{"role": "assistant", "content": response}])
            continue
        if not isinstance(response, list) or not response:
            raise ConfigError(
                f"{where}: the response in {column} is {type(response).__name__} {response!r:.60}; it must be text or "
                "a list of {role, content} messages."
            )
        sides.append(_messages(response, where, column))
    if value is None:  # no prompt column: whole conversations, the prompt their shared first turns
        if any(isinstance(row.get(k), str) for k in (data.chosen_key, data.rejected_key)):
            raise ConfigError(
                f"{where} has no prompt ('{data.prompt_key}', data.prompt_key) and its responses are text: give the "
                "prompt column, or whole conversations (lists of messages) in both response columns."
            )
        shared = 0
        while shared < min(map(len, sides)) and sides[0][shared] == sides[1][shared]:
            shared += 1
        while shared and sides[0][shared - 1]["role"] == "assistant":  # a response starts at an assistant turn
            shared -= 1
        value, sides = sides[0][:shared], [side[shared:] for side in sides]
        if not value:
            raise ConfigError(
                f"{where}: the conversations in '{data.chosen_key}' and '{data.rejected_key}' share no first turns to "
                f"be the prompt; give the prompt in a '{data.prompt_key}' column (data.prompt_key)."
            )
    for side, key in zip(sides, (data.chosen_key, data.rejected_key)):
        said = any(t["content"].strip() for t in side if t["role"] == "assistant")
        if not side or side[0]["role"] != "assistant" or not said:
            raise ConfigError(
                f"{where}: the response in '{key}' must start with a non-empty assistant turn (roles: "
                f"{', '.join(t['role'] for t in side) or 'none'})."
            )
    return value, sides


def _completion(
    where: str, turns: list[dict[str, str]], later: list[dict[str, str]], tokenizer: Any, template: str | None
) -> Completion:
    """The text after the prompt ``turns`` as the chat template renders the whole conversation, in pieces:
    each assistant turn (with its end-of-turn text) trained, the text between turns not. Without a
    template: the one response, then the end-of-text token.

    A row ends where generation would: a final assistant turn ends right after the tokenizer's
    end-of-text token when the template writes it (SmolLM2/Qwen's ``<|im_end|>``, not the ``\n`` the
    template writes after it), and the end-of-text token is appended when the template writes none, so
    a scalar head scores a given response at the token it scores a generated one at. The end-of-text token
    is the one the template writes after the answer (an answer may quote its text), and turns after the
    last assistant turn (a trailing tool or user turn) are left out: nothing after the last answer is
    trained, and a row ends with an answer."""
    if template is None:
        if len(later) > 1:
            raise ConfigError(
                f"{where}: a conversation of several turns needs a chat template, and the tokenizer has none (or "
                "data.chat_template=none): give data.chat_template=FILE."
            )
        return Completion(pieces=(later[0]["content"],), trained=(True,), eos=True)
    conversation = [*turns, *later]
    eos = getattr(tokenizer, "eos_token", None)
    full = render_turns(where, conversation, tokenizer, template, generation_prompt=False)
    pieces: list[str] = []
    trained: list[bool] = []
    at = len(render_turns(where, turns, tokenizer, template))  # the prompt, with the generation prompt
    last = max(i for i, t in enumerate(conversation) if t["role"] == "assistant")
    for i in range(len(turns), last + 1):
        if conversation[i]["role"] != "assistant":
            continue
        start = len(render_turns(where, conversation[:i], tokenizer, template))
        end = render_turns(where, conversation[: i + 1], tokenizer, template, generation_prompt=False)
        if not full.startswith(end) or start < at or start > len(end):
            raise ConfigError(
                f"{where}: the chat template does not render the conversation's turns one after another (a "
                "conversation cut after a turn is not a prefix of the whole), so the assistant's tokens cannot be "
                "told apart; give data.chat_template=FILE with a template that does."
            )
        if start > at:
            pieces.append(full[at:start])
            trained.append(False)
        turn = full[start : len(end)]
        # the end-of-text token the template writes after the answer (trained, with the turn), not one the
        # answer's own text quotes: looked for after the answer's text where the turn shows it as given
        said = conversation[i]["content"].strip()
        after = turn.find(said) + len(said) if said and said in turn else 0
        ends = bool(eos) and eos in turn[after:]
        stop = turn.rfind(eos) + len(eos) if ends else len(turn)
        pieces.append(turn[:stop])
        trained.append(True)
        at = start + stop
    # the row ends with the last answer, as generation does: nothing after its end-of-text token (appended
    # when the template writes none)
    return Completion(pieces=tuple(pieces), trained=tuple(trained), eos=not ends)


def _tokens(tokenizer: Any, completion: Completion) -> list[int]:
    ids = [i for piece in completion.pieces for i in tokenizer(piece, add_special_tokens=False)["input_ids"]]
    return ids + [0] * completion.eos


def _turns(where: str, data: DataConfig, value: Any) -> list[dict[str, str]]:
    """The prompt column's value as chat turns, the system prompt first when one is set."""
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(
                f"{where}: the prompt ('{data.prompt_key}') is empty; give every row a prompt, or leave the row out."
            )
        return [*system, {"role": "user", "content": value}]
    if isinstance(value, list) and value and all(isinstance(t, Mapping) for t in value):
        turns = _messages(value, where, f"'{data.prompt_key}'")
        if not any(t["role"] == "user" for t in turns):
            raise ConfigError(
                f"{where}: the messages in '{data.prompt_key}' have no user turn (roles: "
                f"{', '.join(t['role'] for t in turns)})."
            )
        if not any(t["content"].strip() for t in turns if t["role"] == "user"):
            raise ConfigError(f"{where}: the user turns of the messages in '{data.prompt_key}' are empty.")
        if turns[-1]["role"] == "assistant":  # an SFT conversation: the model would answer after the answer
            raise ConfigError(
                f"{where}: the messages in '{data.prompt_key}' end with an assistant turn; a prompt ends where the "
                "model is to answer: leave the answer turn out (the ground truth goes in data.answer_key)."
            )
        has_system = any(t["role"] == "system" for t in turns)
        return turns if has_system else [*system, *turns]
    raise ConfigError(
        f"{where}: the prompt ('{data.prompt_key}') is {type(value).__name__} {value!r:.60}; it must be text or a list "
        "of {role, content} messages."
    )


def render_turns(
    where: str, turns: list[dict[str, str]], tokenizer: Any, template: str | None, generation_prompt: bool = True
) -> str:
    """Chat ``turns`` as a prompt's text: rendered by ``template`` (within the limits; with the generation
    prompt unless told not to), or without one the turns' texts joined by blank lines (a conversation
    with other turns than system and user is refused); errors name ``where``."""
    if template is not None:  # within the time and size limits; its errors name the row and the template
        return bounded.render_chat(tokenizer, template, turns, where=where, add_generation_prompt=generation_prompt)
    if len(turns) > 1 and any(t["role"] not in ("system", "user") for t in turns):
        raise ConfigError(
            f"{where}: the prompt is a conversation with {', '.join(t['role'] for t in turns)} turns, which needs a "
            "chat template, and the tokenizer has none (or data.chat_template=none): give data.chat_template=FILE."
        )
    return "\n\n".join(t["content"] for t in turns)


def _count(tokenizer: Any, text: str, template: str | None) -> int:
    return len(tokenizer(text, add_special_tokens=template is None)["input_ids"])


def _truncate(
    where: str, turns: list[dict[str, str]], tokenizer: Any, template: str | None, limit: int, what: str
) -> str:
    """The prompt re-rendered with its last user turn cut (from the end) so that it fits in ``limit`` tokens.

    The cut falls between characters of the text as written (found by bisection on its length), never
    through decoded token ids: a tokenizer that maps characters to an unknown token, or splits one into
    bytes, would otherwise put ``<unk>`` or U+FFFD into the prompt."""
    last = max(i for i, t in enumerate(turns) if t["role"] == "user")
    content = turns[last]["content"]

    def rendered(chars: int) -> str:
        return render_turns(where, _with(turns, last, content[:chars]), tokenizer, template)

    overhead = _count(tokenizer, rendered(0), template)
    if overhead >= limit:
        raise ConfigError(
            f"{where}: the prompt limit ({what}: {limit}) leaves no room for the prompt's text: the rest of the "
            f"prompt (the system prompt, earlier turns and the chat template) takes {overhead} tokens. Raise "
            "data.max_prompt_tokens, or set data.overlong=drop."
        )
    fits, over = 0, len(content)  # rendered(fits) fits; the whole text does not
    while over - fits > 1:
        mid = (fits + over) // 2
        if _count(tokenizer, rendered(mid), template) <= limit:
            fits = mid
        else:
            over = mid
    if fits == 0:
        raise ConfigError(
            f"{where}: the prompt limit ({what}: {limit}) leaves no room for even one character of the prompt's "
            f"text (the rest of the prompt takes {overhead} tokens). Raise data.max_prompt_tokens, or set "
            "data.overlong=drop."
        )
    return rendered(fits)


def _with(turns: list[dict[str, str]], index: int, content: str) -> list[dict[str, str]]:
    return [dict(t, content=content) if i == index else t for i, t in enumerate(turns)]


#: The most entries of a data folder whose sizes and times tell whether it changed (a saved dataset has
#: a few files in it and in each split's folder); a folder with more is read again each time.
_STAMP_ENTRIES = 4096


def _stamp(name: str) -> tuple[str, int, int]:
    """What tells whether data file or folder ``name`` changed: its path, size and newest time (a
    folder's files and its split folders' files, never a walk of a whole tree); never raises."""
    import os
    import time

    path = Path(name)
    try:
        top = path.stat()
        resolved = str(path.resolve())
    except (OSError, RuntimeError, ValueError):
        return (name, -1, -1)
    if not path.is_dir():
        return (resolved, top.st_size, top.st_mtime_ns)
    size, newest, count = 0, top.st_mtime_ns, 0
    folders = [path]
    for depth in range(2):
        subfolders = []
        for folder in folders:
            try:
                entries = list(os.scandir(folder))
            except OSError:
                continue
            for entry in entries:
                count += 1
                if count > _STAMP_ENTRIES:
                    return (resolved, -1, time.monotonic_ns())  # never equal: read again
                try:
                    info = entry.stat(follow_symlinks=False)
                    if depth == 0 and entry.is_dir(follow_symlinks=False):
                        subfolders.append(Path(entry.path))
                except OSError:
                    continue
                size, newest = size + info.st_size, max(newest, info.st_mtime_ns)
        folders = subfolders
    return (resolved, size, newest)


def _first_line(exc: BaseException) -> str:
    """The first line of what went wrong: the innermost cause (a reader's "An error occurred while
    generating the dataset" says nothing of it), with a hint for text that is not UTF-8."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return f"{first} (save the file as UTF-8)" if isinstance(exc, UnicodeDecodeError) else first


def _messages(turns: Sequence[Any], where: str, column: str, start: int = 0) -> list[dict[str, str]]:
    """``turns`` as plain {role, content} messages; a ConfigError naming the row, the column and the message
    (numbered from ``start`` + 1) that lacks a text role or content."""
    out = []
    for i, turn in enumerate(turns, start=start):
        role = turn.get("role") if isinstance(turn, Mapping) else None
        content = turn.get("content") if isinstance(turn, Mapping) else None
        if not isinstance(role, str) or not isinstance(content, str):
            raise ConfigError(
                f"{where}: message {i + 1} of {column} must have text 'role' and 'content' fields, got {turn!r:.80}."
            )
        out.append({"role": role, "content": content})
    return out
