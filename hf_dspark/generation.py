"""DSpark in transformers' assisted generation: ``DSparkCandidateGenerator`` and the ``generate()`` dispatch.

Two routes reach the same generator:

(a) ``import hf_dspark`` installs one small dispatch on ``GenerationMixin``: when ``assistant_model`` is a DSpark
    drafter (``config.model_type == "dspark"``), ``_get_candidate_generator`` returns a ``DSparkCandidateGenerator``
    and ``_validate_generation_mode`` checks the request (beams, compatibility) first. Every other assistant type is
    passed to transformers untouched.
(b) Without hf_dspark installed, an exported drafter folder carries this file as ``custom_generate/generate.py``:
    ``target.generate(..., assistant_model=drafter, custom_generate=folder, trust_remote_code=True)`` calls
    ``generate`` below, which installs the same dispatch on that one model for the duration of the call.

Verification itself (greedy matching or rejection sampling, EOS / max-length cropping, cache cropping, streamers,
``return_dict_in_generate``) is transformers' own ``_assisted_decoding``; this module proposes candidates, and crops a
committed round where any stopping criterion fires inside it (transformers checks the criteria only at the end of a
round, so a stop string completed by an accepted draft would otherwise run on past it). A token-tree round is
verified by the generator before the loop sees it, and the loop's forward over the accepted path is answered from
that verification (``tree_round``); the loop's processing of the round is unchanged.

This file is self-contained (torch + transformers + its siblings ``attention``, ``block_source``, ``clock``,
``draft_sources``, ``gate``, ``planner``, ``rollback``, ``scheduling``, ``stats``, ``token_tree``, ``tree_round`` and
``verification_width``), because exported folders carry it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerationMixin

try:  # inside the hf_dspark package, or a custom_generate/ folder carrying its siblings next to this file
    from .attention import packed_attention
    from .block_source import SequenceBlock
    from .clock import RoundClock
    from .draft_sources import Draft, LookupSurvival
    from .gate import RealizedGate
    from .planner import Planner, RowState
    from .rollback import rollback_refusal
    from .scheduling import VerificationPolicy, lookup_max_tokens, policy_from_generation_config
    from .stats import DSparkRound, DSparkStats, stats_lists
    from .token_tree import TREE_NODES, draft_tree_mode, tree_obstacle
    from .tree_round import SequenceTrees, path_forward
    from .verification_width import VERIFICATION_WIDTHS, verification_records_graphs, verification_width_mode
except ImportError:  # pragma: no cover - loaded as a top-level module
    from attention import packed_attention  # type: ignore[no-redef]
    from block_source import SequenceBlock  # type: ignore[no-redef]
    from clock import RoundClock  # type: ignore[no-redef]
    from draft_sources import Draft, LookupSurvival  # type: ignore[no-redef]
    from gate import RealizedGate  # type: ignore[no-redef]
    from planner import Planner, RowState  # type: ignore[no-redef]
    from rollback import rollback_refusal  # type: ignore[no-redef]
    from scheduling import (  # type: ignore[no-redef]
        VerificationPolicy,
        lookup_max_tokens,
        policy_from_generation_config,
    )
    from stats import DSparkRound, DSparkStats, stats_lists  # type: ignore[no-redef]
    from token_tree import TREE_NODES, draft_tree_mode, tree_obstacle  # type: ignore[no-redef]
    from tree_round import SequenceTrees, path_forward  # type: ignore[no-redef]
    from verification_width import (  # type: ignore[no-redef]
        VERIFICATION_WIDTHS,
        verification_records_graphs,
        verification_width_mode,
    )


def is_dspark_drafter(model: Any) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "dspark"


# ------------------------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------------------------
class _PendingRound(NamedTuple):
    """What a round drafted, kept from ``get_candidates`` until its verdict arrives."""

    drafted: int = 0
    verified: int = 0
    confidences: list[float] | None = None
    confidence_logits: list[float] | None = None
    draft_ids: torch.Tensor | None = None  # [1, drafted]
    source: str = "none"
    offer: Draft | None = None  # rounds drafted by a free source: its offer
    offer_tokens: int = 0  # of the verified tokens, those the offer drafted (not a fixed width's pad)
    tree: dict | None = None  # a token-tree round: its nodes and accepted path (``DSparkRound.tree``)


# ------------------------------------------------------------------------------------------------------------------
# Candidate generator
# ------------------------------------------------------------------------------------------------------------------
class DSparkCandidateGenerator(CandidateGenerator):
    """Proposes DSpark drafts inside transformers' ``_assisted_decoding`` (batch size 1).

    Each round: append the newly verified positions' target features to the drafter's context cache, draft a
    block from the anchor (the target's last emitted token), let the verification policy pick how many drafts the
    target verifies, and return them with the exact logits they were sampled from.
    """

    requires_model_outputs = True

    def __init__(
        self,
        drafter,
        target,
        generation_config,
        logits_processor=None,
        input_ids: torch.LongTensor | None = None,
        policy: VerificationPolicy | None = None,
    ):
        validate_dspark_request(target, drafter, generation_config)
        if input_ids is not None and input_ids.shape[0] != 1:
            raise ValueError(
                f"DSpark-assisted generate() runs one sequence at a time, got a batch of {input_ids.shape[0]}; "
                "use hf_dspark's batched engine for several requests"
            )
        drafter.attach_target(target)
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.generation_config = generation_config
        self.max_length = generation_config.max_length
        self.stopping_criteria = in_round_stopping_criteria(_current_stopping_criteria())
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.hidden_state_indices = drafter.target_hidden_states_indices()
        # Ask the target for just the layers the drafter reads.
        self.model_kwargs_overrides = {"output_hidden_states": list(self.hidden_state_indices)}
        self.policy = policy or policy_from_generation_config(
            drafter.generation_config, self.block_size, drafter.confidence_head is not None
        )
        # The most drafts one round verifies: the block, or a longer prompt-lookup draft under the hybrid policy.
        self.max_round_drafts = max(self.block_size, getattr(self.policy, "max_lookup_tokens", 0))
        # Token-tree rounds (greedy): the tree the planner prices above the chain (token_tree.DRAFT_TREES).
        self.trees = SequenceTrees(drafter, target, draft_tree_mode(drafter), self.do_sample,
                                   self.hidden_state_indices, logits_processor, TREE_NODES)
        if self.policy.needs_sps and self.policy.sps is None:
            self.policy.set_sps(_profile_target(target, max(self.max_round_drafts + 1, sps_width(drafter))))
        if self.policy.draft_sources:
            self.policy.set_lookup_survival(lookup_survival_for(drafter, target))
        self.planner = generate_planner(self.policy, self.block_size,
                                    realized_gate_for(drafter, target) if self.policy.uses_realized_gate else None,
                                    lambda rows: self.clock.draft_seconds)
        self.memory = self.planner.new_memory()  # the sequence's confidence memory (policies priced by SPS)
        self._plan = None  # this round's plan and its block's confidences, kept until the verdict
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        # The drafter's block as a draft source for this one sequence: the eager or the static round (draft_round).
        self.block = SequenceBlock(drafter, generation_config.max_length, logits_processor, self.do_sample)
        # Target features of verified positions not yet in the drafter's context: rounds that do not draft from the
        # block leave them here, and the next block draft appends them all in its own forward (one multi-position
        # context pass costs about what a one-position pass costs).
        self._unseen: list[torch.Tensor] = []
        self._unseen_length = 0
        self.stats = DSparkStats(block_size=self.block_size)
        drafter.last_stats = self.stats
        self.round_callback: Callable[[DSparkRound], None] | None = getattr(drafter, "round_callback", None)
        self._pending_round: _PendingRound | None = None
        self.clock = RoundClock(target.device)  # the drafter's time, whole rounds, the stats' marks
        self._target = target
        self.fixed_width: bool | None = None  # decided at the prefill round, from the target's cache
        self._verify_started = None  # a tree round's mark before its target forward

    def _new_target_hidden(self, input_ids, model_outputs) -> torch.Tensor:
        """Features of the positions verified since the last round: [1, n, taps * D]."""
        new = input_ids.shape[1] - 1 - self.block.length - self._unseen_length
        hidden_states = getattr(model_outputs, "hidden_states", None)
        if hidden_states is None or any(hidden_states[i] is None for i in self.hidden_state_indices):
            raise ValueError("the target did not return the hidden states the DSpark drafter needs")
        available = hidden_states[self.hidden_state_indices[0]].shape[1]
        if not 0 < new <= available:
            raise ValueError(
                f"cannot align drafter context: {new} new positions but the target forward covered {available}; "
                "DSpark-assisted generate() needs the prompt run from scratch (no pre-filled cache)"
            )
        device = self.drafter.device
        return torch.cat([hidden_states[i][:, :new].to(device) for i in self.hidden_state_indices], dim=-1)

    def _defer_context(self, target_hidden: torch.Tensor) -> None:
        """Keep features for the next block draft instead of running the drafter's context pass now."""
        self._unseen.append(target_hidden)
        self._unseen_length += target_hidden.shape[1]

    def _context_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Every feature the drafter's context lacks, oldest first, ending with this round's."""
        if not self._unseen:
            return target_hidden
        features = torch.cat([*self._unseen, target_hidden], dim=1)
        self._unseen, self._unseen_length = [], 0
        return features

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens this generator drafts per round: the drafter's block, or the hybrid policy's longest lookup
        draft (transformers >= 5.25 asks, to keep that many recurrent states of caches that can roll back)."""
        return self.max_round_drafts

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        if input_ids.shape[0] != 1:
            raise ValueError(f"DSpark-assisted generate() runs one sequence at a time, got {input_ids.shape[0]}")
        if is_first_iteration:
            passed = model_kwargs or {}
            graphs = verification_records_graphs(self._target, passed, self.generation_config)
            self.fixed_width = verification_width_mode(self.drafter, graphs) == "fixed"
            self.trees.start(passed.get("cache"), self.planner.scheduled, self.fixed_width)
            return input_ids, None  # the prefill forward produces the first anchor and the context features
        started = self.clock.mark()
        self._verify_started = None
        proposal = self._propose(input_ids, model_outputs)
        # a tree round's verification ran inside the proposal: drafting ended where it began
        self.clock.marks = (started, self._verify_started or self.clock.mark())
        return proposal

    def _propose(self, input_ids: torch.LongTensor, model_outputs: Any) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """This round's candidates: the input plus the drafts to verify, and their logits (None for greedy lookup).
        The planner decides the source and the length from this one row's state."""
        ended = self.clock.next_round()
        if ended is not None and self.planner.gate is not None:
            self.planner.gate.record_step(1, *ended)
        target_hidden = self._new_target_hidden(input_ids, model_outputs)
        self.policy.set_context(input_ids.shape[1])
        room = self.max_length - input_ids.shape[1] - 1
        offer_cap = min(self.policy.max_lookup_tokens, room) if self.planner.sources else 0
        row = RowState(min(self.block_size, room), self.memory, lambda: input_ids[0], offer_cap)
        table = self.policy.sps_table() if self.planner.scheduled else None
        plan = self.planner.plan([row], table)
        self._plan = (plan, None, 0, None)
        if plan.offers:
            self._defer_context(target_hidden)  # no drafter forward: its features wait for the next block draft
            return self._offer_candidates(input_ids, plan.offers[0], self.planner.lengths(plan, None, table)[0], room)
        if plan.drafting:
            return self._block_candidates(input_ids, target_hidden, plan, table, room)
        # Nothing fits, or the planner expects no draft worth its cost this round: the target decodes alone.
        self._defer_context(target_hidden)
        self._pending_round = _PendingRound()
        return input_ids, None

    def _block_candidates(self, input_ids: torch.LongTensor, target_hidden: torch.Tensor, plan, table, room: int):
        """A round drafted by the drafter's block: its forward, then the planner's verification length, or the
        token tree the planner prices above it."""
        draft, tree = self._draft_block(input_ids, target_hidden, room, table)
        verify = self.planner.lengths(plan, draft.confidences, table)[0]
        if tree is not None:
            conf = None if draft.confidences is None else draft.confidences[0]
            cap = min(self.policy.max_lookup_tokens, room) if self.planner.sources else 0
            branch = self.planner.best_offer(input_ids[0], cap, table) if cap > 0 else None
            tree = self.planner.tree_round(tree, conf, verify, table, always=self.trees.mode == "always",
                                           branch=branch)
            if tree is not None:
                return self._tree_candidates(input_ids, draft, tree, plan)
        self._plan = (plan, draft.confidences, verify, None)
        if self.fixed_width:
            verify = plan.caps[0]  # every block round is as wide as the block (see VERIFICATION_WIDTHS)
        confidences = None if draft.confidences is None else draft.confidences[0]
        listed, raw = stats_lists(confidences, draft.confidence_logits)
        self._pending_round = _PendingRound(self.block_size, verify, listed, raw, draft.token_ids, source="block")
        if verify == 0:
            return input_ids, None
        candidates = torch.cat([input_ids, draft.token_ids[:, :verify].to(input_ids.device)], dim=-1)
        self._crop_at_stop(candidates, input_ids.shape[1])
        # softmax(q) is the distribution each draft token was actually sampled from.
        return candidates, draft.q[:, :verify]

    def _draft_block(self, input_ids: torch.LongTensor, target_hidden: torch.Tensor, room: int, table):
        """The drafter's block from the anchor (``SequenceBlock``) and, where tree rounds are on, its token tree;
        timed together for the planner."""
        started = self.clock.mark()
        draft = self.block.propose(input_ids, self._context_features(target_hidden))
        tree = None if table is None else self.trees.grow(draft, input_ids[0, -1], room, table.shape[0])
        self.clock.drafted(started, self.clock.mark())
        return draft, tree

    def _tree_candidates(self, input_ids: torch.LongTensor, draft: Draft, tree, plan):
        """A token-tree round: verified here (``SequenceTrees.verify``); the loop gets the accepted path as its
        candidates and its forward over them from the tree forward. The chain's confidences learn from the chain
        nodes the tree verified and the accepted path's leading chain nodes."""
        self._verify_started = self.clock.mark()
        verified = self.trees.verify(input_ids, tree)
        self._plan = (plan, draft.confidences, tree.chain_length(), tree.leading_chain(verified.path))
        confidences = None if draft.confidences is None else draft.confidences[0]
        listed, raw = stats_lists(confidences, draft.confidence_logits)
        path = verified.tokens[1:].view(1, -1)
        drawn = {"tokens": tree.tokens.tolist(), "parents": tree.parents.tolist(), "path": list(verified.path)}
        self._pending_round = _PendingRound(tree.size, tree.size, listed, raw, path, source="tree", tree=drawn)
        candidates = torch.cat([input_ids, path.to(input_ids.device)], dim=-1)
        self._crop_at_stop(candidates, input_ids.shape[1])
        return candidates, None

    def _offer_candidates(self, input_ids, offer: Draft, verify: int, room: int):
        """A round drafted by a free source's offer (no drafter forward). With a fixed verification width it verifies
        exactly the policy's longest offer: the whole draft, and past its end the last token repeated (greedy
        verification accepts a token only where it is the target's own choice; sampled, each carries a one-hot q,
        the distribution it was drawn from)."""
        tokens = offer.token_ids[0]
        offered = tokens.shape[0]
        if self.fixed_width:
            verify = min(self.policy.max_lookup_tokens, room)
            tokens = torch.cat([tokens[:verify], tokens[-1:].expand(max(0, verify - offered))])
        drafts = tokens[:verify].to(input_ids.device)
        self._pending_round = _PendingRound(tokens.shape[0], verify, draft_ids=tokens.view(1, -1), source=offer.source,
                                            offer=offer, offer_tokens=min(offered, verify))
        candidates = torch.cat([input_ids, drafts.view(1, -1)], dim=-1)
        self._crop_at_stop(candidates, input_ids.shape[1])
        if not self.do_sample:
            return candidates, None  # greedy verification compares tokens only
        # The draft is deterministic: q is one-hot on each drafted token (logits 0 there, -inf elsewhere).
        logits = torch.full((1, verify, self.vocab_size), float("-inf"), device=input_ids.device)
        logits.scatter_(-1, drafts.view(1, -1, 1), 0.0)
        return candidates, logits

    def _crop_at_stop(self, candidates: torch.LongTensor, length: int) -> None:
        """Make the assisted loop end this round where a stopping criterion first fires inside the drafts.

        ``first_stop`` is the first draft position whose prefix satisfies a criterion. The round commits that prefix
        only if the target accepts every draft up to it, and then the output must end there, as plain decoding's
        would; so the loop's own length-budget crop is pointed at it for this round (``max_length`` is restored when
        the round is recorded). Verification is untouched: the same drafts are verified with the same q, and a round
        whose acceptance stops before ``first_stop`` never sees the crop (its last token is checked by the loop).
        """
        stop = first_stop(self.stopping_criteria, candidates, length)
        if stop is not None:
            self.generation_config.max_length = min(self.max_length, length + stop)

    def _observe_plan(self, verified: int, accepted: int) -> None:
        """The verdict, for the planner: the sequence's confidence memory and the survival correction learn from the
        length the planner chose (a fixed width verifies more, and what it accepts past that length is not counted
        against the confidences)."""
        plan, confidences, planned, chain_accepted = self._plan
        self._plan = None
        accepted = accepted if chain_accepted is None else chain_accepted
        self.planner.observe(plan, confidences, [planned if plan.drafting else verified], [accepted])

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        verdict = self.clock.mark() if self.clock.marks is not None else None
        self.generation_config.max_length = self.max_length
        if self._pending_round is None:
            return  # the prefill round
        drafted, verified, confidences, confidence_logits, draft_ids, source, offer, offer_tokens, tree = \
            self._pending_round
        accepted = int(num_matches)
        self.clock.verdict(source != "none", accepted + 1)
        self.stats.add_round(drafted, verified, accepted, confidences, confidence_logits, source)
        if verdict is not None:
            self.stats.add_stamps(*self.clock.marks, verdict)
            self.clock.marks = None
        if offer is not None:  # the offer's own tokens only: a fixed width's pad says nothing about its source
            self.planner.observe_offer(offer, offer_tokens, min(accepted, offer_tokens))
        self._observe_plan(verified, accepted)
        self._pending_round = None
        if self.round_callback is not None:
            self.round_callback(DSparkRound(
                index=self.stats.rounds - 1,
                draft_ids=[] if draft_ids is None else draft_ids[0].tolist(),
                verified=verified,
                accepted=accepted,
                emitted_ids=input_ids[0, input_ids.shape[1] - accepted - 1:].tolist(),
                confidences=confidences,
                source=source,
                tree=tree,
            ))


# ------------------------------------------------------------------------------------------------------------------
# How a round runs
# ------------------------------------------------------------------------------------------------------------------
# How a drafting round runs (``drafter.generation_config.draft_round``): ``block_source.DRAFT_ROUNDS``. How wide its
# verification is (``verification_width``): ``verification_width.VERIFICATION_WIDTHS``. Whether it verifies a token
# tree (``draft_tree``): ``token_tree.DRAFT_TREES``.


# ------------------------------------------------------------------------------------------------------------------
# Stopping criteria inside a round
# ------------------------------------------------------------------------------------------------------------------
# transformers hands the stopping criteria to the decoding loop (``_assisted_decoding``), not to the candidate
# generator it builds there; the dispatch's ``_assisted_decoding`` records the list here for the duration of the loop
# (a weak reference: nothing outlives the call) so the DSpark generator can check its drafts against the same criteria.
_STOPPING_CRITERIA: contextvars.ContextVar[weakref.ref | None] = contextvars.ContextVar(
    "hf_dspark_stopping_criteria", default=None
)


def _current_stopping_criteria() -> StoppingCriteriaList | None:
    ref = _STOPPING_CRITERIA.get()
    return None if ref is None else ref()


def in_round_stopping_criteria(criteria) -> StoppingCriteriaList | None:
    """The criteria that can fire inside a committed round and that the assisted loop does not already crop at:
    everything but the length limit and EOS (the loop crops at both itself). None when nothing is left."""
    kept = [c for c in (criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    return StoppingCriteriaList(kept) if kept else None


def first_stop(criteria, candidates: torch.LongTensor, length: int) -> int | None:
    """The first draft position j (1-based) at which ``criteria`` fire on ``candidates[:, :length + j]``, or None.

    ``candidates`` [1, length + k] is the sequence so far followed by k drafts. Criteria are called as the decoding
    loop calls them (``scores=None`` unless scores are recorded; ours never are), once per prefix; the answers are
    gathered on the device and read back once.
    """
    if criteria is None:
        return None
    drafts = candidates.shape[1] - length
    if drafts <= 0:
        return None
    fired = torch.cat([criteria(candidates[:, : length + j], None).reshape(-1)[:1] for j in range(1, drafts + 1)])
    first = int(torch.where(fired.any(), fired.int().argmax() + 1, 0))  # one read: 0 where none fired
    return first or None


def generate_planner(policy: VerificationPolicy, block_size: int, gate: RealizedGate | None,
                 draft_seconds: Callable[[int], float | None]) -> Planner:
    """The planner of one ``generate()`` call: ``policy``'s settings, its one sequence priced by Algorithm 1 at one
    row, the drafter's time from ``draft_seconds``, and ``gate`` (the shared realized gate, when the policy uses one)."""
    settings = dict(online_correction=getattr(policy, "online_correction", True), gate=gate,
                    draft_cost=draft_seconds)
    if policy.needs_sps:
        settings.update(explore=policy.explore_settings, memory=policy.memory_settings)
    return Planner(policy, block_size, "cpu", schedule="prefix", **settings)


def _shared_per_target(drafter, target, attribute: str, factory):
    """One object per (target, device, dtype, thread count), kept on the drafter so that every ``generate()`` call
    with this pair shares it (rounds measured under other conditions say nothing here)."""
    parameter = next(target.parameters())
    key = (str(getattr(target.config, "_name_or_path", "") or type(target).__name__), id(target), str(parameter.device),
           str(parameter.dtype), torch.get_num_threads())
    shared = drafter.__dict__.setdefault(attribute, {})
    if key not in shared:
        shared[key] = factory()
    return shared[key]


def realized_gate_for(drafter, target) -> RealizedGate:
    """The ``RealizedGate`` that ``generate()`` calls with this drafter and this target share."""
    return _shared_per_target(drafter, target, "_dspark_realized_gates", RealizedGate)


def lookup_survival_for(drafter, target) -> LookupSurvival:
    """The prompt-lookup acceptance estimate that ``generate()`` calls with this drafter and target share."""
    return _shared_per_target(drafter, target, "_dspark_lookup_survival",
                              lambda: LookupSurvival(drafter.config.block_size))  # grows to longer drafts


def sps_width(drafter) -> int:
    """The verification widths (drafts plus the anchor) an SPS profile for ``drafter`` must cover: its block or, for
    the hybrid policy, its longest prompt-lookup draft (``generation_config.lookup_max_tokens``), or where it can
    grow token trees, the largest tree (``TREE_NODES``); plus one."""
    widest = max(drafter.config.block_size, lookup_max_tokens(drafter.generation_config))
    if draft_tree_mode(drafter) != "chain" and tree_obstacle(drafter) is None:
        widest = max(widest, TREE_NODES)
    return widest + 1


def _profile_target(target, max_batch_tokens: int):
    """The target's SPS(B) profile for policies that schedule by speed: hf_dspark's cached profile where the package
    is installed, else (the custom_generate route) a quick two-point measurement of this target."""
    try:
        from hf_dspark.profiling import load_or_profile
    except ImportError:  # the custom_generate route without hf_dspark installed
        return _two_point_profile(target, max_batch_tokens)
    return load_or_profile(target, max_batch_tokens)


@torch.no_grad()
def _two_point_profile(target, max_batch_tokens: int, context: int = 64, repeats: int = 3):
    """SPS at B = 1 and B = ``max_batch_tokens``, each the best of ``repeats`` forwards over a ``context``-token
    cache (cropped back after each); the scheduler interpolates between them. Set
    ``generation_config.sps_profile`` to use a fuller profile instead."""
    try:
        from .scheduling import StepsPerSecond
    except ImportError:  # pragma: no cover - loaded as a top-level module
        from scheduling import StepsPerSecond  # type: ignore[no-redef]

    device = next(target.parameters()).device
    ids = torch.zeros(1, context + max_batch_tokens, dtype=torch.long, device=device)
    cache = target(ids[:, :context], use_cache=True).past_key_values
    cache.activate_past_recording()  # sliding-window layers keep what each timed forward adds, so it crops back
    widths, rates = sorted({1, max_batch_tokens}), []
    for width in widths:
        best = float("inf")
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            with packed_attention(target):  # as DSpark-assisted generate() runs its verifications
                target(ids[:, context:context + width], past_key_values=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - started)
            cache.crop(-width)  # drop the tokens this forward appended
        rates.append(1.0 / best)
    if len(rates) == 2:
        rates[1] = min(rates[1], rates[0])  # a wider forward never runs faster: keep the profile non-increasing
    return StepsPerSecond(widths, rates, max_batch_tokens)


# ------------------------------------------------------------------------------------------------------------------
# generate() integration
# ------------------------------------------------------------------------------------------------------------------
def validate_dspark_request(target, drafter, generation_config) -> None:
    """Clear errors for requests the DSpark loop cannot serve (instead of transformers silently ignoring the
    drafter, e.g. under beam search)."""
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"DSpark-assisted generation supports greedy decoding and sampling only, got num_beams="
            f"{generation_config.num_beams}"
        )
    if getattr(target.config, "is_encoder_decoder", False):
        raise ValueError("DSpark drafters serve decoder-only targets")
    refusal = rollback_refusal(target)
    if refusal:
        raise ValueError(f"DSpark-assisted generation cannot serve this target: {refusal}")
    drafter.check_target(target)


def _dspark_validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
    assistant = generation_mode_kwargs.get("assistant_model")
    if is_dspark_drafter(assistant):
        validate_dspark_request(self, assistant, generation_config)
    return _original(GenerationMixin, "_validate_generation_mode")(
        self, generation_mode, generation_config, generation_mode_kwargs
    )


def _dspark_get_candidate_generator(
    self,
    generation_config,
    input_ids,
    inputs_tensor,
    logits_processor,
    model_kwargs,
    assistant_model=None,
    target_tokenizer=None,
    assistant_tokenizer=None,
):
    if is_dspark_drafter(assistant_model):
        return DSparkCandidateGenerator(
            assistant_model, self, generation_config, logits_processor=logits_processor, input_ids=input_ids
        )
    return _original(GenerationMixin, "_get_candidate_generator")(
        self,
        generation_config=generation_config,
        input_ids=input_ids,
        inputs_tensor=inputs_tensor,
        logits_processor=logits_processor,
        model_kwargs=model_kwargs,
        assistant_model=assistant_model,
        target_tokenizer=target_tokenizer,
        assistant_tokenizer=assistant_tokenizer,
    )


def _dspark_assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config,
                              synced_gpus=False, streamer=None, inputs_tensor=None, assistant_model=None, **kwargs):
    """transformers' assisted decoding; with a DSpark drafter its target forwards run under ``packed_attention``
    (a verification forward reads a grouped-query cache in place instead of copying it per query head), the
    generator sees the loop's stopping criteria, and the cached SPS profile is checked against the call's rounds."""
    original = _original(GenerationMixin, "_assisted_decoding")
    if not is_dspark_drafter(assistant_model):
        return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                        synced_gpus=synced_gpus, streamer=streamer, inputs_tensor=inputs_tensor,
                        assistant_model=assistant_model, **kwargs)
    token = _STOPPING_CRITERIA.set(weakref.ref(stopping_criteria))
    trees = not generation_config.do_sample and draft_tree_mode(assistant_model) != "chain"
    try:
        with packed_attention(self), (path_forward(self) if trees else contextlib.nullcontext()):
            out = original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                           synced_gpus=synced_gpus, streamer=streamer, inputs_tensor=inputs_tensor,
                           assistant_model=assistant_model, **kwargs)
    finally:
        _STOPPING_CRITERIA.reset(token)
    if (getattr(assistant_model.generation_config, "sps_profile", None) is None
            and getattr(assistant_model, "last_stats", None) is not None):
        _check_cached_profile(self, assistant_model.last_stats, input_ids.shape[1])
    return out


