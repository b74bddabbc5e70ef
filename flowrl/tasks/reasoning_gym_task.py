"""The ``reasoning_gym`` task: procedural, verifiable reasoning problems from the `reasoning-gym` library.

``task: reasoning_gym`` with ``task_options`` naming one of reasoning-gym's datasets (``dataset: chain_sum``)
and any of that dataset's own config fields (``min_terms: 2``): every option but this task's own
(:class:`ReasoningGymOptions`) goes to the dataset's config class, checked against its field types, and
the dataset is built as ``reasoning_gym.create_dataset(dataset, seed=seed, size=size, **fields)`` would.
Nothing is downloaded: every dataset generates its problems (or reads files shipped in the package).

- Config fields: at the top level of ``task_options``, or in a section named after the dataset
  (``task_options: {dataset: chain_sum, chain_sum: {min_terms: 2}}``), which applies only while that
  dataset is chosen: ``--set task_options.dataset=NAME`` then leaves a graph's defaults for another behind.
- Prompts: each is the entry at an index drawn from the run's rng (``0 <= index < size``), so the stream
  is deterministic given the seed; the entry's question is the user turn, ``data.system_prompt`` a system
  turn before it, rendered by the tokenizer's chat template (``data.chat_template``, as the ``data`` task
  renders its rows) or, without one (the tiny model's character tokenizer), sent as plain text.
- Scoring: the dataset's own ``score_answer(answer, entry)``, with the answer the whole response
  (``extract: response``, stripped) or the text of its last ``<answer>...</answer>`` (``extract: answer_tag``,
  none: 0). The entry travels in ``prompt.meta["entry"]`` (plain data: it pickles to reward workers and
  is stored in checkpoints); an entry holding other objects is regenerated from ``meta["index"]``.
- A prompt longer than the model's context leaves for it (``data.max_prompt_tokens``, else the context
  less the response budget) is passed over and another index drawn.

``reasoning_gym`` is an optional dependency (``pip install 'flowrl[reasoning-gym]'``), imported only
when this task is built.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import msgspec

from flowrl.contract.data import Prompt
from flowrl.errors import ConfigError, TaskError, did_you_mean
from flowrl.specs import Spec

NAME = "reasoning_gym"
#: entries drawn (with a fixed seed, not the run's rng) to size the response budget and prompt lengths
SIZING_ENTRIES = 32
#: indices drawn for one prompt before a dataset whose prompts all run past the limit is refused
MAX_DRAWS = 64
#: the response budget of a dataset without a single oracle answer (its score_answer checks a solution)
OPEN_BUDGET = 256
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

_LOADED: dict[Any, ReasoningGymTask] = {}


class ReasoningGymOptions(Spec):
    """This task's own options; every other option is a field of the dataset's config."""

    dataset: str | None = None  # a reasoning-gym dataset name (required)
    seed: int = 0  # the dataset's seed: which problems its indices hold
    size: int = 10_000  # indices drawn from (some datasets build their problems up front: keep it modest)
    extract: Literal["response", "answer_tag"] = "response"  # what of a response is the answer
    max_new_tokens: int | None = None  # None: the longest answer of a few entries plus EOS (and the tags)


def import_reasoning_gym() -> Any:
    """The ``reasoning_gym`` package, or a TaskError naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise TaskError(
            f"task '{NAME}' needs the reasoning-gym package ({exc}); install it with "
            "pip install 'flowrl[reasoning-gym]'."
        ) from None
    return reasoning_gym


def extract_answer(response: str, how: str) -> str | None:
    """The answer in ``response``: all of it (stripped), or the text of its last ``<answer>...</answer>``
    (stripped; None when it has none)."""
    if how == "answer_tag":
        found = _ANSWER_TAG.findall(response)
        return found[-1].strip() if found else None
    return response.strip()


