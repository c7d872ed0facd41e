"""Admission of waiting requests: how long free slots wait for joiners (``ADMISSION_HOLD``, ``hold_budget``),
which joiners share a prefill forward (``PrefillCost``, ``prefill_groups``), and the row order when requests leave
(``tail_filled_order``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .requests import Request

# Free slots may wait for joiners to share one prefill forward, up to this many batches of idle slot-steps
# (``max_concurrency`` each) per generation the hold keeps together (``EngineConfig.admission_hold``,
# ``hold_budget``). A prefill forward has a fixed price whatever it carries (``PrefillCost``: 73 prompt tokens'
# worth, against 89 for a decode step at 16 rows), so one batch of idle slot-steps prices about one forward saved.
# ``hf-dspark bench-serve --policies plain plain,hold=0`` measures it.
ADMISSION_HOLD = 1.0
# Requests that join apart keep finishing apart: every later generation of their slots joins in several admissions
# again, each split into its own prefill forwards by prompt length. A hold therefore saves a forward for this
# generation and for each later one the waiting queue fills, and is priced for up to this many generations in all.
# What spreads a batch most is a scheduled engine's first drafting rounds (the realized gate measures drafting
# there, early in the answers, where drafts are accepted most often): at 16 requests they leave rows up to ~10
# tokens apart. The cap bounds what a long queue of requests that end early (EOS) may leave idle.
ADMISSION_HOLD_GENERATIONS = 4


def hold_budget(hold: float, max_concurrency: int, waiting: int, free: int) -> float:
    """Idle slot-steps an admission may hold ``free`` slots for, with ``waiting`` requests queued: ``hold`` batches
    of slot-steps (``max_concurrency`` each) for this generation and for each later full batch the queue beyond the
    free slots fills (``ceil((waiting - free) / max_concurrency)``), at most ``ADMISSION_HOLD_GENERATIONS``
    batches in all."""
    later = -(-max(0, waiting - free) // max_concurrency)
    return hold * max_concurrency * min(1 + later, ADMISSION_HOLD_GENERATIONS)


def tail_filled_order(keep: Sequence[int]) -> list[int]:
    """The new row order when only ``keep`` (ascending row indices) stay: rows already among the first ``len(keep)``
    keep their place, and the holes there are filled by the kept rows beyond (so leaving copies a few rows only)."""
    n = len(keep)
    tail = iter([i for i in keep if i >= n])
    kept = set(keep)
    return [i if i in kept else next(tail) for i in range(n)]


@dataclass(frozen=True)
class PrefillCost:
    """The price of one right-padded prefill forward over ``rows`` prompts padded to ``width``, in units of one
    prompt token's share of the weight work: ``fixed_tokens + rows * width * (1 + width / attention_width)``.
    ``fixed_tokens`` is what a forward costs whatever it carries (reading the weights, per-layer overheads);
    ``attention_width`` the width at which a token's attention costs as much as the rest of its forward. Fitted
    for SmolLM2-135M, bf16, 2 threads by ``scripts/engine_prefill_batching.py --fit`` (a forward costs 48 ms +
    0.66 ms per padded token + 0.62 us per padded token and key, within 16% over 1-16 rows of 16-512 tokens: 73
    tokens fixed, attention width 1067)."""

    fixed_tokens: float = 73.0
    attention_width: float = 1067.0

    def __post_init__(self):
        if not (math.isfinite(self.fixed_tokens) and self.fixed_tokens >= 0):
            raise ValueError(f"PrefillCost.fixed_tokens must be a finite number >= 0, got {self.fixed_tokens}")
        if not self.attention_width > 0:
            raise ValueError(f"PrefillCost.attention_width must be > 0, got {self.attention_width}")

    def __call__(self, rows: int, width: int) -> float:
        return self.fixed_tokens + rows * width * (1.0 + width / self.attention_width)


def prefill_groups(requests: list[Request], max_tokens: int, cost: PrefillCost) -> list[list[Request]]:
    """The cheapest split of ``requests`` (sorted by prompt length) into consecutive groups, each prefilled in one
    right-padded forward of at most ``max_tokens`` padded tokens (a longer prompt goes alone), by ``cost``: a
    shortest-path over the sorted order. Grouping saves a forward's fixed price; padding every prompt of a group to
    its longest costs tokens (64 chat prompts in one batch: 2.4x the real tokens, 2-3x slower than one at a time)."""
    lengths = [len(r.prompt_ids) for r in requests]
    best = [0.0] + [math.inf] * len(requests)
    start = [0] * (len(requests) + 1)
    for end in range(1, len(requests) + 1):
        width = lengths[end - 1]
        for first in range(end - 1, -1, -1):
            rows = end - first
            if rows > 1 and rows * width > max_tokens:
                break
            total = best[first] + cost(rows, width)
            if total < best[end]:
                best[end], start[end] = total, first
    groups, end = [], len(requests)
    while end > 0:
        groups.append(requests[start[end]:end])
        end = start[end]
    return groups[::-1]
