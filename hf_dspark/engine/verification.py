"""Verification of a step's ragged blocks: pure functions over tensors ([R, L] drafts, [R, L + 1, V] target scores),
testable without a model. The sharing of its verification budget (``schedule_batch``) is in ``hf_dspark.scheduling``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import LogitsProcessorList

from ..scheduling import SCHEDULES
from .requests import sampling_groups

# The Triton kernel variant family (``hf_dspark.kernels``) each schedule launches on CUDA.
SCHEDULE_KERNELS = {"padded": "width", "prefix": "prefix", "topk": "topk"}


def schedule_kernel_kinds(schedule: str) -> tuple[str, ...]:
    """The kernel kinds an engine with ``schedule`` launches: its own, and under top-K also Algorithm 1's, with which
    it judges whether drafting (or a lookup) can pay at all (top-K pays R + K tokens, as ``prefix`` prices them)."""
    kind = SCHEDULE_KERNELS[schedule]
    return (kind, "prefix") if kind == "topk" else (kind,)


def _processed_probs(logits: torch.Tensor, processors: LogitsProcessorList | None) -> torch.Tensor:
    """softmax(processors(logits)) over the last axis of [..., V] float logits. The warpers used here look at
    scores only, so the token history passed to them is a placeholder."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    if processors:
        flat = processors(flat.new_zeros(flat.shape[0], 1, dtype=torch.long), flat)
    return torch.softmax(flat, dim=-1).view(logits.shape)


# ------------------------------------------------------------------------------------------------------------------
# Verification of ragged blocks (pure functions)
# ------------------------------------------------------------------------------------------------------------------
def greedy_verify(draft_ids: torch.Tensor, num_drafts: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification: accept while the draft equals the target's argmax, then emit the target's own token.

    Args:
        draft_ids: [R, L] drafts (padded past ``num_drafts``).
        num_drafts: [R] verified drafts per row (0..L).
        target_logits: [R, L + 1, V]; position j scores the token after the block's j-th input (anchor = input 0).
    Returns:
        accepted [R] (leading drafts accepted) and next_tokens [R] (the correction, or the bonus token).
    """
    target_ids = target_logits.argmax(dim=-1)  # [R, L + 1]
    length = draft_ids.shape[1]
    verified = torch.arange(length, device=draft_ids.device) < num_drafts[:, None]
    matches = (draft_ids == target_ids[:, :length]) & verified
    accepted = matches.long().cumprod(dim=-1).sum(dim=-1)
    return accepted, target_ids.gather(1, accepted[:, None]).squeeze(1)


def speculative_verify(draft_ids: torch.Tensor, num_drafts: torch.Tensor, draft_probs: torch.Tensor,
                       target_probs: torch.Tensor, generator: torch.Generator | None = None):
    """Speculative sampling: accept draft k with probability min(1, p(x_k) / q(x_k)); at the first rejection sample
    from norm(max(p - q, 0)); when every verified draft is accepted, sample the bonus token from p.

    Args:
        draft_ids: [R, L]; num_drafts: [R].
        draft_probs: [R, L, V] q, exactly the distribution each draft was sampled from.
        target_probs: [R, L + 1, V] p, the target's processed distribution at each block position.
    Returns:
        accepted [R] and next_tokens [R].
    """
    num_rows, length = draft_ids.shape
    device = draft_ids.device
    verified = torch.arange(length, device=device) < num_drafts[:, None]
    p_draft = target_probs[:, :length].gather(-1, draft_ids[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    uniform = torch.rand(num_rows, length, device=device, generator=generator)
    # u < p / q without dividing; q(x) > 0 because x was drawn from q.
    accepted = ((uniform * q_draft < p_draft) & verified).long().cumprod(dim=-1).sum(dim=-1)
    p_next = target_probs.gather(1, accepted.view(-1, 1, 1).expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    rejected = accepted < num_drafts
    if length:
        at = accepted.clamp(max=length - 1).view(-1, 1, 1).expand(-1, 1, draft_probs.shape[-1])
        q_next = torch.where(rejected[:, None], draft_probs.gather(1, at).squeeze(1), 0.0)
    else:
        q_next = torch.zeros_like(p_next)
    residual = (p_next - q_next).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p = q exactly cannot be rejected; guard against a rounding-level residual anyway.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    return accepted, torch.multinomial(residual, 1, generator=generator).squeeze(1)


def one_hot_probs(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q [..., V] of deterministic drafts (prompt lookup): all the mass on each drafted token of ``draft_ids``."""
    return torch.nn.functional.one_hot(draft_ids, vocab_size).float()


def accept_rows(rows: Sequence, logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                lengths: list[int], plan, block, generator_of: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted drafts [R] and the target's next token [R] for a step's ``rows`` (requests, ``logits`` [R, Q, V]):
    greedy matching, or speculative sampling against each draft's q (the block's sampled distribution; one-hot for an
    offer, whose drafts are deterministic), one group of equal sampling parameters at a time, each drawing from
    ``generator_of(request)``."""
    device = logits.device
    accepted = torch.zeros(len(rows), dtype=torch.long, device=device)
    next_tokens = torch.zeros(len(rows), dtype=torch.long, device=device)
    block_row = {r: k for k, r in enumerate(plan.drafting)}
    width = draft_ids.shape[1] + 1
    for members in sampling_groups([r.params for r in rows]).values():
        params = rows[members[0]].params
        sel = torch.tensor(members, device=device)
        if not params.do_sample:
            accepted[sel], next_tokens[sel] = greedy_verify(draft_ids[sel], num_drafts[sel], logits[sel])
            continue
        q = logits.new_zeros(len(members), width - 1, logits.shape[-1])
        drafted = [k for k, i in enumerate(members) if i in block_row and lengths[i] > 0]
        if drafted and width > 1:
            source = torch.tensor([block_row[members[k]] for k in drafted], device=device)
            n = min(width - 1, block.q.shape[1])  # a step with a token tree can be wider than the block
            q[torch.tensor(drafted, device=device), :n] = torch.softmax(
                block.q.index_select(0, source)[:, :n], dim=-1)
        offered = [k for k, i in enumerate(members) if i in plan.offers and lengths[i] > 0]
        if offered:
            at = torch.tensor(offered, device=device)
            q[at] = one_hot_probs(draft_ids[sel].index_select(0, at), logits.shape[-1])
        p = _processed_probs(logits[sel], params.warpers())
        accepted[sel], next_tokens[sel] = speculative_verify(draft_ids[sel], num_drafts[sel], q, p,
                                                             generator_of(rows[members[0]]))
    return accepted, next_tokens
