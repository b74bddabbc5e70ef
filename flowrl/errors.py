"""One error hierarchy. The CLI prints a FlowRLError as one paragraph and exits 2."""

from __future__ import annotations


class FlowRLError(Exception):
    """Base of every error a user can cause and fix."""


class GraphError(FlowRLError):
    """A graph violates an invariant; the message names the node and key."""


class ConfigError(FlowRLError):
    """A config file or --set override is malformed; the message names the field path."""


class PlanError(FlowRLError):
    """A pass failed or a plan cannot run (e.g. does not fit in memory)."""


class PluginError(FlowRLError):
    """A plugin failed to load, or registered something invalid or twice."""


class BackendError(FlowRLError):
    """A backend cannot do what the plan asks (missing model dir, bad tokenizer, ...)."""


class WorkerLostError(BackendError):
    """A worker process or its whole node was lost mid-run (killed, crashed, its node gone): not a fault of
    the run's code or config, so the run may restart from its last checkpoint (``max_restarts``).
    ``rank``, ``pid``, ``group``, ``iteration`` (None: during setup) and ``task`` say which and when."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        pid: int | None = None,
        group: str | None = None,
        iteration: int | None = None,
        task: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank, self.pid, self.group, self.iteration, self.task = rank, pid, group, iteration, task


class TaskError(FlowRLError):
    """An unknown task or a malformed task option."""


class AgentError(FlowRLError):
    """An agent cannot load its environment or play an episode (the environment is not installed, fails to
    load, or fails mid-episode); the message names the environment."""


def reworded(exc: FlowRLError, message: str) -> FlowRLError:
    """``exc`` saying ``message`` instead (a prefix naming the node or step added), as its own type and with
    its attributes (a `WorkerLostError`'s rank and pid), to raise in its place."""
    import copy

    new = copy.copy(exc)
    new.args = (message,)
    return new


def did_you_mean(name: str, known: list[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``known`` (case-insensitive), or ``""``."""
    import difflib

    lowered = {k.lower(): k for k in known}
    hit = difflib.get_close_matches(str(name).lower(), list(lowered), n=1)
    return f" Did you mean '{lowered[hit[0]]}'?" if hit else ""


def plain_name(name: object) -> bool:
    """Whether ``name`` is one plain folder name (no '/', '\\', '.' or '..'), so a folder made from
    it stays inside its parent."""
    return isinstance(name, str) and name not in ("", ".", "..") and not set(name) & {"/", "\\"}
