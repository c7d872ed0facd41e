"""The drafter's block as a draft source: ``propose`` drafts a block for one sequence (``SequenceBlock``, what
``generate()`` runs) or for R rows at once (``BatchedBlock``, what the batched engine runs), returning a
``draft_sources.Draft`` like every other source.

A sequence's block runs one of three ways (``drafter.generation_config.draft_round``, ``DRAFT_ROUNDS``): the eager
round (a growing context cache, every kernel launched from Python), the static round (fixed-shape buffers,
``static_round.DSparkStaticRound``), or that static round captured as a CUDA graph and replayed. R rows run one batched
drafter forward over their ragged contexts, then left-to-right sampling per group of equal sampling parameters.

This file is self-contained (torch + its siblings ``draft_sources`` and ``setting_choices``): exported drafter folders
carry it in ``custom_generate/``. It reads the drafter through its public methods only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # inside the hf_dspark package, or a custom_generate/ folder carrying its siblings next to this file
    from .draft_sources import Draft
    from .setting_choices import checked_choice
except ImportError:  # pragma: no cover - loaded as a top-level module
    from draft_sources import Draft  # type: ignore[no-redef]
    from setting_choices import checked_choice  # type: ignore[no-redef]

# ``drafter.generation_config.draft_round``:
#   "auto"   (default) on CUDA, a static round replayed from a CUDA graph where the round allows it (value-only
#            logits processors; should the capture itself fail, a warning and the static round run eagerly);
#            otherwise the eager round
#   "eager"  the eager round: a growing context cache, every kernel launched from Python
#   "static" the static round (fixed-shape buffers) run eagerly, on any device: the graph's computation without capture
#   "graph"  the static round captured as a CUDA graph; an error where that is impossible
DRAFT_ROUNDS = ("auto", "eager", "static", "graph")
# Context buffers are sized in steps of this many positions, so calls of similar lengths share one round (and graph).
CAPACITY_STEP = 256


def draft_round_mode(drafter) -> str:
    """``drafter.generation_config.draft_round`` (default ``"auto"``), checked."""
    return checked_choice(drafter, "draft_round", DRAFT_ROUNDS, "auto")


def static_round_for(drafter, max_length: int, logits_processor, do_sample: bool):
    """The drafter's static round for a call generating up to ``max_length`` tokens, or None for the eager round
    (see ``DRAFT_ROUNDS``)."""
    mode = draft_round_mode(drafter)
    if mode == "eager":
        return None
    builder = getattr(drafter, "static_round", None)
    cuda = drafter.device.type == "cuda"
    if mode == "auto":
        if not cuda or builder is None or drafter.static_round_obstacle(logits_processor, graph=True) is not None:
            return None
    elif builder is None:
        raise ValueError(f"draft_round={mode!r}: this drafter's code has no static round (DSparkDrafter.static_round)")
    # The anchor of a round is at most max_length - 2 and its window reaches block_size + 1 positions past the
    # context, so max_length + block_size positions always suffice.
    needed = max_length + drafter.config.block_size
    capacity = -(-needed // CAPACITY_STEP) * CAPACITY_STEP
    return builder(capacity, processors=logits_processor, do_sample=do_sample, graph=mode in ("auto", "graph"),
                   fallback=mode == "auto")


class SequenceBlock:
    """The block of one sequence (``generate()``): the static round where ``draft_round`` selects it for this call,
    else the eager round over the drafter's growing context cache (``strategy``: ``"static"`` or ``"eager"``; a
    static round replays its CUDA graph when it captured one)."""

    name = "block"

    def __init__(self, drafter, max_length: int, logits_processor=None, do_sample: bool = False):
        self.drafter, self.logits_processor, self.do_sample = drafter, logits_processor, do_sample
        self.static_round = static_round_for(drafter, max_length, logits_processor, do_sample)
        self.cache = self.static_round if self.static_round is not None else drafter.new_context_cache()
        self.strategy = "eager" if self.static_round is None else "static"

    @property
    def length(self) -> int:
        """Positions of the sequence already in the drafter's context."""
        return self.cache.length

    def propose(self, input_ids: torch.LongTensor, features: torch.Tensor) -> Draft:
        """The block drafted from ``input_ids`` [1, L] (its last token the anchor), after appending ``features``
        [1, n, taps * D] (the target features of the positions its context lacks) to the context."""
        anchor_position = input_ids.shape[1] - 1
        if self.static_round is not None:
            out = self.static_round.draft(input_ids[:, -1], anchor_position, features)
        else:
            out = self.drafter.draft(input_ids[:, -1], anchor_position, features, self.cache,
                                     prefix_ids=input_ids[:, :-1], logits_processor=self.logits_processor,
                                     do_sample=self.do_sample)
        return Draft(out.draft_ids, out.draft_logits, out.confidences, self.name, out.confidence_logits,
                     base_logits=out.base_logits, hidden=out.hidden_states)


class BatchedBlock:
    """The blocks of R rows in one drafter forward (the batched engine): each row's block ``[anchor, mask * (g - 1)]``
    sees its row's valid context columns and the whole block (DSpark's non-causal block), then each group of rows
    with equal sampling parameters samples its blocks left to right."""

    name = "block"

    def __init__(self, drafter):
        self.drafter = drafter
        self.block_size = drafter.config.block_size

    def propose(self, anchors: torch.Tensor, positions: torch.Tensor, context: Any, valid: torch.Tensor,
                groups: Sequence[tuple[list[int], Any, bool, torch.Generator | None]]) -> Draft:
        """Blocks for R rows: ``anchors`` [R], ``positions`` [R] (each anchor's absolute position), the rows' context
        cache view and its ``valid`` columns [R, C]; ``groups`` lists ``(members, logits_processor, do_sample,
        generator)`` per set of rows sampled alike."""
        drafter, g = self.drafter, self.block_size
        rows, device = anchors.shape[0], anchors.device
        block = torch.full((rows, g), drafter.config.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = anchors
        mask = torch.cat([valid, valid.new_ones(rows, g)], dim=1)[:, None, None, :].expand(-1, 1, g, -1)
        out = drafter(input_ids=block, position_ids=positions[:, None] + torch.arange(g, device=device),
                      cache=context, attention_mask=mask)
        ids = torch.empty(rows, g, dtype=torch.long, device=device)
        parts: dict[str, torch.Tensor | None] = {"logits": None, "confidences": None, "confidence_logits": None}
        for members, processors, do_sample, generator in groups:
            sel = torch.tensor(members, device=device)
            draft = drafter.sample_block(out.logits.index_select(0, sel), out.hidden_states.index_select(0, sel),
                                         anchors.index_select(0, sel), logits_processor=processors,
                                         do_sample=do_sample, generator=generator)
            ids[sel] = draft.draft_ids
            values = {"logits": draft.draft_logits.float() if do_sample else None,
                      "confidences": draft.confidences, "confidence_logits": draft.confidence_logits}
            for key, value in values.items():
                if value is not None:
                    if parts[key] is None:
                        parts[key] = value.new_zeros(rows, *value.shape[1:])
                    parts[key][sel] = value
        return Draft(ids, parts["logits"], parts["confidences"], self.name, parts["confidence_logits"],
                     base_logits=out.logits, hidden=out.hidden_states)


__all__ = ["BatchedBlock", "CAPACITY_STEP", "DRAFT_ROUNDS", "SequenceBlock", "draft_round_mode", "static_round_for"]
