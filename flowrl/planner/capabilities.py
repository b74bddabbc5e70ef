"""Moved to `flowrl.contract.capabilities`; this name stays until every importer uses the contract."""

from flowrl.contract.capabilities import (
    Capabilities,
    EngineCapabilities,
    compose,
    declared,
    for_run,
    of_config,
    rollout_conflict,
    supports,
    supports_layout,
    unsupported,
)

__all__ = [
    "Capabilities",
    "EngineCapabilities",
    "compose",
    "declared",
    "for_run",
    "of_config",
    "rollout_conflict",
    "supports",
    "supports_layout",
    "unsupported",
]
