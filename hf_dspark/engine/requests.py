"""What goes in and out of the engine: per-request sampling parameters, the requests themselves, streamed token
events, finished outputs and the engine's per-step statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..scheduling import ConfidenceMemory
from ..stats import DSparkStats
from .cache import DeferredDrafterContext, RaggedBatchCache


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
    drafts too, with ``finish_reason="stop"``; a criterion that raises ends its request alone, with
    ``finish_reason="error"``.
    ``seed`` gives a sampled request a random generator of its own (drafting, acceptance and the target's samples),
    so that it draws the same numbers whatever else the batch holds: it repeats its output whenever its verification
    lengths repeat (served alone, or under the ``fixed`` policy). Two requests with the same seed at once share it.
    """

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | tuple[int, ...] | list[int] | None = None
    stop_strings: tuple[str, ...] | list[str] | str = ()
    stopping_criteria: tuple[Any, ...] | list[Any] = ()
    seed: int | None = None

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
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @property
    def group_key(self) -> tuple:
        """Requests with equal keys draft and verify with the same processors (one batched call)."""
        if not self.do_sample:
            return ("greedy",)
        return ("sample", float(self.temperature), self.top_k, self.top_p, self.seed)

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
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "abort" | "error" when finished
    error: str | None = None  # why the request failed (finish_reason "error")


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
    error: str | None = None  # why the request failed (finish_reason "error")

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed seen by this request, from joining the batch to its last token."""
        elapsed = self.finish_s - self.start_s
        return len(self.token_ids) / elapsed if elapsed > 0 else 0.0

    def to_dict(self, with_rounds: bool = False) -> dict:
        out = {
            "request_id": self.request_id, "prompt_tokens": len(self.prompt_ids), "tokens": len(self.token_ids),
            "finish_reason": self.finish_reason, "error": self.error, "tokens_per_s": self.tokens_per_s,
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
    lookups: list[int] = field(default_factory=list)  # requests verifying a prompt-lookup draft (policy "hybrid")
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
class Request:
    """A request inside the engine: its prompt, what it emitted so far, and what its drafts predict (``memory``)."""

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
    memory: ConfidenceMemory | None = None  # its drafts' confidences and probe clock (policies priced by SPS)
    generator: torch.Generator | None = None  # its own random numbers (``SamplingParams.seed``), else the engine's
    error: str | None = None

    @property
    def anchor(self) -> int:
        return self.tokens[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.tokens)

    def token_ids(self) -> torch.Tensor:
        """Its sequence so far [L]: the prompt, then what it emitted (what a free draft source drafts from)."""
        return torch.tensor(self.prompt_ids + self.tokens)

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
            try:
                stopped = self.stop is not None and bool(self.stop(torch.tensor([self.prompt_ids + self.tokens]),
                                                                   None)[0])
            except Exception as err:  # a user's criterion failed: this request ends, the batch goes on
                self.fail(err)
                return kept
            if stopped:
                self.finish_reason = "stop"
                return kept
        if self.remaining <= 0:
            self.finish_reason = "length"
        return kept


    def fail(self, err: BaseException) -> None:
        self.finish_reason, self.error = "error", f"{type(err).__name__}: {err}"


@dataclass(eq=False)
class Batch:
    """The active requests, one row each, and the caches row-aligned with them: the target's and the drafter's
    context (None without a drafter, both None while no request is active)."""

    rows: list[Request] = field(default_factory=list)
    cache: RaggedBatchCache | None = None
    context: DeferredDrafterContext | None = None


def batch_progress(remaining: Sequence[int], emitted: Sequence[int]) -> int:
    """A step's output as the realized gate counts it by default (``gate_tokens="progress"``): the rows times how
    much the step lowered the most new tokens any row has left (``remaining`` before it, less what each row
    ``emitted``; a row ended by EOS counts as if it had not been). With every row equally far from done that is the
    rows times the least any of them advanced; a plain step counts its rows, a single request what it emitted."""
    if len(remaining) != len(emitted) or not remaining:
        raise ValueError(f"batch_progress needs one emitted count per row, got {len(remaining)} and {len(emitted)}")
    return len(remaining) * (max(remaining) - max(left - new for left, new in zip(remaining, emitted)))


def checked_prompt(prompt_ids, params: SamplingParams, request_id: str, text_config) -> list[int]:
    """A request's prompt as a list of token ids, or a ``ValueError`` naming the request and the problem: one
    sequence of integer ids inside the vocabulary of ``text_config`` (the target's), the prompt plus
    ``max_new_tokens`` within its context."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1:
            raise ValueError(f"request {request_id!r}: a prompt must be one sequence of token ids, got shape "
                             f"{tuple(prompt_ids.shape)}")
        if prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex or prompt_ids.dtype == torch.bool:
            raise ValueError(f"request {request_id!r}: token ids must be integers, got a {prompt_ids.dtype} tensor")
        prompt_ids = prompt_ids.tolist()
    prompt_ids = list(prompt_ids)
    if not prompt_ids:
        raise ValueError(f"request {request_id!r}: empty prompt: a request needs at least one token")
    bad = next((t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int)), None)
    if bad is not None:
        raise ValueError(f"request {request_id!r}: token ids must be integers, got {bad!r}")
    vocab = text_config.vocab_size
    outside = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if outside is not None:
        raise ValueError(f"request {request_id!r}: token id {outside} is outside the target's vocabulary "
                         f"[0, {vocab})")
    context = getattr(text_config, "max_position_embeddings", None)
    if context is not None and len(prompt_ids) + params.max_new_tokens > context:
        raise ValueError(f"request {request_id!r}: a {len(prompt_ids)}-token prompt plus max_new_tokens="
                         f"{params.max_new_tokens} passes the target's context of {context} tokens")
    return prompt_ids


def sampling_groups(params: Sequence[SamplingParams]) -> dict[tuple, list[int]]:
    """Rows with equal sampling parameters, by ``group_key`` (each group drafts and verifies in one call)."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(p.group_key, []).append(i)
    return groups


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


def per_request(params, count: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt from one for all (None: the defaults) or a sequence of them."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling parameter sets for {count} prompts")
    return params
