"""Batched DSpark serving: R concurrent requests share one target forward per step.

transformers' assisted generation serves one sequence at a time; here every step

1. admits waiting requests (continuous batching: they join the batch as new rows, prefilled in the forwards a
   fitted price model (``PrefillCost``) finds cheapest, fewer forwards against less padding; free slots wait a few
   steps for rows about to finish, so that joiners share one prefill forward),
2. drafts a block for the requests that will be verified (``DSparkDrafter`` forward + ``sample_block``, batched),
3. picks a verification length per request from a shared budget (fixed, or the scheduler over the profiled SPS(B)
   curve of the batch's verification tokens B: Algorithm 1 by width layers for the padded batch (the default),
   Algorithm 1 over single entries, or dynamic top-K); requests whose drafts are not expected to pay for the
   drafter's forward skip drafting,
4. verifies every request's ragged block ``[anchor, drafts...]`` in ONE padded target forward,
5. accepts per request (greedy matching or speculative sampling, with that request's own sampling parameters),
   streams the new tokens, and retires finished requests (EOS or max length) so others can join.

Rejected tokens are rolled back by masking, not by cropping: ``RaggedBatchCache`` keeps the target's
``DynamicCache`` column-aligned, with a per-row ``valid`` mask. A verification forward appends the block's columns to
every row; afterwards only the anchor and the accepted drafts stay valid, rejected drafts and padding become holes
that every later attention mask hides. Valid columns of a row hold its positions 0..n-1 in order, so the cache always
contains exactly the verified sequence; ``compact`` squeezes the holes out now and then. Its layers append in place
into spare columns (``_GrowingLayer``) where ``DynamicLayer`` would copy every layer each step. The drafter's context
(``DeferredDrafterContext``) is built lazily: the verified positions' target features wait, and are projected into
the drafter's context K/V only when the request drafts, so requests that skip drafting cost the drafter nothing.
The target's forwards run with ``hf_dspark.attention.packed_attention``: a grouped-query target's query heads are
folded into the query length instead of transformers copying the whole KV cache once per query head for every
masked multi-token step, which made a 2-token step at 64 requests cost 3.6x a 1-token one (bf16, this CPU).

transformers' own continuous batching (``generation/continuous_batching``) was studied first: its paged cache and
varlen inputs do carry ragged query lengths, but the manager samples one token per request per step from the last
position only, returns no hidden states (the drafter needs the target's features), has no way to roll a request's
cache back (``position_offset`` only grows; completed blocks are hashed for prefix sharing), and drives its own
scheduler and sampler in a background thread. Using it would mean driving its internal classes directly, so this
engine uses a padded batch with per-row attention masks and positions instead. The price of padding: a step costs
R * max(1 + l_r) tokens rather than sum(1 + l_r); the SPS(B) profile is measured on that padded batch with the B
tokens spread evenly over the requests (``hf_dspark.profiling.load_or_profile_batched``).

This module holds the step loop (``DSparkEngine``) and the public API; the ragged caches are in ``cache``, the
verification and budget-sharing functions in ``verification``, the admission helpers in ``admission``. Their
public names are importable from here as before.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..attention import packed_attention
from ..generation import DSparkStats, is_dspark_drafter, prompt_lookup, seconds_between, time_mark
from ..scheduling import (
    EXPLORE_BUDGET,
    LookupSurvival,
    OnlineSurvivalCorrection,
    StepsPerSecond,
    dynamic_topk_capacity,
)
from .admission import ADMISSION_HOLD, PrefillCost, _prefill_groups, tail_filled_order
from .cache import DeferredDrafterContext, RaggedBatchCache
from .measurements import EngineMeasurements, measurement_key
from .verification import (
    SCHEDULES,
    _processed_probs,
    capped_confidences,
    greedy_verify,
    one_hot_probs,
    schedule_batch,
    schedule_kernel_kinds,
    speculative_verify,
)

# The engine's exploration budget (``DSparkEngine(explore_budget=)``) and the longest wait between re-measurements of
# a losing drafting side (``max_explore_interval``). In a batch a re-measurement costs several times the shortfall of
# its own drafting steps (what ``RealizedGate.remeasure_loss`` prices): its extra tokens make requests finish apart
# (idle held slots, extra prefill forwards), which its steps do not show. Hence a fifth of single-sequence
# generation's budget, and a cap long enough that the budget, not the cap, times the re-measurements.
ENGINE_EXPLORE_BUDGET = EXPLORE_BUDGET / 5
ENGINE_MAX_EXPLORE_INTERVAL = 4096

METHODS = ("plain", "fixed", "scheduled", "hybrid")
SCHEDULED_METHODS = ("scheduled", "hybrid")  # share the verification budget by the SPS curve
GATE_TOKENS = ("progress", "emitted")  # what the realized gate counts as a step's output (``gate_tokens``)
# Weight of the profile's shape (at the engine's measured level) against a width's own verify timings when pricing
# it (``DSparkEngine._sps_table``): a width with a full window of 16 timings moves a third of the way from the shape
# to its own median. Each width's timings come from other stretches of the run: at 16 requests the width-2 steps
# were the early, short-context ones and the plain steps the late ones, so their medians came out equal where the
# profile (and each measured alone) has width 2 at 1.25x width 1, and the cost model took width 2 for free.
PRICE_PRIOR_TIMINGS = 32.0
# How long an engine's first SPS profile waits for a scheduler kernel compiling in the background to finish (one
# variant takes seconds) before timing anyway.
KERNEL_QUIET_TIMEOUT_S = 30.0


# ------------------------------------------------------------------------------------------------------------------
# Per-request sampling parameters
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. Greedy unless ``do_sample``; sampling applies transformers' temperature, top-k and
    top-p warpers (in generate()'s order) to both the target's and the drafter's logits.

    ``eos_token_id`` None means the target's ``generation_config.eos_token_id``; ``[]`` disables EOS.
    ``stop_strings`` end the request as transformers' ``StopStringCriteria`` does (the engine needs a ``tokenizer``);
    ``stopping_criteria`` are transformers ``StoppingCriteria`` called on the prompt plus the tokens so far, as
    ``generate()`` calls them. Either ends the request at the first token where it fires, inside a step's accepted
    drafts too, with ``finish_reason="stop"``.
    """

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | tuple[int, ...] | list[int] | None = None
    stop_strings: tuple[str, ...] | list[str] | str = ()
    stopping_criteria: tuple[Any, ...] | list[Any] = ()

    def __post_init__(self):
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.top_k is not None and int(self.top_k) < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        stop_strings = (self.stop_strings,) if isinstance(self.stop_strings, str) else tuple(self.stop_strings)
        if any(not isinstance(text, str) or not text for text in stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        object.__setattr__(self, "stop_strings", stop_strings)
        criteria = tuple(self.stopping_criteria)
        if any(not callable(criterion) for criterion in criteria):
            raise ValueError("stopping_criteria must be callables (transformers StoppingCriteria)")
        object.__setattr__(self, "stopping_criteria", criteria)

    @property
    def group_key(self) -> tuple:
        """Requests with equal keys draft and verify with the same processors (one batched call)."""
        if not self.do_sample:
            return ("greedy",)
        return ("sample", float(self.temperature), self.top_k, self.top_p)

    def warpers(self) -> LogitsProcessorList | None:
        """The processors that define p (and q): None for greedy decoding."""
        if not self.do_sample:
            return None
        processors = LogitsProcessorList()
        if self.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(float(self.temperature)))
        if self.top_k is not None:
            processors.append(TopKLogitsWarper(int(self.top_k)))
        if self.top_p is not None and self.top_p < 1.0:
            processors.append(TopPLogitsWarper(float(self.top_p)))
        return processors


