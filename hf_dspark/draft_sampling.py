"""Sampling a drafted block: what a drafting round returns (``DSparkDraft``), the sequential head as a logits
processor, and the warpers a draft step may apply over the draft vocabulary or its top candidates.

Self-contained (torch + transformers): drafter folders carry it beside ``modeling_dspark.py`` for
``trust_remote_code``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import logits_process


# Warpers that see only the scores' values, never token ids (each is equivariant under a permutation of the
# vocabulary): applied to draft-vocabulary scores they give a distribution over the draft vocabulary, which is a
# valid q for rejection sampling as long as it is the one the draft was drawn from (it is, and it goes to the
# verifier scattered into the full vocabulary with q = 0 elsewhere).
VALUE_ONLY_WARPERS = tuple(getattr(logits_process, name) for name in (
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "TopHLogitsWarper") if hasattr(logits_process, name))


def value_only(processors: LogitsProcessorList) -> bool:
    """True when every processor is one of ``VALUE_ONLY_WARPERS`` (exact types: a subclass may read token ids)."""
    return all(type(processor) in VALUE_ONLY_WARPERS for processor in processors)


def exponential_race(scores: torch.Tensor) -> torch.Tensor:
    """One index per row drawn from softmax(scores) [batch, V] -> [batch, 1]: the argmax of p_i / E_i with
    E_i ~ Exp(1) is i with probability p_i. The same draw as torch.multinomial's one-sample path, spelled out so that
    no check can read back to the host (a captured round must not synchronise)."""
    probs = torch.softmax(scores, dim=-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1, keepdim=True)


# How many of the highest-scoring tokens ``CandidateWarpers`` warps and samples among.
DRAFT_CANDIDATES = 256


class CandidateWarpers:
    """Temperature, then top-k / top-p / min-p, applied to the ``DRAFT_CANDIDATES`` highest-scoring tokens only.

    The user's truncating warpers keep the most probable tokens, so a draft step needs only the top of its scores:
    one ``topk`` and a log-normaliser over the whole vocabulary replace transformers' full sort (top-p) and the
    full-vocabulary softmax and draw, which made a sampled round on CPU cost twice a greedy one. Each truncation sees
    exact probabilities (the first over the whole vocabulary, later ones renormalised over what is kept, as the
    warpers chain), so whenever the kept set lies within the candidates the result is the warpers' own distribution;
    where it would reach past them (a nucleus wider than the candidates) it stops at them. Either way the scores
    returned are exactly the distribution the draft is drawn from, which is all lossless verification needs.

    ``build`` returns None (apply the processors as they are) unless every processor is a temperature, top-k, top-p
    or min-p warper of exactly those types with removed tokens set to -inf, the temperatures come before the
    truncations, and there is at least one truncation (without one, candidates would cut the distribution short).
    """

    def __init__(self, temperature: float, truncations: list[tuple[str, float, int]], candidates: int):
        self.temperature = temperature
        self.truncations = truncations  # (kind, value, min_tokens_to_keep), in the processors' order
        self.candidates = candidates

    @classmethod
    def build(cls, processors, vocab_size: int) -> "CandidateWarpers | None":
        temperature, truncations = 1.0, []
        for processor in processors or ():
            kind = type(processor)
            if kind is logits_process.TemperatureLogitsWarper and not truncations:
                temperature *= float(processor.temperature)
                continue
            if kind not in (logits_process.TopKLogitsWarper, logits_process.TopPLogitsWarper,
                            logits_process.MinPLogitsWarper) or processor.filter_value != -float("inf"):
                return None
            if kind is logits_process.TopKLogitsWarper:
                truncations.append(("top_k", int(processor.top_k), 1))
            elif kind is logits_process.TopPLogitsWarper:
                truncations.append(("top_p", float(processor.top_p), int(processor.min_tokens_to_keep)))
            else:
                truncations.append(("min_p", float(processor.min_p), int(processor.min_tokens_to_keep)))
        if not truncations:
            return None
        candidates = min([DRAFT_CANDIDATES, vocab_size] + [int(v) for k, v, _ in truncations if k == "top_k"])
        return cls(temperature, truncations, candidates)

    def __call__(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(candidate scores [batch, K] with -inf where removed, their token indices [batch, K])`` from scores
        [batch, V]; the candidates are sorted by score, highest first."""
        scores = scores / self.temperature if self.temperature != 1.0 else scores
        values, indices = scores.topk(self.candidates, dim=-1)
        log_total = scores.logsumexp(dim=-1, keepdim=True)  # the first truncation sees the whole distribution
        rank = torch.arange(self.candidates, device=scores.device)
        keep = torch.ones_like(values, dtype=torch.bool)
        for i, (kind, value, min_keep) in enumerate(self.truncations):
            if i:  # later truncations see the distribution renormalised over what the earlier ones kept
                kept = values.masked_fill(~keep, -float("inf"))
                log_total = kept.logsumexp(dim=-1, keepdim=True)
            probs = (values - log_total).exp().masked_fill(~keep, 0.0)
            if kind == "top_k":
                new = (rank < value).expand_as(keep)
            elif kind == "top_p":  # a token stays while the mass ranked above it is below top_p
                new = probs.cumsum(dim=-1) - probs < value
            else:  # min_p: at least min_p times the most probable token's probability
                new = probs >= value * probs[:, :1]
            keep = keep & (new | (rank < min_keep))
        return values.masked_fill(~keep, -float("inf")), indices

    def full(self, candidate_scores: torch.Tensor, indices: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The candidates' scores scattered into [batch, V] (-inf elsewhere): the q a draft step reports."""
        out = candidate_scores.new_full((candidate_scores.shape[0], vocab_size), -float("inf"))
        return out.scatter(-1, indices, candidate_scores)


class SequentialHeadLogitsProcessor(LogitsProcessor):
    """The sequential head as a transformers ``LogitsProcessor`` over one block's draft logits.

    Sampling a block goes left to right; at block position ``k`` the processor sees the sequence whose last token
    is the previously sampled one (the anchor for ``k = 0``) and adds the head's bias for it. Recurrent heads keep
    their state here, so calls must come in block order, once per position.
    """

    def __init__(self, head: "DSparkMarkovHead", block_hidden: torch.Tensor, start_length: int):
        self.head = head
        self.block_hidden = block_hidden  # [batch, g, d]
        self.start_length = start_length  # sequence length when the anchor is the last token
        self.state = head.initial_state(block_hidden)
        self.next_position = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        position = input_ids.shape[1] - self.start_length
        if position != self.next_position:
            raise RuntimeError(
                f"SequentialHeadLogitsProcessor called for block position {position}, expected {self.next_position}"
            )
        bias, self.state = self.head.step(input_ids[:, -1], self.block_hidden[:, position], self.state)
        self.next_position += 1
        return scores + bias.to(scores.dtype)



@dataclass
class DSparkDraft:
    """One drafting round (``DSparkDrafter.draft``).

    - ``base_logits`` [batch, g, V_draft]: LM head on the block (U_k), before the sequential head, over the draft
      vocabulary (the full vocabulary unless ``draft_vocab_size`` is set).
    - ``draft_ids`` [batch, g]: the sampled (or greedy) draft tokens.
    - ``draft_logits`` [batch, g, V]: the logits each draft token was sampled from, after the sequential head and
      every logits processor; ``softmax(draft_logits)`` is exactly q for rejection sampling. With a draft
      vocabulary they are scattered into the full vocabulary on first access (``sampled_logits`` holds them over
      the draft vocabulary until then): greedy callers that never read them skip a [batch, g, V] fill.
    - ``confidence_logits`` / ``confidences`` [batch, g]: calibrated per-position acceptance confidence c_k
      (None without a confidence head).
    - ``hidden_states`` [batch, g, d]: the block's final hidden states.
    """

    base_logits: torch.Tensor
    draft_ids: torch.Tensor
    sampled_logits: torch.Tensor
    hidden_states: torch.Tensor
    confidence_logits: torch.Tensor | None = None
    confidences: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)
    to_full_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def draft_logits(self) -> torch.Tensor:
        if self.to_full_vocab is not None:
            self.sampled_logits, self.to_full_vocab = self.to_full_vocab(self.sampled_logits), None
        return self.sampled_logits

    @draft_logits.setter
    def draft_logits(self, value: torch.Tensor) -> None:
        self.sampled_logits, self.to_full_vocab = value, None

