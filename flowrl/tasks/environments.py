"""Environments for multi-turn rollouts (placeholder list filled below)."""

ENVIRONMENTS: dict = {}
