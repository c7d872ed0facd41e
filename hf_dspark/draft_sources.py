"""Draft sources: what proposes the tokens a round verifies (``Draft``).

The drafter's block is one source (``"block"``: a forward of the drafter, run by each route in its own shape: one
sequence in ``generate()``, a ragged batch in the engine); every other source proposes from a sequence's own tokens and
costs no drafter forward, so one class serves both routes: ``PromptLookupSource`` (``"lookup"``) continues an earlier
occurrence of the sequence's last tokens. A new source of that kind is one ``DraftSource`` subclass under
``@register_draft_source(name)``; a policy whose ``draft_sources`` names it (the hybrid) prices its drafts against the
block's and plain decoding's.

This file is self-contained (torch only): exported drafter folders carry it in ``custom_generate/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
    # the drafter's block: the backbone's logits [R, g, V_draft] and hidden states [R, g, d] a token tree grows from
    base_logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

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


def check_lookup_ngram(max_ngram: int) -> None:
    """Refuse a prompt-lookup match length (``lookup_max_ngram``: the longest suffix ``prompt_lookup`` matches)
    below 1. The one check of this setting: the lookup source, the hybrid policy and ``EngineConfig`` call it."""
    if max_ngram < 1:
        raise ValueError(f"lookup_max_ngram must be >= 1, got {max_ngram}")


@register_draft_source("lookup")
class PromptLookupSource(DraftSource):
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's last tokens
    (``prompt_lookup``), priced by its own verified rounds (``LookupSurvival``). Deterministic: q is one-hot."""

    def __init__(self, max_ngram: int, survival: LookupSurvival):
        check_lookup_ngram(max_ngram)
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
    "DRAFT_SOURCES",
    "Draft",
    "DraftSource",
    "LookupSurvival",
    "PromptLookupSource",
    "check_lookup_ngram",
    "prompt_lookup",
    "register_draft_source",
    "registrar",
]