def _plain(value: Any) -> bool:
    """Whether ``value`` is plain data (None, bool, int, float, str, lists, tuples and dicts of them):
    what pickles to reward workers and a checkpoint stores as it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return False


def _split_options(options: Mapping[str, Any]) -> tuple[ReasoningGymOptions, dict[str, Any]]:
    """This task's own options, and the dataset's config fields: the section named after the chosen
    dataset (``basic_arithmetic: {min_terms: 2}``; other datasets' sections are ignored, so a graph's
    defaults for one dataset leave another alone), then the options given at the top level."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    own = {k: v for k, v in options.items() if k in ReasoningGymOptions.__struct_fields__}
    try:
        parsed = msgspec.convert(own, ReasoningGymOptions)
    except msgspec.ValidationError as exc:
        raise TaskError(f"task '{NAME}': bad option: {str(exc).replace('`$.', '`')}") from None
    rest = {k: v for k, v in options.items() if k not in ReasoningGymOptions.__struct_fields__}
    sections = {k for k, v in rest.items() if k in DATASETS and isinstance(v, Mapping)}
    fields = dict(rest.get(parsed.dataset, {})) if parsed.dataset in sections else {}
    fields.update({k: v for k, v in rest.items() if k not in sections})
    return parsed, fields


def build_dataset(options: ReasoningGymOptions, fields: Mapping[str, Any]) -> Any:
    """The reasoning-gym dataset ``options.dataset`` with config ``fields`` (and the options' seed and size);
    a TaskError names an unknown dataset (listing them) or a config field that is unknown (listing the
    dataset's), of the wrong type or refused by the dataset's own checks."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    known = sorted(DATASETS)
    if options.dataset is None:
        raise TaskError(f"task '{NAME}': option 'dataset' names no dataset; choose one of: {', '.join(known)}.")
    if options.dataset not in DATASETS:
        raise TaskError(
            f"task '{NAME}': option 'dataset' = {options.dataset!r} is not a reasoning-gym dataset; choose one of: "
            f"{', '.join(known)}.{did_you_mean(options.dataset, known)}"
        )
    dataset_cls, config_cls = DATASETS[options.dataset]
    where = f"task '{NAME}' dataset '{options.dataset}'"
    settable = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for key in fields:
        if key in ("seed", "size"):
            continue
        if key not in settable:
            ours = ", ".join(ReasoningGymOptions.__struct_fields__)
            raise TaskError(
                f"{where}: unknown option {key!r}; the dataset's config fields: {', '.join(settable)} (and this "
                f"task's own options: {ours}).{did_you_mean(key, settable)}"
            )
    if options.size < 1:
        raise TaskError(f"task '{NAME}': option 'size' must be at least 1, got {options.size}")
    values = {**fields, "seed": options.seed, "size": options.size}
    try:
        config = msgspec.convert(values, config_cls)
    except msgspec.ValidationError as exc:
        raise TaskError(f"{where}: bad config field: {str(exc).replace('`$.', '`')}") from None
    except TypeError:  # a field type msgspec does not know: the dataclass takes the values as they are
        config = config_cls(**values)
    try:
        if hasattr(config, "validate"):
            config.validate()
        return dataset_cls(config=config)
    except (AssertionError, ValueError, TypeError, KeyError) as exc:
        raise TaskError(f"{where}: the dataset refuses its config ({type(exc).__name__}: {exc}).") from None


class ReasoningGymTask:
    """A reasoning-gym dataset as a flowrl task: prompts drawn with the run's rng, scored by the dataset."""

    name: ClassVar[str] = NAME
    description: ClassVar[str] = (
        "reasoning-gym's procedural problems: task_options dataset=NAME and its config fields (pip install "
        "'flowrl[reasoning-gym]')"
    )

    def __init__(
        self,
        options: ReasoningGymOptions,
        dataset: Any,
        *,
        tokenizer: Any = None,
        template: str | None = None,
        system_prompt: str | None = None,
        context: int | None = None,
        max_prompt_tokens: int | None = None,
        budget: int | None = None,
    ) -> None:
        """``dataset`` as built by `build_dataset` from ``options``; prompts rendered for ``tokenizer`` with
        ``template`` (None: plain text; no tokenizer: lengths counted in characters) and kept within
        ``max_prompt_tokens``, else the ``context`` less the response ``budget`` (None: the task's)."""
        self.options, self.dataset = options, dataset
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt
        draws = random.Random(f"flowrl-reasoning-gym:{options.seed}").choices(range(options.size), k=SIZING_ENTRIES)
        sized = [self._prompt(i) for i in draws]
        self._budget = options.max_new_tokens or _answer_budget(sized, options.extract)
        run_budget = budget or self._budget
        self.limit = max_prompt_tokens or (context - run_budget if context is not None else None)
        lengths = [self._tokens(p.text) for p in sized]
        if self.limit is not None and min(lengths) > self.limit:
            raise TaskError(
                f"task '{NAME}' dataset '{options.dataset}': its prompts run to {min(lengths)}-{max(lengths)} tokens, "
                f"over the {self.limit} the model's context ({context} tokens) leaves beside a response budget of "
                f"{run_budget}; choose a config with shorter questions, raise tiny_model.max_position_embeddings, "
                "or use a model with a longer context (--model DIR)."
            )
        self._prompt_tokens = min(max(lengths), self.limit) if self.limit is not None else max(lengths)
        if tokenizer is not None:
            self._check_answer_tokens(sized)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ReasoningGymTask:
        """The task of ``options`` alone (``task_options``): prompts as plain text, no length limit."""
        if not isinstance(options, Mapping):
            raise TaskError(f"task '{NAME}': options must be a mapping, got {type(options).__name__}")
        parsed, fields = _split_options(options)
        return cls(parsed, build_dataset(parsed, fields))

    @classmethod
    def from_config(cls, cfg: Any) -> ReasoningGymTask:
        """The task of run config ``cfg``: ``cfg.task_options``, with prompts rendered for the actor's tokenizer
        as the ``data`` task renders its rows (``data.chat_template``, ``data.system_prompt``); built once per
        options, model and settings."""
        from flowrl.tasks import dataset

        if not isinstance(cfg.task_options, Mapping):
            raise TaskError(f"task '{NAME}': options must be a mapping, got {type(cfg.task_options).__name__}")
        options, fields = _split_options(cfg.task_options)
        folder = dataset.actor_folder(cfg.model)
        key = (
            msgspec.json.encode(cfg.task_options),
            folder,
            cfg.trust_remote_code,
            msgspec.json.encode(cfg.data),
            cfg.tiny_model.max_position_embeddings,
            cfg.rollout.max_new_tokens,
        )
        if key not in _LOADED:
            built = build_dataset(options, fields)  # a bad dataset or field is named before a tokenizer loads
            tokenizer = dataset.load_tokenizer(folder, cfg.trust_remote_code)
            template = dataset.chat_template(cfg.data, tokenizer)
            context = (
                cfg.tiny_model.max_position_embeddings if folder is None else dataset.model_context(folder, tokenizer)
            )
            _LOADED.clear()
            _LOADED[key] = cls(
                options,
                built,
                tokenizer=tokenizer,
                template=template,
                system_prompt=cfg.data.system_prompt,
                context=context,
                max_prompt_tokens=cfg.data.max_prompt_tokens,
                budget=cfg.rollout.max_new_tokens,
            )
        return _LOADED[key]

    # ------------------------------------------------------------ the Task protocol
    def max_new_tokens(self) -> int:
        return self._budget

    def prompt_tokens(self) -> int:
        """The longest prompt of a few entries, in tokens (what the planner sizes prompts by)."""
        return self._prompt_tokens

    def prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` prompts at indices drawn with ``rng``: deterministic given its state; one past the prompt
        limit is passed over (another index drawn)."""
        if n < 0:
            raise TaskError(f"task '{NAME}': cannot draw a negative number of prompts ({n})")
        out = []
        for _ in range(n):
            for _draw in range(MAX_DRAWS):
                prompt = self._prompt(rng.randrange(self.options.size))
                if self.limit is None or self._tokens(prompt.text) <= self.limit:
                    out.append(prompt)
                    break
            else:
                raise TaskError(
                    f"task '{NAME}' dataset '{self.options.dataset}': {MAX_DRAWS} prompts in a row ran past the "
                    f"prompt limit ({self.limit} tokens); choose a config with shorter questions or a longer context."
                )
        return out

    def score(self, prompt: Prompt, response: str) -> float:
        """The dataset's ``score_answer`` of the response's answer (``extract``) in [0, 1]; an answer the
        dataset's scorer cannot read (it raises) scores 0."""
        entry = self.entry(prompt)
        answer = extract_answer(str(response), self.options.extract)
        try:
            value = float(self.dataset.score_answer(answer, entry))
        except Exception:  # noqa: BLE001 - a malformed answer is a wrong one
            return 0.0
        return min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0

    # ------------------------------------------------------------ entries
    def entry(self, prompt: Prompt) -> dict[str, Any]:
        """The reasoning-gym entry ``prompt`` was made from: the one it carries, or regenerated from its index."""
        meta = prompt.meta
        if meta.get("dataset") != self.options.dataset or not isinstance(meta.get("index"), int):
            raise TaskError(
                f"task '{NAME}' dataset '{self.options.dataset}': prompt {prompt.text[:60]!r} is not one of its "
                f"entries (its meta names dataset {meta.get('dataset')!r}, index {meta.get('index')!r})."
            )
        entry = meta.get("entry")
        return entry if isinstance(entry, dict) else self.dataset[meta["index"]]

    def _prompt(self, index: int) -> Prompt:
        from flowrl.tasks.dataset import render_turns

        entry = self.dataset[index]
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        turns.append({"role": "user", "content": str(entry["question"])})
        where = f"task '{NAME}' dataset '{self.options.dataset}' entry {index}"
        try:
            text = render_turns(where, turns, self.tokenizer, self.template)
        except ConfigError as exc:
            raise TaskError(str(exc)) from None
        answer = entry.get("answer")
        meta: dict[str, Any] = {"dataset": self.options.dataset, "index": index}
        if _plain(entry):
            meta["entry"] = entry
        templated = self.template is not None
        return Prompt(
            text=text,
            answer="" if answer is None else str(answer),
            meta=meta,
            templated=templated,
            messages=tuple(turns) if templated else (),
        )

    def _tokens(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text) + 1
        return len(self.tokenizer(text, add_special_tokens=self.template is None)["input_ids"])

    def _check_answer_tokens(self, sized: list[Prompt]) -> None:
        """Answers the tokenizer cannot write (characters it maps to its unknown token: the tiny model's
        character tokenizer knows only a few) are refused, naming the characters: no response could be right."""
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is None:
            return
        chars = {c for p in sized for c in p.answer}
        missing = sorted(c for c in chars if unk in self.tokenizer(c, add_special_tokens=False)["input_ids"])
        if missing:
            raise TaskError(
                f"task '{NAME}' dataset '{self.options.dataset}': its answers use characters the model's tokenizer "
                f"cannot write ({''.join(missing)!r}), so no response could be right; choose a dataset (or config) "
                "whose answers it can write, or a model whose tokenizer has them (--model DIR)."
            )


def _answer_budget(prompts: list[Prompt], extract: str) -> int:
    """The longest answer of ``prompts`` plus one token for EOS (and the answer tags): no room to spare, since
    reasoning-gym's scorers give partial credit to a response that holds the answer among other characters
    (a from-scratch model would learn to write several guesses at once); a dataset without oracle answers
    gets `OPEN_BUDGET`."""
    if not any(p.answer for p in prompts):
        return OPEN_BUDGET
    tags = len("<answer></answer>") if extract == "answer_tag" else 0
    return max(len(p.answer) for p in prompts) + tags + 1
