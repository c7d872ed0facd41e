"""The planner: for a set of rows, which source drafts each row this round and how many drafts the target verifies.

``generate()`` asks it with one row (``DSparkCandidateGenerator``), the batched engine with its R rows
(``DSparkEngine.step``); every decision to draft or not, of a free source's offer against the drafter's block, of the
verification lengths, and every skip reason lives here, over the rule pieces of ``scheduling`` (Algorithm 1, the
pay-off rule, the survival correction, the confidence memory) and the realized gate of ``gate``.

Each round the caller describes its rows (``RowState``: the block's cap, the row's confidence memory, its tokens for
the free sources), then:

1. ``plan(rows, table)``: the offers that replace a row's block, the rows that draft a block, the top-K capacity;
2. after the block is drafted, ``lengths(plan, block_confidences, table)``: the drafts each row verifies;
3. after verification, ``observe(plan, block_confidences, lengths, accepted)`` and ``observe_offer``.

Every decision reads earlier rounds only (confidences of previous drafts, timings of previous rounds, the rows' own
tokens), never the target's verdict on the drafts being verified, so none can change the output.

This file is self-contained (torch + its siblings ``draft_sources``, ``gate`` and ``scheduling``): exported drafter
folders carry it in ``custom_generate/``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

try:  # inside the hf_dspark package, or a custom_generate/ folder carrying its siblings next to this file
    from .draft_sources import DRAFT_SOURCES, Draft
    from .gate import EXPLORE_BUDGET, RealizedGate
    from .budget import BatchShare, chain_rate, tree_schedule
    from .scheduling import (
        ConfidenceMemory,
        OnlineSurvivalCorrection,
        VerificationPolicy,
        capped_confidences,
        drafting_pays,
        dynamic_topk_capacity,
        expected_round,
        on_host,
        schedule_batch,
    )
except ImportError:  # pragma: no cover - loaded as a top-level module
    from draft_sources import DRAFT_SOURCES, Draft  # type: ignore[no-redef]
    from gate import EXPLORE_BUDGET, RealizedGate  # type: ignore[no-redef]
    from budget import BatchShare, chain_rate, tree_schedule  # type: ignore[no-redef]
    from scheduling import (  # type: ignore[no-redef]
        ConfidenceMemory,
        OnlineSurvivalCorrection,
        VerificationPolicy,
        capped_confidences,
        drafting_pays,
        dynamic_topk_capacity,
        expected_round,
        on_host,
        schedule_batch,
    )

# Why a round that could draft did not (``Planner.skips`` counts them).
SKIP_REASONS = ("gate", "cannot_pay", "cost", "no_budget", "gate_rows")


class RowState(NamedTuple):
    """One row as the planner sees it this round: ``cap``, the most block drafts it may verify (its block within its
    remaining length; 0: only the target's own token fits); ``memory``, its confidence memory (policies priced by
    SPS); ``tokens``, a callable returning its sequence [L] for the free sources to draft from (called only when
    a source may offer); ``offer_cap``, the most drafts an offer may hold (0: no offer this round)."""

    cap: int
    memory: ConfidenceMemory | None = None
    tokens: Callable[[], torch.Tensor] | None = None
    offer_cap: int = 0


class Plan(NamedTuple):
    """A round's plan: each row's cap, whether the round is representative for the realized gate, the rows verifying
    a free source's offer (row -> offer), the rows drafting a block, the top-K capacity the block rows share, and the
    memories of the rows (observed after verification)."""

    caps: list[int]
    representative: bool
    offers: dict[int, Draft]
    drafting: list[int]
    capacity: int | None
    memories: list[ConfidenceMemory | None]


class Planner:
    """Decides for the rows of each round, by ``policy`` (None: plain decoding).

    A policy priced by the SPS curve (``needs_sps``: the scheduler, the hybrid) shares each round's verification
    budget by Algorithm 1 (``schedule``: ``"prefix"``, ``"padded"`` for a padded batch, ``"topk"``) over the caller's
    SPS table, and skips drafting where earlier rounds predict it would not pay: the rows' smoothed confidences give
    a zero budget (until a probe is due), or with ``cost_aware`` the predicted gain does not cover ``draft_cost(rows)``
    (the drafter's measured seconds for that many rows, None until measured), each side scaled by
    ``model_factors(rows)`` (what the caller's rounds delivered against the prediction; 1 by default). With a
    ``gate`` (a ``RealizedGate``; the engine's ``EngineMeasurements`` is one) it also asks the realized gate, with
    ``explore`` its (interval, max interval, budget). Any other policy drafts every row that has room and verifies
    what its ``verify_lengths`` says.

    ``online_correction``: rescale survivals by the acceptance observed so far (``OnlineSurvivalCorrection``).
    ``memory``: the (probe_interval, max_probe_interval, smoothing) of the rows' ``ConfidenceMemory``
    (``new_memory``). ``skips``: a dict the skip reasons are counted in (the engine's stats)."""

    def __init__(self, policy: VerificationPolicy | None, block_size: int, device: torch.device | str = "cpu", *,
                 schedule: str = "prefix", cost_aware: bool = True, online_correction: bool = True,
                 gate: RealizedGate | None = None, explore: tuple[int, int, float] = (16, 256, EXPLORE_BUDGET),
                 draft_cost: Callable[[int], float | None] | None = None,
                 model_factors: Callable[[int], tuple[float, float]] | None = None,
                 memory: tuple[int, int, float] = (4, 64, 0.1), skips: dict[str, int] | None = None):
        self.policy, self.block_size, self.device = policy, block_size, torch.device(device)
        self.scheduled = policy is not None and policy.needs_sps
        self.schedule, self.cost_aware = schedule, cost_aware
        self.skip_drafting = bool(getattr(policy, "skip_drafting", True))
        self.gate = gate if self.scheduled else None
        self.explore = explore
        self.draft_cost = draft_cost or (lambda rows: None)
        self.model_factors = model_factors or (lambda rows: (1.0, 1.0))
        self.memory_settings = memory
        self.correction = OnlineSurvivalCorrection(block_size) if online_correction and self.scheduled else None
        names = () if policy is None else policy.draft_sources
        self.sources = {name: DRAFT_SOURCES[name].from_policy(policy) for name in names}
        self.max_verify = getattr(policy, "max_verify", None)
        self.skips = {} if skips is None else skips
        self.prediction: tuple[float, float] | None = None  # the cost model's (tokens, seconds) for this round
        self.gate_ruled_out = False  # this round's drafting was ruled out by the realized gate alone
        self._certain = None  # (table, caps, whether certain drafts of every row pay): _certain_drafts_pay
        self._stale = None  # (table, key, smoothed confidences, prediction): _stale_prediction

    @property
    def realized_gate(self) -> bool:
        return self.gate is not None

    def new_memory(self, prior: torch.Tensor | None = None) -> ConfidenceMemory | None:
        """A row's confidence memory (None where the policy is not priced by SPS), starting from ``prior``."""
        return ConfidenceMemory(*self.memory_settings, prior) if self.scheduled else None

    # --------------------------------------------------------------------------------------------------------------
    # The round's plan
    # --------------------------------------------------------------------------------------------------------------
    def plan(self, rows: Sequence[RowState], table: torch.Tensor | None, representative: bool = True,
             catch_up: Callable[[Sequence[int]], float] | None = None) -> Plan:
        """Which rows verify an offer and which draft a block this round. ``table``: the SPS table at these rows and
        their context (None for a policy not priced by SPS); ``representative``: whether the round is like most for
        the realized gate; ``catch_up(rows)``: the seconds a drafting round would first spend bringing those rows'
        drafter context up to date (0 by default). Under the realized gate a round with offers counts as a drafting
        round (both verify speculative tokens), so offers wait while the gate rules drafting out: the gate judges
        every source by what its rounds deliver, not the block alone."""
        caps = [min(row.cap, self.max_verify) if self.max_verify is not None else row.cap for row in rows]
        memories = [row.memory for row in rows]
        plan = Plan(caps, representative, {}, [], None, memories)
        self.prediction, self.gate_ruled_out = None, False
        catch_up = catch_up or (lambda chosen: 0.0)
        offers = self._offers(rows, caps, table, representative, catch_up) if self._speculation_open(
            plan, catch_up) else {}
        block_caps = [0 if i in offers else cap for i, cap in enumerate(caps)] if offers else caps
        capacity = self._topk_capacity(plan, block_caps, table) if self.scheduled and self.schedule == "topk" else None
        plan = plan._replace(offers=offers, capacity=capacity)
        return plan._replace(drafting=self._drafting_rows(plan, block_caps, table, catch_up))

    def _speculation_open(self, plan: Plan, catch_up) -> bool:
        """Whether the realized gate lets this round verify speculative tokens at its number of rows (True without
        the gate, or without free sources to offer). Reads the gate's verdict without changing it."""
        if not (self.sources and self.gate is not None):
            return True
        return self.gate.drafting_verdict(len(plan.caps), *self.explore, plan.representative)[0]

    # --------------------------------------------------------------------------------------------------------------
    # Free sources: offers that replace a row's block this round
    # --------------------------------------------------------------------------------------------------------------
    def _offers(self, rows: Sequence[RowState], caps: list[int], table: torch.Tensor, representative: bool,
                catch_up) -> dict[int, Draft]:
        """The rows whose free source (the policy's ``draft_sources``, e.g. prompt lookup) offers drafts worth
        verifying, with the offers: each row takes its first source with an offer, priced as Algorithm 1 prices a
        block (the offer's confidences with the rows' SPS table; top-K prices as ``"prefix"``); an offer that gets a
        length there replaces the row's block. At one row the block is priced too, from the row's smoothed past
        confidences and the drafter's measured time: the offer goes first unless the block is predicted to pay
        more (in a batch the block's rate is the batch's, not a row's, and offers take their rows)."""
        if not self.sources:
            return {}
        found = {}
        for i, (row, cap) in enumerate(zip(rows, caps)):
            if cap > 0 and row.offer_cap > 0 and row.tokens is not None:
                offer = self.best_offer(row.tokens(), row.offer_cap, table)
                if offer is not None:
                    found[i] = offer
        if not found:
            return {}
        empty = torch.zeros(len(caps), self._offer_width(found), device=self.device)
        confidences, offer_caps = self.with_offers(empty, [0] * len(caps), found)
        worth = schedule_batch(confidences, offer_caps, table, self._pricing_schedule()).tolist()
        offers = {i: offer for i, offer in found.items() if worth[i] > 0}
        if len(caps) == 1 and offers and self._block_beats_offer(rows[0], caps[0], offers[0], worth[0], table):
            return {}
        return offers

    def _offer_width(self, found: dict[int, Draft]) -> int:
        return max(self.block_size, *(offer.num_tokens for offer in found.values()))

    def best_offer(self, token_ids: torch.Tensor, cap: int, table: torch.Tensor) -> Draft | None:
        """The row's offer from its sources: the only one, or among several the one expected to deliver the most
        tokens per second verified alone (``_offer_rate``)."""
        offers = [offer for offer in (source.propose(token_ids, cap) for source in self.sources.values())
                  if offer is not None and offer.num_tokens > 0]
        if len(offers) < 2:
            return offers[0] if offers else None
        return max(offers, key=lambda offer: self._offer_rate(offer, table))

    def _offer_rate(self, offer: Draft, table: torch.Tensor) -> float:
        """Expected tokens per second of verifying ``offer`` alone: Algorithm 1's length over its confidences, 0
        where it gives none."""
        confidences = on_host(offer.confidences.float())
        length = int(schedule_batch(confidences, torch.tensor([offer.num_tokens]), table, "prefix")[0])
        if length == 0:
            return 0.0
        tokens, seconds = expected_round(confidences, [length], table)
        return tokens / seconds

    def _block_beats_offer(self, row: RowState, cap: int, offer: Draft, length: int, table: torch.Tensor) -> bool:
        """One row: whether the block's predicted tokens per second (its smoothed past confidences, the drafter's
        measured time) beat the offer's at ``length``. Not when nothing predicts the block yet or a probe of it is
        due: the block's own rounds are what teach the prediction, and it is probed on a round without an offer."""
        cost = self.draft_cost(1) if self.cost_aware else None
        memory = row.memory
        if cost is None or memory is None or memory.smoothed is None or memory.probe_due:
            return False
        tokens, seconds = expected_round(on_host(offer.confidences.float()), [length], table)
        stale_plan = Plan([cap], True, {}, [], None, [memory])
        prediction = self._stale_prediction(stale_plan, [cap], torch.tensor([cap], device=self.device), table)
        if prediction[2][0] == 0:
            return False
        block_tokens, block_seconds = self._expected(prediction, table)
        return block_tokens / (block_seconds + cost) > tokens / seconds

    @staticmethod
    def with_offers(confidences: torch.Tensor, caps: list[int],
                    offers: dict[int, Draft]) -> tuple[torch.Tensor, torch.Tensor]:
        """``confidences`` [R, g] and ``caps`` with each offer row's estimates and draft length in place."""
        caps = list(caps)
        for i, offer in offers.items():
            confidences[i] = 0.0
            confidences[i, : offer.num_tokens] = offer.confidences[0].to(confidences.device)
            caps[i] = offer.num_tokens
        return confidences, torch.tensor(caps, device=confidences.device)

    def observe_offer(self, offer: Draft, verified: int, accepted: int) -> None:
        """What the target made of a row's offer (its own tokens), for the source that made it."""
        self.sources[offer.source].observe(offer, verified, accepted)

    # --------------------------------------------------------------------------------------------------------------
    # Which rows draft a block
    # --------------------------------------------------------------------------------------------------------------
    def _drafting_rows(self, plan: Plan, caps: list[int], table: torch.Tensor | None, catch_up) -> list[int]:
        """Rows that draft a block this round. A policy not priced by SPS drafts every row it would verify drafts of
        (when it decides without confidences, rows it gives a zero length skip drafting). Priced by SPS: a row whose
        earlier confidences predict a zero budget skips drafting until its next probe; with ``cost_aware`` the rows
        predicted to verify drafts skip drafting too when the predicted gain does not cover the drafter's measured
        cost (until one of them is due for a probe, which also refreshes the cost)."""
        if self.policy is None:
            return []
        candidates = [i for i, cap in enumerate(caps) if cap > 0]
        if not self.scheduled:
            if self.policy.needs_confidences:
                return candidates
            return [i for i in candidates if self._policy_lengths(None, [caps[i]])[0] > 0]
        if not candidates:
            return candidates
        return self._scheduled_rows(plan, caps, candidates, table, catch_up)

    def _scheduled_rows(self, plan: Plan, caps: list[int], candidates: list[int], table: torch.Tensor,
                        catch_up) -> list[int]:
        num_rows, gate = len(caps), self.gate
        if gate is not None and not gate.drafting_verdict(num_rows, *self.explore, plan.representative,
                                                          catch_up(candidates))[0]:
            # The realized gate rules drafting out at this many rows whichever rows would draft (the gate, asked
            # below only once rows are chosen, would refuse them): skip the confidences and schedules.
            self.gate_ruled_out = True
            return self._skip("gate")
        if not self.skip_drafting:
            return self._gated(plan, candidates, catch_up)
        cap_tensor = torch.tensor(caps, device=self.device)
        if not self._certain_drafts_pay(caps, cap_tensor, table):
            return self._skip("cannot_pay")  # not even certain drafts would be verified at this many rows
        prediction = self._stale_prediction(plan, caps, cap_tensor, table)
        stale, known, lengths, _ = prediction
        worth = [i for i in candidates if known[i] and lengths[i] > 0]
        due = [i for i in candidates if not known[i] or plan.memories[i].probe_due]  # new rows, and probes
        if worth and not due and self.cost_aware and not self._pays(self._expected(prediction, table), table, num_rows, len(worth)):
            return self._skip("cost")
        chosen = sorted(set(worth) | set(due))
        if not chosen:
            return self._skip("no_budget")  # every row's confidences predict a zero budget, and no probe is due
        if due and self.cost_aware:
            # Probes and new rows draft whatever the model says, but its prediction for the round is still checked
            # against what the round delivers: checked only on the rounds it chose to draft (those whose stale
            # confidences looked best), its drafting side would learn only its own optimism (a winner's curse: the
            # next drafts fall back toward the mean) and, its factor pulled down, skip drafting for long stretches.
            self._pays(self._expected(prediction, table), table, num_rows, len(chosen), keep_prediction=True)
        if len(chosen) < num_rows and not self.drafts_can_pay(cap_tensor, table, chosen):
            # Even if these rows' drafts were certain, the padded batch would not verify them (one row's draft
            # widens every row): wait until enough rows draft together (probes wait too; unknown rows stay due).
            return self._skip("cannot_pay")
        return self._gated(plan, chosen, catch_up)

    def _gated(self, plan: Plan, chosen: list[int], catch_up) -> list[int]:
        """``chosen``, where the realized gate (if any) lets them draft now (this is where its state moves)."""
        if self.gate is not None and not self.gate.drafting_allowed(len(plan.caps), *self.explore,
                                                                     plan.representative, catch_up(chosen)):
            return self._skip("gate_rows")
        return chosen

    def _skip(self, reason: str) -> list[int]:
        """A round that drafts nothing although some rows could: counted by ``reason`` in ``skips``."""
        self.skips[reason] = self.skips.get(reason, 0) + 1
        return []

    def _certain_drafts_pay(self, caps: list[int], cap_tensor: torch.Tensor, table: torch.Tensor) -> bool:
        """``drafts_can_pay`` for every row, kept while the table and the caps stay the same (most rounds)."""
        cached = self._certain
        if cached is not None and cached[0] is table and cached[1] == caps:
            return cached[2]
        pays = self.drafts_can_pay(cap_tensor, table)
        self._certain = (table, list(caps), pays)
        return pays

    def _stale_prediction(self, plan: Plan, caps: list[int], cap_tensor: torch.Tensor, table: torch.Tensor):
        """What the rows' smoothed past confidences (corrected) predict for a block drafted this round:
        ``(stale [R, g], known, lengths, (tokens, verify seconds))``. It changes only when a block round updates a
        memory or the correction, or the table or the caps change, so the rounds in between reuse it (one sequence
        skipping drafting reads nothing new)."""
        smoothed = [None if memory is None else memory.smoothed for memory in plan.memories]
        key = (list(caps), plan.capacity, None if self.correction is None else self.correction.predicted)
        cached = self._stale
        if (cached is not None and cached[0] is table and cached[1][:2] == key[:2] and cached[1][2] is key[2]
                and len(cached[2]) == len(smoothed) and all(a is b for a, b in zip(cached[2], smoothed))):
            return cached[3]
        stale, known = self.stale_confidences(plan.memories, smoothed=True)
        lengths = schedule_batch(stale, cap_tensor, table, self.schedule, plan.capacity).tolist()
        prediction = [stale, known, lengths, None]  # the expected round is computed when first asked (``_expected``)
        self._stale = (table, key, smoothed, prediction)
        return prediction

    def _expected(self, prediction: list, table: torch.Tensor) -> tuple[float, float]:
        """The stale prediction's expected round (tokens, verify seconds), computed once per prediction."""
        if prediction[3] is None:
            prediction[3] = expected_round(prediction[0], prediction[2], table, padded=self.schedule == "padded")
        return prediction[3]

    def _corrected(self, confidences: torch.Tensor) -> torch.Tensor:
        return confidences if self.correction is None else self.correction.correct(confidences)

    def corrected(self, confidences: torch.Tensor) -> torch.Tensor:
        """One row's block confidences [g] with the survival correction applied (as the schedule prices them)."""
        return self._corrected(confidences.float()[None].to(self.device))[0]

    def stale_confidences(self, memories: Sequence[ConfidenceMemory | None],
                          smoothed: bool = False) -> tuple[torch.Tensor, list[bool]]:
        """Each row's confidences from its last drafting round [R, g] (zeros where unknown), corrected, and which
        are known; ``smoothed``: the moving average of its drafts' confidences instead (the skip decisions)."""
        values = [None if memory is None else memory.smoothed if smoothed else memory.last for memory in memories]
        known = [value is not None for value in values]
        stale = torch.stack([on_host(value.float()) if value is not None else torch.zeros(self.block_size)
                             for value in values])
        return self._corrected(stale).to(self.device), known

    def _topk_capacity(self, plan: Plan, caps: list[int], table: torch.Tensor) -> int:
        """Dynamic top-K capacity from the rows' previous confidences (none from this round); unknown rows count as
        the known ones' mean, or as fully confident when none is known."""
        stale, known = self.stale_confidences(plan.memories)
        known_rows = torch.tensor(known, device=stale.device)
        prior = stale[known_rows].mean(dim=0) if any(known) else torch.ones_like(stale[0])
        filled = torch.where(known_rows[:, None], stale, prior)
        capped = capped_confidences(filled, torch.tensor(caps, device=stale.device))
        return dynamic_topk_capacity(capped.cpu(), table.cpu())

    def _pricing_schedule(self) -> str:
        """The schedule that prices whether drafts can pay: the planner's, top-K priced as ``"prefix"`` (it pays
        R + K tokens)."""
        return "prefix" if self.schedule == "topk" else self.schedule

    def drafts_can_pay(self, caps: torch.Tensor, table: torch.Tensor, rows: list[int] | None = None) -> bool:
        """Whether Algorithm 1 would verify anything at this many rows if the drafts of ``rows`` (default: every
        row) were certain (confidences 1 within the caps, the other rows not drafting). When not, drafting those
        rows is pointless whatever the drafter says (the batch is too large for verification to pay on this
        hardware), and they skip even their probes."""
        if rows is None:
            certain = torch.ones(caps.shape[0], self.block_size, device=self.device)
        else:
            certain = torch.zeros(caps.shape[0], self.block_size, device=self.device)
            certain[list(rows)] = 1.0
        return bool(schedule_batch(certain, caps, table, self._pricing_schedule()).any())

    def drafting_pays(self, stale: torch.Tensor, predicted: list[int], table: torch.Tensor, rows: int,
                      keep_prediction: bool = False) -> bool:
        """Whether drafting ``rows`` rows is expected to beat plain decoding this round (``drafting_pays``), from
        the stale prediction (``predicted`` lengths, survivals of ``stale`` confidences: ``expected_round``) and the
        drafter's measured cost, each side's expected rate scaled by ``model_factors``. When it says "draft" (or
        ``keep_prediction``: the round drafts anyway), its prediction (tokens, seconds) is kept in ``prediction``
        for the caller to check against what the round delivers."""
        expected = expected_round(stale, predicted, table, padded=self.schedule == "padded")
        return self._pays(expected, table, stale.shape[0], rows, keep_prediction)

    def _pays(self, expected: tuple[float, float], table: torch.Tensor, num_rows: int, rows: int,
              keep_prediction: bool = False) -> bool:
        """``drafting_pays`` from the stale prediction's ``expected`` (tokens, verify seconds) at ``num_rows``."""
        self.prediction = None
        cost = self.draft_cost(rows)
        if cost is None:
            return True  # not measured yet: draft, and measure
        tokens, verify_seconds = expected
        pays = drafting_pays(tokens, verify_seconds, cost, num_rows * float(table[num_rows]),
                             *self.model_factors(num_rows))
        self.prediction = (tokens, verify_seconds + cost) if pays or keep_prediction else None
        return pays

    # --------------------------------------------------------------------------------------------------------------
    # How many drafts each row verifies, and what the rows learn from the verdict
    # --------------------------------------------------------------------------------------------------------------
    def lengths(self, plan: Plan, block_confidences: torch.Tensor | None, table: torch.Tensor | None) -> list[int]:
        """Drafts each row verifies: the policy's ``verify_lengths`` over the drafting rows, or, priced by SPS, the
        round's shared budget (Algorithm 1 by ``schedule`` over the corrected confidences [D, g] of the drafting
        rows' block, offers in place)."""
        caps, offers, drafting = plan.caps, plan.offers, plan.drafting
        lengths = [0] * len(caps)
        if not drafting and not offers:
            return lengths
        if not self.scheduled:
            chosen = self._policy_lengths(block_confidences, [caps[i] for i in drafting])
            for i, length in zip(drafting, chosen):
                if not 0 <= length <= caps[i]:
                    raise ValueError(f"verification policy {self.policy.name!r} returned {length}, outside "
                                     f"[0, {caps[i]}]")
                lengths[i] = length
            return lengths
        width = self._offer_width(offers) if offers else self.block_size
        confidences = torch.zeros(len(caps), width, device=self.device)
        if drafting:
            current = self._corrected(block_confidences.float().to(self.device))
            confidences[torch.tensor(drafting, device=self.device), : current.shape[1]] = current
        confidences, cap_tensor = self.with_offers(confidences, caps, offers)
        return schedule_batch(confidences, cap_tensor, table, self.schedule, plan.capacity).tolist()

    def tree_round(self, tree, confidences: torch.Tensor | None, chain_length: int, table: torch.Tensor | None,
                   always: bool = False, branch: Draft | None = None, share: BatchShare = BatchShare()):
        """The token tree one sequence verifies this round instead of its chain's first ``chain_length`` drafts, or
        None for the chain. Each node's survival is corrected like the chain's (the survival correction's factor at
        its depth, never above its parent's); a free source's ``branch`` (its offer, priced by its own confidences)
        is grafted on; the nodes are admitted by ``tree_schedule``, and the tree is taken where it holds a node off
        the chain and its expected rate beats the chain's. ``always``: every round, with at least one node more
        than the chain (within the tree and ``max_verify``). ``share``: the rest of the batch the row's round is
        priced within (alone by default). Needs a policy priced by SPS."""
        if table is None or tree.size == 0:
            return None
        tree = tree.ranked(self._corrected_survival(tree))
        if branch is not None and branch.confidences is not None:
            tree = tree.graft(branch.token_ids[0], branch.confidences[0].float())
        nodes, rate = tree_schedule(tree.survival, table, share)
        if self.max_verify is not None:
            nodes = min(nodes, self.max_verify)
        if always:
            nodes = max(nodes, min(chain_length + 1, tree.size, self.max_verify or tree.size))
            return tree.prefix(nodes) if nodes else None
        if nodes == 0 or tree.prefix(nodes).is_chain():
            return None
        chain = chain_rate(self.corrected(confidences), chain_length, table, share) \
            if confidences is not None else 0.0
        return tree.prefix(nodes) if rate > chain else None

    def _corrected_survival(self, tree) -> torch.Tensor:
        """The tree's survival with the survival correction's per-depth factors, never above a node's parent's."""
        if self.correction is None:
            return tree.survival
        factors = self.correction.factors().float()
        survival = (tree.survival * factors[(tree.depths - 1).clamp(max=factors.shape[0] - 1)]).clamp(max=1.0)
        values = survival.tolist()
        for i, parent in enumerate(tree.parents.tolist()):
            if parent >= 0 and values[i] > values[parent]:
                values[i] = values[parent]
        return torch.tensor(values)

    def _policy_lengths(self, confidences: torch.Tensor | None, caps: list[int]) -> list[int]:
        """A policy not priced by SPS: its lengths for rows with these caps (one row: its per-row rule, which for a
        fixed length reads no tensor)."""
        if len(caps) == 1:
            return [int(self.policy.num_to_verify(None if confidences is None else confidences[0], caps[0]))]
        return self.policy.verify_lengths(confidences, torch.tensor(caps)).tolist()

    def observe(self, plan: Plan, block_confidences: torch.Tensor | None, lengths: list[int],
                accepted: list[int]) -> None:
        """After verification: each row's confidence memory (a block round, or a round without one), and the
        survival correction's record of what the verified prefixes of the block delivered."""
        block_row = {i: k for k, i in enumerate(plan.drafting)}
        confidences = None if block_confidences is None else on_host(block_confidences.detach().float())
        for i, memory in enumerate(plan.memories):
            if memory is None:
                continue
            k = block_row.get(i)
            if k is not None and confidences is not None:
                memory.drafted(confidences[k], lengths[i])
            else:
                memory.skipped()
        if self.correction is not None and confidences is not None and plan.drafting:
            index = torch.tensor(plan.drafting)  # raw survivals: the factors map the drafter's own to the observed
            self.correction.observe(capped_confidences(confidences, torch.tensor(plan.caps)[index]),
                                    torch.tensor(lengths)[index], torch.tensor(accepted)[index])


__all__ = ["Plan", "Planner", "RowState", "SKIP_REASONS"]
