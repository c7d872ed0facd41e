"""What generate() and the batched engine share: the clock, the per-round statistics and the draft sources.

A draft source proposes the tokens a round verifies (``Draft``). The drafter's block is one source (``"block"``: a
forward of the drafter, run by each route in its own shape: one sequence in ``generate()``, a ragged batch in the
engine); every other source proposes from a sequence's own tokens and costs no drafter forward, so one class serves
both routes: ``PromptLookupSource`` (``"lookup"``) continues an earlier occurrence of the sequence's last tokens.
A new source of that kind is one ``DraftSource`` subclass under ``@register_draft_source(name)``; a policy whose
``draft_sources`` names it (the hybrid) prices its drafts against the block's and plain decoding's.

This file is self-contained (torch only): exported drafter folders carry it in ``custom_generate/``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


# ------------------------------------------------------------------------------------------------------------------
# Targets whose cache a rejected draft cannot be taken back from
# ------------------------------------------------------------------------------------------------------------------
# transformers' cache layer kinds that hold a recurrent or convolution state: a forward folds every token it reads
# into the state, so the tokens of rejected drafts cannot be removed from it afterwards.
RECURRENT_LAYER_KINDS = ("conv", "linear_attention", "hybrid", "hybrid_sliding")


def rollback_refusal(target) -> str | None:
    """Why speculative decoding cannot serve ``target`` (None when it can): a layer kind whose state cannot roll back
    (``RECURRENT_LAYER_KINDS``, named with its layer indices), or a model whose cache is not transformers'
    ``DynamicCache`` at all (RWKV, xLSTM, the original MiniMax, ...)."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    kinds = list(getattr(config, "layer_types", None) or [])
    recurrent = sorted({kind for kind in kinds if kind in RECURRENT_LAYER_KINDS})
    if recurrent:
        where = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in recurrent}
        return (f"{type(target).__name__} has {', '.join(f'{k!r} layers {v}' for k, v in where.items())}: their "
                "recurrent state absorbs every token a verification forward reads, so rejected drafts cannot be "
                "rolled back")
    supports = getattr(type(target), "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return (f"{type(target).__name__} keeps a model-specific (recurrent) cache instead of transformers' "
                "DynamicCache, which cannot be rolled back past rejected drafts")
    return None


# ------------------------------------------------------------------------------------------------------------------
# The clock and the statistics
# ------------------------------------------------------------------------------------------------------------------
def totals_by_source(sources: list[str], **per_round: list[int]) -> dict[str, dict[str, int]]:
    """Rounds and the sum of each per-round count (``drafted=[...]``, ``verified=[...]``, ...) per draft source."""
    out: dict[str, dict[str, int]] = {}
    for i, source in enumerate(sources):
        row = out.setdefault(source, {"rounds": 0, **{name: 0 for name in per_round}})
        row["rounds"] += 1
        for name, counts in per_round.items():
            row[name] += counts[i]
    return out


