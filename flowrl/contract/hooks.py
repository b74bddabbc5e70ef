"""The marker a plugin's hook implementations carry (``@hookimpl def register_...``) and the type of
the ``register`` callback they receive (`Register`); the hooks themselves are specified in
`flowrl.plugins.hookspecs`, which uses this same marker."""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookimpl = pluggy.HookimplMarker("flowrl")

#: What every ``register_*`` hook receives: ``register(name, obj, description=..., **meta)``.
Register = Callable[..., None]