# ------------------------------------------------------------------------------------------------------------------
# Requests, events, outputs, statistics
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class TokenEvent:
    """Streaming: the tokens a request emitted in one step."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "eos" | "stop" | "length" when finished


@dataclass
class RequestOutput:
    """A finished request. Times are seconds on the engine's clock (0 = engine created)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    params: SamplingParams
    stats: DSparkStats
    arrival_s: float
    start_s: float  # joined the batch (prefill started)
    first_token_s: float
    finish_s: float

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed seen by this request, from joining the batch to its last token."""
        elapsed = self.finish_s - self.start_s
        return len(self.token_ids) / elapsed if elapsed > 0 else 0.0

    def to_dict(self, with_rounds: bool = False) -> dict:
        out = {
            "request_id": self.request_id, "prompt_tokens": len(self.prompt_ids), "tokens": len(self.token_ids),
            "finish_reason": self.finish_reason, "tokens_per_s": self.tokens_per_s,
            "accepted_length": self.stats.accepted_length, "rounds": self.stats.rounds,
            "verified": sum(self.stats.verified), "accepted": sum(self.stats.accepted),
            "arrival_s": self.arrival_s, "start_s": self.start_s, "first_token_s": self.first_token_s,
            "finish_s": self.finish_s,
        }
        if with_rounds:
            out["token_ids"] = list(self.token_ids)
            out["stats"] = self.stats.to_dict()
        return out


@dataclass
class EngineStats:
    """Per-step records of one engine: active requests, requests that drafted, draft tokens verified (the shared
    verification budget actually used) and tokens emitted; phase times in seconds."""

    active: list[int] = field(default_factory=list)
    drafting: list[int] = field(default_factory=list)
    lookups: list[int] = field(default_factory=list)  # requests verifying a prompt-lookup draft (method "hybrid")
    verify_tokens: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)  # padded block width (1 + longest verification) per step
    cache_widths: list[int] = field(default_factory=list)  # target cache columns (valid and holes) each step attended
    cache_holes: list[int] = field(default_factory=list)  # of which holes, summed over rows
    survival_correction: list[float] = field(default_factory=list)  # online factors per position (scheduler)
    emitted: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # whole step (decisions, drafting, verification), no prefill
    # scheduler steps with candidate rows that drafted nothing, by the reason: "gate" (the realized gate ruled drafting
    # out at this batch size), "cannot_pay" (not even certain drafts would be verified), "cost" (the cost model
    # predicted drafting would not pay), "no_budget" (every row's confidences predicted a zero budget, no probe due),
    # "gate_rows" (the gate refused the rows chosen)
    skips: dict[str, int] = field(default_factory=dict)
    compactions: int = 0
    prefill_calls: int = 0  # prefill forwards (joining requests share one when they join in the same step)
    held_slot_steps: int = 0  # free slots left empty a step while waiting joiners were held (``admission_hold``)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.active)

    def summary(self) -> dict:
        steps = self.steps or 1
        return {
            "steps": self.steps,
            "mean_active_requests": sum(self.active) / steps,
            "mean_drafting_requests": sum(self.drafting) / steps,
            "mean_verify_tokens_per_step": sum(self.verify_tokens) / steps,
            "mean_batch_tokens_per_step": (sum(self.active) + sum(self.verify_tokens)) / steps,
            "mean_padded_tokens_per_step": sum(a * w for a, w in zip(self.active, self.widths)) / steps,
            "mean_verify_tokens_per_request_step": sum(self.verify_tokens) / max(1, sum(self.active)),
            "drafting_fraction": sum(self.drafting) / max(1, sum(self.active)),
            "lookup_fraction": sum(self.lookups) / max(1, sum(self.active)),
            "emitted_tokens": sum(self.emitted),
            "compactions": self.compactions, "skips": dict(sorted(self.skips.items())),
            "prefill_calls": self.prefill_calls, "held_slot_steps": self.held_slot_steps,
            "prefill_s": self.prefill_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
            "survival_correction": list(self.survival_correction),
            "by_active_requests": self.by_active_requests(),
        }

    def by_active_requests(self) -> dict[int, dict]:
        """Per number of active requests, for its drafting steps and its plain steps apart: steps, draft tokens
        verified, tokens emitted, seconds (where the scheduler drafted, and what each side delivered there), and the
        target cache's columns and hole cells those steps attended over (summed over steps)."""
        out: dict[int, dict] = {}
        empty = {"steps": 0, "verify_tokens": 0, "emitted": 0, "seconds": 0.0, "cache_columns": 0, "cache_holes": 0}
        for rows, drafting, verified, emitted, seconds, columns, holes in zip(
                self.active, self.drafting, self.verify_tokens, self.emitted, self.seconds, self.cache_widths,
                self.cache_holes, strict=True):
            side = "drafting" if drafting else "plain"
            entry = out.setdefault(rows, {s: dict(empty) for s in ("drafting", "plain")})[side]
            entry["steps"] += 1
            entry["verify_tokens"] += verified
            entry["emitted"] += emitted
            entry["seconds"] += seconds
            entry["cache_columns"] += columns
            entry["cache_holes"] += holes
        return dict(sorted(out.items()))


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    eos: frozenset[int]
    stats: DSparkStats
    arrival_s: float
    stop: StoppingCriteriaList | None = None  # stop strings and custom criteria, called on prompt + tokens
    tokens: list[int] = field(default_factory=list)
    length: int = 0  # positions in the caches (prompt + emitted tokens, minus the anchor)
    start_s: float = 0.0
    first_token_s: float = 0.0
    finish_reason: str | None = None
    last_confidences: list[float] | None = None  # from the request's last drafting step (or the engine's prior)
    smoothed_confidences: list[float] | None = None  # moving average of its drafts' (from the prior), for skipping
    idle_steps: int = 0  # consecutive steps without drafting
    probe_wait: int = 0  # idle steps before the next probe (doubles after each probe that verified nothing)

    @property
    def anchor(self) -> int:
        return self.tokens[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.tokens)

    def emit(self, new_tokens: list[int]) -> list[int]:
        """Append tokens, stopping at the first EOS, stopping criterion or max_new_tokens; returns what was
        appended."""
        kept = []
        for token in new_tokens:
            if self.remaining <= 0:
                break
            kept.append(token)
            self.tokens.append(token)
            if token in self.eos:
                self.finish_reason = "eos"
                return kept
            if self.stop is not None and bool(self.stop(torch.tensor([self.prompt_ids + self.tokens]), None)[0]):
                self.finish_reason = "stop"
                return kept
        if self.remaining <= 0:
            self.finish_reason = "length"
        return kept


@dataclass
class _Drafts:
    rows: list[int]  # batch rows that drafted
    ids: torch.Tensor  # [D, g]
    logits: torch.Tensor | None  # [D, g, V] the exact logits each draft was sampled from (sampling rows only)
    confidences: torch.Tensor | None  # [D, g]
    confidence_logits: torch.Tensor | None = None  # [D, g] raw (before STS), recorded for calibration / eval


class _Lookup(NamedTuple):
    """A request's prompt-lookup draft this step (method "hybrid"): deterministic, so its q is one-hot."""

    tokens: list[int]  # the continuation of the latest earlier occurrence of the request's last tokens (<= its cap)
    match_length: int  # how many of the last tokens matched (``LookupSurvival``'s bucket)
    confidences: torch.Tensor  # [len(tokens)] estimated conditional acceptance per position