def time_mark(device: torch.device) -> Any:
    """A point in time on ``device``: on CUDA a recorded timing event on its current stream (no sync: it marks when
    the work launched before it has run), elsewhere ``time.perf_counter()``."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))  # the device's own stream, whichever device is current
    return event


def seconds_between(start: Any, end: Any) -> float:
    """Seconds between two ``time_mark`` points (CUDA events: once ``end`` has been reached)."""
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1000.0


@dataclass
class DSparkStats:
    """Per-round statistics of one ``generate`` call (``drafter.last_stats``).

    A round is one target forward after the prefill: it verifies ``verified[i]`` of ``drafted[i]`` draft tokens and
    accepts ``accepted[i]`` of them, then emits one more token from the target (the bonus or the correction).
    ``sources[i]`` says where its drafts came from: ``"block"`` (the drafter), ``"lookup"`` (prompt lookup) or
    ``"none"`` (the target decoded alone).

    ``time_split()`` divides the rounds' wall time into drafting (everything the candidate generator does to propose:
    lookup search, policy, drafter forward), verification (the target's forward and transformers' acceptance) and
    bookkeeping (the assisted loop between a verdict and the next round: cache crop, stopping criteria, streamer).
    On CUDA the stamps are CUDA events, read once when the split is asked for, so timing adds no sync to a round.
    """

    block_size: int
    drafted: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)
    confidence_logits: list[list[float]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    # Per round: [drafting start, drafting end, verdict, next round start or None] (floats, or CUDA events).
    stamps: list[list[Any]] = field(default_factory=list, repr=False)

    def add_round(self, drafted: int, verified: int, accepted: int, confidences: list[float] | None = None,
                  confidence_logits: list[float] | None = None, source: str | None = None) -> None:
        self.drafted.append(drafted)
        self.verified.append(verified)
        self.accepted.append(accepted)
        self.confidences.append(confidences or [])
        self.confidence_logits.append(confidence_logits or [])
        self.sources.append(source or ("block" if drafted else "none"))

    def by_source(self) -> dict[str, dict[str, int]]:
        """Rounds, drafted, verified and accepted draft tokens per draft source."""
        return totals_by_source(self.sources, drafted=self.drafted, verified=self.verified, accepted=self.accepted)

    def add_stamps(self, started: Any, drafted: Any, verified: Any) -> None:
        """The clock stamps of the round just recorded; the previous round's bookkeeping ends at ``started``."""
        if self.stamps and self.stamps[-1][3] is None:
            self.stamps[-1][3] = started
        self.stamps.append([started, drafted, verified, None])

    def time_split(self) -> dict[str, float]:
        """Seconds spent drafting, verifying and in the loop's bookkeeping over the rounds (the last round's
        bookkeeping, after its verdict, is outside every round and not counted)."""
        split = {"drafting_s": 0.0, "verification_s": 0.0, "bookkeeping_s": 0.0}
        if not self.stamps:
            return split
        if not isinstance(self.stamps[0][0], float):
            torch.cuda.synchronize()  # CUDA events: every stamp reached
        for stamp in self.stamps:
            for key, (a, b) in zip(split, zip(stamp, stamp[1:])):
                if b is not None:
                    split[key] += seconds_between(a, b)
        return split

    @property
    def rounds(self) -> int:
        return len(self.verified)

    @property
    def accepted_length(self) -> float:
        """tau: tokens emitted per round, accepted drafts plus the target's own token (the paper's definition)."""
        return (sum(self.accepted) + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens."""
        verified = sum(self.verified)
        return sum(self.accepted) / verified if verified else 0.0

    def position_acceptance(self) -> list[float | None]:
        """Conditional acceptance per block position k = 1..g: P(token k accepted | tokens 1..k-1 accepted and k
        verified). None where no round reached that position."""
        rates: list[float | None] = []
        for k in range(1, self.block_size + 1):
            reached = sum(1 for v, a in zip(self.verified, self.accepted) if v >= k and a >= k - 1)
            hit = sum(1 for v, a in zip(self.verified, self.accepted) if v >= k and a >= k)
            rates.append(hit / reached if reached else None)
        return rates

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "rounds": self.rounds,
            "drafted": list(self.drafted),
            "verified": list(self.verified),
            "accepted": list(self.accepted),
            "confidences": [list(c) for c in self.confidences],
            "confidence_logits": [list(c) for c in self.confidence_logits],
            "sources": list(self.sources),
            "by_source": self.by_source(),
            "accepted_length": self.accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "position_acceptance": self.position_acceptance(),
            "time_split": self.time_split(),
        }

    def __repr__(self) -> str:
        return (
            f"DSparkStats(rounds={self.rounds}, accepted_length={self.accepted_length:.3f}, "
            f"verified={sum(self.verified)}, accepted={sum(self.accepted)})"
        )


# ------------------------------------------------------------------------------------------------------------------
# Prompt lookup
# ------------------------------------------------------------------------------------------------------------------
def prompt_lookup(ids: torch.LongTensor, max_ngram: int, max_tokens: int) -> tuple[torch.LongTensor, int] | None:
    """Prompt-lookup draft: ``(tokens, n)``, the continuation (up to ``max_tokens``) of the latest earlier occurrence
    of the last ``n`` tokens of ``ids`` [L], for the largest ``n <= max_ngram`` that occurs; None if none does.

    Among occurrences of the longest matching suffix, the latest one with ``max_tokens`` tokens after it wins (the
    latest of all if none has): recent text predicts the next tokens best, and a full continuation drafts more.
    Every match length is computed at once on the device (``max_ngram`` comparisons of shifted ids) and the choice
    is read back in one transfer: one host synchronisation per call, whatever ``max_ngram`` is.
    """
    length = ids.shape[0]
    longest = min(max_ngram, length - 1)
    if longest < 1:
        return None
    follow = torch.arange(1, length, device=ids.device)  # position after each earlier n-gram's last token
    matched = torch.zeros_like(follow)  # how many tokens before ``follow`` equal the last tokens of ids
    alive = torch.ones_like(follow, dtype=torch.bool)
    for k in range(longest):
        source = follow - 1 - k
        alive &= (source >= 0) & (ids[source.clamp(min=0)] == ids[length - 1 - k])
        matched += alive
    # longest match first, then a full continuation, then the latest occurrence: one argmax over a combined key
    full = follow + max_tokens <= length
    key = matched * (2 * length) + full * length + follow
    best = key.argmax()
    n, begin = torch.stack([matched[best], follow[best]]).tolist()
    if n == 0:
        return None
    return ids[begin: begin + max_tokens], n


class LookupSurvival:
    """Per-position acceptance of prompt-lookup drafts, learned from their own verified rounds.

    A lookup draft continues an earlier occurrence of the sequence's last ``n`` tokens; how often the target agrees
    depends on ``n`` (a one-token match is a guess, a four-token match usually a copy) and on the position in the
    draft. For each match-length bucket and position k the estimate of P(draft k accepted | drafts 1..k-1 accepted)
    is ``(accepted_k + m * prior_n) / (reached_k + m)``: ``m`` pseudo-observations at the bucket's prior, so the first
    rounds follow the prior and the measured rate takes over as rounds come in.
    """

    PRIORS = (0.3, 0.5, 0.6, 0.7)  # match length 1, 2, 3, >= 4

    def __init__(self, max_tokens: int, pseudo_count: float = 4.0):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.pseudo_count = pseudo_count
        buckets = len(self.PRIORS)
        self.reached = torch.zeros(buckets, max_tokens, dtype=torch.float64)
        self.accepted = torch.zeros(buckets, max_tokens, dtype=torch.float64)

    @classmethod
    def bucket(cls, match_length: int) -> int:
        return min(max(int(match_length), 1), len(cls.PRIORS)) - 1

    def _cover(self, num_tokens: int) -> None:
        """Grow the per-position counts to ``num_tokens`` positions (new positions start at the prior)."""
        extra = num_tokens - self.reached.shape[1]
        if extra > 0:
            self.reached = torch.nn.functional.pad(self.reached, (0, extra))
            self.accepted = torch.nn.functional.pad(self.accepted, (0, extra))

    def confidences(self, match_length: int, num_tokens: int) -> torch.Tensor:
        """Conditional acceptance estimates [num_tokens] for a draft found with a ``match_length``-token match."""
        b = self.bucket(match_length)
        self._cover(num_tokens)
        k = num_tokens
        prior = self.PRIORS[b]
        estimate = (self.accepted[b, :k] + self.pseudo_count * prior) / (self.reached[b, :k] + self.pseudo_count)
        return estimate.float()

    def observe(self, match_length: int, verified: int, accepted: int) -> None:
        """One verified lookup round: ``verified`` drafts went to the target, the first ``accepted`` survived."""
        b = self.bucket(match_length)
        self._cover(verified)
        k = torch.arange(self.reached.shape[1])
        reached = (k < verified) & (k <= accepted)  # draft k+1 was verified with drafts 1..k accepted
        self.reached[b] += reached.double()
        self.accepted[b] += (reached & (k < accepted)).double()


# ------------------------------------------------------------------------------------------------------------------
# Draft sources
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class Draft:
    """Drafts of one source for R rows: what a round verifies and what verification needs to stay lossless.

    ``token_ids`` [R, n]; ``q`` [R, n, V] the logits each token was sampled from, or None when the drafts are
    deterministic (verification then takes q one-hot on each token) or greedy; ``confidences`` [R, n] the estimated
    conditional acceptance per position (None: the source has none); ``source`` the name it was proposed by.
    """

    token_ids: torch.Tensor
    q: torch.Tensor | None
    confidences: torch.Tensor | None
    source: str
    confidence_logits: torch.Tensor | None = None  # the drafter's raw confidences (before STS), for the statistics
    match_length: int = 0  # prompt lookup: how many of the sequence's last tokens matched (its survival bucket)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[-1])


def registrar(registry: dict[str, type]):
    """``register(name)``, a class decorator that files a class under ``name`` in ``registry`` and sets its
    ``name`` (the draft sources' registry here, the verification policies' in ``scheduling``)."""

    def register(name: str):
        def decorator(cls: type) -> type:
            registry[name] = cls
            cls.name = name
            return cls

        return decorator

    return register


DRAFT_SOURCES: dict[str, type["DraftSource"]] = {}
# Class decorator: make a source selectable by name in a policy's ``draft_sources``.
register_draft_source = registrar(DRAFT_SOURCES)


class DraftSource:
    """A source that drafts from a sequence's own tokens, without the drafter: ``propose`` one sequence's drafts,
    ``observe`` what the target made of them. Built from the policy that prices it (``from_policy``)."""

    name = "base"

    @classmethod
    def from_policy(cls, policy: Any) -> "DraftSource":
        return cls()

    def propose(self, token_ids: torch.LongTensor, max_tokens: int) -> Draft | None:
        """Up to ``max_tokens`` drafts continuing ``token_ids`` [L] (a [1, n] ``Draft``), or None."""
        raise NotImplementedError

    def observe(self, draft: Draft, verified: int, accepted: int) -> None:
        """Feedback after verification: ``verified`` of the drafts went to the target, the first ``accepted``
        survived. The default ignores it."""


@register_draft_source("lookup")
class PromptLookupSource(DraftSource):
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's last tokens
    (``prompt_lookup``), priced by its own verified rounds (``LookupSurvival``). Deterministic: q is one-hot."""

    def __init__(self, max_ngram: int, survival: LookupSurvival):
        if max_ngram < 1:
            raise ValueError(f"lookup_max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.survival = survival

    @classmethod
    def from_policy(cls, policy):
        return cls(policy.max_ngram, policy.lookup)

    def propose(self, token_ids, max_tokens):
        found = prompt_lookup(token_ids, self.max_ngram, max_tokens) if max_tokens > 0 else None
        if found is None:
            return None
        tokens, n = found
        return Draft(tokens.view(1, -1), None, self.survival.confidences(n, tokens.shape[0]).view(1, -1), self.name,
                     match_length=n)

    def observe(self, draft, verified, accepted):
        self.survival.observe(draft.match_length, verified, accepted)


__all__ = [
    "RECURRENT_LAYER_KINDS",
    "rollback_refusal",
    "DRAFT_SOURCES",
    "DSparkStats",
    "Draft",
    "DraftSource",
    "LookupSurvival",
    "PromptLookupSource",
    "prompt_lookup",
    "register_draft_source",
    "seconds_between",
    "time_mark",
    "totals_by_source",
]
