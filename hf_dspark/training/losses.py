"""DSpark training math: anchor sampling, per-block attention masks, and the CE / TV / confidence losses.

Pure functions over tensors (no model state), so each piece is testable alone.

Shapes: ``b`` sequences of length ``n``; ``A`` anchors per sequence; block size ``g``; ``q = A * g`` block tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..modeling_dspark import BlockLayout
from .settings import DEFAULT_LOSS_WEIGHTS

CONFIDENCE_TARGETS = ("sampling", "greedy")


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None):
    """Sample up to ``num_anchors`` anchor positions per sequence, uniformly without replacement, among positions
    ``p`` whose next token ``p + 1`` is supervised (the anchor itself is known: prompt or response).

    Args:
        loss_mask: [b, n] bool, True where the token is a training label (response tokens).
    Returns:
        anchors [b, A] long (sorted; padded with 0) and keep [b, A] bool.
    """
    b, n = loss_mask.shape
    candidates = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidates[:, :-1] = loss_mask[:, 1:].bool()
    candidates[:, 0] = False  # an anchor needs at least one context position before it
    counts = candidates.sum(dim=1)
    num = int(min(num_anchors, max(int(counts.max()), 1)))
    # drawn on the CPU (where the trainer's generator lives) and moved: the same anchors on every device
    scores = torch.rand(b, n, generator=generator).to(loss_mask.device)
    scores = scores.masked_fill(~candidates, -1.0)
    top = scores.topk(num, dim=1)
    keep = top.values >= 0
    anchors = torch.where(keep, top.indices, torch.zeros_like(top.indices))
    anchors, order = anchors.sort(dim=1)
    keep = keep.gather(1, order)
    # Sorting moved padded zeros first; keep them flagged off.
    return anchors, keep


@dataclass
class Blocks:
    """The training blocks of a batch."""

    input_ids: torch.Tensor  # [b, q] anchor + masks per block
    position_ids: torch.Tensor  # [b, q]
    labels: torch.Tensor  # [b, A, g] token at anchor + k + 1 (0 where invalid)
    prev_ids: torch.Tensor  # [b, A, g] true previous tokens (teacher forcing): anchor, label_0, ...
    target_positions: torch.Tensor  # [b, A, g] position whose target logits predict the label (anchor + k)
    valid: torch.Tensor  # [b, A, g] bool, contiguous prefix of supervised positions
    attention_mask: torch.Tensor  # [b, 1, q, n + q] bool (True = attend)
    context_lengths: torch.Tensor  # [b, A] context positions each block sees (its anchor; 0 for dropped blocks)


def build_blocks(input_ids, loss_mask, anchors, keep, block_size: int, mask_token_id: int) -> Blocks:
    """Blocks, labels and the per-block attention mask (context ``< anchor`` plus the block itself)."""
    b, n = input_ids.shape
    num = anchors.shape[1]
    g = block_size
    device = input_ids.device
    offsets = torch.arange(g, device=device)
    positions = anchors.unsqueeze(-1) + offsets  # [b, A, g]
    label_positions = positions + 1
    in_range = label_positions < n
    clamped = label_positions.clamp(max=n - 1)
    labels = input_ids.gather(1, clamped.view(b, -1)).view(b, num, g)
    supervised = loss_mask.bool().gather(1, clamped.view(b, -1)).view(b, num, g) & in_range
    valid = (supervised.long().cumprod(dim=-1).bool()) & keep.unsqueeze(-1)
    labels = torch.where(valid, labels, torch.zeros_like(labels))
    anchor_ids = input_ids.gather(1, anchors)  # [b, A]
    block_ids = torch.full((b, num, g), mask_token_id, dtype=torch.long, device=device)
    block_ids[..., 0] = anchor_ids
    prev_ids = torch.cat([anchor_ids.unsqueeze(-1), labels[..., :-1]], dim=-1)

    q = num * g
    context_mask = torch.arange(n, device=device).view(1, 1, n) < anchors.view(b, num, 1)  # [b, A, n]
    context_mask = context_mask.unsqueeze(2).expand(b, num, g, n).reshape(b, q, n)
    block_of = torch.arange(q, device=device) // g
    own_block = (block_of.view(q, 1) == block_of.view(1, q)).unsqueeze(0).expand(b, q, q)
    own_block = own_block & keep.repeat_interleave(g, dim=1).unsqueeze(-1)
    mask = torch.cat([context_mask & keep.repeat_interleave(g, dim=1).unsqueeze(-1), own_block], dim=-1)
    # Dropped (padding) blocks must still attend somewhere to keep softmax finite: let them see their own token.
    eye = torch.eye(q, dtype=torch.bool, device=device).unsqueeze(0)
    mask[..., n:] |= eye & ~keep.repeat_interleave(g, dim=1).view(b, q, 1)
    return Blocks(
        input_ids=block_ids.view(b, q),
        position_ids=positions.view(b, q),
        labels=labels,
        prev_ids=prev_ids,
        target_positions=positions.clamp(max=n - 1),
        valid=valid,
        attention_mask=mask.unsqueeze(1),
        context_lengths=torch.where(keep, anchors, torch.zeros_like(anchors)),
    )


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-k / gamma), k = 0..g-1 (the reference's decay; gamma = 4 for g = 7)."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / gamma)


@dataclass
class TargetView:
    """What the losses read of the target at each supervised position: its probabilities over the drafter's output
    vocabulary (the draft vocabulary, or the full one), the probability mass outside that vocabulary, and its argmax
    token id. Full-vocabulary target logits are never kept per block position: ``target_view`` builds this from
    distinct positions only."""

    probs: torch.Tensor  # [..., V_out] float32 (with ``rows``: [U, V_out], one row per distinct position)
    outside: torch.Tensor  # [...] float32 (zeros without a draft vocabulary)
    argmax: torch.Tensor  # [...] long, target token ids
    rows: torch.Tensor | None = None  # [...] long: the row of ``probs`` each position reads, if not expanded

    @classmethod
    def from_logits(cls, target_logits: torch.Tensor, draft_vocab: torch.Tensor | None = None) -> "TargetView":
        """The reference construction: softmax over the full vocabulary, then the draft vocabulary's columns."""
        probs = F.softmax(target_logits.float(), dim=-1)
        argmax = target_logits.argmax(-1)
        if draft_vocab is None:
            return cls(probs, probs.new_zeros(probs.shape[:-1]), argmax)
        probs = probs.index_select(-1, draft_vocab)
        return cls(probs, (1 - probs.sum(dim=-1)).clamp(min=0), argmax)

    def expand(self, inverse: torch.Tensor, shape: tuple[int, ...]) -> "TargetView":
        """Rows ``inverse`` of a view over distinct positions, shaped ``shape`` (the block positions). The
        probabilities stay one row per distinct position, indexed by ``rows``: the losses read them row by row, so
        the ``[..., V_out]`` copy per block position is never made (under ``torch.compile`` the read fuses into the
        loss loops)."""
        return TargetView(self.probs, self.outside[inverse].view(shape), self.argmax[inverse].view(shape),
                          rows=inverse.view(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        """The ``[..., V_out]`` shape of the probabilities per position."""
        return (*self.outside.shape, self.probs.shape[-1])


@torch.no_grad()
def target_view(rows: torch.Tensor, lm_head_weight: torch.Tensor, draft_vocab: torch.Tensor | None = None,
                lse: torch.Tensor | None = None, argmax: torch.Tensor | None = None,
                chunk_rows: int = 256, compiled: bool = False) -> TargetView:
    """The target's view at hidden-state ``rows`` [U, D] (final, post-norm): ``softmax(rows @ W^T)`` restricted
    to ``draft_vocab``, its outside mass and argmax, without materialising more than ``chunk_rows`` full-vocabulary
    logit rows at a time. With the full-vocabulary log-normaliser ``lse`` [U] and ``argmax`` [U] given (cached
    with the features), only the draft vocabulary's rows of the LM head are multiplied: a sixth of the work for an
    8192-token draft vocabulary of a 49152-token target. ``compiled`` normalises those logits in one fused loop
    (``torch.compile``)."""
    weight = lm_head_weight.detach()
    rows = rows.to(weight.dtype)
    if lse is not None and argmax is not None and draft_vocab is not None:
        logits = F.linear(rows, weight.index_select(0, draft_vocab))
        probs, outside = (_compiled_normalised_probs() if compiled else normalised_probs)(logits, lse)
        return TargetView(probs, outside, argmax.long())
    parts = []
    for start in range(0, rows.shape[0], chunk_rows):
        parts.append(TargetView.from_logits(F.linear(rows[start : start + chunk_rows], weight), draft_vocab))
    if not parts:
        width = weight.shape[0] if draft_vocab is None else draft_vocab.numel()
        empty = rows.new_zeros(0, dtype=torch.float32)
        return TargetView(rows.new_zeros(0, width, dtype=torch.float32), empty, empty.long())
    return TargetView(*(torch.cat([getattr(p, k) for p in parts]) for k in ("probs", "outside", "argmax")))


@torch.no_grad()
def log_normalizer_and_argmax(hidden: torch.Tensor, lm_head_weight: torch.Tensor, chunk_rows: int = 256):
    """``logsumexp`` and ``argmax`` of ``hidden @ W^T`` over the full vocabulary, per row of ``hidden`` [N, D]
    (float32 [N], int32 [N]), ``chunk_rows`` at a time: what a features cache stores so that training multiplies
    only the draft vocabulary's rows of the LM head."""
    weight = lm_head_weight.detach()
    lse, top = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        logits = F.linear(hidden[start : start + chunk_rows].to(weight.dtype), weight).float()
        lse.append(torch.logsumexp(logits, dim=-1))
        top.append(logits.argmax(-1).int())
    if not lse:
        return hidden.new_zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.int32)
    return torch.cat(lse), torch.cat(top)


def normalised_probs(logits: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(logits - lse)`` in float32 for logits over part of a vocabulary whose full log-normaliser is ``lse``,
    and the probability mass outside that part (``1 - sum``, clamped at 0)."""
    probs = torch.exp(logits.float() - lse.float().unsqueeze(-1))
    return probs, (1 - probs.sum(dim=-1)).clamp(min=0)


def vocab_terms(draft_logits: torch.Tensor, target_probs: torch.Tensor, draft_labels: torch.Tensor,
                rows: torch.Tensor | None = None, bias: torch.Tensor | None = None):
    """The vocabulary-wide part of the losses, per block position: the cross-entropy of ``draft_labels`` under the
    draft distribution, ``sum |p_d - p_t|`` over the drafter's vocabulary, and the draft's argmax (no gradient).
    With ``rows``, position ``i`` reads ``target_probs[rows[i]]``; with ``bias`` (the sequential head's), the draft
    logits are ``draft_logits + bias``."""
    if rows is not None:
        target_probs = target_probs[rows]
    if bias is not None:
        draft_logits = draft_logits + bias.to(draft_logits.dtype)
    log_pd = F.log_softmax(draft_logits.float(), dim=-1)
    ce = -log_pd.gather(-1, draft_labels.unsqueeze(-1)).squeeze(-1)
    l1 = (log_pd.exp() - target_probs).abs().sum(dim=-1)
    return ce, l1, draft_logits.detach().argmax(-1)


# ``vocab_terms`` and ``normalised_probs`` under ``torch.compile``, built on first use (the first call of a new
# shape compiles). Shapes vary between batches (distinct positions, the last batch), so they turn dynamic after the
# first change.
_compiled_vocab_terms = functools.cache(lambda: torch.compile(vocab_terms))
_compiled_normalised_probs = functools.cache(lambda: torch.compile(normalised_probs))


def dspark_losses(
    draft_logits: torch.Tensor,  # [b, A, g, V] base logits (+ teacher-forced sequential bias, or see below)
    target_logits: torch.Tensor | TargetView,  # [b, A, g, V] target logits at anchor + k, or their TargetView
    labels: torch.Tensor,  # [b, A, g]
    valid: torch.Tensor,  # [b, A, g]
    confidence_logits: torch.Tensor | None,  # [b, A, g]
    gamma: float = 4.0,
    weights: dict[str, float] | None = None,
    draft_vocab: torch.Tensor | None = None,  # [V_draft] target ids of the draft vocabulary, if any
    confidence_target: str = "sampling",
    compiled: bool = False,
    sequential_bias: torch.Tensor | None = None,  # [b, A, g, V] the sequential head's bias, if not in draft_logits
) -> dict[str, torch.Tensor]:
    """CE to the target's token, L1 between draft and target distributions (= 2 TV), and BCE of the confidence
    head; each averaged with the per-position decay. With a draft vocabulary, p_d is zero outside it: the target's
    mass there counts fully in the L1 term, and labels outside it get no CE. Returns the weighted total as
    ``"loss"`` and each term, the token ``"accuracy"``, and ``"greedy_matches"`` (bool [b, A, g], not a scalar:
    valid positions where the draft's argmax is the target's).

    ``confidence_target`` is what the confidence head learns to predict: ``"sampling"`` (the paper) the analytic
    acceptance rate of speculative sampling, ``1 - 0.5 * ||p_d - p_t||_1``; ``"greedy"`` the acceptance event of
    greedy verification, 1 where the draft's argmax is the target's argmax, else 0.

    ``target_logits`` may be a ``TargetView`` (what ``drafter_training_step`` passes): the same losses without
    full-vocabulary tensors per block position. ``compiled`` computes the vocabulary-wide terms (``vocab_terms``)
    with ``torch.compile``, which fuses their elementwise passes and reductions into a few loops; given apart as
    ``sequential_bias``, the head's bias is added inside those loops instead of in a pass of its own."""
    if confidence_target not in CONFIDENCE_TARGETS:
        raise ValueError(f"confidence_target must be one of {CONFIDENCE_TARGETS}, got {confidence_target!r}")
    weights = {**DEFAULT_LOSS_WEIGHTS, **(weights or {})}
    w = position_weights(labels.shape[-1], gamma, labels.device) * valid.float()  # [b, A, g]
    denom = w.sum().clamp(min=1e-6)
    target = _covering_target_view(target_logits, draft_vocab, draft_logits.shape)
    draft_labels, in_vocab = _draft_vocab_labels(labels, valid, draft_vocab)
    terms = _compiled_vocab_terms() if compiled else vocab_terms
    ce, l1, predicted = terms(draft_logits, target.probs, draft_labels, target.rows, sequential_bias)
    ce_w = w * in_vocab.float()
    l1 = l1 + target.outside
    out = {"ce": (ce * ce_w).sum() / ce_w.sum().clamp(min=1e-6), "tv": (l1 * w).sum() / denom}
    total = weights["ce"] * out["ce"] + weights["tv"] * out["tv"]
    out.update(_token_matches(predicted, labels, valid, target.argmax, draft_vocab))
    if confidence_logits is not None:
        out["confidence"] = _confidence_loss(confidence_logits, confidence_target, out["greedy_matches"], l1, w, denom)
        total = total + weights["confidence"] * out["confidence"]
    out["loss"] = total
    return out


def _covering_target_view(target_logits: torch.Tensor | TargetView, draft_vocab: torch.Tensor | None,
                          draft_shape: torch.Size) -> TargetView:
    """``target_logits`` as a ``TargetView`` over the draft vocabulary, refused unless it matches the draft logits'
    shape ``draft_shape``."""
    target = target_logits if isinstance(target_logits, TargetView) else TargetView.from_logits(target_logits,
                                                                                                 draft_vocab)
    if target.shape != draft_shape:
        raise ValueError(f"target probabilities {tuple(target.shape)} do not match the draft logits "
                         f"{tuple(draft_shape)}: the target view must cover the drafter's output vocabulary")
    return target


def _draft_vocab_labels(labels: torch.Tensor, valid: torch.Tensor,
                        draft_vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``labels`` [b, A, g] as indices into the draft vocabulary (0 where a label lies outside it) and whether each
    lies inside it; without a draft vocabulary, the labels themselves and all true."""
    if draft_vocab is None:
        return labels, torch.ones_like(valid)
    vocab_size = max(int(draft_vocab.max()), int(labels.max())) + 1
    lookup = torch.full((vocab_size,), -1, dtype=torch.long, device=labels.device)
    lookup[draft_vocab] = torch.arange(draft_vocab.numel(), device=labels.device)
    draft_labels = lookup[labels]
    in_vocab = draft_labels >= 0
    return draft_labels.clamp(min=0), in_vocab


@torch.no_grad()
def _token_matches(predicted: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, target_argmax: torch.Tensor,
                   draft_vocab: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """``"accuracy"`` of the draft's argmax ``predicted`` (draft-vocabulary indices when ``draft_vocab`` is given)
    against ``labels`` over valid positions, and ``"greedy_matches"``: greedy acceptance events with teacher-forced
    previous tokens, where the draft's argmax is the target's argmax."""
    if draft_vocab is not None:
        predicted = draft_vocab[predicted]
    accuracy = ((predicted == labels).float() * valid.float()).sum() / valid.float().sum().clamp(min=1)
    return {"accuracy": accuracy, "greedy_matches": (predicted == target_argmax) & valid}


def _confidence_loss(confidence_logits: torch.Tensor, confidence_target: str, greedy_matches: torch.Tensor,
                     l1: torch.Tensor, w: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """BCE of the confidence head against ``confidence_target``'s label (``greedy_matches``, or the analytic
    acceptance rate ``1 - 0.5 * l1``), averaged with the position weights ``w`` over ``denom``."""
    if confidence_target == "greedy":
        label = greedy_matches.float()
    else:
        label = (1 - 0.5 * l1).clamp(0, 1).detach()
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), label, reduction="none")
    return (bce * w).sum() / denom


def leading_matches(matches: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Drafts a whole-block greedy verification would accept, per block: the count of leading ``matches``
    [N, g] in each block whose g positions are all ``valid`` (blocks cut short by the end of a response are left
    out). The accepted length tau is one (the bonus token) plus their mean."""
    full = valid.all(dim=-1)
    return torch.cumprod(matches[full].long(), dim=-1).sum(dim=-1)


def drafter_training_step(drafter, target_hidden, target_last_hidden, input_ids, loss_mask, num_anchors: int,
                          gamma: float = 4.0, weights: dict[str, float] | None = None,
                          generator: torch.Generator | None = None,
                          confidence_target: str = "sampling", target_lse: torch.Tensor | None = None,
                          target_argmax: torch.Tensor | None = None,
                          reference_target: bool = False, dense_attention: bool = False,
                          compiled: bool = False) -> dict[str, torch.Tensor]:
    """Losses for one batch given target features.

    Args:
        target_hidden: [b, n, taps * D] concatenated target hidden states (``gather_target_hidden``).
        target_last_hidden: [b, n, D] the target's final (post-norm, pre-LM-head) hidden states; the target's view
            (``target_view``) is recomputed from it only at the distinct supervised block positions.
        input_ids / loss_mask: [b, n].
        target_lse / target_argmax: [b, n] the full-vocabulary log-normaliser and argmax of the target at every
            position (a features cache stores them); with a draft vocabulary they spare the full LM head.
        reference_target: build full-vocabulary target logits per block position and take the losses from them
            (the plain construction, for checking the fast one).
        dense_attention: give the drafter the dense ``[q, n + q]`` block mask instead of its ``BlockLayout`` (the
            plain construction again; the losses are the same).
        compiled: compute the vocabulary-wide loss terms with ``torch.compile`` (``dspark_losses``).
    """
    config = drafter.config
    anchors, keep = sample_anchors(loss_mask, num_anchors, generator)
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, config.block_size, config.mask_token_id)
    b, n = input_ids.shape
    layout = blocks.attention_mask if dense_attention else BlockLayout(blocks.context_lengths, config.block_size)
    out = drafter(
        input_ids=blocks.input_ids,
        position_ids=blocks.position_ids,
        target_hidden=target_hidden,
        context_position_ids=torch.arange(n, device=input_ids.device).unsqueeze(0).expand(b, -1),
        attention_mask=layout,
    )
    num, g = blocks.labels.shape[1:]
    hidden = out.hidden_states.view(b, num, g, -1)
    base = out.logits.view(b, num, g, -1)
    bias = drafter.sequential_bias(hidden, blocks.prev_ids)
    lm_head = drafter.lm_head
    draft_vocab = drafter.draft_vocab
    with torch.no_grad():  # the target once per distinct supervised position
        flat = (blocks.target_positions + n * torch.arange(b, device=input_ids.device).view(b, 1, 1)).view(-1)
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows = target_last_hidden.reshape(b * n, -1).index_select(0, unique)
        if reference_target:
            target = lm_head(rows.to(lm_head.weight.dtype))[inverse].view(b, num, g, -1)
        else:
            lse = None if target_lse is None else target_lse.reshape(-1).index_select(0, unique)
            top = None if target_argmax is None else target_argmax.reshape(-1).index_select(0, unique)
            target = target_view(rows, lm_head.weight, draft_vocab, lse, top,
                                 compiled=compiled).expand(inverse, (b, num, g))
    confidence_logits = drafter.confidence_logits(hidden, blocks.prev_ids)
    out = dspark_losses(base, target, blocks.labels, blocks.valid, confidence_logits, gamma, weights,
                        draft_vocab=draft_vocab, confidence_target=confidence_target, compiled=compiled,
                        sequential_bias=bias)
    out["valid"] = blocks.valid  # [b, A, g] supervised block positions (with ``greedy_matches``: per-block metrics)
    return out
