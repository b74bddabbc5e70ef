"""An OpenAI-compatible HTTP endpoint served by the policy in training (an ASGI app on uvicorn).

During rollouts of a generate node with an agent (`flowrl.runtime.agents`) the run serves its
policy on loopback: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, under one base
URL per episode (``http://127.0.0.1:PORT/episodes/ID/v1``), so a plain ``openai`` client given that
URL is one episode; on the run-wide base URL (``http://127.0.0.1:PORT/v1``) a request's ``model``
names its episode instead, for clients that keep one connection pool per base URL. Requests need the
run's key (``Authorization: Bearer KEY``, what the client sends as its ``api_key``); anything else on
the machine is refused.

This module is the HTTP side only: it parses and bounds a request into a `ChatRequest` or
`CompletionRequest` (an `ApiError` for what is malformed or too large, in OpenAI's error shape) and
hands it, as a `Call`, to the run's driver thread, which answers the call's future with the response
body (a dict) or an `ApiError`. Responses stream as server-sent events when a request asks to
(``stream: true``): the whole completion in one chunk, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

#: a request body's bytes, at most
MAX_BODY = 4 << 20
#: messages of one chat request, at most
MAX_MESSAGES = 4096
#: choices of one request (``n``), at most
MAX_CHOICES = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answer: HTTP ``status`` and OpenAI's ``{"error": {...}}`` body."""

    def __init__(self, status: int, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class ChatRequest(msgspec.Struct, kw_only=True):
    """The fields of ``/v1/chat/completions`` flowrl reads (others a client sends are ignored)."""

    messages: list[dict[str, Any]]
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    n: int = 1
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    return_token_ids: bool | None = None  # vLLM's extension: the prompt's and each choice's token ids


class CompletionRequest(msgspec.Struct, kw_only=True):
    """The fields of ``/v1/completions`` flowrl reads: one prompt, as text or token ids."""

    prompt: str | list[int]
    model: str = ""
    n: int = 1
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    logprobs: int | None = None
    stream: bool | None = None
    return_token_ids: bool | None = None


@dataclass
class Call:
    """One request for the driver: its episode, what it asks, and the future its answer goes to."""

    episode: str
    request: ChatRequest | CompletionRequest
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    received: float = field(default_factory=time.monotonic)

    @property
    def chat(self) -> bool:
        return isinstance(self.request, ChatRequest)


def stops(request: ChatRequest | CompletionRequest) -> tuple[str, ...]:
    if request.stop is None:
        return ()
    return (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)


def _checked(request: ChatRequest | CompletionRequest) -> None:
    """Bounds msgspec's types do not say; an `ApiError` naming the field."""
    if not 1 <= request.n <= MAX_CHOICES:
        raise ApiError(400, f"n must be in [1, {MAX_CHOICES}], got {request.n}.", param="n")
    limit = request.max_completion_tokens if isinstance(request, ChatRequest) else None
    limit = limit if limit is not None else request.max_tokens
    if limit is not None and limit < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {limit}.", param="max_tokens")
    stop = stops(request)
    if len(stop) > 4 or any(not isinstance(s, str) or not s or len(s) > 256 for s in stop):
        raise ApiError(400, "stop must be at most 4 non-empty strings of at most 256 characters.", param="stop")
    if isinstance(request, CompletionRequest):
        if not request.prompt:
            raise ApiError(400, "prompt is empty.", param="prompt")
        return
    if not request.messages:
        raise ApiError(400, "messages is empty.", param="messages")
    if len(request.messages) > MAX_MESSAGES:
        raise ApiError(400, f"{len(request.messages)} messages, over the {MAX_MESSAGES} served.", param="messages")
    for i, m in enumerate(request.messages):
        if m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}.", param=f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(400, f"messages[{i}].content must be text or a list of parts.", param=f"messages[{i}]")
    for i, tool in enumerate(request.tools or ()):
        if not isinstance(tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str):
            raise ApiError(400, f"tools[{i}] has no function name.", param=f"tools[{i}]")


def _parse(raw: bytes, kind: type) -> ChatRequest | CompletionRequest:
    try:
        request = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"bad request: {exc}.") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}.") from None
    _checked(request)
    return request


