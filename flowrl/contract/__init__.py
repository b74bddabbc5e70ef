"""The contract between planning and running: the one module a plugin imports.

It holds what crosses from the planner to the executors and engines, and between the layers
of a run:

- the plan and its parts (`ExecutionPlan`, its cluster, layout, workload and model shapes),
  read and written with `load_plan` / `dump_plan`, and the helpers that read a plan the same way
  on both sides (`verify_plan`, `generating_models`, `model_checkpoints`, ...);
- the resolved per-model specs engines receive (`ModelRun`: sampling, optimizer, numerics);
- the engine and executor protocols (`TrainingEngine`, `GenerationEngine`, `EngineContext`,
  `TrainStep`, `Executor`; for engines split over ranks `ShardedTrainingEngine`,
  `ShardedGenerationEngine` and `DataRank`) and what a run's timeline is compared with (`Predictor`);
- what an executor and an engine declare they can run (`Capabilities`, `EngineCapabilities`);
- the typed data that crosses layers (`Prompt`, `Sequences`, `Rollout`, `StepBatch`, ...) and
  the one set of rules for how a response ends (`ResponseRules`, `to_rollout`);
- the plugin hook marker (`hookimpl`), the ``register`` callback's type (`Register`) and the
  error types (`FlowRLError` and its kinds).

The planner produces these types; the runtime, the backends and the plugins use them from here.
This package imports nothing of the planner, the runtime, the backends or the plugins, and no
torch until a tensor is built.
"""

from flowrl.contract.capabilities import Capabilities, EngineCapabilities, compose, rollout_conflict, unsupported
from flowrl.contract.checked import CheckedSpec, SpecFieldError
from flowrl.contract.data import (
    Completion,
    EpisodeText,
    GenerateResult,
    Part,
    Prompt,
    Rollout,
    Sequences,
    StepBatch,
    ToolCall,
    Turn,
    adds_special_tokens,
    pair_rows,
    sequences_in,
)
from flowrl.contract.hardware import (
    ClusterNode,
    ClusterSpec,
    GenerationCalibration,
    HardwareSpec,
    load_hardware,
    save_hardware,
)
from flowrl.contract.hooks import Register, hookimpl
from flowrl.contract.layout import (
    ClusterPlan,
    DeviceGroup,
    GenerationLayout,
    ModelLayout,
    Parallel,
    PipelineSchedule,
    Prediction,
    RolloutPolicy,
    WeightSync,
)
from flowrl.contract.model import ModelSpec
from flowrl.contract.numerics import Numerics
from flowrl.contract.plan import (
    ClusterTarget,
    ExecutionPlan,
    GraphRef,
    MemoryEstimate,
    NodePlan,
    dump_plan,
    encode_plan,
    load_plan,
)
from flowrl.contract.predict import Forecast, Predictor, Span, steady
from flowrl.contract.protocols import (
    Batch,
    DataRank,
    EngineContext,
    Executor,
    GenerationEngine,
    LossFn,
    RunResult,
    ShardedGenerationEngine,
    ShardedTrainingEngine,
    TrainingEngine,
    TrainStep,
)
from flowrl.contract.reading import (
    episode_budget,
    fusable,
    generating_models,
    lora_on_fresh_weights,
    model_checkpoints,
    verify_plan,
)
from flowrl.contract.resolved import EngineNumerics, ModelRun, NodeOptions, OptimizerSpec, SamplingSpec
from flowrl.contract.responses import (
    Response,
    ResponseRules,
    padded_rows,
    prompt_rows,
    ragged,
    responses_of,
    to_rollout,
)
from flowrl.contract.workload import WorkloadSpec
from flowrl.errors import (
    BackendError,
    ConfigError,
    FlowRLError,
    GraphError,
    PlanError,
    PluginError,
    TaskError,
    WorkerLostError,
)
from flowrl.graph.ir import Graph, ModelDecl
from flowrl.specs import AlgoConfig, RunConfig

__all__ = [
    "ShardedTrainingEngine",
    "ShardedGenerationEngine",
    "Register",
    "DataRank",
    "AlgoConfig",
    "BackendError",
    "WorkerLostError",
    "Batch",
    "Capabilities",
    "CheckedSpec",
    "ClusterPlan",
    "ClusterNode",
    "ClusterSpec",
    "ClusterTarget",
    "ConfigError",
    "DeviceGroup",
    "EngineCapabilities",
    "EngineContext",
    "EngineNumerics",
    "EpisodeText",
    "ExecutionPlan",
    "Executor",
    "FlowRLError",
    "Forecast",
    "GenerateResult",
    "GenerationCalibration",
    "GenerationEngine",
    "GenerationLayout",
    "Graph",
    "GraphError",
    "GraphRef",
    "HardwareSpec",
    "LossFn",
    "MemoryEstimate",
    "ModelDecl",
    "ModelLayout",
    "ModelRun",
    "ModelSpec",
    "NodeOptions",
    "NodePlan",
    "Numerics",
    "OptimizerSpec",
    "Parallel",
    "PipelineSchedule",
    "Part",
    "PlanError",
    "PluginError",
    "Prediction",
    "Predictor",
    "Prompt",
    "Completion",
    "Response",
    "ResponseRules",
    "Rollout",
    "RolloutPolicy",
    "RunConfig",
    "RunResult",
    "SamplingSpec",
    "Sequences",
    "Span",
    "SpecFieldError",
    "StepBatch",
    "TaskError",
    "ToolCall",
    "TrainStep",
    "TrainingEngine",
    "Turn",
    "WeightSync",
    "WorkloadSpec",
    "adds_special_tokens",
    "compose",
    "dump_plan",
    "encode_plan",
    "episode_budget",
    "fusable",
    "generating_models",
    "hookimpl",
    "load_hardware",
    "load_plan",
    "lora_on_fresh_weights",
    "model_checkpoints",
    "padded_rows",
    "prompt_rows",
    "ragged",
    "responses_of",
    "rollout_conflict",
    "save_hardware",
    "pair_rows",
    "sequences_in",
    "steady",
    "to_rollout",
    "unsupported",
    "verify_plan",
]
