"""A node's port bindings against what its registered function declares (``needs``, ``gives``,
``optional``): checked by `resolve`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl.errors import PlanError

if TYPE_CHECKING:
    pass


def inputs_only(meta: dict[str, Any]) -> dict[str, Any]:
    """A loss's or filter's ports: inputs only (what it gives is not keys)."""
    return {"needs": meta.get("needs", ()), "optional": meta.get("optional", ())}


def check_keys(
    node: Any, what: str, meta: dict[str, Any], sequence_keys: set[str], state: tuple[str, ...] = ()
) -> None:
    """The node's port bindings against what its function declares: every input port it needs is
    bound to a key the node reads; every key it writes comes from a port the function gives."""
    needs, gives = tuple(meta.get("needs", ())), meta.get("gives")
    for port in needs:
        key = node.ports.get(port, port)
        if key not in node.reads:
            bound = f"port '{port}' is bound to key '{key}'" if port in node.ports else f"key '{key}'"
            bind = "" if port in node.ports else f", or bind the port to a key it reads (ports={{{port!r}: KEY}})"
            raise PlanError(
                f"node '{node.name}': {what} needs {bound}, but the node does not read it. Add '{key}' to its "
                f"reads{bind}."
            )
    port_of = {key: port for port, key in node.ports.items()}
    if gives is not None:
        for key in node.writes:
            port = port_of.get(key, key)
            if port not in gives:
                via = f" (through port '{port}')" if key in port_of else ""
                raise PlanError(
                    f"node '{node.name}' writes key '{key}'{via}, but {what} only produces {', '.join(gives)}; bind "
                    f"one of them to it (ports={{'{gives[0] if gives else 'PORT'}': '{key}'}})."
                )
    if needs or gives:  # the function declares its ports: a binding of another port is a mistake
        known = set(needs) | set(gives or ()) | set(meta.get("optional", ())) | set(state)
        for port, key in node.ports.items():
            if port not in known and key not in sequence_keys:  # responses are found by their type
                raise PlanError(
                    f"node '{node.name}': port '{port}' (bound to key '{key}') is not a port of {what}; its ports: "
                    f"{', '.join(sorted(known)) or 'none'}."
                )


def check_unused(node: Any, what: str, meta: dict[str, Any], sequence_keys: set[str]) -> None:
    """A node whose function declares its ports reads no key the function does not use: such a read
    only makes the producer run for nothing (a reference forward whose log-probs no loss reads)."""
    declared = set(meta.get("needs", ())) | set(meta.get("optional", ()))
    if not declared:
        return
    port_of = {key: port for port, key in node.ports.items()}
    unused = [k for k in node.reads if k not in sequence_keys and port_of.get(k, k) not in declared]
    if unused:
        raise PlanError(
            f"node '{node.name}' reads {', '.join(repr(k) for k in unused)}, which {what} does not use (it reads "
            f"{', '.join(sorted(declared))}); computing it would be wasted work. Drop it from the node's reads "
            "(and the node that produces it, if nothing else reads it), or use a loss that reads it."
        )