def _sse(body: dict[str, Any], chat: bool) -> list[bytes]:
    """A finished completion as server-sent events: one chunk per choice, then ``[DONE]``."""
    events = []
    for choice in body["choices"]:
        if chat:
            message = choice["message"]
            delta = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
            part = {"index": choice["index"], "delta": delta, "finish_reason": choice["finish_reason"]}
            if choice.get("logprobs") is not None:
                part["logprobs"] = choice["logprobs"]
        else:
            part = dict(choice)
        chunk = {k: v for k, v in body.items() if k not in ("choices", "usage")}
        chunk["object"] = "chat.completion.chunk" if chat else "text_completion"
        chunk["choices"] = [part]
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


class Endpoint:
    """The HTTP server in a thread of its own; ``submit(call)`` hands each parsed request to the driver."""

    def __init__(self, submit: Callable[[Call], None], model: str, host: str = "127.0.0.1") -> None:
        self.submit, self.model, self.host = submit, model, host
        self.key = "flowrl-" + secrets.token_urlsafe(24)
        self.port = 0
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.counts: dict[str, int] = {}  # refused requests by reason (since the driver last took them)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the run's own handlers stay
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_until_complete(self._server.serve(sockets=[sock]))
            loop.close()

        self._thread = threading.Thread(target=serve, name="flowrl-endpoint", daemon=True)
        self._thread.start()
        ready.wait(30)
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(10)
        self._thread = None

    def base_url(self, episode: str) -> str:
        return f"http://{self.host}:{self.port}/episodes/{episode}/v1"

    def _refused(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    # ------------------------------------------------------------ the ASGI app
    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        def error(exc: ApiError) -> JSONResponse:
            self._refused(exc.code)
            return JSONResponse(exc.body(), status_code=exc.status)

        def authorised(request: Request) -> None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
                raise ApiError(
                    401, "a missing or wrong API key (the run's key is the agent's api_key).", "unauthorized"
                )

        async def body(request: Request) -> bytes:
            size = request.headers.get("content-length")
            if size is not None and (not size.isdigit() or int(size) > MAX_BODY):
                raise ApiError(413, f"the body is over the {MAX_BODY >> 20} MiB served.", "too_large")
            chunks, total = [], 0
            async for chunk in request.stream():
                total += len(chunk)
                if total > MAX_BODY:
                    raise ApiError(413, f"the body is over the {MAX_BODY >> 20} MiB served.", "too_large")
                chunks.append(chunk)
            return b"".join(chunks)

        async def models(request: Request) -> Response:
            try:
                authorised(request)
            except ApiError as exc:
                return error(exc)
            entry = {"id": self.model, "object": "model", "created": 0, "owned_by": "flowrl"}
            return JSONResponse({"object": "list", "data": [entry]})

        def completion(kind: type) -> Callable[[Request], Any]:
            async def handle(request: Request) -> Response:
                try:
                    authorised(request)
                    parsed = _parse(await body(request), kind)
                    episode = request.path_params.get("episode") or parsed.model
                    call = Call(episode, parsed)
                    self.submit(call)
                    answer = await asyncio.wrap_future(call.future)
                except ApiError as exc:
                    return error(exc)
                if parsed.stream:
                    events = _sse(answer, kind is ChatRequest)
                    return StreamingResponse(iter(events), media_type="text/event-stream")
                return JSONResponse(answer)

            return handle

        async def missing(request: Request) -> Response:
            return error(
                ApiError(404, f"no route {request.url.path}: this endpoint serves /episodes/ID/v1/...", "no_route")
            )

        routes = [
            Route("/episodes/{episode}/v1/chat/completions", completion(ChatRequest), methods=["POST"]),
            Route("/episodes/{episode}/v1/completions", completion(CompletionRequest), methods=["POST"]),
            Route("/episodes/{episode}/v1/models", models, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            # one base URL for every episode: the request's ``model`` names its episode (for clients that
            # keep one connection per base URL, such as verifiers' model clients)
            Route("/v1/chat/completions", completion(ChatRequest), methods=["POST"]),
            Route("/v1/completions", completion(CompletionRequest), methods=["POST"]),
        ]

        async def not_found(request: Request, exc: Exception) -> Response:
            return await missing(request)

        return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
