"""Agent ``verifiers``: one rollout of a verifiers (0.4, Environments Hub) environment per episode.

``g.generate(..., agent="verifiers", environment="gsm8k", env_args={...})`` plays each episode as verifiers
does (``Env.run_episode``: task setup, the agent's turns, the task's ``@vf.reward`` functions) with the
policy answering through flowrl's endpoint, and returns the trace's reward (the weighted sum of the rewards).

``environment`` names the environment's taskset as verifiers does: an installed package (``gsm8k``; a hub id
``owner/gsm8k@1.0`` imports ``gsm8k``), or a Python file of your own (``path/to/my_env.py``) that exports its
``Taskset`` subclass in ``__all__``. Nothing is downloaded: install a hub environment beforehand
(``prime env install owner/name``). ``env_args`` are the taskset's config fields (``TasksetConfig``).

The episode's task: the verifiers task the prompt came from (``meta["vf_idx"]``, set by
:func:`verifiers_prompts`, which turns the environment's taskset into flowrl prompts -- the ``verifiers``
task), else a task of the environment's type built from the prompt's messages (and the ``meta`` fields its
``TaskData`` declares).

Every seat is played by flowrl's in-process chat harness (`flowrl.agents.verifiers_harness`) in a subprocess
runtime: the built-in harnesses install programs with ``uv`` at run time, and the default runtime is a
remote sandbox.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flowrl.agents.imports import file_module, require
from flowrl.contract.data import Prompt
from flowrl.errors import AgentError

AGENT = "verifiers"
EXTRA = "verifiers"

#: loaded environments by (environment, env_args, limit): the task and the agent of a run share one load
_LOADED: dict[tuple[str, str, int | None], Loaded] = {}


class Loaded:
    """A loaded verifiers environment: the `Env`, its tasks (the taskset iterated once) and its name."""

    def __init__(self, name: str, env: Any, tasks: list[Any]) -> None:
        self.name, self.env, self.tasks = name, env, tasks


def load_environment(environment: str, env_args: Mapping[str, Any] | None = None, limit: int | None = None) -> Loaded:
    """The verifiers environment ``environment`` with taskset config ``env_args`` (loaded once per process)."""
    if not isinstance(environment, str) or not environment.strip():
        raise AgentError(
            f"agent {AGENT!r}: option 'environment' must name a verifiers environment, got {environment!r}."
        )
    if env_args is not None and not isinstance(env_args, Mapping):
        raise AgentError(f"verifiers environment {environment!r}: env_args must be a mapping, got {env_args!r}.")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise AgentError(f"verifiers environment {environment!r}: limit must be a positive number of tasks.")
    args = dict(env_args or {})
    try:
        key = (environment, json.dumps(args, sort_keys=True), limit)
    except TypeError:
        raise AgentError(
            f"verifiers environment {environment!r}: env_args must be JSON values, got {args!r}."
        ) from None
    if key not in _LOADED:
        _LOADED[key] = _load(environment, args, limit)
    return _LOADED[key]


def _load(environment: str, args: dict[str, Any], limit: int | None) -> Loaded:
    require("verifiers.v1", EXTRA, AGENT)
    require("openai", EXTRA, AGENT)
    import verifiers.v1 as vf
    from pydantic import ValidationError

    from flowrl.agents.verifiers_harness import HARNESS_ID

    where = f"verifiers environment {environment!r}"
    taskset_id = environment
    if environment.endswith(".py"):  # the user's own environment file
        path = Path(environment)
        if not path.is_file():
            raise AgentError(f"{where}: the file '{environment}' does not exist.")
        taskset_id = file_module(path, where).__name__
    try:
        roles = _roles(vf.env_config_type(taskset_id))
        seat = {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}}
        config = vf.resolve_env_config({"taskset": {**args, "id": taskset_id}, **{role: seat for role in roles}})
        env = vf.load_environment(config)
        taskset = env.taskset if limit is None else env.taskset.take(limit)
        if not taskset.bounded:
            raise AgentError(f"{where}: its taskset is infinite; give the agent option limit=N (tasks to draw from).")
        tasks = list(taskset)
    except AgentError:
        raise
    except ModuleNotFoundError as exc:
        raise AgentError(
            f"{where} is not installed ({exc}). Install it before the run (a hub environment: prime env install "
            "OWNER/NAME, or pip install its package), or give a Python file of your own (path/to/env.py); flowrl "
            "downloads nothing at run time."
        ) from None
    except ValidationError as exc:
        raise AgentError(f"{where}: env_args do not fit its config: {_first_error(exc)}") from None
    except Exception as exc:
        raise AgentError(f"{where} failed to load: {type(exc).__name__}: {exc}") from exc
    if not tasks:
        raise AgentError(f"{where}: its taskset holds no tasks.")
    return Loaded(environment, env, tasks)


def _roles(config_cls: type) -> list[str]:
    """The seats (``AgentConfig`` fields) of an env config class: ``agent`` for a single-agent env."""
    import verifiers.v1 as vf

    return [name for name, info in config_cls.model_fields.items() if isinstance(info.default, vf.AgentConfig)]


def _first_error(exc: Any) -> str:
    errors = exc.errors()
    if not errors:
        return str(exc)
    first = errors[0]
    return f"{'.'.join(str(p) for p in first.get('loc', ()))}: {first.get('msg')}"


# ---------------------------------------------------------------- the task: the environment's own prompts


def verifiers_prompts(
    environment: str, env_args: Mapping[str, Any] | None = None, limit: int | None = None
) -> list[Prompt]:
    """Each task of the environment's taskset as a flowrl `Prompt`, in taskset order: its messages (system
    prompt first), their text, its ``answer`` field when the task data has one (else ""), and in ``meta`` the
    task's index (``vf_idx``, which the agent plays), the environment, and the task data's other fields."""
    loaded = load_environment(environment, env_args, limit)
    return [_prompt(loaded.name, task) for task in loaded.tasks]


def _prompt(environment: str, task: Any) -> Prompt:
    import verifiers.v1 as vf

    data = task.data
    messages = _messages(data)
    infra = set(vf.TaskData.model_fields) - {"id", "name", "description"}  # runtime settings, not the task's
    fields = data.model_dump(mode="json", exclude_none=True, exclude=infra)
    answer = fields.pop("answer", "")
    meta = {"vf_idx": data.idx, "vf_env": environment, **fields}
    text = "\n\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))
    return Prompt(
        text=text, answer=answer if isinstance(answer, str) else json.dumps(answer), meta=meta, messages=tuple(messages)
    )


def _messages(data: Any) -> list[dict[str, Any]]:
    from verifiers.v1.dialects.chat import message_to_wire

    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if data.prompt is None:
        return system
    if isinstance(data.prompt, str):
        return [*system, {"role": "user", "content": data.prompt}]
    return [*system, *(message_to_wire(m) for m in data.prompt)]


# ---------------------------------------------------------------- the agent


def verifiers_agent(
    task: Any = None,
    *,
    environment: str = "",
    env_args: Mapping[str, Any] | None = None,
    sampling_args: Mapping[str, Any] | None = None,
    limit: int | None = None,
    max_turns: int | None = None,
) -> Callable[..., Any]:
    """The ``verifiers`` agent of environment ``environment`` (loaded here, once): an ``async`` callable
    playing one episode and returning its reward. ``sampling_args`` (temperature, top_p, max_tokens, ...) are
    set on every request the environment's turns send; ``max_turns`` caps the model's turns per episode."""
    if not environment:
        raise AgentError(
            f"agent {AGENT!r} needs the option environment=ID (an installed environment, or a local file.py)."
        )
    loaded = load_environment(environment, env_args, limit)
    import verifiers.v1 as vf
    from pydantic import ValidationError

    where = f"verifiers environment {environment!r}"
    try:
        sampling = vf.SamplingConfig.model_validate(dict(sampling_args or {}))
    except ValidationError as exc:
        raise AgentError(f"{where}: sampling_args: {_first_error(exc)}") from None
    if max_turns is not None:
        if not isinstance(max_turns, int) or max_turns < 1:
            raise AgentError(f"{where}: max_turns must be a positive number of turns, got {max_turns!r}.")
        for role in _roles(type(loaded.env.config)):
            getattr(loaded.env.config, role).max_turns = max_turns
    task_cls = type(loaded.env.taskset).task_type()

    async def agent(
        base_url: str,
        api_key: str,
        messages: list[dict],
        answer: str,
        meta: dict,
        episode_id: str = "",
        model: str = "",
    ) -> float:
        # the run-wide base URL, the episode named as the model: verifiers keeps one HTTP client per distinct
        # client config, so a base URL per episode would build (and keep) one per episode
        base_url, model = base_url.split("/episodes/", 1)[0] + "/v1", episode_id or model
        vf_task = _task_of(loaded, task_cls, messages, answer, meta)
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=_key_variable(api_key))
        ctx = vf.ModelContext(model=model, client=client, sampling=sampling)
        episode = await loaded.env.run_episode(vf_task, ctx)
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if not episode.ok or errors:
            detail = "; ".join(f"{e.type}: {e.message}" for e in errors) or "the episode did not complete"
            raise AgentError(f"{where}: the episode failed: {detail}")
        return float(sum(t.reward for t in episode.traces))

    return agent


def _task_of(loaded: Loaded, task_cls: type, messages: list[dict], answer: str, meta: Mapping[str, Any]) -> Any:
    """The verifiers task an episode plays: the environment's own (``meta["vf_idx"]``), else one built from the
    flowrl prompt (its messages, the answer and the ``meta`` fields the task data declares)."""
    where = f"verifiers environment {loaded.name!r}"
    idx = meta.get("vf_idx") if isinstance(meta, Mapping) else None
    if idx is not None and meta.get("vf_env", loaded.name) == loaded.name:
        if not isinstance(idx, int) or not 0 <= idx < len(loaded.tasks):
            raise AgentError(f"{where}: the prompt's vf_idx {idx!r} is no task of it ({len(loaded.tasks)} tasks).")
        return loaded.tasks[idx]
    data_type = task_cls.data_type()
    fields = {k: v for k, v in (meta or {}).items() if k in data_type.model_fields and k not in ("idx", "prompt")}
    if "answer" in data_type.model_fields and answer:
        fields.setdefault("answer", answer)
    from pydantic import ValidationError

    try:
        data = data_type.model_validate({**fields, "prompt": list(messages)})
    except ValidationError as exc:
        raise AgentError(
            f"{where}: the prompt is none of its tasks (no meta['vf_idx']: train with task 'verifiers') and its "
            f"task data ({data_type.__name__}) cannot be built from it: {_first_error(exc)}"
        ) from None
    return task_cls(data, loaded.env.taskset.config.task)


def _key_variable(api_key: str) -> str:
    """The environment variable verifiers reads the endpoint's api key from (one per key)."""
    name = "FLOWRL_ENDPOINT_KEY_" + hashlib.sha256(api_key.encode()).hexdigest()[:12].upper()
    os.environ[name] = api_key
    return name
