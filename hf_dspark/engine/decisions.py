"""The engine's drafting decisions: which rows draft a block this step, which verify a free source's offer instead,
and how many drafts each row verifies (``DraftingDecisions``).

Every decision reads earlier steps only (confidences of previous drafts, timings of previous steps, the rows' own
tokens), never the target's verdict on the drafts being verified, so none can change the output. The rules shared
with ``generate()`` live in ``hf_dspark.scheduling``: the verification policy (``verify_lengths``), a request's
confidence memory and probe clock (``ConfidenceMemory``), and whether drafting pays (``expected_round``,
``drafting_pays``); the free sources are in ``hf_dspark.draft_sources``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..draft_sources import DRAFT_SOURCES, Draft
from ..scheduling import (
    OnlineSurvivalCorrection,
    VerificationPolicy,
    drafting_pays,
    dynamic_topk_capacity,
    expected_round,
)
from .config import EngineConfig
from .measurements import EngineMeasurements, rows_bucket
from .pricing import VerifyPricing
from .requests import Batch, EngineStats
from .verification import capped_confidences, schedule_batch


class StepPlan(NamedTuple):
    """What a step's decisions start from: each row's cap on drafts (its block, within its remaining tokens) and
    whether the step is representative for the realized gate."""

    caps: list[int]
    representative: bool


class Choice(NamedTuple):
    """What a step drafts: the rows verifying a free source's offer (row -> offer), the rows drafting a block, and
    the top-K capacity the block rows share (schedule ``"topk"``)."""

    offers: dict[int, Draft]
    drafting: list[int]
    capacity: int | None


class DraftingDecisions:
    """Decides, for the rows of ``batch``, by ``policy`` (None: plain decoding). A policy priced by the SPS curve
    (``needs_sps``: the scheduler, the hybrid) shares each step's verification budget by Algorithm 1 over
    ``pricing``'s tables, and skips drafting where earlier steps predict it would not pay; any other policy drafts
    every row that has room and verifies what its ``verify_lengths`` says."""

    def __init__(self, config: EngineConfig, policy: VerificationPolicy | None, batch: Batch,
                 pricing: VerifyPricing | None, measurements: EngineMeasurements, stats: EngineStats,
                 block_size: int, device: torch.device):
        self.config = config
        self.policy = policy
        self.batch = batch
        self.pricing = pricing
        self.measurements = measurements
        self.stats = stats
        self.block_size = block_size
        self.device = device
        self.scheduled = policy is not None and policy.needs_sps
        self.realized_gate = config.realized_gate and config.cost_aware and self.scheduled
        self.correction = (OnlineSurvivalCorrection(block_size)
                           if config.online_correction and self.scheduled else None)
        names = () if policy is None else policy.draft_sources
        self.sources = {name: DRAFT_SOURCES[name].from_policy(policy) for name in names}
        self.prediction: tuple[float, float] | None = None  # the cost model's (tokens, seconds) for this step
        self.gate_ruled_out = False  # this step's drafting was ruled out by the realized gate alone

    # --------------------------------------------------------------------------------------------------------------
    # The step's plan
    # --------------------------------------------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """Caps and representativeness of this step (the SPS table of a first batch size is profiled here, before
        the step's timing starts)."""
        rows = self.batch.rows
        if self.scheduled:
            self.pricing.profiled_table(len(rows))  # a first profile (cached afterwards) is not part of a step's time
        return StepPlan([min(self.block_size, request.remaining - 1) for request in rows], self.representative())

    def choose(self, plan: StepPlan) -> Choice:
        """Which rows verify an offer (``offers``) and which draft a block (``drafting_rows``, over the rows left).
        Under the realized gate a step with offers counts as a drafting step (both verify speculative tokens, and
        both widen every row of the padded batch), so offers wait while the gate rules drafting out at this batch
        size: the gate then judges every source by what its steps deliver, not the block alone."""
        offers = self.offers(plan.caps) if self.speculation_open(plan) else {}
        caps = [0 if i in offers else cap for i, cap in enumerate(plan.caps)] if offers else plan.caps
        capacity = self.topk_capacity(caps) if self.scheduled and self.config.schedule == "topk" else None
        return Choice(offers, self.drafting_rows(caps, capacity, plan.representative), capacity)

    def speculation_open(self, plan: StepPlan) -> bool:
        """Whether the realized gate lets this step verify speculative tokens at its batch size (True without the
        gate, or before the policy has free sources to offer). Reads the gate's verdict without changing it."""
        if not (self.sources and self.realized_gate):
            return True
        config, rows = self.config, len(plan.caps)
        return self.measurements.drafting_verdict(rows, config.explore_interval, config.max_explore_interval,
                                                  config.explore_budget, plan.representative)[0]

    def representative(self) -> bool:
        """Whether this step is like most for the realized gate: not one where most requests take their first step
        after the prompt. Those drafts are accepted about twice as often (SmolLM2's embedded drafter at 16 requests:
        73% of first drafted tokens against 30-56% later, a response's opening being the most predictable text), so
        a drafting verdict measured on them, two rounds, says "draft" where later steps lose. Nor do they enter the
        gate's windows: a re-measurement that drafted through a batch's first step would be judged on it."""
        rows = self.batch.rows
        return not rows or 2 * sum(len(request.tokens) <= 1 for request in rows) < len(rows)

    # --------------------------------------------------------------------------------------------------------------
    # Free sources: offers that replace a row's block this step
    # --------------------------------------------------------------------------------------------------------------
    def offers(self, caps: list[int]) -> dict[int, Draft]:
        """The rows whose free source (the policy's ``draft_sources``, e.g. prompt lookup) offers drafts worth
        verifying this step, with the offers: each row takes its first source with an offer, priced as the scheduler
        prices a block (the offer's confidences through Algorithm 1 with the batch's SPS curve; top-K prices as
        ``"prefix"``); an offer that gets a length there replaces the row's block this step. Only the row's own
        tokens and earlier rounds decide, never the target's verdict on these drafts."""
        if not self.sources:
            return {}
        found = {}
        for i, (request, cap) in enumerate(zip(self.batch.rows, caps)):
            if cap > 0:
                ids = torch.tensor(request.prompt_ids + request.tokens)
                found.update({i: offer for offer in self._first_offer(ids, cap)})
        if not found:
            return {}
        empty = torch.zeros(len(caps), self.block_size, device=self.device)
        confidences, offer_caps = self.with_offers(empty, [0] * len(caps), found)
        worth = schedule_batch(confidences, offer_caps, self.pricing.sps_table(len(caps)), self._pricing_schedule())
        return {i: offer for i, offer in found.items() if worth[i] > 0}

    def _first_offer(self, token_ids: torch.Tensor, cap: int) -> list[Draft]:
        for source in self.sources.values():
            offer = source.propose(token_ids, cap)
            if offer is not None:
                return [offer]
        return []

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
        """What the target made of a row's offer, for the source that made it."""
        self.sources[offer.source].observe(offer, verified, accepted)

    # --------------------------------------------------------------------------------------------------------------
    # Which rows draft a block
    # --------------------------------------------------------------------------------------------------------------
    def drafting_rows(self, caps: list[int], capacity: int | None, representative: bool | None = None) -> list[int]:
        """Rows that draft a block this step. A policy not priced by SPS drafts every row it would verify drafts of
        (when it decides without confidences, rows it gives a zero length skip drafting). Under the scheduler, a
        request whose earlier confidences predict a zero budget skips drafting (its draft could not be verified)
        until its next probe; and with ``cost_aware`` the requests predicted to verify drafts skip drafting too when
        the predicted gain does not cover the drafter's measured cost (until one of them is due for a probe, which
        also refreshes the cost). ``representative``: this step's (``plan``), computed here when not given."""
        self.prediction = None
        self.gate_ruled_out = False
        if self.policy is None:
            return []
        candidates = [i for i, cap in enumerate(caps) if cap > 0]
        if not self.scheduled:
            if self.policy.needs_confidences:
                return candidates
            lengths = self.policy.verify_lengths(None, torch.tensor(caps)).tolist()
            return [i for i in candidates if lengths[i] > 0]
        if not candidates:
            return candidates
        if representative is None:
            representative = self.representative()
        return self._scheduled_rows(caps, candidates, capacity, representative)

    def _scheduled_rows(self, caps: list[int], candidates: list[int], capacity: int | None,
                        representative: bool) -> list[int]:
        config = self.config
        if self.realized_gate and not self.measurements.drafting_verdict(
                len(caps), config.explore_interval, config.max_explore_interval, config.explore_budget,
                representative, self.catch_up(candidates))[0]:
            # The realized gate rules drafting out at this batch size this step whichever rows would draft (the
            # gate, asked below only once rows are chosen, would refuse them): skip the confidences and schedules,
            # about a millisecond, 1-2% of a plain step at 16 requests.
            self.gate_ruled_out = True
            return self._skip("gate")
        cap_tensor = torch.tensor(caps, device=self.device)
        table = self.pricing.sps_table(len(caps))
        if not self.drafts_can_pay(cap_tensor, table):
            return self._skip("cannot_pay")  # not even certain drafts would be verified at this batch size
        stale, known = self.stale_confidences(smoothed=True)
        predicted = schedule_batch(stale, cap_tensor, table, config.schedule, capacity)
        lengths = predicted.tolist()
        rows = self.batch.rows
        worth = [i for i in candidates if known[i] and lengths[i] > 0]
        due = [i for i in candidates if not known[i] or rows[i].memory.probe_due]  # new requests, and probes
        if worth and not due and config.cost_aware and not self.drafting_pays(stale, lengths, table, len(worth)):
            return self._skip("cost")
        chosen = sorted(set(worth) | set(due))
        if not chosen:
            return self._skip("no_budget")  # every row's confidences predict a zero budget, and no probe is due
        if due and config.cost_aware:
            # Probes and new requests draft whatever the model says, but its prediction for the step is still
            # checked against what the step delivers: checked only on the steps it chose to draft (those whose stale
            # confidences looked best), its drafting side would learn only its own optimism (a winner's curse: the
            # next drafts fall back toward the mean) and, its factor pulled down, skip drafting for long stretches.
            self.drafting_pays(stale, lengths, table, len(chosen), keep_prediction=True)
        if len(chosen) < len(caps) and not self.drafts_can_pay(cap_tensor, table, chosen):
            # Even if these rows' drafts were certain, the padded batch would not verify them (one request's draft
            # widens every row): wait until enough rows draft together (probes wait too; unknown rows stay due). With
            # every row chosen this is the question answered above.
            return self._skip("cannot_pay")
        if self.realized_gate and not self.realized_allows_drafting(len(caps), representative, chosen):
            return self._skip("gate_rows")
        return chosen

    def _skip(self, reason: str) -> list[int]:
        """A scheduler step that drafts nothing although some rows could: counted by ``reason`` in ``stats.skips``."""
        self.stats.skips[reason] = self.stats.skips.get(reason, 0) + 1
        return []

    def realized_allows_drafting(self, num_requests: int, representative: bool | None = None,
                                 rows: Sequence[int] = ()) -> bool:
        """``realized_gate``: whether this step may draft at ``num_requests`` rows, from past whole-step rates
        (``representative``: this step's, computed here when not given; ``rows``: those that would draft, whose
        context catch-up a re-measurement pays)."""
        if representative is None:
            representative = self.representative()
        config = self.config
        return self.measurements.drafting_allowed(num_requests, config.explore_interval, config.max_explore_interval,
                                                  config.explore_budget, representative, self.catch_up(rows))

    def catch_up(self, rows: Sequence[int]) -> float:
        """Expected seconds of projecting the pending target features of ``rows`` into the drafter's context (what a
        drafting step pays first after they decoded plain), at the engine's measured price per position."""
        if self.batch.context is None or not rows:
            return 0.0
        return self.measurements.catch_up_seconds(self.batch.context.pending_positions(rows))

    def stale_confidences(self, smoothed: bool = False) -> tuple[torch.Tensor, list[bool]]:
        """Each request's confidences from its last drafting step [R, g] (zeros where unknown), and which are known;
        ``smoothed``: the moving average of its drafts' confidences instead (the skip decisions)."""
        memories = [request.memory for request in self.batch.rows]
        values = [memory.smoothed if smoothed else memory.last for memory in memories]
        known = [value is not None for value in values]
        stale = torch.stack([value.float() if value is not None else torch.zeros(self.block_size)
                             for value in values])
        if self.correction is not None:
            stale = self.correction.correct(stale)
        return stale.to(self.device), known

    def topk_capacity(self, caps: list[int]) -> int:
        """Dynamic top-K capacity from the requests' previous confidences (none from this step); unknown requests
        count as the known ones' mean, or as fully confident when none is known."""
        stale, known = self.stale_confidences()
        known_rows = torch.tensor(known, device=stale.device)
        prior = stale[known_rows].mean(dim=0) if any(known) else torch.ones_like(stale[0])
        filled = torch.where(known_rows[:, None], stale, prior)
        capped = capped_confidences(filled, torch.tensor(caps, device=stale.device))
        return dynamic_topk_capacity(capped.cpu(), self.pricing.sps_table(len(caps)).cpu())

    def _pricing_schedule(self) -> str:
        """The schedule that prices whether drafts can pay: the engine's, top-K priced as ``"prefix"`` (it pays
        R + K tokens)."""
        return "prefix" if self.config.schedule == "topk" else self.config.schedule

    def drafts_can_pay(self, caps: torch.Tensor, table: torch.Tensor, rows: list[int] | None = None) -> bool:
        """Whether the scheduler would verify anything at this batch size if the drafts of ``rows`` (default: every
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
        """Whether drafting ``rows`` requests is expected to beat plain decoding this step (``drafting_pays``), from
        the stale prediction (``predicted`` lengths, survivals of ``stale`` confidences: ``expected_round``) and the
        drafter's measured cost, each side's expected rate scaled by what its recent steps delivered against this
        model's prediction for them (``EngineMeasurements.model_factor``). When it says "draft" (or
        ``keep_prediction``: the step drafts anyway), its prediction (tokens, seconds) is kept for the step to check
        against what it delivers."""
        self.prediction = None
        cost = self.measurements.draft_cost.get(rows_bucket(rows))
        if cost is None:
            return True  # not measured yet: draft, and measure
        num_requests = stale.shape[0]
        tokens, verify_seconds = expected_round(stale, predicted, table, padded=self.config.schedule == "padded")
        bucket = rows_bucket(num_requests)
        factors = self.measurements.model_factor(bucket, True), self.measurements.model_factor(bucket, False)
        pays = drafting_pays(tokens, verify_seconds, cost, num_requests * float(table[num_requests]), *factors)
        self.prediction = (tokens, verify_seconds + cost) if pays or keep_prediction else None
        return pays

    # --------------------------------------------------------------------------------------------------------------
    # How many drafts each row verifies
    # --------------------------------------------------------------------------------------------------------------
    def verification_lengths(self, plan: StepPlan, choice: Choice, block: Draft | None) -> list[int]:
        """Drafts each row verifies: the policy's ``verify_lengths`` over the drafting rows, or, priced by SPS, the
        step's shared budget (Algorithm 1 by ``config.schedule`` over the corrected confidences, offers in place)."""
        caps, offers, drafting = plan.caps, choice.offers, choice.drafting
        lengths = [0] * len(caps)
        if block is None and not offers:
            return lengths
        if not self.scheduled:
            chosen = self.policy.verify_lengths(block.confidences, torch.tensor([caps[i] for i in drafting]))
            for i, length in zip(drafting, chosen.tolist()):
                lengths[i] = length
            return lengths
        confidences = torch.zeros(len(caps), self.block_size, device=self.device)
        if block is not None:
            current = block.confidences.float()
            if self.correction is not None:
                current = self.correction.correct(current)
            confidences[torch.tensor(drafting, device=self.device)] = current.to(self.device)
        confidences, cap_tensor = self.with_offers(confidences, caps, offers)
        return schedule_batch(confidences, cap_tensor, self.pricing.sps_table(len(caps)), self.config.schedule,
                              choice.capacity).tolist()

    def observe(self, caps: list[int], drafting: list[int], block: Draft | None, lengths: list[int],
                accepted: list[int]) -> None:
        """After verification: the drafts' confidences for the prior of joining requests, and the survival
        correction's record of what the verified prefixes delivered."""
        if block is None or block.confidences is None:
            return
        # the mean of every draft's confidences so far is where a joining request starts (``confidence_prior``)
        self.measurements.record_confidences(block.confidences.detach().float().sum(dim=0).cpu().tolist(),
                                             len(drafting))
        if self.correction is not None:
            index = torch.tensor(drafting)  # raw survivals: the factors map the drafter's own to the observed
            self.correction.observe(capped_confidences(block.confidences.cpu(), torch.tensor(caps)[index]),
                                    torch.tensor(lengths)[index], torch.tensor(accepted)[index])
            self.stats.survival_correction = self.correction.factors().tolist()