def _check_cached_profile(target, stats, prompt_length: int) -> None:
    """Let the cached SPS profile learn that this call's rounds contradict it (re-measured at its next use)."""
    try:
        from hf_dspark.profiling import check_against_rounds
    except ImportError:  # the custom_generate route without hf_dspark installed: no cached profile
        return
    try:
        check_against_rounds(target, stats, prompt_length)
    except Exception as err:  # the output is computed: a damaged or contended cache file must not lose it
        logging.getLogger(__name__).warning("could not check the cached SPS profile against this call: %s", err)


# The smallest hook that works: three of GenerationMixin's methods, each passing every other assistant through.
#   _get_candidate_generator   the hook itself: a DSpark drafter gets a DSparkCandidateGenerator (transformers builds
#                              its own generators there, and has no registry for new ones)
#   _assisted_decoding         around the loop, which only it spans: packed attention for the verification forwards,
#                              the stopping criteria for the generator (handed to the loop only), the profile check
#   _validate_generation_mode  refusals before anything runs: under beam search transformers would never build a
#                              candidate generator and would drop the drafter silently
_PATCHES = {
    "_assisted_decoding": _dspark_assisted_decoding,
    "_get_candidate_generator": _dspark_get_candidate_generator,
    "_validate_generation_mode": _dspark_validate_generation_mode,
}
_ORIGINAL_PREFIX = "_hf_dspark_original"


