"""The marker a plugin's hook implementations carry (``@hookimpl def register_...``); the hooks
themselves are specified in `flowrl.plugins.hookspecs`, which uses this same marker."""

from __future__ import annotations

import pluggy

hookimpl = pluggy.HookimplMarker("flowrl")
