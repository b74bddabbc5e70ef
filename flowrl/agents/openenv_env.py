"""Agent ``openenv``: one OpenEnv (openenv-core 0.3) episode per flowrl episode.

``g.generate(..., agent="openenv", environment="my_envs/echo.py:EchoEnvironment")`` (or ``base_url="http://host:8000"``
for an OpenEnv server already running) plays each episode as a chat: ``reset()`` -> the observation as a user
message -> the policy's reply (a chat completion at flowrl's endpoint) -> the reply as an action -> ``step()``
-> ... until the environment says done (or ``max_steps``); the reward is the sum of the steps' rewards.

- ``environment``: an OpenEnv ``Environment`` subclass (``package.module:Class`` or ``path/to/file.py:Class``),
  served once per factory call on a loopback port in this process with OpenEnv's own app
  (``create_fastapi_app``) -- no Docker, nothing downloaded; ``env_kwargs`` are its constructor's arguments.
- ``base_url``: a running OpenEnv server instead (never started nor stopped here).
- The episode's messages: ``system_prompt`` (optional), then each observation: its one text field when it
  has one, else its JSON. The reply becomes the action: a JSON object as it is, else -- for an action with
  one text field (its schema, read from the server's ``/schema``) -- ``{field: reply}``.
- ``reset_args`` go to every ``reset()``, with ``episode_id`` and a ``seed``: the prompt's ``meta["seed"]``
  (the ``openenv`` task's prompts carry one), else a number derived from the prompt's text. So the run's
  prompt stream (drawn from its rng) picks the episodes, deterministically, and the ``n`` episodes of one
  prompt (a GRPO group) play the same episode of a seeded environment; ``reset_args={"seed": ...}`` overrides.

The environment draws its own episode at ``reset()``: the flowrl task's prompt is not shown to the policy,
only its seed is used (the ``openenv`` task, `flowrl.tasks.openenv_task`, is a stream of seeds).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
import typing
from collections.abc import Callable, Mapping
from typing import Any

from flowrl.agents.imports import load_object, require
from flowrl.errors import AgentError

AGENT = "openenv"
EXTRA = "openenv"

#: servers launched in this process, by (env, env_kwargs): one per environment and arguments
_SERVERS: dict[tuple[str, str], LocalServer] = {}


class LocalServer:
    """An OpenEnv environment class served by uvicorn on a loopback port, in a daemon thread."""

    def __init__(self, env_cls: type, action_cls: type, observation_cls: type, kwargs: dict[str, Any]) -> None:
        import uvicorn
        from openenv.core.env_server.http_server import create_fastapi_app

        app = _quiet_hangups(
            create_fastapi_app(lambda: env_cls(**kwargs), action_cls, observation_cls, max_concurrent_envs=256)
        )
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="critical", lifespan="off")  # a client hanging up is no error
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="openenv-server", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise AgentError(f"OpenEnv environment {env_cls.__name__}: its local server did not start.")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _quiet_hangups(app: Any) -> Any:
    """``app`` with a websocket session's end by the client (the agent closing its episode) ending quietly:
    OpenEnv's endpoint closes the socket again after the client did, which raises, and uvicorn logs it as an
    application error (its logger's level is shared with flowrl's endpoint server, so it is not silenced)."""
    from starlette.websockets import WebSocketDisconnect
    from uvicorn.protocols.utils import ClientDisconnected

    async def quiet(scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "websocket":
            return await app(scope, receive, send)
        try:
            await app(scope, receive, send)
        except (WebSocketDisconnect, ClientDisconnected):
            pass

    return quiet


def _classes(env_cls: type, where: str) -> tuple[type, type]:
    """The Action and Observation classes of an ``Environment[ActT, ObsT, StateT]`` subclass."""
    from openenv.core.env_server.types import Action, Observation

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if len(args) >= 2 and all(isinstance(a, type) for a in args[:2]):
                if issubclass(args[0], Action) and issubclass(args[1], Observation):
                    return args[0], args[1]
    raise AgentError(
        f"{where}: {env_cls.__name__} does not name its Action and Observation types; declare it as "
        "class MyEnv(Environment[MyAction, MyObservation, State])."
    )


def launch(env: str, env_kwargs: Mapping[str, Any] | None = None) -> LocalServer:
    """The loopback server of OpenEnv environment class ``env`` (started once per class and arguments)."""
    require("openenv.core", EXTRA, AGENT)
    from openenv.core.env_server.interfaces import Environment

    where = f"OpenEnv environment {env!r}"
    kwargs = dict(env_kwargs or {})
    try:
        key = (env, json.dumps(kwargs, sort_keys=True))
    except TypeError:
        raise AgentError(f"{where}: env_kwargs must be JSON values, got {kwargs!r}.") from None
    if key not in _SERVERS:
        env_cls = load_object(env, where)
        if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
            raise AgentError(f"{where}: {env_cls!r} is not an OpenEnv Environment subclass.")
        action_cls, observation_cls = _classes(env_cls, where)
        try:
            env_cls(**kwargs).close()  # its constructor's errors, here rather than in a server thread
        except Exception as exc:
            raise AgentError(f"{where}: {env_cls.__name__}(**{kwargs!r}) failed: {type(exc).__name__}: {exc}") from exc
        _SERVERS[key] = LocalServer(env_cls, action_cls, observation_cls, kwargs)
    return _SERVERS[key]


def render(observation: Mapping[str, Any]) -> str:
    """An observation as the user message's text: its one non-empty text field, else its JSON."""
    texts = [v for v in observation.values() if isinstance(v, str) and v]
    return texts[0] if len(texts) == 1 else json.dumps(observation, ensure_ascii=False, sort_keys=True)