def _original(owner, name: str):
    return getattr(owner, f"{_ORIGINAL_PREFIX}{name}", None) or getattr(GenerationMixin, name)


def install_generate_dispatch() -> None:
    """Route DSpark drafters in ``GenerationMixin.generate`` (idempotent). Other assistants are untouched."""
    for name, patch in _PATCHES.items():
        current = GenerationMixin.__dict__[name]
        if getattr(current, "_hf_dspark_patch", False):
            continue
        setattr(GenerationMixin, f"{_ORIGINAL_PREFIX}{name}", current)
        patch._hf_dspark_patch = True
        setattr(GenerationMixin, name, patch)


@contextlib.contextmanager
def dspark_dispatch(model):
    """Install the dispatch on one model instance only, for the duration of a call (the custom_generate route)."""
    names = [n for n in _PATCHES if n not in model.__dict__]
    for name in names:
        setattr(model, name, types.MethodType(_PATCHES[name], model))
    try:
        yield model
    finally:
        for name in names:
            model.__dict__.pop(name, None)


def generate(model, *args, **kwargs):
    """``custom_generate`` entry point: ``target.generate(..., assistant_model=drafter, custom_generate=folder,
    trust_remote_code=True)`` lands here and runs transformers' assisted decoding with the DSpark generator."""
    if not is_dspark_drafter(kwargs.get("assistant_model")):
        raise ValueError("this custom_generate expects `assistant_model` to be a DSpark drafter")
    with dspark_dispatch(model), packed_attention(model):  # the class-level _assisted_decoding runs here
        return GenerationMixin.generate(model, *args, **kwargs)


__all__ = [
    "DSparkCandidateGenerator",
    "DSparkRound",
    "VERIFICATION_WIDTHS",
    "dspark_dispatch",
    "first_stop",
    "generate",
    "in_round_stopping_criteria",
    "install_generate_dispatch",
    "is_dspark_drafter",
    "lookup_survival_for",
    "realized_gate_for",
    "validate_dspark_request",
    "verification_records_graphs",
    "verification_width_mode",
]
