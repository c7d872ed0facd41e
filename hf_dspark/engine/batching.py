"""Batched DSpark serving: R concurrent requests share one target forward per step.

transformers' assisted generation serves one sequence at a time; here every step

1. admits waiting requests (continuous batching: they join the batch as new rows, prefilled in the forwards a
   fitted price model (``PrefillCost``) finds cheapest, fewer forwards against less padding; free slots wait a few
   steps for rows about to finish, so that joiners share one prefill forward),
2. proposes drafts: a free source's offer (prompt lookup, under the hybrid) where it pays, else a block from the
   drafter for the requests that will be verified (``DSparkDrafter`` forward + ``sample_block``, batched);
   requests whose drafts are not expected to pay for the drafter's forward skip drafting (``hf_dspark.planner``),
3. schedules: a verification length per request from the verification policy ``EngineConfig.policy`` names (the registry
   ``generate()`` uses), for a policy priced by SPS from a shared budget over the profiled SPS(B) curve of the
   batch's verification tokens B: Algorithm 1 by width layers for the padded batch (the default), Algorithm 1 over
   single entries, or dynamic top-K,
4. verifies every request's ragged block ``[anchor, drafts...]`` in ONE padded target forward,
5. commits per request (greedy matching or speculative sampling, with that request's own sampling parameters),
   streams the new tokens, and retires finished requests (EOS or max length) so others can join,
6. records what the step cost and delivered (the statistics, and the measurements later decisions are priced by).

Rejected tokens are rolled back by masking, not by cropping: ``RaggedBatchCache`` keeps the target's
``DynamicCache`` column-aligned, with a per-row ``valid`` mask. A verification forward appends the block's columns to
every row; afterwards only the anchor and the accepted drafts stay valid, rejected drafts and padding become holes
that every later attention mask hides. Valid columns of a row hold its positions 0..n-1 in order, so the cache always
contains exactly the verified sequence; ``compact`` squeezes the holes out now and then. Its layers append in place
into spare columns (``_GrowingLayer``) where ``DynamicLayer`` would copy every layer each step. The drafter's context
(``DeferredDrafterContext``) is built lazily: the verified positions' target features wait, and are projected into
the drafter's context K/V only when the request drafts, so requests that skip drafting cost the drafter nothing.
The target's forwards run with ``hf_dspark.attention.packed_attention``: a grouped-query target's query heads are
folded into the query length instead of transformers copying the whole KV cache once per query head for every
masked multi-token step, which made a 2-token step at 64 requests cost 3.6x a 1-token one (bf16, this CPU).

transformers' own continuous batching (``generation/continuous_batching``) was studied first: its paged cache and
varlen inputs do carry ragged query lengths, but the manager samples one token per request per step from the last
position only, returns no hidden states (the drafter needs the target's features), has no way to roll a request's
cache back (``position_offset`` only grows; completed blocks are hashed for prefix sharing), and drives its own
scheduler and sampler in a background thread. Using it would mean driving its internal classes directly, so this
engine uses a padded batch with per-row attention masks and positions instead. The price of padding: a step costs
R * max(1 + l_r) tokens rather than sum(1 + l_r); the SPS(B) profile is measured on that padded batch with the B
tokens spread evenly over the requests (``hf_dspark.profiling.load_or_profile_batched``).

This module holds the step loop (``DSparkEngine``) and the one-call API. The settings are ``config``'s
(``EngineConfig``), requests and outputs ``requests``', the drafting decisions ``hf_dspark.planner``'s (the same
planner ``generate()`` runs, fed the engine's rows by ``planning``), the priced SPS tables ``pricing``'s, the ragged
caches ``cache``'s, verification ``verification``'s, admission ``admission``'s.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import DynamicCache, StoppingCriteriaList, StopStringCriteria

from ..attention import packed_attention
from ..block_source import BatchedBlock
from ..clock import seconds_between, time_mark
from ..draft_sources import Draft
from ..generation import is_dspark_drafter
from ..kernels import warm_scheduler_kernels  # importing it also routes schedule_batch through the kernels
from ..policy_names import DEFAULT_POLICY
from ..rollback import rollback_refusal
from ..planner import Plan
from ..stats import DSparkStats
from .admission import PrefillCost, hold_budget, prefill_groups, tail_filled_order
from .cache import AttentionLayout, DeferredDrafterContext, RaggedBatchCache
from .config import PLAIN, EngineConfig, engine_draft_tree, engine_policy
from .measurements import EngineMeasurements, measurement_key, rows_bucket
from .planning import catch_up_seconds, engine_planner, representative, row_states
from .pricing import VerifyPricing
from .requests import (
    Batch,
    BatchOutput,
    EngineStats,
    Request,
    RequestOutput,
    SamplingParams,
    TokenEvent,
    batch_progress,
    checked_prompt,
    per_request,
    sampling_groups,
)
from .trees import EngineTrees
from .verification import _processed_probs, accept_rows, schedule_kernel_kinds


class DSparkEngine:
    """Continuous-batching DSpark engine.

    Args:
        target: a decoder-only transformers model with full attention.
        drafter: a ``DSparkDrafter`` for it (not needed for ``policy="plain"``; without one, the default policy
            decodes plain).
        config: the settings (``EngineConfig``); keyword arguments override its fields (or, without a config, make
            one: ``DSparkEngine(target, drafter, policy="fixed")``).
    """

    def __init__(self, target, drafter=None, config: EngineConfig | None = None, **settings: Any):
        if config is None:
            config = EngineConfig(**settings)
        else:  # the deprecated ``method=`` replaces the config's policy, as ``policy=`` would
            config = replace(config, **{**({"policy": None} if "method" in settings else {}), **settings})
        if drafter is None and config.policy == DEFAULT_POLICY:
            config = replace(config, policy=PLAIN)
        if getattr(target.config, "is_encoder_decoder", False):
            raise ValueError("the batched engine serves decoder-only targets")
        refusal = rollback_refusal(target)
        if refusal:
            raise ValueError(f"the batched engine cannot serve this target: {refusal}")
        layout = AttentionLayout.of(target.config)
        if not layout.kinds <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"the batched engine serves full and sliding-window attention layers; this target also "
                             f"has {sorted(layout.kinds - {'full_attention', 'sliding_attention'})} layers")
        if config.optimize_target is not None:
            from ..optimization import optimize_target

            optimize_target(target, config.optimize_target)  # before any profile or timing: they key on it
        self.config = config
        self.target = target
        self.device = next(target.parameters()).device
        self.layout = layout
        self.drafter, self.block_size, self._taps = None, 0, []  # _taps: target hidden_states the drafter reads
        self.block_source: BatchedBlock | None = None  # the drafter's block as a draft source for R rows
        policy = None if config.policy == PLAIN else self._attach(drafter)
        # Drafter, verify and whole-step timings (possibly shared with other engines on the same hardware)
        self.measurements = EngineMeasurements() if config.measurements is None else config.measurements
        self.measurements.bind(measurement_key(target, self.drafter))
        self.stats = EngineStats()
        self.batch = Batch()
        scheduled = policy is not None and policy.needs_sps
        self.trees = EngineTrees(self.drafter, "chain" if self.drafter is None else
                                 engine_draft_tree(config, self.drafter), scheduled, layout.windowed,
                                 target.config.get_text_config()._attn_implementation == "eager")
        self.pricing = VerifyPricing(target, self.block_size, self._taps, self.measurements, config.sps,
                                     (config.sps is None) if config.adapt_sps is None else config.adapt_sps,
                                     config.max_concurrency, self.trees.tokens_per_request(self.block_size)) \
            if scheduled else None
        self.planner = engine_planner(config, policy, self.measurements, self.stats, self.block_size, self.device)
        if self.planner.realized_gate:
            self.measurements.bind_gate_tokens(config.gate_tokens)
        if scheduled and self.device.type == "cuda":
            # Compile the scheduler kernel variants this engine can launch in the background from now on: a step
            # whose variant is not ready yet schedules with the torch twin (the same lengths) instead of waiting.
            warm_scheduler_kernels(self.device, config.max_concurrency or 64, self.block_size,
                                   kinds=schedule_kernel_kinds(config.schedule))
        self.prefill_cost = PrefillCost() if config.prefill_cost is None else config.prefill_cost
        self._held_slot_steps = 0  # idle slot-steps of the admission being held
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        default_eos = target.generation_config.eos_token_id
        self._default_eos = frozenset([] if default_eos is None else
                                      [default_eos] if isinstance(default_eos, int) else list(default_eos))
        self._clock = config.clock
        self._clock0 = self._clock()
        self._waiting: deque[Request] = deque()
        self._ids: set[str] = set()
        self.outputs: dict[str, RequestOutput] = {}

    def _attach(self, drafter):
        """Check and attach the drafter a drafting policy needs; returns the policy ``EngineConfig.policy`` names."""
        if drafter is None or not is_dspark_drafter(drafter):
            raise ValueError(f"policy {self.config.policy!r} needs a DSpark drafter")
        drafter.attach_target(self.target)
        if next(drafter.parameters()).device != self.device:
            raise ValueError(f"drafter is on {next(drafter.parameters()).device}, target on {self.device}")
        policy = engine_policy(self.config, drafter)
        if policy.needs_confidences and drafter.confidence_head is None:
            raise ValueError(f"policy {self.config.policy!r} needs a drafter with a confidence head; "
                             f"use policy='fixed'")
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.block_source = BatchedBlock(drafter)
        self._taps = drafter.target_hidden_states_indices()
        return policy

    # --------------------------------------------------------------------------------------------------------------
    # Requests
    # --------------------------------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self._clock() - self._clock0

    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request (token ids: list, 1D tensor or [1, n] tensor); it joins at the next step with room.

        The request is checked here, so that nothing it holds can fail a later step shared with other requests:
        integer token ids inside the target's vocabulary, a prompt plus ``max_new_tokens`` within the target's
        context, ``SamplingParams``, stop strings the engine can watch. A refusal is a ``ValueError`` naming the
        request and the problem."""
        request_id = str(len(self._ids)) if request_id is None else str(request_id)
        if request_id in self._ids:
            raise ValueError(f"duplicate request id {request_id!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
        prompt_ids = checked_prompt(prompt_ids, params, request_id, self.target.config.get_text_config())
        stop = self._stopping_criteria(params, request_id)
        self._ids.add(request_id)
        eos = self._default_eos if params.eos_token_id is None else frozenset(
            [params.eos_token_id] if isinstance(params.eos_token_id, int) else params.eos_token_id)
        generator = None if params.seed is None else torch.Generator(device=self.device).manual_seed(params.seed)
        self._waiting.append(Request(request_id, prompt_ids, params, eos, DSparkStats(block_size=self.block_size),
                                     arrival_s=self._now(), stop=stop, generator=generator))
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """End a waiting or running request now (``finish_reason="abort"``), freeing its slot; False if it had
        already finished. Its output so far is in ``outputs``."""
        request_id = str(request_id)
        if request_id not in self._ids:
            raise ValueError(f"no request {request_id!r}")
        waiting = next((r for r in self._waiting if r.request_id == request_id), None)
        if waiting is not None:
            self._waiting.remove(waiting)
        request = waiting or next((r for r in self.batch.rows if r.request_id == request_id), None)
        if request is None:
            return False
        request.finish_reason = "abort"
        self._finish(request)
        if waiting is None:
            self._retire()
        return True

    def _generator(self, request: Request) -> torch.Generator:
        """The random numbers a request's group draws from: its own (a seeded request), else the engine's."""
        return self.generator if request.generator is None else request.generator

    def _stopping_criteria(self, params: SamplingParams, request_id: str) -> StoppingCriteriaList | None:
        criteria = list(params.stopping_criteria)
        if params.stop_strings:
            if self.config.tokenizer is None:
                raise ValueError(f"request {request_id!r}: stop_strings needs the engine's tokenizer: "
                                 "DSparkEngine(..., tokenizer=tokenizer)")
            criteria.append(StopStringCriteria(self.config.tokenizer, list(params.stop_strings)))
        return StoppingCriteriaList(criteria) if criteria else None

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.batch.rows)

    def prepare(self, progress=None) -> None:
        """Measure now what the first steps would otherwise stop to measure: the batched SPS profile a policy that
        prices widths needs (cached per machine; ``progress(done, sizes, seconds)`` hears each batch size). A server
        calls this before it says it is ready, so no request waits on a profile. Nothing to do for plain decoding,
        a policy that does not price widths, or a profile given in the config."""
        if self.pricing is not None:
            self.pricing.profile(progress)

    @property
    def num_active(self) -> int:
        return len(self.batch.rows)

    def stream(self) -> Iterator[TokenEvent]:
        """Run until every queued request is finished, yielding each step's new tokens per request."""
        while self.has_unfinished():
            yield from self.step()

    def run(self) -> list[RequestOutput]:
        """Run to completion; outputs in the order requests finished."""
        finished = []
        for event in self.stream():
            if event.finished:
                finished.append(self.outputs[event.request_id])
        return finished

    def _finish(self, request: Request) -> None:
        self.outputs[request.request_id] = RequestOutput(
            request.request_id, request.prompt_ids, list(request.tokens), request.finish_reason, request.params,
            request.stats, request.arrival_s, request.start_s, request.first_token_s, self._now(), request.error,
        )

    # --------------------------------------------------------------------------------------------------------------
    # One step: admit -> propose -> schedule -> verify -> commit and emit -> record
    # --------------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """Admit waiting requests, then propose, schedule, verify, commit and emit for every active request once."""
        events = self._admit()
        if not self.batch.rows:
            return events
        remaining = [request.remaining for request in self.batch.rows]
        rows = len(self.batch.rows)
        if self.pricing is not None:
            self.pricing.profiled_table(rows)  # a first profile (cached afterwards) is not part of a step's time
        states = row_states(self.batch, self.block_size, bool(self.planner.sources))
        started = time.perf_counter()
        table = None if self.pricing is None else self.pricing.sps_table(rows)
        plan = self.planner.plan(states, table, representative(self.batch), self._catch_up)
        block, draft_marks = self._propose(plan.drafting)
        confidences = None if block is None else block.confidences
        lengths = self.planner.lengths(plan, confidences, table)
        trees = self.trees.choose(self.planner, self.batch.rows, plan, block, lengths, table)
        plain_seconds = self._plain_price(plan)
        self._record_cache_shape()
        verifying = time.perf_counter()
        accepted, next_tokens, paths = self._verify(lengths, plan, block, trees)
        verified = time.perf_counter()
        widths = self.trees.verified(lengths, trees)  # what each row verified: its chain's drafts or tree's nodes
        self._record_timings(plan.drafting, draft_marks, widths, verified - verifying)
        emitted = self._commit(events, plan, block, lengths, accepted, next_tokens, trees, paths)
        self._retire()
        self.planner.observe(plan, confidences, *self.trees.chain_view(lengths, accepted, trees, paths))
        self._record_confidences(plan, confidences)
        self._record_step(plan, widths, remaining, emitted, (started, verifying, verified), plain_seconds)
        return events

    def _catch_up(self, rows) -> float:
        return catch_up_seconds(self.batch, self.measurements, rows)

    def _record_confidences(self, plan: Plan, confidences: torch.Tensor | None) -> None:
        """The drafts' confidences, for the prior of joining requests (the mean of every draft's confidences so far,
        ``confidence_prior``), and the survival correction's factors in the stats."""
        if confidences is None:
            return
        self.measurements.record_confidences(confidences.detach().float().sum(dim=0).cpu().tolist(),
                                             len(plan.drafting))
        if self.planner.correction is not None:
            self.stats.survival_correction = self.planner.correction.factors().tolist()

    def _propose(self, drafting: list[int]) -> tuple[Draft | None, tuple | None]:
        """The drafting rows' block, and the clock marks of its context catch-up and drafter forward. The rows'
        pending target features are projected first, outside the drafter's timed cost: after a long skip (or a
        prompt) this is a one-off catch-up, not the price of the next draft."""
        if not drafting:
            return None, None
        pending = self.batch.context.pending_positions(drafting)
        started = time_mark(self.device)
        self.batch.context.flush(self.drafter, drafting)
        flushed = time_mark(self.device)
        block = self._draft(drafting)
        return block, (pending, started, flushed, time_mark(self.device))

    def _plain_price(self, plan: Plan) -> float | None:
        """A plain step's model price (seconds), from the table the decision used (the verify reprices it), when the
        step checks the cost model: not those the realized gate ruled out before asking it (pricing a plain step
        re-prices the SPS table, 0.17 ms of a 45 ms step at 16 requests), nor those whose output includes offers,
        which the model does not price."""
        if plan.drafting or not self._checks_model(plan):
            return None
        rows = len(self.batch.rows)
        return 1.0 / float(self.pricing.sps_table(rows)[rows])

    def _checks_model(self, plan: Plan) -> bool:
        """Whether what this step delivers checks the cost model's prediction (see ``_plain_price``)."""
        planner = self.planner
        return planner.scheduled and self.config.cost_aware and not planner.gate_ruled_out and not plan.offers

    def _record_cache_shape(self) -> None:
        rows, cache = self.batch.rows, self.batch.cache
        self.stats.cache_widths.append(cache.width)
        # row r's valid columns are its verified positions 0..length-1 (RaggedBatchCache's invariant)
        self.stats.cache_holes.append(len(rows) * cache.width - sum(r.length for r in rows))

    def _record_timings(self, drafting: list[int], draft_marks: tuple | None, lengths: list[int],
                        verify_seconds: float) -> None:
        """The drafter's and the verify forward's timings, for later decisions. Read once verification has
        synchronised: on CUDA the draft's events are done."""
        if draft_marks is not None:
            pending, started, flushed, drafted = draft_marks
            if pending:
                self.measurements.record_catch_up(pending, seconds_between(started, flushed))
            self.measurements.record_draft(rows_bucket(len(drafting)), seconds_between(flushed, drafted))
        if self.pricing is not None and self.pricing.adapt_sps:  # the real price of this (rows, width)
            self.measurements.record_verify(len(lengths), 1 + max(lengths), verify_seconds)

    def _commit(self, events: list[TokenEvent], plan: Plan, block: Draft | None, lengths: list[int],
                accepted: list[int], next_tokens: list[int], trees: dict, paths: dict) -> list[int]:
        """Each row's round: its statistics, what its offer delivered (for the source), its new tokens (emitted and
        streamed; a tree row's along its accepted path), and the outputs of requests that finish. Returns the
        tokens each row emitted."""
        block_row = {i: k for k, i in enumerate(plan.drafting)}
        ids = [] if block is None else block.token_ids.tolist()
        confidences = None if block is None or block.confidences is None else block.confidences.detach().float()
        listed = [] if confidences is None else confidences.tolist()
        raw = [] if block is None or block.confidence_logits is None else block.confidence_logits.float().tolist()
        counts = []
        for i, request in enumerate(self.batch.rows):
            k, offer = block_row.get(i), plan.offers.get(i)
            tree = trees.get(i)
            if tree is not None:
                request.stats.add_round(tree.size, tree.size, accepted[i], listed[k] if listed else None,
                                        raw[k] if raw else None, "tree")
            elif offer is not None and lengths[i] > 0:
                request.stats.add_round(offer.num_tokens, lengths[i], accepted[i], source=offer.source)
                self.planner.observe_offer(offer, lengths[i], accepted[i])
            else:
                request.stats.add_round(self.block_size if k is not None else 0, lengths[i], accepted[i],
                                        listed[k] if listed and k is not None else None,
                                        raw[k] if raw and k is not None else None,
                                        "block" if k is not None else "none")
            proposed = ids[k] if k is not None else offer.token_ids[0].tolist() if offer is not None else []
            if tree is not None:
                proposed = tree.tokens[paths[i]].tolist()
            request.length += accepted[i] + 1
            new = request.emit(proposed[: accepted[i]] + [next_tokens[i]])
            counts.append(len(new))
            events.append(TokenEvent(request.request_id, new, request.finish_reason is not None,
                                     request.finish_reason, request.error))
            if request.finish_reason is not None:
                self._finish(request)
        return counts

    def _retire(self) -> None:
        """Drop the finished requests' rows (the kept rows fill the holes from the tail, ``tail_filled_order``), and
        compact a cache whose holes (rejected drafts, rows that did not take part in a context flush) pass a fifth
        of its width: one gather, cheaper than carrying them through every later append."""
        batch = self.batch
        keep = [i for i, request in enumerate(batch.rows) if request.finish_reason is None]
        if len(keep) < len(batch.rows):
            order = tail_filled_order(keep)
            batch.rows[:] = [batch.rows[i] for i in order]
            if keep:
                index = torch.tensor(order, device=self.device)
                batch.cache.select_rows(index)
                if batch.context is not None:
                    batch.context.select_rows(index)
            else:
                batch.cache = batch.context = None
        for part in (batch.cache, batch.context):
            if part is not None and part.holes_exceed():
                part.compact()
                self.stats.compactions += 1

    def _record_step(self, plan: Plan, lengths: list[int], remaining: list[int],
                     counts: list[int], marks: tuple[float, float, float], plain_seconds: float | None) -> None:
        """The step's statistics, and what it delivered for the realized gate and the cost model's check."""
        stats, rows = self.stats, len(plan.caps)
        started, verifying, verified = marks
        offered = sum(1 for i in plan.offers if lengths[i] > 0)
        stats.active.append(rows)
        stats.drafting.append(len(plan.drafting))
        stats.lookups.append(offered)
        stats.verify_tokens.append(sum(lengths))
        stats.widths.append(1 + max(lengths))
        stats.emitted.append(sum(counts))
        stats.draft_s += verifying - started
        stats.verify_s += verified - verifying
        seconds = time.perf_counter() - started
        stats.seconds.append(seconds)
        # What the whole step delivered (a first step is not typical). The gate weighs the steps that verify
        # speculative tokens (a block or an offer) against the steps without.
        if self.planner.realized_gate and plan.representative:
            output = sum(counts) if self.config.gate_tokens == "emitted" else batch_progress(remaining, counts)
            self.measurements.record_step(rows, bool(plan.drafting) or offered > 0, output, seconds)
        prediction = self.planner.prediction
        if plan.drafting and prediction is not None and self._checks_model(plan):
            self.measurements.record_model_check(rows_bucket(rows), True, *prediction, sum(counts), seconds)
        elif plain_seconds is not None:
            self.measurements.record_model_check(rows_bucket(rows), False, rows, plain_seconds, sum(counts), seconds)

    # --------------------------------------------------------------------------------------------------------------
    # Joining: prefill the new requests together (right-padded), then append their rows
    # --------------------------------------------------------------------------------------------------------------
    def _remember(self, joining: list[Request]) -> None:
        """Policies priced by SPS: each joining request's confidence memory, starting from the mean confidences of
        every draft so far (``confidence_prior``), by which it is judged until its own first draft."""
        if not self.planner.scheduled:
            return
        prior = self.measurements.confidence_prior() if self.config.confidence_prior else None
        prior = None if prior is None else torch.tensor(prior)
        for request in joining:
            request.memory = self.planner.new_memory(prior)

    def _hold_admission(self) -> bool:
        """Whether this step's free slots wait (``admission_hold``): only when more requests wait than fit now, an
        active request will surely have finished (each step emits at least one token) before the hold's remaining
        slot-steps run out, and the budget (``hold_budget``) is not spent. Counts the slot-steps it holds."""
        config = self.config
        free = 0 if config.max_concurrency is None else config.max_concurrency - len(self.batch.rows)
        if config.admission_hold <= 0 or not self.batch.rows or free <= 0 or len(self._waiting) <= free:
            self._held_slot_steps = 0
            return False
        budget = hold_budget(config.admission_hold, config.max_concurrency, len(self._waiting), free)
        steps_left = int((budget - self._held_slot_steps) // free)
        if steps_left < 1 or not any(r.remaining <= steps_left for r in self.batch.rows):
            self._held_slot_steps = 0
            return False
        self._held_slot_steps += free
        self.stats.held_slot_steps += free
        return True

    def _admit(self) -> list[TokenEvent]:
        if self._hold_admission():
            return []
        joining = []
        limit = self.config.max_concurrency
        while self._waiting and (limit is None or len(self.batch.rows) + len(joining) < limit):
            joining.append(self._waiting.popleft())
        if not joining:
            return []
        self._remember(joining)
        started = time.perf_counter()
        events, parts = [], []
        # Shortest prompts first: groups of similar lengths waste little on right-padding.
        for chunk in prefill_groups(sorted(joining, key=lambda r: len(r.prompt_ids)), self.config.max_prefill_tokens,
                                    self.prefill_cost):
            start = self._now()
            part, context = self._prefill(chunk)
            self.stats.prefill_calls += 1
            kept = []
            for i, request in enumerate(chunk):
                request.start_s, request.first_token_s = start, self._now()
                finished = request.finish_reason is not None
                events.append(TokenEvent(request.request_id, list(request.tokens), finished, request.finish_reason,
                                         request.error))
                if finished:
                    self._finish(request)
                else:
                    kept.append(i)
                    self.batch.rows.append(request)
            if kept:
                if len(kept) < len(chunk):
                    index = torch.tensor(kept, device=self.device)
                    part.select_rows(index)
                    if context is not None:
                        context.select_rows(index)
                parts.append((part, context))
        if parts:
            if self.batch.cache is None:
                self.batch.cache, self.batch.context = parts.pop(0)
            self.batch.cache.append_rows([part for part, _ in parts])
            if self.batch.context is not None:
                self.batch.context.append_rows([context for _, context in parts])
        self.stats.prefill_s += time.perf_counter() - started
        return events

    def _prefill(self, requests: list[Request]) -> tuple[RaggedBatchCache, DeferredDrafterContext | None]:
        """One forward over the prompts, right-padded: a prompt never attends to padding (it comes after it), and the
        padding columns are holes from the start. Emits each request's first token. The prompts' target features
        wait in the drafter context until each request first drafts."""
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        ids = torch.tensor([r.prompt_ids + r.prompt_ids[-1:] * (width - len(r.prompt_ids)) for r in requests],
                           device=self.device)
        valid = torch.arange(width, device=self.device) < torch.tensor(lengths, device=self.device)[:, None]
        positions = torch.arange(width, device=self.device).expand(len(requests), -1)
        last = torch.tensor(lengths, device=self.device)[:, None] - 1
        cache = self.layout.new_cache()
        extra = {"output_hidden_states": list(self._taps)} if self.drafter is not None else {}
        mask = self._windowed_masks(valid, positions, positions) if self.layout.windowed else valid
        with packed_attention(self.target):
            out = self.target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                              use_cache=True, logits_to_keep=last, **extra)
        logits = out.logits[:, -1].float()  # [J, V] at each prompt's last position
        first = torch.empty(len(requests), dtype=torch.long, device=self.device)
        for members in sampling_groups([r.params for r in requests]).values():
            params = requests[members[0]].params
            sel = torch.tensor(members, device=self.device)
            if params.do_sample:
                probs = _processed_probs(logits[sel], params.warpers())
                first[sel] = torch.multinomial(probs, 1, generator=self._generator(requests[members[0]])).squeeze(1)
            else:
                first[sel] = logits[sel].argmax(dim=-1)
        for request, token in zip(requests, first.tolist()):
            request.length = len(request.prompt_ids)
            request.emit([token])
        context = None
        if self.drafter is not None:
            context = DeferredDrafterContext(self.drafter, len(requests), self.device)
            context.defer([out.hidden_states[i] for i in self._taps], positions, lengths)
        return RaggedBatchCache(cache, valid), context

    def _windowed_masks(self, key_valid: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor):
        """A sliding-window target's masks, built from positions (``AttentionLayout.masks``): transformers builds its
        window from cache columns, which the engine's holes (rejected drafts, padding) would shift."""
        implementation = self.target.config.get_text_config()._attn_implementation
        if implementation not in ("sdpa", "eager"):
            raise ValueError(f"the batched engine serves sliding-window targets with sdpa or eager attention; this "
                             f"target uses {implementation!r} (load it with attn_implementation='sdpa')")
        return self.layout.masks(key_valid, key_positions, query_positions,
                                 next(self.target.parameters()).dtype if implementation == "eager" else None)

    # --------------------------------------------------------------------------------------------------------------
    # Drafting a block: one batched drafter forward
    # --------------------------------------------------------------------------------------------------------------
    def _draft(self, rows: list[int]) -> Draft:
        """The drafting rows' blocks (``BatchedBlock``: one drafter forward against their context caches, then
        left-to-right sampling per group of equal sampling parameters, each group with its random numbers)."""
        requests = [self.batch.rows[i] for i in rows]
        context, valid = self.batch.context.rows_view(rows)  # _propose flushed the rows' pending features
        anchors = torch.tensor([request.anchor for request in requests], device=self.device)
        positions = torch.tensor([request.length for request in requests], device=self.device)
        groups = []
        for members in sampling_groups([request.params for request in requests]).values():
            first = requests[members[0]]
            groups.append((members, first.params.warpers(), first.params.do_sample, self._generator(first)))
        return self.block_source.propose(anchors, positions, context, valid, groups)

    # --------------------------------------------------------------------------------------------------------------
    # Verification: one padded target forward over every request's block
    # --------------------------------------------------------------------------------------------------------------
    def _verify(self, lengths: list[int], plan: Plan, block: Draft | None,
                trees: dict) -> tuple[list[int], list[int], dict[int, list[int]]]:
        """Every row's ``[anchor, drafts...]`` (a tree row's ``[anchor, nodes...]``, ``EngineTrees``) in one padded
        target forward, then each group of equal sampling parameters accepted together. Keeps the anchor and the
        accepted drafts in the cache; rejected drafts and padding become holes. Returns the accepted drafts, next
        tokens and each tree row's accepted path."""
        rows, cache, device = self.batch.rows, self.batch.cache, self.device
        width = self.trees.width(lengths, trees)
        num_drafts = torch.tensor(lengths, device=device)
        draft_ids = self._draft_matrix(width, plan, block)
        anchors = torch.tensor([r.anchor for r in rows], device=device)
        block_valid = torch.arange(width, device=device) < (num_drafts + 1)[:, None]  # [R, Q]
        tokens = torch.cat([anchors[:, None], draft_ids], dim=1)
        offsets = torch.arange(width, device=device).repeat(len(rows), 1)
        self.trees.place(tokens, offsets, block_valid, trees)
        tokens = torch.where(block_valid, tokens, anchors[:, None])  # padding: any real id, masked out
        positions = torch.tensor([r.length for r in rows], device=device)[:, None] + offsets
        extra = {"output_hidden_states": list(self._taps)} if self.drafter is not None else {}
        if self.layout.windowed:
            mask = self._windowed_masks(cache.attention_mask(block_valid),
                                        torch.cat([cache.key_positions(), positions], dim=1), positions)
        elif trees:
            mask = self.trees.mask(cache.valid, block_valid, trees, next(self.target.parameters()).dtype)
        else:
            mask = cache.attention_mask(block_valid)
        with packed_attention(self.target):  # no per-head copy of the cache for a wide block
            out = self.target(input_ids=tokens, attention_mask=mask,
                              position_ids=positions, cache=cache.target_cache, use_cache=True, **extra)
        logits = out.logits.float()
        accepted, next_tokens = accept_rows(rows, logits, draft_ids, num_drafts, lengths, plan, block, self._generator)
        paths = self.trees.accept(logits, trees, accepted, next_tokens)
        if self.drafter is not None:  # the verified positions' features wait until the request drafts again
            taps, order = [out.hidden_states[i] for i in self._taps], self.trees.path_first(paths, len(rows), width,
                                                                                            device)
            if order is not None:  # a tree row's path columns first: the features of its accepted positions
                taps = [t.gather(1, order[:, :, None].expand(-1, -1, t.shape[-1])) for t in taps]
                positions = positions.gather(1, order)
            self.batch.context.defer(taps, positions, (accepted + 1).tolist())
        cache.commit(self.trees.kept(width, accepted, paths))
        return accepted.tolist(), next_tokens.tolist(), paths

    def _draft_matrix(self, width: int, plan: Plan, block: Draft | None) -> torch.Tensor:
        """[R, width - 1] drafts: each block row's and each offer row's, zeros elsewhere."""
        draft_ids = torch.zeros(len(self.batch.rows), width - 1, dtype=torch.long, device=self.device)
        if block is not None and width > 1:
            n = min(width - 1, block.token_ids.shape[1])  # a step with a tree can be wider than the block
            draft_ids[torch.tensor(plan.drafting, device=self.device), :n] = block.token_ids[:, :n]
        for i, offer in plan.offers.items():
            n = min(offer.num_tokens, width - 1)
            draft_ids[i, :n] = offer.token_ids[0, :n].to(self.device)
        return draft_ids

