"""Batched DSpark serving: ``DSparkEngine`` (continuous batching, one target forward per step for all requests),
``generate_batch`` / ``stream_batch``, and the ``bench-serve`` replay (``hf_dspark.engine.bench``)."""

from .batching import (
    ENGINE_EXPLORE_BUDGET,
    ENGINE_MAX_EXPLORE_INTERVAL,
    BatchOutput,
    DeferredDrafterContext,
    DSparkEngine,
    EngineStats,
    GATE_TOKENS,
    PrefillCost,
    RaggedBatchCache,
    RequestOutput,
    SamplingParams,
    TokenEvent,
    batch_progress,
    capped_confidences,
    generate_batch,
    greedy_verify,
    schedule_batch,
    speculative_verify,
    stream_batch,
)
from .measurements import EngineMeasurements, measurement_key

from .batching import __all__ as _batching_all

__all__ = [*_batching_all, "EngineMeasurements", "measurement_key"]
