"""Preference pairs made from problems with numeric answers (``flowrl data pairs IN.jsonl --out
pairs.jsonl``): for each row of a GSM8K-format file (a question and an answer ``"... #### 42"``), the
worked answer ending in its number is chosen and the same answer with a plausible slip -- a wrong
final number -- rejected, so a preference run (graphs/dpo.py, graphs/reward_model.py) has pairs to
learn from without a model to sample them.

Chosen: ``"{work} The answer is {N}."``. Rejected, by the row's ``slip`` (``--slips``, each row drawn
from the seed and its question among the kinds given):

- ``work``: the work with its last mention of N (the number as a whole, however written, and the GSM8K
  calculator note ``<<...=N>>`` before it) replaced by a wrong number M, then ``"The answer is {M}."`` -- a
  slip in the arithmetic, carried to the end: telling it apart means checking the sums (a work that never
  shows N has nothing to carry it: that row's slip is ``answer``);
- ``answer``: the work unchanged, then ``"The answer is {M}."`` -- an answer the work does not support,
  a slip models make between their reasoning and their final line.

(The format of benchmarks/real_model.py's system prompt, "Finish with: The answer is N.") M is N plus or
minus 1..10 (never below 0 for a non-negative N), drawn from the seed and the row's question, so the
same file, kinds and seed always give the same pairs. Each output row keeps the input's other columns,
with ``prompt``, ``chosen``, ``rejected``, ``answer`` (the ground truth, N) and ``slip`` (the kind); a
row without a number for an answer is refused by its line.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flowrl.errors import ConfigError

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
#: a number as a whole in text (thousands commas allowed; not a part of a longer number)
_MENTION = re.compile(r"(?<![\d.,])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])")
#: GSM8K's calculator note ending right before a result: ``<<48+24=72>>`` of ``<<48+24=72>>72``
_NOTE = re.compile(r"=\s*(-?\d[\d,]*(?:\.\d+)?)\s*>>$")

#: The columns every output row has (the input's other columns are kept beside them).
OUTPUT_COLUMNS = ("prompt", "chosen", "rejected", "answer", "slip")

#: The kinds of slip a rejected answer makes (the module's docstring); a row's kind is drawn among the
#: given ones in this order, however ``--slips`` lists them.
SLIPS = ("work", "answer")


def slip(answer: str, rng: random.Random) -> str:
    """A plausible wrong number for the numeric ``answer``: off by 1..10, not negative when it is not."""
    value = float(answer) if "." in answer else int(answer)
    while True:
        wrong = value + rng.choice([-1, 1]) * rng.randint(1, 10)
        if wrong != value and (wrong >= 0 or value < 0):
            return str(round(wrong, 6) if isinstance(wrong, float) else wrong)


def pair_of(question: str, answer: str, seed: int = 0, slips: tuple[str, ...] = SLIPS) -> tuple[str, str, str, str]:
    """(chosen, rejected, the final number, the kind of slip) for a GSM8K-format ``answer`` ("work #### N"),
    the kind drawn among ``slips``; a ValueError when N is not a number."""
    work, _, final = answer.rpartition("####")
    final = final.strip().replace(",", "")
    if not _NUMBER.fullmatch(final):
        raise ValueError(f"the answer's final part {final!r} is not a number (GSM8K's format: 'work #### N')")
    work = work.strip()
    rng = random.Random(f"flowrl-pairs:{seed}:{question}")
    wrong = slip(final, rng)
    kinds = _kinds(slips)
    kind = kinds[0] if len(kinds) == 1 else rng.choice(kinds)
    chosen = f"{work} The answer is {final}." if work else f"The answer is {final}."
    slipped = _carried(work, final, wrong) if kind == "work" else work
    if slipped is None:  # the work never shows N: nothing to carry the slip through, an answer slip
        kind, slipped = "answer", work
    rejected = f"{slipped} The answer is {wrong}." if slipped else f"The answer is {wrong}."
    return chosen, rejected, final, kind


def _kinds(slips: Iterable[str]) -> tuple[str, ...]:
    """The kinds of slip ``slips`` names, each once, in `SLIPS`' order (so the same kinds draw the same
    pairs however they are listed); a ValueError naming the unknown or missing ones."""
    given = tuple(slips)
    if not given or any(k not in SLIPS for k in given):
        raise ValueError(f"slips must be some of {', '.join(SLIPS)}; got {', '.join(given) or 'none'}")
    return tuple(k for k in SLIPS if k in given)


def _carried(work: str, final: str, wrong: str) -> str | None:
    """``work`` with its last mention of the number ``final`` (a whole number, however written: ``1,000``
    for 1000, ``2.50`` for 2.5) replaced by ``wrong``, and the GSM8K calculator note right before it
    (``<<48+24=72>>72``) too; None when the work never mentions it."""
    value = float(final)
    last = None
    for m in _MENTION.finditer(work):
        start, text = m.start(), m.group()
        if text.startswith("-") and start and (work[start - 1].isalnum() or work[start - 1] == ")"):
            start, text = start + 1, text[1:]  # a minus between two terms (10-9) is the operator's
        if float(text.replace(",", "")) == value:
            last = (start, m.end())
    if last is None:
        return None
    before, after = work[: last[0]], work[last[1] :]
    note = _NOTE.search(before)
    if note and float(note.group(1).replace(",", "")) == value:
        before = before[: note.start(1)] + wrong + before[note.end(1) :]
    return before + wrong + after


def make_pairs(
    rows: Iterable[dict[str, Any]],
    *,
    prompt_key: str = "question",
    answer_key: str = "answer",
    seed: int = 0,
    slips: tuple[str, ...] = SLIPS,
) -> list[dict[str, Any]]:
    """Preference rows (``prompt``, ``chosen``, ``rejected``, ``answer``, ``slip`` and the other columns) of
    GSM8K-format ``rows``, each rejected answer with a slip of a kind among ``slips``; a row without the
    columns or a numeric answer is a ValueError naming its number (from 1)."""
    slips = _kinds(slips)
    out = []
    for number, row in enumerate(rows, start=1):
        question, answer = row.get(prompt_key), row.get(answer_key)
        if not isinstance(question, str) or not isinstance(answer, (str, int, float)):
            raise ValueError(
                f"row {number} needs text '{prompt_key}' and '{answer_key}' columns, got {row!r:.100}; name other "
                "columns with --prompt-key and --answer-key"
            )
        try:
            chosen, rejected, final, kind = pair_of(question, str(answer), seed, slips)
        except ValueError as exc:
            raise ValueError(f"row {number}: {exc}") from None
        rest = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        taken = [k for k in OUTPUT_COLUMNS if k in rest]
        if taken:  # kept, it would replace the pair's own column: a pair with another column's value
            raise ValueError(
                f"row {number} has a column '{taken[0]}', which the pair's own '{taken[0]}' would overwrite (the "
                f"output's columns: {', '.join(OUTPUT_COLUMNS)}); rename or drop that column first"
            )
        out.append({"prompt": question, "chosen": chosen, "rejected": rejected, "answer": final, "slip": kind, **rest})
    return out


def write_pairs(
    src: Path,
    out: Path,
    *,
    prompt_key: str,
    answer_key: str,
    seed: int,
    slips: tuple[str, ...] = SLIPS,
    force: bool = False,
) -> int:
    """``make_pairs`` of jsonl file ``src`` written to jsonl file ``out``; the number of pairs. Errors
    name the file and line."""
    from flowrl.tasks import bounded

    try:
        slips = _kinds(slips)
    except ValueError:
        given = ", ".join(slips)
        raise ConfigError(f"--slips must be some of {', '.join(SLIPS)} (comma-separated); got {given!r}.") from None
    if out.exists() and not force:
        raise ConfigError(f"--out '{out}' exists; give --force to replace it.")
    if not src.is_file():
        raise ConfigError(f"'{src}' is not a file; give a jsonl file of GSM8K-format rows (question, answer).")
    rows = []
    with src.open("rb") as f:
        try:
            for number, raw in bounded.lines(f):
                if not raw.strip():
                    continue
                try:
                    row = bounded.loads(raw.decode("utf-8"), unique_keys=True)
                except (bounded.JSONRefused, UnicodeDecodeError) as exc:
                    raise ConfigError(f"'{src}' line {number} is not a JSON row ({exc}).") from None
                if not isinstance(row, dict):
                    raise ConfigError(f"'{src}' line {number} is not a JSON object of columns.")
                rows.append(row)
        except bounded.JSONRefused as exc:
            raise ConfigError(f"'{src}': {exc}.") from None
    if not rows:
        raise ConfigError(f"'{src}' holds no rows.")
    try:
        pairs = make_pairs(rows, prompt_key=prompt_key, answer_key=answer_key, seed=seed, slips=slips)
    except ValueError as exc:
        raise ConfigError(f"'{src}' {exc}.") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return len(pairs)
