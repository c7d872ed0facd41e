"""What the engine hands the planner (``hf_dspark.planner.Planner``): its settings and measurements as the planner's
inputs (``engine_planner``), each step's rows (``row_states``), and whether a step is representative for the realized
gate. The decisions themselves (offers, which rows draft, how many drafts each row verifies, the skip reasons) are the
planner's, the same code ``generate()`` runs with one row."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..planner import Planner, RowState
from ..scheduling import VerificationPolicy
from .config import EngineConfig
from .measurements import EngineMeasurements, rows_bucket
from .requests import Batch, EngineStats


def engine_planner(config: EngineConfig, policy: VerificationPolicy | None, measurements: EngineMeasurements,
                   stats: EngineStats, block_size: int, device: torch.device) -> Planner:
    """The engine's planner: ``config``'s schedule, cost model, survival correction, probe and explore settings;
    the drafter's cost and the model factors from ``measurements`` per batch-size bucket; the realized gate
    (``measurements`` itself) under ``realized_gate`` with ``cost_aware``; skips counted in ``stats.skips``."""

    def draft_cost(rows: int) -> float | None:
        return measurements.draft_cost.get(rows_bucket(rows))

    def model_factors(rows: int) -> tuple[float, float]:
        bucket = rows_bucket(rows)
        return measurements.model_factor(bucket, True), measurements.model_factor(bucket, False)

    gate = measurements if config.realized_gate and config.cost_aware else None
    return Planner(policy, block_size, device, schedule=config.schedule, cost_aware=config.cost_aware,
                   online_correction=config.online_correction, gate=gate,
                   explore=(config.explore_interval, config.max_explore_interval, config.explore_budget),
                   draft_cost=draft_cost, model_factors=model_factors,
                   memory=(config.probe_interval, config.max_probe_interval, config.confidence_smoothing),
                   skips=stats.skips)


def row_states(batch: Batch, block_size: int, offers: bool) -> list[RowState]:
    """Each row's state for the planner: its cap (the block within its remaining tokens), its confidence memory, and
    (``offers``: the policy has free sources) its tokens for them, an offer being at most a block long."""
    states = []
    for request in batch.rows:
        cap = min(block_size, request.remaining - 1)
        states.append(RowState(cap, request.memory, request.token_ids if offers else None, cap if offers else 0))
    return states


def representative(batch: Batch) -> bool:
    """Whether this step is like most for the realized gate: not one where most requests take their first step
    after the prompt. Those drafts are accepted about twice as often (SmolLM2's embedded drafter at 16 requests:
    73% of first drafted tokens against 30-56% later, a response's opening being the most predictable text), so
    a drafting verdict measured on them, two rounds, says "draft" where later steps lose. Nor do they enter the
    gate's windows: a re-measurement that drafted through a batch's first step would be judged on it."""
    rows = batch.rows
    return not rows or 2 * sum(len(request.tokens) <= 1 for request in rows) < len(rows)


def catch_up_seconds(batch: Batch, measurements: EngineMeasurements, rows: Sequence[int]) -> float:
    """Expected seconds of projecting the pending target features of ``rows`` into the drafter's context (what a
    drafting step pays first after they decoded plain), at the engine's measured price per position."""
    if batch.context is None or not rows:
        return 0.0
    return measurements.catch_up_seconds(batch.context.pending_positions(rows))
