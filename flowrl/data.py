"""Moved to `flowrl.contract.data`; this name stays until every importer uses the contract."""

from flowrl.contract.data import (
    ROW_FIELDS,
    EpisodeText,
    GenerateResult,
    Part,
    Prompt,
    Rollout,
    Sequences,
    StepBatch,
    ToolCall,
    Turn,
    _pad,
    adds_special_tokens,
)

__all__ = [
    "ROW_FIELDS",
    "EpisodeText",
    "GenerateResult",
    "Part",
    "Prompt",
    "Rollout",
    "Sequences",
    "StepBatch",
    "ToolCall",
    "Turn",
    "_pad",
    "adds_special_tokens",
]