def parse_action(reply: str, schema: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The policy's reply as an action: a JSON object as it is, else ``{field: reply}`` for an action with
    one text field."""
    text = reply.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            return value
    fields = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    texts = [k for k, v in fields.items() if v.get("type") == "string"]
    if len(fields) == 1 and texts:
        return {texts[0]: text}
    raise AgentError(
        f"{where}: the reply {reply[:80]!r} is not a JSON object, and the action has no single text field to put "
        f"it in (fields: {', '.join(fields) or 'none'})."
    )


def episode_seed(prompt: str, meta: Mapping[str, Any] | None) -> int:
    """The ``reset()`` seed of an episode of ``prompt``: its ``meta["seed"]``, else one derived from its text."""
    seed = (meta or {}).get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16)


def openenv_agent(
    task: Any = None,
    *,
    environment: str | None = None,
    base_url: str | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    reset_args: Mapping[str, Any] | None = None,
    sampling_args: Mapping[str, Any] | None = None,
    system_prompt: str | None = None,
    max_steps: int = 8,
) -> Callable[..., Any]:
    """The ``openenv`` agent: ``environment`` (an Environment class, served here) or ``base_url`` (a running
    server). (The option is not ``env``: that names a generate node's built-in environment.)"""
    env = environment
    if (env is None) == (base_url is None):
        raise AgentError(
            f"agent {AGENT!r}: give one of environment='module:Class' (an OpenEnv Environment class, served in this "
            "process) "
            "or base_url='http://host:port' (a running OpenEnv server)."
        )
    if not isinstance(max_steps, int) or max_steps < 1:
        raise AgentError(f"agent {AGENT!r}: max_steps must be a positive number of steps, got {max_steps!r}.")
    require("openenv.core", EXTRA, AGENT)
    require("openai", EXTRA, AGENT)
    where = f"OpenEnv environment {env or base_url!r}"
    url = launch(env, env_kwargs).url if env is not None else str(base_url).rstrip("/")
    sampling = dict(sampling_args or {})
    resets = dict(reset_args or {})
    schema: dict[str, Any] = {}

    async def action_schema() -> dict[str, Any]:
        if not schema:
            import httpx

            try:
                async with httpx.AsyncClient(timeout=30) as http:
                    response = await http.get(f"{url}/schema")
                    response.raise_for_status()
                schema.update(response.json()["action"])
            except Exception as exc:
                raise AgentError(f"{where}: its action schema ({url}/schema) cannot be read: {exc}") from exc
        return schema

    async def agent(base_url: str, api_key: str, model: str, episode_id: str, prompt: str, meta: dict) -> float:
        from openai import AsyncOpenAI
        from openenv.core.generic_client import GenericEnvClient

        policy = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        client = GenericEnvClient(base_url=url)
        seed = episode_seed(prompt, meta)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        total = 0.0
        try:
            try:
                await client.connect()
                result = await client.reset(**{"seed": seed, "episode_id": episode_id, **resets})
            except Exception as exc:
                raise AgentError(f"{where}: reset failed: {type(exc).__name__}: {exc}") from exc
            for _ in range(max_steps):
                if result.done:
                    break
                messages.append({"role": "user", "content": render(result.observation)})
                completion = await policy.chat.completions.create(model=model, messages=messages, **sampling)
                reply = completion.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": reply})
                action = parse_action(reply, await action_schema(), where)
                try:
                    result = await client.step(action)
                except Exception as exc:
                    raise AgentError(f"{where}: step({action!r}) failed: {type(exc).__name__}: {exc}") from exc
                total += float(result.reward or 0.0)
        finally:
            await client.close()
            await policy.close()
        return total

    return agent
