"""Batched DSpark serving: ``DSparkEngine`` (continuous batching, one target forward per step for all requests),
configured by ``EngineConfig``; ``generate_batch`` / ``stream_batch``. The ``bench-serve`` replay on top of it is
``hf_dspark.evaluation.engine_bench``."""

from .admission import PrefillCost
from .batching import DSparkEngine, generate_batch, stream_batch
from .cache import DeferredDrafterContext, RaggedBatchCache
from .config import ENGINE_EXPLORE_BUDGET, ENGINE_MAX_EXPLORE_INTERVAL, GATE_TOKENS, EngineConfig
from .measurements import EngineMeasurements, measurement_key
from .requests import BatchOutput, EngineStats, RequestOutput, SamplingParams, TokenEvent, batch_progress
from ..scheduling import capped_confidences, schedule_batch
from .verification import greedy_verify, speculative_verify

__all__ = [
    "BatchOutput",
    "DSparkEngine",
    "DeferredDrafterContext",
    "ENGINE_EXPLORE_BUDGET",
    "ENGINE_MAX_EXPLORE_INTERVAL",
    "EngineConfig",
    "EngineMeasurements",
    "EngineStats",
    "GATE_TOKENS",
    "PrefillCost",
    "RaggedBatchCache",
    "RequestOutput",
    "SamplingParams",
    "TokenEvent",
    "batch_progress",
    "capped_confidences",
    "generate_batch",
    "greedy_verify",
    "measurement_key",
    "schedule_batch",
    "speculative_verify",
    "stream_batch",
]
