"""Moved to `flowrl.contract.protocols`; this name stays until every importer uses the contract."""

from flowrl.contract.protocols import (
    Batch,
    EngineContext,
    Executor,
    GenerationEngine,
    LossFn,
    RunResult,
    TrainingEngine,
    TrainStep,
)

__all__ = [
    "Batch",
    "EngineContext",
    "Executor",
    "GenerationEngine",
    "LossFn",
    "RunResult",
    "TrainStep",
    "TrainingEngine",
]
