"""Register functions from a graph file, without a plugin package.

A graph file may define its own reward, compute function (``@register.compute``; its older
name ``@register.estimator`` still works), loss, filter, environment or task next to ``build(cfg)``,
with a decorator::

    from flowrl import register

    @register.reward("shorter_is_better")
    def shorter_is_better(prompts, responses, task):
        return [1.0 / (1 + len(r)) for r in responses]

They are registered when flowrl loads the file (``flowrl run graphs/mine.py``), under the graph
file as their plugin (`flowrl plugins` lists them while it runs), exactly as a plugin's hook
would register them: the same checks of signature and metadata, the same names space. A name
another graph file already uses is refused; a built-in's or an installed plugin's name is shadowed
inside this graph (its function wins there), with a one-line notice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

#: (kind, name, object, metadata) registered by decorators since the last `take_pending()`.
_PENDING: list[tuple[str, str, Any, dict[str, Any]]] = []


def _decorator(kind: str, name: str | Callable[..., Any] | None, meta: dict[str, Any]) -> Any:
    def wrap(fn: F) -> F:
        _PENDING.append((kind, name if isinstance(name, str) else fn.__name__, fn, meta))
        return fn

    if callable(name):  # used bare: @register.reward
        return wrap(name)
    return wrap


def reward(name: str | None = None) -> Callable[[F], F]:
    """A reward function ``fn(prompts, responses, task, **options)`` -> one score per response
    (or (scores, metrics))."""
    return _decorator("reward_functions", name, {})


def compute(
    name: str | None = None, *, needs: Iterable[str] = (), gives: Iterable[str] = (), optional: Iterable[str] = ()
) -> Callable[[F], F]:
    """A compute function ``fn(inputs, algo, **options)`` -> {port: tensor} (or (outputs, metrics)), which
    ``g.compute(..., fn=name)`` nodes call; ``needs`` / ``gives`` name its input and output ports (a node
    binds them to keys), ``optional`` the inputs it uses when a node reads them."""
    return _decorator(
        "compute_functions", name, {"needs": tuple(needs), "gives": tuple(gives), "optional": tuple(optional)}
    )


#: The older name of :func:`compute` (graph files written with ``@register.estimator`` keep working).
estimator = compute


def loss(
    name: str | None = None,
    *,
    needs: Iterable[str] = (),
    output: str = "logprobs",
    optional: Iterable[str] = (),
    aggregate: str = "token-mean",
    rows: str = "each",
) -> Callable[[F], F]:
    """A loss ``fn(outputs, batch, algo, **options)`` -> (scalar tensor, stats), trained on the model's
    ``output`` ("logprobs", "values", or "scores": one per row); ``needs`` names the batch ports it reads, ``optional``
    those it uses when the node reads them. ``aggregate`` says what the loss is a mean over, so that
    micro-batches add up to the mini-batch's gradient: ``token-mean`` (its tokens), ``seq-mean``
    (its rows: a sequence-level loss), ``sum`` (a sum, e.g. over a constant), or ``loss_agg`` (as the
    run's ``algo.loss_agg`` says). ``rows="pairs"``: the loss reads rows ``2i`` and ``2i+1`` together (a
    preference pair from a ``g.source(..., rows="pairs")`` node: chosen, then rejected), so the engine
    keeps each pair whole, in order, in one micro-batch (`flowrl.contract.pair_rows` reads them)."""
    meta = {"needs": tuple(needs), "output": output, "optional": tuple(optional), "aggregate": aggregate}
    if rows != "each":
        meta["rows"] = rows
    return _decorator("losses", name, meta)


def filter(  # noqa: A001
    name: str | None = None, *, needs: Iterable[str] = (), optional: Iterable[str] = ()
) -> Callable[[F], F]:
    """A filter function ``fn(inputs, algo, **options)`` -> one bool per group (or per row): the
    groups a filter node keeps."""
    return _decorator("filters", name, {"needs": tuple(needs), "optional": tuple(optional)})


def environment(name: str | None = None) -> Callable[[F], F]:
    """An environment factory ``factory(task, **options)`` -> an object with ``reply(prompt, turns)``."""
    return _decorator("environments", name, {})


def task(name: str | None = None) -> Callable[[F], F]:
    """A task class: a ``msgspec.Struct`` (or dataclass) whose fields are its options, built from
    ``task_options``, or any class with a ``from_config(cfg)`` classmethod (built from the whole run
    config); either way with ``max_new_tokens()``, ``prompts(rng, n)`` and ``score(prompt, response)``
    (see ``flowrl.tasks.builtin.Task``). ``flowrl run GRAPH --task NAME`` trains on it."""
    return _decorator("tasks", name, {})


def take_pending() -> list[tuple[str, str, Any, dict[str, Any]]]:
    """What decorators registered since the last call (and forget it)."""
    out = list(_PENDING)
    _PENDING.clear()
    return out
