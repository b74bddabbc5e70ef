"""Agents that play one episode of an ecosystem environment through flowrl's OpenAI-compatible endpoint.

- `flowrl.agents.verifiers_env`: ``verifiers`` (Environments Hub) environments (extra ``flowrl[verifiers]``).
- `flowrl.agents.openenv_env`: OpenEnv environments (extra ``flowrl[openenv]``).

Each module's factory (``factory(task, **options)``) loads its environment once and returns an ``async def``
agent called once per episode with the episode's ``base_url``, ``api_key`` and ``model``; it returns the
episode's reward. The packages are imported only when a factory runs (`flowrl.agents.imports`).
"""