# ------------------------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------------------------
class DSparkEngine:
    """Continuous-batching DSpark engine.

    Args:
        target: a decoder-only transformers model with full attention.
        drafter: a ``DSparkDrafter`` for it (not needed for ``method="plain"``).
        method: ``"plain"`` (no drafting: one token per request per step, the baseline), ``"fixed"`` (every request
            verifies ``num_verify_tokens`` drafts, default the whole block), ``"scheduled"`` (a shared budget per
            step from the drafter's confidences and the SPS curve) or ``"hybrid"`` (``"scheduled"``, and each request
            whose prompt lookup pays at this batch size verifies the lookup's drafts instead of the drafter's block).
        schedule: ``"padded"`` (the default: Algorithm 1 by width layers, for the padded batch this engine runs, whose
            cost is R * (1 + longest verification) tokens), ``"prefix"`` (Algorithm 1 over single entries, costed as
            if the batch were packed: R + sum of lengths) or ``"topk"`` (dynamic top-K: the capacity comes from the
            requests' previous confidences, the current step admits the top-K entries).
        sps: ``hf_dspark.profiling.BatchedStepsPerSecond`` or a ``StepsPerSecond`` used for every batch size; None
            profiles the target once (cached) at batch sizes 1, 2, 4, .. up to ``max_concurrency`` (default 64).
        max_concurrency: most requests in the batch at once; more wait and join as others finish.
        probe_interval: under the scheduler a request whose previous confidences predict a zero budget skips
            drafting, but drafts again after this many skipped steps to refresh its confidences; each probe that
            ends with nothing verified doubles the wait, up to ``max_probe_interval``.
        cost_aware: under the scheduler, skip drafting in a step when the drafts its requests' previous confidences
            predict would not pay for the drafter's forward (measured as the engine runs): the expected
            ``(R + sum a) / (1 / SPS(B) + t_draft)`` must beat plain decoding's ``R * SPS(R)``, each scaled by what the
            steps this model decided delivered against its prediction for them (``EngineMeasurements.model_factor``).
        realized_gate: under the scheduler with ``cost_aware``, also judge drafting by what it has actually delivered:
            per batch size R, tokens per second (counted as ``gate_tokens`` says) over recent whole steps (drafter,
            context catch-up, verification, bookkeeping) are kept for steps where some request drafted and steps where
            none did. Once both are measured at R and drafting steps have not been ``DRAFTING_MARGIN`` (3%) faster (the
            last 4 plain steps against the drafting steps since the first of them, ``RealizedGate.compared_rates``:
            the two sides from the same stretch of a machine whose speed drifts), R decodes plain, drafting again
            after ``explore_interval`` steps to re-measure (the wait doubling, up to ``max_explore_interval``, each
            time drafting is still the slower; back to ``explore_interval`` once it wins). A re-measurement drafts
            ``REMEASURE_ROUNDS`` steps and is judged on those alone, not on the steps of the stretch that lost. Once
            drafting has been measured twice at R and plain not yet twice, the next steps decode plain to measure that
            side (a plain step costs nothing next to plain decoding). A batch size not yet measured takes the verdict
            of the nearest smaller one measured on both sides (a load rising past sizes where drafting lost does not
            draft at every new size to find out), and a loss at the nearest larger one up to twice its size (nor does
            a draining batch on its way down). This catches every cost the model in ``cost_aware`` leaves out or
            misprices. The decision uses past steps' timings only, so
            it is lossless.
        explore_interval, max_explore_interval: steps between re-measurements for ``realized_gate`` (defaults 16 and
            ``ENGINE_MAX_EXPLORE_INTERVAL``, 4096).
        explore_budget: ``realized_gate`` re-measures a losing drafting side only once its expected loss (two drafting
            steps at the measured shortfall, plus the context catch-up of the rows that would draft, at the measured
            seconds per pending position: ``EngineMeasurements.catch_up``) is at most this fraction of the plain
            steps' time since drafting last ran at that batch size, or after ``max_explore_interval`` steps
            (``RealizedGate.drafting_allowed``; 0: the doubling wait alone). Drafting that lost narrowly is
            re-measured soon, drafting that lost by 45% (SmolLM2 at 64 requests) rarely. Default
            ``ENGINE_EXPLORE_BUDGET`` (0.001, a fifth of single-sequence generation's: in a batch a re-measurement also
            desynchronises the requests, which its steps do not show).
        online_correction: under the scheduler, rescale the drafter's survivals by how often verified prefixes were
            actually accepted so far in this engine (``OnlineSurvivalCorrection``), for prompts unlike the
            calibration set.
        adapt_sps: under the scheduler, reprice the profile by the measured verify times: the profile's shape at the
            engine's measured level, each width run at the current batch size pulled toward its own measured time by
            how many times it was timed (``_sps_table``) (default: True when the engine profiles the target itself,
            ``sps=None``; an SPS passed in is used as given unless this is True).
        confidence_prior: under the scheduler, a joining request starts from the mean confidences of every draft so
            far (when there are any; kept in ``measurements``, so an engine sharing them starts from what earlier
            engines drafted) instead of drafting at once: it drafts when those predict a budget (and the cost gate
            agrees), else it first probes after ``probe_interval`` steps. Short requests do not pay a drafter
            forward each just to learn what the others already show.
        confidence_smoothing: under the scheduler, a request's skip decisions use a moving average of its drafts'
            confidences (starting from the prior when there is one), the newest weighted by this; 1 uses its last
            draft alone (see ``PrefixSchedulerPolicy``).
        max_prefill_tokens: joining requests are prefilled together in right-padded batches of at most this many
            (padded) tokens.
        prefill_cost: a ``PrefillCost``, the price model that splits joining requests (sorted by prompt length)
            into prefill forwards: fewer forwards against less padding. Default: the one fitted on this project's
            CPU (``scripts/engine_prefill_batching.py --fit`` fits another device's).
        admission_hold: with ``max_concurrency`` set and more requests waiting than there are free slots, the free
            slots wait while an active request is sure to finish (its remaining ``max_new_tokens``) within the
            steps they may still wait, so that its successor joins in the same prefill forward: at most
            ``admission_hold * max_concurrency`` idle slot-steps per admission (``ADMISSION_HOLD``, 1: a prefill
            forward costs about half a full decode step whatever it carries, and requests that joined apart keep
            finishing apart, each later generation paying again). Requests finishing at different steps
            (EOS, accepted drafts) would otherwise pay one prefill forward each. 0 admits at once. Outputs do not
            depend on it; the slot-steps held are counted in ``stats.held_slot_steps``.
        measurements: an ``EngineMeasurements`` holding the drafter, verify and whole-step timings this engine
            prices its decisions with, and adds to. Pass the same object to several engines (or one loaded from a
            file) and each starts from what the others measured instead of paying to learn it again; it must come
            from the same target, drafter, device, dtype and thread count (else ``ValueError``). Default: a fresh one.
        gate_tokens: what ``realized_gate`` counts as a step's output: ``"progress"`` (the default,
            ``batch_progress``) the batch's rows times how much the step lowered the most new tokens any of its
            requests has left: the steps the batch as a whole saved, which is what a drafting step buys when its
            requests finish together (those joining after them are prefilled together, ``admission_hold``; or none
            are waiting): at 16 requests in step, drafts accepted by some rows and not by the one furthest from done
            only make the others wait. A plain step counts its rows either way, one request what it emitted; where
            rows are out of step it is a lower bound. ``"emitted"``: the tokens the step emitted. The count is kept
            with the measurements (``EngineMeasurements.gate_tokens``): windows counted the other way are refused.
        lookup_max_ngram: under ``"hybrid"``, the longest suffix of a request's tokens that prompt lookup matches
            (``hf_dspark.generation.prompt_lookup``).
        seed: seeds the engine's generator (drafting, acceptance and target sampling).
        clock: the time source of each request's timestamps (arrival, start, first token, finish: its
            ``RequestOutput.tokens_per_s``). Default ``time.perf_counter``. ``bench_serve(lockstep=True)`` gives each
            of several engines stepped in turn a clock that runs only during its own steps.
    """

    def __init__(self, target, drafter=None, *, method: str | None = None, num_verify_tokens: int | None = None,
                 schedule: str = "padded", sps: Any = None, max_concurrency: int | None = None,
                 probe_interval: int = 4, max_probe_interval: int = 64, cost_aware: bool = True,
                 realized_gate: bool = True, explore_interval: int = 16,
                 max_explore_interval: int = ENGINE_MAX_EXPLORE_INTERVAL, explore_budget: float = ENGINE_EXPLORE_BUDGET,
                 online_correction: bool = True, adapt_sps: bool | None = None, confidence_prior: bool = True,
                 confidence_smoothing: float = 0.1, max_prefill_tokens: int = 16384,
                 prefill_cost: PrefillCost | None = None, admission_hold: float = ADMISSION_HOLD,
                 measurements: EngineMeasurements | None = None, gate_tokens: str = "progress",
                 lookup_max_ngram: int = 4, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter, tokenizer=None):
        method = method or ("scheduled" if drafter is not None else "plain")
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
        if getattr(target.config, "is_encoder_decoder", False):
            raise ValueError("the batched engine serves decoder-only targets")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if num_verify_tokens is not None and num_verify_tokens < 0:
            raise ValueError(f"num_verify_tokens must be >= 0, got {num_verify_tokens}")
        if probe_interval < 1:
            raise ValueError(f"probe_interval must be >= 1, got {probe_interval}")
        if max_probe_interval < probe_interval:
            raise ValueError(f"max_probe_interval ({max_probe_interval}) must be >= probe_interval ({probe_interval})")
        if explore_interval < 1:
            raise ValueError(f"explore_interval must be >= 1, got {explore_interval}")
        if max_explore_interval < explore_interval:
            raise ValueError(f"max_explore_interval ({max_explore_interval}) must be >= explore_interval "
                             f"({explore_interval})")
        if not 0.0 <= explore_budget < 1.0:
            raise ValueError(f"explore_budget must be in [0, 1), got {explore_budget}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if prefill_cost is not None and not isinstance(prefill_cost, PrefillCost):
            raise ValueError(f"prefill_cost must be a PrefillCost, got {type(prefill_cost).__name__}")
        if not math.isfinite(admission_hold) or admission_hold < 0:
            raise ValueError(f"admission_hold must be a finite number >= 0, got {admission_hold}")
        if not 0.0 < confidence_smoothing <= 1.0:
            raise ValueError(f"confidence_smoothing must be in (0, 1], got {confidence_smoothing}")
        if gate_tokens not in GATE_TOKENS:
            raise ValueError(f"unknown gate_tokens {gate_tokens!r}; expected one of {GATE_TOKENS}")
        if lookup_max_ngram < 1:
            raise ValueError(f"lookup_max_ngram must be >= 1, got {lookup_max_ngram}")
        self.target = target
        self.device = next(target.parameters()).device
        self.method = method
        self.drafter = None
        self.block_size = 0
        self._taps: list[int] = []  # target hidden_states indices the drafter reads
        if method != "plain":
            if drafter is None or not is_dspark_drafter(drafter):
                raise ValueError(f"method {method!r} needs a DSpark drafter")
            drafter.attach_target(target)
            if next(drafter.parameters()).device != self.device:
                raise ValueError(f"drafter is on {next(drafter.parameters()).device}, target on {self.device}")
            if method in SCHEDULED_METHODS and drafter.confidence_head is None:
                raise ValueError(f"method {method!r} needs a drafter with a confidence head; use method='fixed'")
            self.drafter = drafter
            self.block_size = drafter.config.block_size
            self._taps = drafter.target_hidden_states_indices()
        self.num_verify_tokens = num_verify_tokens
        self.schedule = schedule
        self.max_concurrency = max_concurrency
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.cost_aware = cost_aware
        self.scheduled = method in SCHEDULED_METHODS
        self.realized_gate = realized_gate and cost_aware and self.scheduled
        self.explore_interval = explore_interval
        self.max_explore_interval = max_explore_interval
        self.explore_budget = explore_budget
        self.confidence_prior = confidence_prior
        self.confidence_smoothing = confidence_smoothing
        self.correction = (OnlineSurvivalCorrection(self.block_size)
                           if online_correction and self.scheduled else None)
        if self.scheduled and self.device.type == "cuda":
            # Compile the scheduler kernel variants this engine can launch in the background from now on: a step
            # whose variant is not ready yet schedules with the torch twin (the same lengths) instead of waiting.
            from ..kernels import warm_scheduler_kernels

            warm_scheduler_kernels(self.device, max_concurrency or 64, self.block_size,
                                   kinds=schedule_kernel_kinds(schedule))
        # Drafter, verify and whole-step timings (possibly shared with other engines on the same hardware)
        self.measurements = EngineMeasurements() if measurements is None else measurements
        self.measurements.bind(measurement_key(target, self.drafter))
        if self.realized_gate:
            self.measurements.bind_gate_tokens(gate_tokens)
        self._priced_tables: dict[int, tuple[int, torch.Tensor]] = {}
        self._prediction: tuple[float, float] | None = None  # the cost model's (tokens, seconds) for this step
        self._gate_ruled_out = False  # this step's drafting was ruled out by the realized gate alone
        self.gate_tokens = gate_tokens
        self.lookup_max_ngram = lookup_max_ngram
        # method "hybrid": per-position acceptance of lookup drafts by match length, learnt from their own rounds
        self.lookup = LookupSurvival(self.block_size) if method == "hybrid" else None
        self.adapt_sps = (sps is None) if adapt_sps is None else adapt_sps
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_cost = PrefillCost() if prefill_cost is None else prefill_cost
        self.admission_hold = admission_hold
        self._held_slot_steps = 0  # idle slot-steps of the admission being held
        self._sps = sps
        self._sps_tables: dict[int, torch.Tensor] = {}
        self._profiled_lists: dict[int, list[float]] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.tokenizer = tokenizer  # for requests with stop_strings
        default_eos = target.generation_config.eos_token_id
        self._default_eos = frozenset([] if default_eos is None else
                                      [default_eos] if isinstance(default_eos, int) else list(default_eos))
        self._clock = clock
        self._clock0 = clock()
        self._waiting: deque[_Request] = deque()
        self._rows: list[_Request] = []
        self._cache: RaggedBatchCache | None = None
        self._context: DeferredDrafterContext | None = None  # row-aligned with _cache; None without a drafter
        self._ids: set[str] = set()
        self.outputs: dict[str, RequestOutput] = {}
        self.stats = EngineStats()

    # --------------------------------------------------------------------------------------------------------------
    # Requests
    # --------------------------------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self._clock() - self._clock0

    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request (token ids: list, 1D tensor or [1, n] tensor); it joins at the next step with room."""
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
                prompt_ids = prompt_ids[0]
            if prompt_ids.dim() != 1:
                raise ValueError(f"a prompt must be one sequence of token ids, got shape {tuple(prompt_ids.shape)}")
            prompt_ids = prompt_ids.tolist()
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt: a request needs at least one token")
        params = params or SamplingParams()
        request_id = str(len(self._ids)) if request_id is None else str(request_id)
        if request_id in self._ids:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._ids.add(request_id)
        eos = self._default_eos if params.eos_token_id is None else frozenset(
            [params.eos_token_id] if isinstance(params.eos_token_id, int) else params.eos_token_id)
        self._waiting.append(_Request(request_id, prompt_ids, params, eos, DSparkStats(block_size=self.block_size),
                                      arrival_s=self._now(), stop=self._stopping_criteria(params),
                                      probe_wait=self.probe_interval))
        return request_id

    def _stopping_criteria(self, params: SamplingParams) -> StoppingCriteriaList | None:
        criteria = list(params.stopping_criteria)
        if params.stop_strings:
            if self.tokenizer is None:
                raise ValueError("a request with stop_strings needs the engine's tokenizer: DSparkEngine(..., "
                                 "tokenizer=tokenizer)")
            criteria.append(StopStringCriteria(self.tokenizer, list(params.stop_strings)))
        return StoppingCriteriaList(criteria) if criteria else None

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._rows)

    @property
    def num_active(self) -> int:
        return len(self._rows)

    def stream(self) -> Iterator[TokenEvent]:
        """Run until every queued request is finished, yielding each step's new tokens per request."""
        while self.has_unfinished():
            yield from self.step()

    def run(self) -> list[RequestOutput]:
        """Run to completion; outputs in the order requests finished."""
        finished = []
        for event in self.stream():
            if event.finished:
                finished.append(self.outputs[event.request_id])
        return finished

    def _finish(self, request: _Request) -> None:
        self.outputs[request.request_id] = RequestOutput(
            request.request_id, request.prompt_ids, list(request.tokens), request.finish_reason, request.params,
            request.stats, request.arrival_s, request.start_s, request.first_token_s, self._now(),
        )

    # --------------------------------------------------------------------------------------------------------------
    # One step
    # --------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """Admit waiting requests, then draft, schedule, verify and emit for every active request once."""
        events = self._admit()
        if not self._rows:
            return events
        rows = self._rows
        remaining = [r.remaining for r in rows]
        caps = [min(self.block_size, left - 1) for left in remaining]
        representative = self._representative()

        if self.scheduled:
            self._profiled_table(len(rows))  # a first profile (cached afterwards) is not part of any step's time
        t0 = time.perf_counter()
        # Requests whose lookup pays verify it this step instead of drafting a block (``_lookups``)
        lookups = self._lookups(caps) if self.lookup is not None else {}
        block_caps = [0 if i in lookups else cap for i, cap in enumerate(caps)] if lookups else caps
        capacity = self._topk_capacity(block_caps) if self.scheduled and self.schedule == "topk" else None
        drafting = self._drafting_rows(block_caps, capacity, representative)
        drafts, draft_marks = None, None
        if drafting:
            # Project the drafting rows' pending target features first, outside the drafter's timed cost: after a
            # long skip (or a prompt) this is a one-off catch-up, not the price of the next draft.
            pending = self._context.pending_positions(drafting)
            started = time_mark(self.device)
            self._context.flush(self.drafter, drafting)
            flushed = time_mark(self.device)
            drafts = self._draft(drafting)
            draft_marks = (pending, started, flushed, time_mark(self.device))
        lengths = self._verification_lengths(caps, drafts, capacity, lookups)
        # The cost model's prediction is checked below, on the steps it decided: not those the realized gate ruled out
        # before asking it (pricing a plain step re-prices the SPS table, 0.17 ms of a 45 ms step at 16 requests),
        # nor those whose output includes lookup drafts, which the model does not price.
        checked = self.scheduled and self.cost_aware and not self._gate_ruled_out and not lookups
        # a plain step's model price, from the table the decision used (the verify below reprices it)
        plain_seconds = 1.0 / float(self._sps_table(len(rows))[len(rows)]) if checked and not drafting else None
        self.stats.cache_widths.append(self._cache.width)
        # row r's valid columns are its verified positions 0..length-1 (RaggedBatchCache's invariant)
        self.stats.cache_holes.append(len(rows) * self._cache.width - sum(r.length for r in rows))
        t1 = time.perf_counter()
        accepted, next_tokens = self._verify(lengths, drafts, lookups)
        t2 = time.perf_counter()
        if draft_marks is not None:  # read once verification has synchronised: on CUDA the draft's events are done
            pending, started, flushed, drafted = draft_marks
            if pending:
                self.measurements.record_catch_up(pending, seconds_between(started, flushed))
            self.measurements.record_draft(_bucket(len(drafting)), seconds_between(flushed, drafted))
        if self.scheduled and self.adapt_sps:  # the real price of this (rows, width), for later budgets
            self.measurements.record_verify(len(rows), 1 + max(lengths), t2 - t1)

        keep, new_counts = [], []
        draft_ids = {} if drafts is None else dict(zip(drafts.rows, drafts.ids.tolist()))
        confidences = {} if drafts is None or drafts.confidences is None else dict(
            zip(drafts.rows, drafts.confidences.tolist()))
        raw = {} if drafts is None or drafts.confidence_logits is None else dict(
            zip(drafts.rows, drafts.confidence_logits.float().tolist()))
        proposed = {**draft_ids, **{i: lookup.tokens for i, lookup in lookups.items()}}
        for i, request in enumerate(rows):
            drafted = i in draft_ids
            if i in lookups and lengths[i] > 0:
                lookup = lookups[i]
                request.stats.add_round(len(lookup.tokens), lengths[i], accepted[i], source="lookup")
                self.lookup.observe(lookup.match_length, lengths[i], accepted[i])
            else:
                request.stats.add_round(self.block_size if drafted else 0, lengths[i], accepted[i],
                                        confidences.get(i), raw.get(i), "block" if drafted else "none")
            if drafted:
                request.smoothed_confidences = self._smoothed(request.smoothed_confidences, confidences.get(i))
                request.last_confidences, request.idle_steps = confidences.get(i), 0
                # Back off while drafting verifies nothing (a probe that did not pay); reset once drafts are used.
                request.probe_wait = (self.probe_interval if lengths[i] > 0
                                      else min(2 * request.probe_wait, self.max_probe_interval))
            else:
                request.idle_steps += 1
            request.length += accepted[i] + 1
            new = request.emit(proposed.get(i, [])[: accepted[i]] + [next_tokens[i]])
            new_counts.append(len(new))
            finished = request.finish_reason is not None
            events.append(TokenEvent(request.request_id, new, finished, request.finish_reason))
            if finished:
                self._finish(request)
            else:
                keep.append(i)
        emitted = sum(new_counts)
        if len(keep) < len(rows):
            order = tail_filled_order(keep)
            self._rows = [rows[i] for i in order]
            if keep:
                index = torch.tensor(order, device=self.device)
                self._cache.select_rows(index)
                if self._context is not None:
                    self._context.select_rows(index)
            else:
                self._cache = self._context = None
        # Holes (rejected drafts, rows that did not take part in a context flush) past a fifth of the width: one
        # gather, cheaper than carrying them through every later append.
        for part in (self._cache, self._context):
            if part is not None and part.holes_exceed():
                part.compact()
                self.stats.compactions += 1
        self.stats.active.append(len(rows))
        self.stats.drafting.append(len(drafting))
        looked_up = sum(1 for i in lookups if lengths[i] > 0)
        self.stats.lookups.append(looked_up)
        self.stats.verify_tokens.append(sum(lengths))
        self.stats.widths.append(1 + max(lengths))
        if drafts is not None and drafts.confidences is not None:
            # the mean of every draft's confidences so far is where a joining request starts (``confidence_prior``)
            self.measurements.record_confidences(drafts.confidences.detach().float().sum(dim=0).cpu().tolist(),
                                                 len(drafts.rows))
        if self.correction is not None and drafts is not None and drafts.confidences is not None:
            index = torch.tensor(drafts.rows)  # raw survivals: the factors map the drafter's own to the observed
            self.correction.observe(capped_confidences(drafts.confidences.cpu(), torch.tensor(caps)[index]),
                                    torch.tensor(lengths)[index], torch.tensor(accepted)[index])
            self.stats.survival_correction = self.correction.factors().tolist()
        self.stats.emitted.append(emitted)
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        seconds = time.perf_counter() - t0
        self.stats.seconds.append(seconds)
        # What the whole step delivered (a first step is not typical). The gate weighs the drafter's steps against
        # steps without it; a step with lookup drafts is neither.
        if self.realized_gate and representative and not looked_up:
            output = emitted if self.gate_tokens == "emitted" else batch_progress(remaining, new_counts)
            self.measurements.record_step(len(rows), bool(drafting), output, seconds)
        if checked and drafting and self._prediction is not None:
            self.measurements.record_model_check(_bucket(len(rows)), True, *self._prediction, emitted, seconds)
        elif plain_seconds is not None:
            self.measurements.record_model_check(_bucket(len(rows)), False, len(rows), plain_seconds, emitted, seconds)
        return events

    def _realized_allows_drafting(self, num_requests: int, representative: bool | None = None,
                                  rows: Sequence[int] = ()) -> bool:
        """``realized_gate``: whether this step may draft at ``num_requests`` rows, from past whole-step rates
        (``representative``: this step's ``_representative()``, computed here when not given; ``rows``: those that
        would draft, whose context catch-up a re-measurement pays)."""
        if representative is None:
            representative = self._representative()
        return self.measurements.drafting_allowed(num_requests, self.explore_interval, self.max_explore_interval,
                                                  self.explore_budget, representative, self._catch_up(rows))

    def _catch_up(self, rows: Sequence[int]) -> float:
        """Expected seconds of projecting the pending target features of ``rows`` into the drafter's context (what a
        drafting step pays first after they decoded plain), at the engine's measured price per position."""
        if self._context is None or not rows:
            return 0.0
        return self.measurements.catch_up_seconds(self._context.pending_positions(rows))

    def _representative(self) -> bool:
        """Whether this step is like most for the realized gate: not one where most requests take their first step
        after the prompt. Those drafts are accepted about twice as often (SmolLM2's embedded drafter at 16 requests:
        73% of first drafted tokens against 30-56% later, a response's opening being the most predictable text), so
        a drafting verdict measured on them, two rounds, says "draft" where later steps lose. Nor do they enter the
        gate's windows: a re-measurement that drafted through a batch's first step would be judged on it."""
        return not self._rows or 2 * sum(len(request.tokens) <= 1 for request in self._rows) < len(self._rows)

    # --------------------------------------------------------------------------------------------------------------
    # Joining: prefill the new requests together (right-padded), then append their rows
    # --------------------------------------------------------------------------------------------------------------
    def _hold_admission(self) -> bool:
        """Whether this step's free slots wait (``admission_hold``): only when more requests wait than fit now, an
        active request will surely have finished (each step emits at least one token) before the hold's remaining
        slot-steps run out, and the budget is not spent. Counts the slot-steps it holds."""
        free = 0 if self.max_concurrency is None else self.max_concurrency - len(self._rows)
        if self.admission_hold <= 0 or not self._rows or free <= 0 or len(self._waiting) <= free:
            self._held_slot_steps = 0
            return False
        steps_left = int((self.admission_hold * self.max_concurrency - self._held_slot_steps) // free)
        if steps_left < 1 or not any(r.remaining <= steps_left for r in self._rows):
            self._held_slot_steps = 0
            return False
        self._held_slot_steps += free
        self.stats.held_slot_steps += free
        return True

    def _admit(self) -> list[TokenEvent]:
        if self._hold_admission():
            return []
        joining = []
        while self._waiting and (self.max_concurrency is None or len(self._rows) + len(joining) < self.max_concurrency):
            joining.append(self._waiting.popleft())
        if not joining:
            return []
        prior = self.measurements.confidence_prior() if self.scheduled and self.confidence_prior else None
        if prior is not None:
            for request in joining:  # judged by the drafts seen so far until its own first draft
                request.last_confidences = request.smoothed_confidences = prior
        started = time.perf_counter()
        events, parts = [], []
        # Shortest prompts first: groups of similar lengths waste little on right-padding.
        for chunk in _prefill_groups(sorted(joining, key=lambda r: len(r.prompt_ids)), self.max_prefill_tokens,
                                     self.prefill_cost):
            start = self._now()
            part, context = self._prefill(chunk)
            self.stats.prefill_calls += 1
            kept = []
            for i, request in enumerate(chunk):
                request.start_s, request.first_token_s = start, self._now()
                finished = request.finish_reason is not None
                events.append(TokenEvent(request.request_id, list(request.tokens), finished, request.finish_reason))
                if finished:
                    self._finish(request)
                else:
                    kept.append(i)
                    self._rows.append(request)
            if kept:
                if len(kept) < len(chunk):
                    index = torch.tensor(kept, device=self.device)
                    part.select_rows(index)
                    if context is not None:
                        context.select_rows(index)
                parts.append((part, context))
        if parts:
            if self._cache is None:
                self._cache, self._context = parts.pop(0)
            self._cache.append_rows([part for part, _ in parts])
            if self._context is not None:
                self._context.append_rows([context for _, context in parts])
        self.stats.prefill_s += time.perf_counter() - started
        return events

    def _prefill(self, requests: list[_Request]) -> tuple[RaggedBatchCache, DeferredDrafterContext | None]:
        """One forward over the prompts, right-padded: a prompt never attends to padding (it comes after it), and the
        padding columns are holes from the start. Emits each request's first token. The prompts' target features
        wait in the drafter context until each request first drafts."""
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        ids = torch.tensor([r.prompt_ids + r.prompt_ids[-1:] * (width - len(r.prompt_ids)) for r in requests],
                           device=self.device)
        valid = torch.arange(width, device=self.device) < torch.tensor(lengths, device=self.device)[:, None]
        positions = torch.arange(width, device=self.device).expand(len(requests), -1)
        last = torch.tensor(lengths, device=self.device)[:, None] - 1
        cache = DynamicCache(config=self.target.config)
        extra = {"output_hidden_states": list(self._taps)} if self.drafter is not None else {}
        with packed_attention(self.target):
            out = self.target(input_ids=ids, attention_mask=valid, position_ids=positions, cache=cache,
                              use_cache=True, logits_to_keep=last, **extra)
        logits = out.logits[:, -1].float()  # [J, V] at each prompt's last position
        first = torch.empty(len(requests), dtype=torch.long, device=self.device)
        for members in _groups([r.params for r in requests]).values():
            params = requests[members[0]].params
            sel = torch.tensor(members, device=self.device)
            if params.do_sample:
                probs = _processed_probs(logits[sel], params.warpers())
                first[sel] = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            else:
                first[sel] = logits[sel].argmax(dim=-1)
        for request, token in zip(requests, first.tolist()):
            request.length = len(request.prompt_ids)
            request.emit([token])
        context = None
        if self.drafter is not None:
            context = DeferredDrafterContext(self.drafter, len(requests), self.device)
            context.defer([out.hidden_states[i] for i in self._taps], positions, lengths)
        return RaggedBatchCache(cache, valid), context

    # --------------------------------------------------------------------------------------------------------------
    # Drafting
    # --------------------------------------------------------------------------------------------------------------
    def _sps_table(self, num_requests: int) -> torch.Tensor:
        """SPS over the batch's total verification tokens B = 0..R * (g + 1), for R requests: the profile, repriced by
        what this engine has measured (medians of recent verify forwards), kept non-increasing. The profile is
        timed on a clean cache at one context length; measured steps price what the budget really buys. Each
        measured verify time is read as a ratio to the profile's price of the same (rows, width), and combined in log
        scale:

        - the level: this R's ratios, averaged with their numbers of timings as weights (or the level of the nearest
          batch size measured, when nothing was run at this R yet): the profile's shape at the engine's level;
        - a width run at this R: its own ratio, weighted by its number of timings against ``PRICE_PRIOR_TIMINGS``
          for the level. A width timed many times costs what it measured; one timed once or twice (a probe, a rare
          width, possibly in a hiccup of a shared machine) moves its price only part of the way, so one noisy
          timing does not make every wider width look dear;
        - a width not yet run at this R: the level, times how much dearer than the level that width (or a narrower
          one not run here) was at the nearest batch size that ran it (never cheaper: one slow wide step at R = 8
          stops the first wide step at R = 16 from being taken at the profile's word).

        A width is never priced cheaper than a narrower one: the log costs get their weighted non-decreasing fit
        (``nondecreasing_fit``; weights: the width's timings plus ``PRICE_PRIOR_TIMINGS``), so a narrow width that
        measured dear is pooled with the cheaper wider ones after it instead of lifting all of them to its price.
        Only past steps are used. Tables are cached until a new measurement arrives."""
        table = self._profiled_table(num_requests)
        if not self.adapt_sps or not self.measurements.verify_cost:  # without adapt_sps the given SPS is used as is
            return table
        cached = self._priced_tables.get(num_requests)
        if cached is not None and cached[0] == self.measurements.version:
            return cached[1]
        profiled = self._profiled_list(num_requests)
        ratios = self._log_cost_ratios()
        level = self._log_level(num_requests, ratios)
        widths = [w for w in range(1, self.block_size + 2) if num_requests * w < table.shape[0]]
        log_costs, weights = [], []
        excess = 0.0  # carried to wider widths not run here: they are at least as much dearer than the level
        for w in widths:
            own = ratios.get(num_requests, {}).get(w)
            weight = PRICE_PRIOR_TIMINGS
            if own is not None:
                timings = float(self.measurements.timings(num_requests, w))
                log_ratio = (timings * own + PRICE_PRIOR_TIMINGS * level) / (timings + PRICE_PRIOR_TIMINGS)
                weight += timings
            else:
                excess = max(excess, self._log_width_excess(num_requests, w, ratios))
                log_ratio = level + excess
            log_costs.append(log_ratio - math.log(profiled[num_requests * w]))
            weights.append(weight)
        priced = list(profiled)
        for w, log_cost in zip(widths, nondecreasing_fit(log_costs, weights)):
            priced[num_requests * w] = math.exp(-log_cost)
        priced = torch.tensor(priced, dtype=table.dtype, device=table.device)
        self._priced_tables[num_requests] = (self.measurements.version, priced)
        return priced

    def _log_cost_ratios(self) -> dict[int, dict[int, float]]:
        """``{R: {width: log(measured verify seconds / profiled seconds)}}`` over every measured (R, width)."""
        out: dict[int, dict[int, float]] = {}
        for (rows, width), seconds in self.measurements.verify_cost.items():
            try:
                table = self._profiled_list(rows)
            except ValueError:  # shared measurements from a batch size this engine's profile does not cover
                continue
            if rows * width < len(table) and seconds > 0:
                out.setdefault(rows, {})[width] = math.log(seconds * table[rows * width])
        return out

    def _profiled_list(self, num_requests: int) -> list[float]:
        """``_profiled_table`` as Python floats (the repricing reads it entry by entry, every step)."""
        table = self._profiled_lists.get(num_requests)
        if table is None:
            table = self._profiled_lists[num_requests] = self._profiled_table(num_requests).tolist()
        return table

    def _log_level(self, num_requests: int, ratios: dict[int, dict[int, float]]) -> float:
        """The timing-weighted mean log ratio at ``num_requests``, or at the nearest batch size measured (in log scale,
        ties toward the larger); 0 (the profile) when nothing is measured."""
        if not ratios:
            return 0.0
        rows = min(ratios, key=lambda r: (abs(math.log(r / num_requests)), -r))
        weights = {w: float(self.measurements.timings(rows, w)) for w in ratios[rows]}
        return sum(weights[w] * value for w, value in ratios[rows].items()) / sum(weights.values())

    def _log_width_excess(self, num_requests: int, width: int, ratios: dict[int, dict[int, float]]) -> float:
        """How much dearer (log ratio, >= 0) than its batch size's level ``width`` measured at the nearest other batch
        size that ran it (in log scale, ties toward the larger); 0 when none did."""
        sizes = [r for r in ratios if r != num_requests and width in ratios[r]]
        if not sizes:
            return 0.0
        nearest = min(sizes, key=lambda r: (abs(math.log(r / num_requests)), -r))
        return max(0.0, ratios[nearest][width] - self._log_level(nearest, ratios))

    def _profiled_table(self, num_requests: int) -> torch.Tensor:
        table = self._sps_tables.get(num_requests)
        if table is None:
            if self._sps is None:
                from ..profiling import load_or_profile_batched, powers_of_two_with

                sizes = powers_of_two_with([self.max_concurrency or 64])
                # The scheduler kernels this engine started compiling in the background wait meanwhile: a compile
                # beside the timed forwards would price them slower than they run (``KernelWarmup.quiet``).
                with self._quiet_kernels():
                    self._sps = load_or_profile_batched(self.target, sizes, self.block_size + 1,
                                                        hidden_state_indices=self._taps)
            if isinstance(self._sps, StepsPerSecond):
                table = self._sps.table()
            else:
                table = self._sps.table(num_requests, num_requests * (self.block_size + 1))
            if table.shape[0] <= num_requests:
                raise ValueError(f"the SPS profile covers {table.shape[0] - 1} batch tokens, fewer than the "
                                 f"{num_requests} active requests' anchors; profile larger batches")
            self._sps_tables[num_requests] = table.to(self.device)
        return self._sps_tables[num_requests]

    def _quiet_kernels(self):
        """``KernelWarmup.quiet`` on CUDA, where this engine compiles scheduler kernels; elsewhere nothing."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from ..kernels.scheduler import WARMUP

        return WARMUP.quiet(timeout=KERNEL_QUIET_TIMEOUT_S)

    def _smoothed(self, previous: list[float] | None, current: list[float] | None) -> list[float] | None:
        """The moving average behind a request's skip decisions (the last draft alone with smoothing 1)."""
        if previous is None or current is None or len(previous) != len(current):
            return current
        w = self.confidence_smoothing
        return [(1.0 - w) * p + w * c for p, c in zip(previous, current)]

    def _stale_confidences(self, smoothed: bool = False) -> tuple[torch.Tensor, list[bool]]:
        """Each request's confidences from its last drafting step [R, g] (zeros where unknown), and which are known;
        ``smoothed``: the moving average of its drafts' confidences instead (the skip decisions)."""
        values = [r.smoothed_confidences if smoothed else r.last_confidences for r in self._rows]
        known = [v is not None for v in values]
        stale = torch.tensor([v if k else [0.0] * self.block_size for v, k in zip(values, known)])
        if self.correction is not None:
            stale = self.correction.correct(stale)
        return stale.to(self.device), known

    def _topk_capacity(self, caps: list[int]) -> int:
        """Dynamic top-K capacity from the requests' previous confidences (none from this step); unknown requests
        count as the known ones' mean, or as fully confident when none is known."""
        stale, known = self._stale_confidences()
        known_rows = torch.tensor(known, device=stale.device)
        prior = stale[known_rows].mean(dim=0) if any(known) else torch.ones_like(stale[0])
        filled = torch.where(known_rows[:, None], stale, prior)
        capped = capped_confidences(filled, torch.tensor(caps, device=stale.device))
        return dynamic_topk_capacity(capped.cpu(), self._sps_table(len(caps)).cpu())

    def _drafting_rows(self, caps: list[int], capacity: int | None, representative: bool | None = None) -> list[int]:
        """Rows that draft this step. Under the scheduler, a request whose earlier confidences predict a zero budget
        skips drafting (its draft could not be verified) until its next probe; and with ``cost_aware`` the requests
        predicted to verify drafts skip drafting too when the predicted gain does not cover the drafter's measured
        cost (until one of them is due for a probe, which also refreshes the cost). The decision uses no
        information from this step's drafts, so it cannot bias the output. ``representative``: this step's
        ``_representative()`` (``step`` computes it once for the gate and its own records; here when not given)."""
        self._prediction = None
        self._gate_ruled_out = False
        if self.method == "plain" or self.num_verify_tokens == 0:
            return []
        candidates = [i for i, cap in enumerate(caps) if cap > 0]
        if self.method == "fixed" or not candidates:
            return candidates
        if representative is None:
            representative = self._representative()
        if self.realized_gate and not self.measurements.drafting_verdict(
                len(caps), self.explore_interval, self.max_explore_interval, self.explore_budget, representative,
                self._catch_up(candidates))[0]:
            # The realized gate rules drafting out at this batch size this step whichever rows would draft (the
            # gate, asked below only once rows are chosen, would refuse them): skip the confidences and schedules,
            # about a millisecond, 1-2% of a plain step at 16 requests.
            self._gate_ruled_out = True
            return self._skip("gate")
        cap_tensor = torch.tensor(caps, device=self.device)
        table = self._sps_table(len(caps))
        if not self._drafts_can_pay(cap_tensor, table):
            return self._skip("cannot_pay")  # not even certain drafts would be verified at this batch size
        stale, known = self._stale_confidences(smoothed=True)
        predicted = schedule_batch(stale, cap_tensor, table, self.schedule, capacity)
        lengths = predicted.tolist()
        worth = [i for i in candidates if known[i] and lengths[i] > 0]
        due = [i for i in candidates  # new requests, and probes of requests skipped for a while
               if not known[i] or self._rows[i].idle_steps >= self._rows[i].probe_wait]
        if worth and not due and self.cost_aware and not self._drafting_pays(stale, predicted, table, len(worth)):
            return self._skip("cost")
        chosen = sorted(set(worth) | set(due))
        if not chosen:
            return self._skip("no_budget")  # every row's confidences predict a zero budget, and no probe is due
        if due and self.cost_aware:
            # Probes and new requests draft whatever the model says, but its prediction for the step is still
            # checked against what the step delivers: checked only on the steps it chose to draft (those whose stale
            # confidences looked best), its drafting side would learn only its own optimism (a winner's curse: the
            # next drafts fall back toward the mean) and, its factor pulled down, skip drafting for long stretches.
            self._drafting_pays(stale, predicted, table, len(chosen), keep_prediction=True)
        if len(chosen) < len(caps) and not self._drafts_can_pay(cap_tensor, table, chosen):
            # Even if these rows' drafts were certain, the padded batch would not verify them (one request's draft
            # widens every row): wait until enough rows draft together (probes wait too; unknown rows stay due). With
            # every row chosen this is the question answered above.
            return self._skip("cannot_pay")
        if self.realized_gate and not self._realized_allows_drafting(len(caps), representative, chosen):
            return self._skip("gate_rows")
        return chosen

    def _skip(self, reason: str) -> list[int]:
        """A scheduler step that drafts nothing although some rows could: counted by ``reason`` in ``stats.skips``."""
        self.stats.skips[reason] = self.stats.skips.get(reason, 0) + 1
        return []

    def _drafts_can_pay(self, caps: torch.Tensor, table: torch.Tensor, rows: list[int] | None = None) -> bool:
        """Whether the scheduler would verify anything at this batch size if the drafts of ``rows`` (default: every
        row) were certain (confidences 1 within the caps, the other rows not drafting). When not, drafting those
        rows is pointless whatever the drafter says (the batch is too large for verification to pay on this
        hardware), and they skip even their probes."""
        if rows is None:
            certain = torch.ones(caps.shape[0], self.block_size, device=self.device)
        else:
            certain = torch.zeros(caps.shape[0], self.block_size, device=self.device)
            certain[list(rows)] = 1.0
        schedule = "prefix" if self.schedule == "topk" else self.schedule  # top-K pays R + K tokens, as "prefix"
        return bool(schedule_batch(certain, caps, table, schedule).any())

    def _drafting_pays(self, stale: torch.Tensor, predicted: torch.Tensor, table: torch.Tensor, rows: int,
                       keep_prediction: bool = False) -> bool:
        """Whether drafting ``rows`` requests is expected to beat plain decoding this step, from the stale
        prediction (``predicted`` lengths, survivals of ``stale`` confidences) and the drafter's measured cost, each
        side's expected rate scaled by what its recent steps delivered against this model's prediction for them
        (``EngineMeasurements.model_factor``). When it says "draft" (or ``keep_prediction``: the step drafts anyway),
        its prediction (tokens, seconds) is kept for the step to check against what it delivers."""
        self._prediction = None
        cost = self.measurements.draft_cost.get(_bucket(rows))
        if cost is None:
            return True  # not measured yet: draft, and measure
        num_requests = stale.shape[0]
        survival = torch.cumprod(stale.float().clamp(0, 1), dim=-1)
        admitted = torch.arange(stale.shape[1], device=stale.device) < predicted[:, None].to(stale.device)
        gain = float((survival * admitted).sum())
        longest = int(predicted.max())
        batch = num_requests * (1 + longest) if self.schedule == "padded" else num_requests + int(predicted.sum())
        batch = min(batch, table.shape[0] - 1)
        seconds = 1.0 / float(table[batch]) + cost
        bucket = _bucket(num_requests)
        # What each side's recent steps delivered over what this model predicted for them (1 until checked)
        drafting = (num_requests + gain) / seconds * self.measurements.model_factor(bucket, True)
        plain = num_requests * float(table[num_requests]) * self.measurements.model_factor(bucket, False)
        pays = drafting > plain
        self._prediction = (num_requests + gain, seconds) if pays or keep_prediction else None
        return pays

    def _draft(self, rows: list[int]) -> _Drafts:
        """One batched drafter forward over the drafting rows' blocks ``[anchor, mask * (g - 1)]`` against their
        context caches, then left-to-right sampling per group of equal sampling parameters."""
        drafter, g = self.drafter, self.block_size
        context, valid = self._context.rows_view(rows)  # step() flushed the rows' pending features
        anchors = torch.tensor([self._rows[i].anchor for i in rows], device=self.device)
        positions = torch.tensor([self._rows[i].length for i in rows], device=self.device)[:, None] + torch.arange(
            g, device=self.device)
        block = torch.full((len(rows), g), drafter.config.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = anchors
        # The block sees its row's valid context columns and the whole block (DSpark's non-causal block).
        mask = torch.cat([valid, valid.new_ones(len(rows), g)], dim=1)[:, None, None, :].expand(-1, 1, g, -1)
        out = drafter(input_ids=block, position_ids=positions, cache=context, attention_mask=mask)
        ids = torch.empty(len(rows), g, dtype=torch.long, device=self.device)
        logits = confidences = confidence_logits = None
        for key, members in _groups([self._rows[i].params for i in rows]).items():
            params = self._rows[rows[members[0]]].params
            sel = torch.tensor(members, device=self.device)
            draft = drafter.sample_block(out.logits.index_select(0, sel), out.hidden_states.index_select(0, sel),
                                         anchors.index_select(0, sel), logits_processor=params.warpers(),
                                         do_sample=params.do_sample, generator=self.generator)
            ids[sel] = draft.draft_ids
            if params.do_sample:
                if logits is None:
                    logits = draft.draft_logits.new_zeros(len(rows), g, draft.draft_logits.shape[-1])
                logits[sel] = draft.draft_logits.float()
            if draft.confidences is not None:
                if confidences is None:
                    confidences = draft.confidences.new_zeros(len(rows), g)
                confidences[sel] = draft.confidences
            if draft.confidence_logits is not None:
                if confidence_logits is None:
                    confidence_logits = draft.confidence_logits.new_zeros(len(rows), g)
                confidence_logits[sel] = draft.confidence_logits
        return _Drafts(rows, ids, logits, confidences, confidence_logits)

    def _lookups(self, caps: list[int]) -> dict[int, _Lookup]:
        """Method "hybrid": the rows whose prompt-lookup draft is worth verifying this step, with their drafts.

        Each request's lookup (``prompt_lookup`` over its prompt and tokens, up to its cap) is priced as the scheduler
        prices a block: its ``LookupSurvival`` estimates go through Algorithm 1 with the batch's SPS curve (top-K
        prices as ``"prefix"``, as ``_drafts_can_pay`` does), and a lookup that gets a length there replaces the
        request's block this step. Only the request's own text and earlier rounds decide, never the target's verdict
        on these drafts, so the choice cannot bias the output."""
        found = {}
        for i, (request, cap) in enumerate(zip(self._rows, caps)):
            if cap > 0:
                hit = prompt_lookup(torch.tensor(request.prompt_ids + request.tokens), self.lookup_max_ngram, cap)
                if hit is not None:
                    tokens, n = hit
                    found[i] = _Lookup(tokens.tolist(), n, self.lookup.confidences(n, tokens.shape[0]))
        if not found:
            return {}
        empty = torch.zeros(len(caps), self.block_size, device=self.device)
        confidences, lookup_caps = self._with_lookups(empty, [0] * len(caps), found)
        schedule = "prefix" if self.schedule == "topk" else self.schedule
        worth = schedule_batch(confidences, lookup_caps, self._sps_table(len(caps)), schedule).tolist()
        return {i: lookup for i, lookup in found.items() if worth[i] > 0}

    @staticmethod
    def _with_lookups(confidences: torch.Tensor, caps: list[int],
                      lookups: dict[int, _Lookup]) -> tuple[torch.Tensor, torch.Tensor]:
        """``confidences`` [R, g] and ``caps`` with each lookup row's estimates and draft length in place."""
        caps = list(caps)
        for i, lookup in lookups.items():
            confidences[i] = 0.0
            confidences[i, : len(lookup.tokens)] = lookup.confidences.to(confidences.device)
            caps[i] = len(lookup.tokens)
        return confidences, torch.tensor(caps, device=confidences.device)

    def _verification_lengths(self, caps: list[int], drafts: _Drafts | None, capacity: int | None,
                              lookups: dict[int, _Lookup]) -> list[int]:
        lengths = [0] * len(caps)
        if drafts is None and not lookups:
            return lengths
        if self.method == "fixed":
            for i in drafts.rows:
                lengths[i] = caps[i] if self.num_verify_tokens is None else min(self.num_verify_tokens, caps[i])
            return lengths
        confidences = torch.zeros(len(caps), self.block_size, device=self.device)
        if drafts is not None:
            current = drafts.confidences.float()
            if self.correction is not None:
                current = self.correction.correct(current)
            confidences[torch.tensor(drafts.rows, device=self.device)] = current.to(self.device)
        confidences, cap_tensor = self._with_lookups(confidences, caps, lookups)
        return schedule_batch(confidences, cap_tensor, self._sps_table(len(caps)), self.schedule, capacity).tolist()

    # --------------------------------------------------------------------------------------------------------------
    # Verification: one padded target forward over every request's block
    # --------------------------------------------------------------------------------------------------------------
    def _verify(self, lengths: list[int], drafts: _Drafts | None,
                lookups: dict[int, _Lookup]) -> tuple[list[int], list[int]]:
        rows, cache, device = self._rows, self._cache, self.device
        num_rows, width = len(rows), max(lengths) + 1
        num_drafts = torch.tensor(lengths, device=device)
        draft_ids = torch.zeros(num_rows, width - 1, dtype=torch.long, device=device)
        if drafts is not None and width > 1:
            draft_ids[torch.tensor(drafts.rows, device=device)] = drafts.ids[:, : width - 1]
        for i, lookup in lookups.items():
            n = min(len(lookup.tokens), width - 1)
            draft_ids[i, :n] = torch.tensor(lookup.tokens[:n], device=device)
        anchors = torch.tensor([r.anchor for r in rows], device=device)
        block_valid = torch.arange(width, device=device) < (num_drafts + 1)[:, None]  # [R, Q]
        block = torch.cat([anchors[:, None], draft_ids], dim=1)
        block = torch.where(block_valid, block, anchors[:, None])  # padding: any real id, masked out
        positions = torch.tensor([r.length for r in rows], device=device)[:, None] + torch.arange(width, device=device)
        extra = {"output_hidden_states": list(self._taps)} if self.drafter is not None else {}
        with packed_attention(self.target):  # no per-head copy of the cache for a wide block
            out = self.target(input_ids=block, attention_mask=cache.attention_mask(block_valid),
                              position_ids=positions, cache=cache.target_cache, use_cache=True, **extra)
        logits = out.logits.float()  # [R, Q, V]

        accepted = torch.zeros(num_rows, dtype=torch.long, device=device)
        next_tokens = torch.zeros(num_rows, dtype=torch.long, device=device)
        draft_row = {} if drafts is None else {r: k for k, r in enumerate(drafts.rows)}
        for key, members in _groups([r.params for r in rows]).items():
            params = rows[members[0]].params
            sel = torch.tensor(members, device=device)
            if not params.do_sample:
                a, t = greedy_verify(draft_ids[sel], num_drafts[sel], logits[sel])
            else:
                q = logits.new_zeros(len(members), width - 1, logits.shape[-1])
                drafted = [k for k, i in enumerate(members) if i in draft_row and lengths[i] > 0]
                if drafted and width > 1:
                    source = torch.tensor([draft_row[members[k]] for k in drafted], device=device)
                    q[torch.tensor(drafted, device=device)] = torch.softmax(
                        drafts.logits.index_select(0, source)[:, : width - 1], dim=-1)
                looked_up = [k for k, i in enumerate(members) if i in lookups and lengths[i] > 0]
                if looked_up:  # a lookup draft is deterministic: q is one-hot on each drafted token
                    at = torch.tensor(looked_up, device=device)
                    q[at] = one_hot_probs(draft_ids[sel].index_select(0, at), logits.shape[-1])
                p = _processed_probs(logits[sel], params.warpers())
                a, t = speculative_verify(draft_ids[sel], num_drafts[sel], q, p, self.generator)
            accepted[sel], next_tokens[sel] = a, t

        if self.drafter is not None:  # the verified positions' features wait until the request drafts again
            self._context.defer([out.hidden_states[i] for i in self._taps], positions, (accepted + 1).tolist())
        # Keep the anchor and the accepted drafts; rejected drafts and padding become holes.
        cache.commit(torch.arange(width, device=device) <= accepted[:, None])
        return accepted.tolist(), next_tokens.tolist()


def batch_progress(remaining: Sequence[int], emitted: Sequence[int]) -> int:
    """A step's output as the realized gate counts it by default (``gate_tokens="progress"``): the rows times how
    much the step lowered the most new tokens any row has left (``remaining`` before it, less what each row
    ``emitted``; a row ended by EOS counts as if it had not been). With every row equally far from done that is the
    rows times the least any of them advanced; a plain step counts its rows, a single request what it emitted."""
    if len(remaining) != len(emitted) or not remaining:
        raise ValueError(f"batch_progress needs one emitted count per row, got {len(remaining)} and {len(emitted)}")
    return len(remaining) * (max(remaining) - max(left - new for left, new in zip(remaining, emitted)))


def nondecreasing_fit(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of ``values`` (pool adjacent violators): runs that decrease are
    replaced by their weighted mean, merging until the sequence never decreases."""
    if len(values) != len(weights) or any(w <= 0 for w in weights):
        raise ValueError("need one positive weight per value")
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([float(value), float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean2, weight2, count2 = blocks.pop()
            mean1, weight1, count1 = blocks.pop()
            blocks.append([(mean1 * weight1 + mean2 * weight2) / (weight1 + weight2), weight1 + weight2,
                           count1 + count2])
    return [mean for mean, _, count in blocks for _ in range(int(count))]


def _bucket(rows: int) -> int:
    """Power-of-two bucket of a number of drafting rows (the drafter's cost is tracked per bucket)."""
    return 1 << max(0, (rows - 1).bit_length())


def _groups(params: Sequence[SamplingParams]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.group_key, []).append(i)
    return groups


# ------------------------------------------------------------------------------------------------------------------
# One-call API
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class BatchOutput:
    """``generate_batch``'s result: per-request outputs (in prompt order) and the engine's step statistics."""

    outputs: list[RequestOutput]
    stats: EngineStats
    wall_s: float

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def _per_request(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling parameter sets for {count} prompts")
    return params


def stream_batch(target, prompts: Sequence, drafter=None, params=None, **engine_kwargs) -> Iterator[TokenEvent]:
    """Serve ``prompts`` (token-id sequences; request ids "0", "1", ...) and yield tokens as they are produced."""
    engine = DSparkEngine(target, drafter, **engine_kwargs)
    for prompt, p in zip(prompts, _per_request(params, len(prompts))):
        engine.add_request(prompt, p)
    yield from engine.stream()


def generate_batch(target, prompts: Sequence, drafter=None, params=None, **engine_kwargs) -> BatchOutput:
    """Serve ``prompts`` with the batched engine and return every request's output and the step statistics.

    ``params``: one ``SamplingParams`` for all, or one per prompt. ``engine_kwargs`` go to ``DSparkEngine``
    (``method``, ``num_verify_tokens``, ``schedule``, ``sps``, ``max_concurrency``, ``seed``...).
    """
    engine = DSparkEngine(target, drafter, **engine_kwargs)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, _per_request(params, len(prompts)))]
    started = time.perf_counter()
    for _ in engine.stream():
        pass
    wall = time.perf_counter() - started
    return BatchOutput([engine.outputs[i] for i in ids], engine.stats, wall)


__all__ = [
    "BatchOutput",
    "DSparkEngine",
    "DeferredDrafterContext",
    "ENGINE_EXPLORE_BUDGET",
    "ENGINE_MAX_EXPLORE_INTERVAL",
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
    "schedule_batch",
    "speculative_verify",
    "stream_batch",
]