# ------------------------------------------------------------------------------------------------------------------
# One-call API
# ------------------------------------------------------------------------------------------------------------------
def stream_batch(target, prompts: Sequence, drafter=None, params=None, config: EngineConfig | None = None,
                 **settings) -> Iterator[TokenEvent]:
    """Serve ``prompts`` (token-id sequences; request ids "0", "1", ...) and yield tokens as they are produced."""
    engine = DSparkEngine(target, drafter, config, **settings)
    for prompt, p in zip(prompts, per_request(params, len(prompts))):
        engine.add_request(prompt, p)
    yield from engine.stream()


def generate_batch(target, prompts: Sequence, drafter=None, params=None, config: EngineConfig | None = None,
                   **settings) -> BatchOutput:
    """Serve ``prompts`` with the batched engine and return every request's output and the step statistics.

    ``params``: one ``SamplingParams`` for all, or one per prompt. ``config`` and ``settings`` go to ``DSparkEngine``
    (``policy``, ``num_verify_tokens``, ``schedule``, ``sps``, ``max_concurrency``, ``seed``...).
    """
    engine = DSparkEngine(target, drafter, config, **settings)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, per_request(params, len(prompts)))]
    started = time.perf_counter()
    for _ in engine.stream():
        pass
    wall = time.perf_counter() - started
    return BatchOutput([engine.outputs[i] for i in ids], engine.stats, wall)


__all__ = [
    "BatchOutput",
    "DSparkEngine",
    "EngineConfig",
    "EngineStats",
    "RequestOutput",
    "SamplingParams",
    "TokenEvent",
    "generate_batch",
    "stream_batch",
]
