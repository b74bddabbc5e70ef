"""The ``command`` agent: an episode is a process of the user's command (any language).

The process finds the endpoint where the ``openai`` clients look for it, in ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` (so ``OpenAI()`` with no arguments talks to the policy), with ``FLOWRL_MODEL`` and
``FLOWRL_EPISODE_ID``; it reads the task's prompt as one JSON object on stdin (``messages``,
``prompt``, ``answer``, ``meta``) and writes its reward as the last line of stdout: a number, a JSON
object with ``"reward"``, or ``null``. A non-zero exit status is the episode's failure; a process past
the node's timeout is killed with its process group.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
from collections.abc import Callable, Mapping
from typing import Any

from flowrl.errors import GraphError

#: what a command may write on stdout, at most
MAX_OUTPUT = 1 << 20


def command(
    task: Any, *, command: str | list[str] = "", env: Mapping[str, str] | None = None, cwd: str | None = None
) -> Callable[..., Any]:
    """An agent that runs ``command`` (a string split as a shell would, or a list) once per episode."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise GraphError("agent 'command' needs the option command='PROGRAM ARGS' (or a list).")
    extra = {str(k): str(v) for k, v in (env or {}).items()}

    async def run(
        base_url: str, api_key: str, model: str, episode_id: str, messages: list, prompt: str, answer: str, meta: dict
    ) -> Any:
        environ = {
            **os.environ,
            **extra,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            "FLOWRL_MODEL": model,
            "FLOWRL_EPISODE_ID": episode_id,
        }
        stdin = json.dumps({"messages": messages, "prompt": prompt, "answer": answer, "meta": meta}).encode()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=cwd,
                env=environ,
                start_new_session=True,  # its own process group: a timeout kills what it started too
                limit=MAX_OUTPUT,
            )
        except OSError as exc:
            raise RuntimeError(f"command {argv[0]!r} cannot start: {exc}") from None
        try:
            out, err = await _communicate(proc, stdin)
        except BaseException:
            _kill(proc)
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise RuntimeError(f"command exited with status {proc.returncode}: {tail[0][:300]}")
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            raise RuntimeError("command wrote no reward (its last line on stdout: a number, {'reward': x} or null)")
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            raise RuntimeError(f"command's last line is not JSON: {lines[-1][:200]!r}") from None

    return run


async def _communicate(proc: asyncio.subprocess.Process, stdin: bytes) -> tuple[bytes, bytes]:
    """stdin written, stdout and stderr read (each at most `MAX_OUTPUT`), the exit awaited."""

    async def feed() -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(stdin)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            proc.stdin.close()

    async def read(stream: asyncio.StreamReader | None, name: str) -> bytes:
        assert stream is not None
        data = bytearray()
        while chunk := await stream.read(65536):
            data += chunk
            if len(data) > MAX_OUTPUT:
                raise RuntimeError(f"command wrote over {MAX_OUTPUT >> 20} MiB on {name}")
        return bytes(data)

    _, out, err = await asyncio.gather(feed(), read(proc.stdout, "stdout"), read(proc.stderr, "stderr"))
    await proc.wait()
    return out, err


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
