"""The batched engine: verification math, the ragged cache, and per-request losslessness on tiny models.

Greedy outputs must equal plain single-sequence ``target.generate`` token for token for every request, whatever the
batch around it (mixed prompt and output lengths, EOS, joins mid-flight, scheduler on or off, zero budgets);
sampled outputs must follow the exactly enumerated target distribution per request, with different sampling
parameters per request in the same batch.
"""

import json
import math
import statistics

import pytest
import torch
from transformers import DynamicCache

from hf_dspark.engine import (
    DeferredDrafterContext,
    DSparkEngine,
    RaggedBatchCache,
    SamplingParams,
    generate_batch,
    greedy_verify,
    schedule_batch,
    speculative_verify,
)
from hf_dspark.engine.admission import ADMISSION_HOLD_GENERATIONS, hold_budget
from hf_dspark.engine import batching as engine_batching
from hf_dspark.planner import Planner, RowState
from hf_dspark.profiling import BatchedStepsPerSecond
from hf_dspark.scheduling import ConfidenceMemory, StepsPerSecond
from tests.helpers import make_drafter, make_target, random_prompts, train_drafter_on_target, require_smollm2
from tests.test_sampling import VOCAB, chi_square_pvalue, exact_pair_distribution

FLAT_SPS = StepsPerSecond([1, 4096], [100.0, 100.0])  # verifying more never costs: the scheduler admits everything
# Per-request curve (B / R tokens each): gently decreasing, so the scheduler admits only likely drafts.
DECREASING_SPS = BatchedStepsPerSecond({1: StepsPerSecond([1, 2, 3, 5, 8], [100.0, 80.0, 66.0, 50.0, 36.0])})
# Steeply decreasing: no draft is ever worth verifying, every budget is zero.
PROHIBITIVE_SPS = BatchedStepsPerSecond({1: StepsPerSecond([1, 2, 8], [100.0, 1.0, 0.1])})

METHODS = {
    "plain": dict(policy="plain"),
    "fixed": dict(policy="fixed"),
    "fixed=2": dict(policy="fixed", num_verify_tokens=2),
    # cost_aware=False: whether drafting pays for the drafter's MEASURED time depends on the machine's load; these
    # tests check exactness and that drafts are used (the cost gate has its own test).
    "padded": dict(policy="scheduler", schedule="padded", sps=DECREASING_SPS, cost_aware=False),
    "prefix": dict(policy="scheduler", schedule="prefix", sps=DECREASING_SPS, cost_aware=False),
    "topk": dict(policy="scheduler", schedule="topk", sps=DECREASING_SPS, cost_aware=False),
}


def plain_greedy(target, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    kwargs = {} if eos is None else {"eos_token_id": eos, "pad_token_id": eos}
    out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def in_distribution_prompts(target, count: int) -> list[list[int]]:
    """Prompts of mixed lengths on which the trained drafter is accurate: its training prompts extended by 0..9
    tokens of their own greedy continuation, plus a few truncated ones."""
    prompts = []
    for i, base in enumerate(random_prompts(48, 8, target.config.vocab_size, seed=1)[:count]):
        base = base[0].tolist()
        extra = (3 * i) % 10
        prompts.append(base[: 3 + i] if i % 4 == 3 else base + plain_greedy(target, base, extra) if extra else base)
    return prompts


# ------------------------------------------------------------------------------------------------------------------
# Pure verification math
# ------------------------------------------------------------------------------------------------------------------
def test_greedy_verify_hand_computed():
    # Target argmax per block position: row 0 -> [5, 6, 7], row 1 -> [1, 2, 3], row 2 -> [4, 4, 4].
    logits = torch.full((3, 3, 8), -1.0)
    for r, ids in enumerate([[5, 6, 7], [1, 2, 3], [4, 4, 4]]):
        for j, t in enumerate(ids):
            logits[r, j, t] = 1.0
    drafts = torch.tensor([[5, 0], [1, 2], [4, 4]])
    num = torch.tensor([2, 2, 0])
    accepted, nxt = greedy_verify(drafts, num, logits)
    assert accepted.tolist() == [1, 2, 0]  # mismatch at 2nd draft; all accepted; nothing verified
    assert nxt.tolist() == [6, 3, 4]  # correction; bonus; the target's own token


def drafting_rows(engine: DSparkEngine, caps: list[int]) -> list[int]:
    """The rows the engine's planner drafts this step with these caps (rows past the batch's: no memory)."""
    rows = engine.batch.rows
    states = [RowState(cap, rows[i].memory if i < len(rows) else None) for i, cap in enumerate(caps)]
    table = engine.pricing.sps_table(len(caps))
    return engine.planner.plan(states, table, engine_batching.representative(engine.batch), engine._catch_up).drafting


def allows(engine: DSparkEngine, rows: int) -> bool:
    """The engine's realized gate: whether a step at ``rows`` requests may draft (its state moves, as a step's)."""
    return engine.measurements.drafting_allowed(rows, *engine.planner.explore)


def test_speculative_verify_edge_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 3, 5, generator=g), dim=-1)
    drafts = torch.multinomial(p[:, :2].reshape(-1, 5), 1, generator=g).view(64, 2)
    accepted, _ = speculative_verify(drafts, torch.full((64,), 2), p[:, :2], p, g)
    assert accepted.tolist() == [2] * 64  # q = p is always accepted
    q = torch.zeros(64, 2, 5)
    q[..., 4] = 1.0
    p_no4 = p.clone()
    p_no4[..., 4] = 0
    p_no4 = p_no4 / p_no4.sum(-1, keepdim=True)
    accepted, nxt = speculative_verify(torch.full((64, 2), 4), torch.full((64,), 2), q, p_no4, g)
    assert accepted.tolist() == [0] * 64 and (nxt != 4).all()  # p(x) = 0: always rejected, never resampled


def test_speculative_verify_keeps_target_distribution():
    """Emitted tokens follow p whatever q is: first token ~ p_0, second (when the first draft is accepted) ~ p_1."""
    g = torch.Generator().manual_seed(1)
    rows = 40000
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]])
    drafts = torch.stack([torch.multinomial(q[k], rows, replacement=True, generator=g) for k in range(2)], dim=1)
    accepted, nxt = speculative_verify(drafts, torch.full((rows,), 2), q.expand(rows, -1, -1),
                                       p.expand(rows, -1, -1), g)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    second = torch.where(accepted > 1, drafts[:, 1], nxt)[accepted > 0]
    for tokens, probs in ((first, p[0]), (second, p[1])):
        assert chi_square_pvalue(torch.bincount(tokens, minlength=4), probs.double()) > 1e-3


# ------------------------------------------------------------------------------------------------------------------
# Scheduling the shared budget
# ------------------------------------------------------------------------------------------------------------------
def test_schedule_batch_caps_and_zero_rows():
    conf = torch.tensor([[0.99, 0.99, 0.99, 0.99], [0.0, 0.0, 0.0, 0.0], [0.95, 0.9, 0.9, 0.9]])
    caps = torch.tensor([2, 4, 4])
    flat = FLAT_SPS.table()
    assert schedule_batch(conf, caps, flat, "prefix").tolist() == [2, 0, 4]
    assert schedule_batch(conf, caps, flat, "padded").tolist() == [2, 0, 4]
    assert schedule_batch(conf, caps, flat, "topk", capacity=3).tolist() == [2, 0, 1]
    steep = PROHIBITIVE_SPS.table(3, 15)
    assert schedule_batch(conf, caps, steep, "prefix").tolist() == [0, 0, 0]
    assert schedule_batch(conf, caps, steep, "padded").tolist() == [0, 0, 0]


def test_batched_sps_table_scales_by_tokens_per_request():
    sps = BatchedStepsPerSecond({2: StepsPerSecond([2, 4, 6], [90.0, 60.0, 30.0])})
    table = sps.table(4, 100)
    assert table.shape[0] == 13  # 3 tokens per request profiled: B <= 12 for 4 requests
    assert table[4].item() == pytest.approx(90.0) and table[8].item() == pytest.approx(60.0)
    assert table[6].item() == pytest.approx(75.0) and table[0].item() == 0.0
    assert BatchedStepsPerSecond.from_dict(sps.to_dict()).table(4).tolist() == table.tolist()


# ------------------------------------------------------------------------------------------------------------------
# The ragged cache
# ------------------------------------------------------------------------------------------------------------------
def numbered_cache(rows: int, width: int, start: float = 0.0):
    """Target cache (2 layers) whose entry [r, :, c, :] is start + 100 r + c."""
    target = make_target("llama", layers=2)
    values = start + 100 * torch.arange(rows)[:, None] + torch.arange(width)[None, :]
    kv = values[:, None, :, None].expand(rows, 2, width, 4).float()
    cache = DynamicCache(config=target.config)
    for layer in range(2):
        cache.update(kv.clone(), -kv.clone(), layer)
    return cache


def row_contents(ragged) -> list[list[list[float]]]:
    """Per row, each cache tensor's valid entries in column order (first feature only)."""
    tensors = ragged._tensors()
    return [[t[r, 0, ragged.valid[r], 0].tolist() for t in tensors] for r in range(ragged.num_rows)]


def test_ragged_cache_compact_select_append():
    cache = numbered_cache(3, 6)
    valid = torch.tensor([[1, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 0, 1, 0]], dtype=torch.bool)
    ragged = RaggedBatchCache(cache, valid)
    before = row_contents(ragged)
    assert before[0][0] == [0.0, 2.0, 3.0] and before[0][1] == [-0.0, -2.0, -3.0]
    ragged.compact()
    assert ragged.width == 6 and row_contents(ragged) == before
    assert ragged.valid[0].tolist() == [True, True, True, False, False, False]
    ragged.select_rows(torch.tensor([2, 0]))
    assert row_contents(ragged) == [before[2], before[0]]
    ragged.compact()
    assert ragged.width == 3 and row_contents(ragged) == [before[2], before[0]]
    other = RaggedBatchCache(numbered_cache(1, 5, start=1000.0), torch.ones(1, 5, dtype=torch.bool))
    ragged.append_rows([other])
    ragged.check_aligned()
    assert ragged.width == 5 and row_contents(ragged) == [before[2], before[0], row_contents(other)[0]]


def test_deferred_drafter_context_matches_eager_projection():
    """Features deferred in pieces, flushed for some rows at a time, through row selection, joins and compaction:
    every row's valid context K/V equal the drafter's eager projection of that row's whole feature sequence."""
    target = make_target("llama")
    drafter = make_drafter(target, num_hidden_layers=2)
    width = target.config.hidden_size * len(drafter.target_hidden_states_indices())
    torch.manual_seed(0)
    history: list[list[torch.Tensor]] = [[] for _ in range(3)]  # each row's features in position order

    def defer(context, rows_history, q, counts):
        features = torch.randn(context.num_rows, q, width)
        start = [sum(f.shape[0] for f in h) for h in rows_history]
        positions = torch.tensor(start)[:, None] + torch.arange(q)
        if q % 2:  # the concatenated features, or the taps' hidden states one by one (what the engine passes)
            context.defer(features, positions, counts)
        else:
            context.defer(list(features.chunk(len(drafter.target_hidden_states_indices()), dim=-1)), positions, counts)
        for r, n in enumerate(counts):
            rows_history[r].append(features[r, :n])

    def check(context, rows_history, rows):
        # the pending counts the realized gate prices a catch-up by follow the pending features
        assert context.pending_counts == [sum(entry.count for entry in row) for row in context.pending]
        for r in rows:
            assert context.num_pending(r) == 0
            expected = drafter.new_context_cache()
            feats = torch.cat(rows_history[r])[None]
            drafter.extend_context(expected, feats, 0)
            for layer in range(2):
                got_k = context.cache.keys[layer][r][:, context.valid[r]]
                got_v = context.cache.values[layer][r][:, context.valid[r]]
                torch.testing.assert_close(got_k, expected.keys[layer][0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got_v, expected.values[layer][0], atol=1e-5, rtol=1e-5)

    with torch.no_grad():
        context = DeferredDrafterContext(drafter, 3, torch.device("cpu"))
        defer(context, history, 9, [9, 5, 7])  # a right-padded prefill
        context.flush(drafter, [0, 2])  # rows 0 and 2 draft: row 1 stays pending, gets holes
        assert context.num_pending(1) == 5 and context.width == 9
        check(context, history, [0, 2])
        defer(context, history, 4, [1, 3, 2])  # verify steps: anchor + accepted drafts
        defer(context, history, 2, [2, 1, 1])
        context.flush(drafter, [1, 2])
        check(context, history, [1, 2])
        context.select_rows(torch.tensor([2, 0]))  # row 1 leaves
        history = [history[2], history[0]]
        joining = DeferredDrafterContext(drafter, 1, torch.device("cpu"))
        history.append([])
        defer(joining, history[2:], 6, [6])
        context.append_rows([joining])
        assert context.num_rows == 3 and len(context.pending) == 3
        assert [context.num_pending(r) for r in range(3)] == [0, 3, 6]  # old row 0 did not flush again
        context.flush(drafter, [0, 1, 2])
        check(context, history, [0, 1, 2])
        context.compact()
        check(context, history, [0, 1, 2])
        cache, valid = context.rows_view([2, 0])
        assert valid.shape[0] == 2 and cache.keys[0].shape[0] == 2
        assert torch.equal(cache.keys[1][0], context.cache.keys[1][2])


# ------------------------------------------------------------------------------------------------------------------
# Greedy: every request equals plain generate()
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", sorted(METHODS))
def test_greedy_equality_mixed_lengths(tiny_targets, trained_drafters, family, method):
    target, drafter = tiny_targets[family], trained_drafters[family]
    prompts = in_distribution_prompts(target, 8)
    max_new = [40, 3, 25, 1, 33, 12, 40, 7]
    params = [SamplingParams(max_new_tokens=m) for m in max_new]
    result = generate_batch(target, prompts, drafter, params, max_concurrency=5, **METHODS[method])
    for prompt, m, out in zip(prompts, max_new, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, m), f"request {out.request_id} diverged"
        assert out.finish_reason == "length" and len(out.token_ids) == m
    summary = result.stats.summary()
    assert max(result.stats.active) == 5  # joins: 8 requests through 5 slots
    # the per-batch-size breakdown accounts for every step, its drafting, tokens and seconds
    by_rows = summary["by_active_requests"]
    assert set(by_rows) == set(result.stats.active)
    sides = [side for entry in by_rows.values() for side in entry.values()]
    assert sum(side["steps"] for side in sides) == result.stats.steps
    assert sum(entry["drafting"]["steps"] for entry in by_rows.values()) == sum(
        1 for d in result.stats.drafting if d)
    assert sum(side["emitted"] for side in sides) == sum(result.stats.emitted)
    assert sum(side["verify_tokens"] for side in sides) == sum(result.stats.verify_tokens)
    assert sum(side["seconds"] for side in sides) == pytest.approx(sum(result.stats.seconds))
    assert all(entry["plain"]["verify_tokens"] == 0 for entry in by_rows.values())
    # the cache the steps attended over: at the first step the first five prompts but the one finished by its
    # prefill (max_new_tokens=1), right-padded to the longest
    assert sum(side["cache_columns"] for side in sides) == sum(result.stats.cache_widths)
    assert sum(side["cache_holes"] for side in sides) == sum(result.stats.cache_holes)
    first = [len(p) for p, m in zip(prompts[:5], max_new) if m > 1]
    assert (result.stats.cache_widths[0], result.stats.cache_holes[0]) == (max(first),
                                                                        sum(max(first) - n for n in first))
    assert all(0 <= h < a * w for a, w, h in zip(result.stats.active, result.stats.cache_widths,
                                                 result.stats.cache_holes))
    if method == "plain":
        assert summary["mean_verify_tokens_per_step"] == 0
    else:
        assert max(o.stats.accepted_length for o in result.outputs) >= 2.0, "accepted runs were not exercised"
    if method.startswith("fixed"):
        limit = int(method.split("=")[1]) if "=" in method else drafter.config.block_size
        assert max(v for o in result.outputs for v in o.stats.verified) == limit


@pytest.mark.parametrize("head,block_size", [("none", 1), ("markov", 4), ("gated", 7), ("rnn", 4)])
def test_greedy_equality_random_drafter(tiny_targets, family, head, block_size):
    """Mostly rejected drafts: many holes, so (with blocks longer than one) the cache is compacted on the way."""
    target = tiny_targets[family]
    drafter = make_drafter(target, head=head, block_size=block_size, seed=block_size)
    prompts = [p[0].tolist() for p in random_prompts(5, 6, target.config.vocab_size, seed=7)]
    prompts = [p[: 2 + 2 * i] for i, p in enumerate(prompts)]
    max_new = [30, 19, 1, 26, 9]
    result = generate_batch(target, prompts, drafter, [SamplingParams(max_new_tokens=m) for m in max_new],
                            policy="fixed", max_concurrency=3)
    for prompt, m, out in zip(prompts, max_new, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, m)
    if block_size > 1:
        assert result.stats.compactions > 0


def test_eos_and_length_finish_at_different_times(tiny_targets, trained_drafters, family):
    """Each request has its own EOS (inside an accepted block where possible) or none; they finish at different
    steps and leave the batch while others keep going."""
    target, drafter = tiny_targets[family], trained_drafters[family]
    prompts, params, expected = [], [], []
    for i, prompt in enumerate(random_prompts(48, 8, target.config.vocab_size, seed=1)[:6]):
        prompt = prompt[0].tolist()
        free = plain_greedy(target, prompt, 30)
        position = next((k for k in range(4 + i, len(free)) if free[k] not in free[:k]), None)
        eos = None if i % 3 == 2 or position is None else free[position]
        prompts.append(prompt)
        params.append(SamplingParams(max_new_tokens=30, eos_token_id=[] if eos is None else eos))
        expected.append((plain_greedy(target, prompt, 30, eos), "length" if eos is None else "eos"))
    result = generate_batch(target, prompts, drafter, params, policy="fixed")
    reasons = set()
    for out, (tokens, reason) in zip(result.outputs, expected):
        assert out.token_ids == tokens and out.finish_reason == reason
        reasons.add(reason)
    assert reasons == {"eos", "length"}
    assert len({o.stats.rounds for o in result.outputs}) > 2 and min(result.stats.active) < 6


@pytest.mark.parametrize("method", ["fixed", "prefix"])
def test_joins_mid_flight_and_streaming(tiny_targets, trained_drafters, method):
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 7)
    max_new = [30, 20, 5, 30, 12, 25, 18]
    engine = DSparkEngine(target, drafter, **METHODS[method])
    streamed: dict[str, list[int]] = {}
    finished: list[str] = []

    def consume(events):
        for event in events:
            assert event.request_id not in finished, "a finished request emitted tokens"
            streamed.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finished:
                finished.append(event.request_id)

    ids = [engine.add_request(p, SamplingParams(max_new_tokens=m)) for p, m in zip(prompts[:3], max_new[:3])]
    for _ in range(3):
        consume(engine.step())
    assert engine.num_active >= 1  # the 30-token request cannot be done yet: the next ones join mid-flight
    ids += [engine.add_request(torch.tensor([p]), SamplingParams(max_new_tokens=m), request_id=f"late{i}")
            for i, (p, m) in enumerate(zip(prompts[3:6], max_new[3:6]))]
    consume(engine.step())
    assert engine.num_active >= 4
    consume(engine.step())
    ids.append(engine.add_request(prompts[6], SamplingParams(max_new_tokens=max_new[6])))
    consume(engine.stream())
    assert sorted(finished) == sorted(ids)
    for request_id, prompt, m in zip(ids, prompts, max_new):
        expected = plain_greedy(target, prompt, m)
        assert engine.outputs[request_id].token_ids == expected == streamed[request_id]


@pytest.mark.parametrize("hold,calls,held", [(0, 3, 0), (0.25, 3, 0), (2, 2, 2)])
def test_admission_hold_lets_joiners_share_a_prefill(tiny_targets, hold, calls, held):
    """Two slots, four requests. A (3 tokens) leaves after step 2, when B (5 tokens) still has 2 to go. Held, A's slot
    waits the two steps for B's and C and D share one prefill forward; with too small a budget for B's two steps
    (0.25 * 2 slots * 2 generations, this one and D's = 1 slot-step), or none, C joins at once and D after B.
    Outputs never change."""
    target = tiny_targets["llama"]
    prompts = [p[0].tolist()[: 3 + i] for i, p in enumerate(random_prompts(4, 8, target.config.vocab_size, seed=3))]
    max_new = [3, 5, 6, 4]
    result = generate_batch(target, prompts, None, [SamplingParams(max_new_tokens=m) for m in max_new],
                            policy="plain", max_concurrency=2, admission_hold=hold)
    for prompt, m, out in zip(prompts, max_new, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, m)
    summary = result.stats.summary()
    assert (summary["prefill_calls"], summary["held_slot_steps"]) == (calls, held)
    assert result.stats.active[:5] == ([2, 2, 1, 1, 2] if held else [2, 2, 2, 2, 2])


def test_admission_is_not_held_without_a_queue_or_a_row_about_to_finish(tiny_targets):
    target = tiny_targets["llama"]
    prompts = [p[0].tolist() for p in random_prompts(4, 6, target.config.vocab_size, seed=4)]
    # C alone waits for A's slot: it can join now, holding could merge nothing
    three = generate_batch(target, prompts[:3], None, [SamplingParams(max_new_tokens=m) for m in (3, 5, 4)],
                           policy="plain", max_concurrency=2, admission_hold=8)
    assert three.stats.held_slot_steps == 0 and three.stats.prefill_calls == 2
    # B has 20 tokens to go when A leaves, more than the budget's 16 steps (4 * 2 slots * 2 generations): C and D
    # do not wait for it
    four = generate_batch(target, prompts, None, [SamplingParams(max_new_tokens=m) for m in (3, 23, 4, 4)],
                          policy="plain", max_concurrency=2, admission_hold=4)
    assert four.stats.held_slot_steps == 0 and four.stats.prefill_calls == 3
    with pytest.raises(ValueError, match="admission_hold"):
        DSparkEngine(target, policy="plain", admission_hold=-1)


def test_hold_budget_prices_each_generation_the_queue_fills():
    # one batch of slot-steps per generation: this one, and each later one the queue beyond the free slots fills
    assert hold_budget(1.0, 16, waiting=17, free=16) == 32
    assert hold_budget(1.0, 16, waiting=48, free=5) == 64  # 43 beyond: 3 later generations
    assert hold_budget(1.0, 16, waiting=20, free=1) == 48  # 19 beyond: 2 later generations, under the cap
    assert hold_budget(0.5, 16, waiting=500, free=1) == 0.5 * 16 * ADMISSION_HOLD_GENERATIONS  # capped
    assert hold_budget(1.0, 2, waiting=2, free=1) == 4


@pytest.mark.parametrize("queued,held", [(2, 0), (4, 3)])
def test_a_longer_queue_holds_longer(tiny_targets, queued, held):
    """Two slots. A (3 tokens) leaves after step 2, when B (6 tokens) still has 3 to go. At hold 0.5 the budget is a
    slot-step per generation: with two requests queued (this generation and one more) A's slot may wait 2 steps, not
    B's 3; with four queued (two more generations) it waits the 3 and B's successor joins with A's."""
    target = tiny_targets["llama"]
    prompts = [p[0].tolist() for p in random_prompts(2 + queued, 6, target.config.vocab_size, seed=5)]
    max_new = [3, 6] + [4] * queued
    result = generate_batch(target, prompts, None, [SamplingParams(max_new_tokens=m) for m in max_new],
                            policy="plain", max_concurrency=2, admission_hold=0.5)
    for prompt, m, out in zip(prompts, max_new, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, m)
    assert result.stats.summary()["held_slot_steps"] == held


def test_scheduler_on_and_off(tiny_targets, trained_drafters):
    """With a flat SPS curve the scheduler admits every draft: exactly the fixed method's verification; with a
    decreasing curve it verifies fewer drafts; outputs are the same either way."""
    target, drafter = tiny_targets["qwen3"], trained_drafters["qwen3"]
    prompts = in_distribution_prompts(target, 6)
    params = SamplingParams(max_new_tokens=24)
    fixed = generate_batch(target, prompts, drafter, params, policy="fixed")
    flat = generate_batch(target, prompts, drafter, params, policy="scheduler", sps=FLAT_SPS, cost_aware=False)
    scheduled = generate_batch(target, prompts, drafter, params, policy="scheduler", sps=DECREASING_SPS)
    assert flat.stats.verify_tokens == fixed.stats.verify_tokens
    assert sum(scheduled.stats.verify_tokens) < sum(fixed.stats.verify_tokens)
    for a, b, c in zip(fixed.outputs, flat.outputs, scheduled.outputs):
        assert a.token_ids == b.token_ids == c.token_ids


def test_zero_budget_requests_skip_drafting(tiny_targets, trained_drafters, monkeypatch):
    """When no draft is worth verifying every budget is zero: requests stop drafting (only probes refresh their
    confidences, ever more rarely: each fruitless one doubles the wait) and decode exactly like plain greedy."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 5)
    probe = 3
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=PROHIBITIVE_SPS, probe_interval=probe)
    # probe as if a certain draft could pay (see the next test)
    engine.planner.drafts_can_pay = lambda caps, table, rows=None: True
    monkeypatch.setattr(engine_batching, "representative", lambda batch: True)  # the gate may measure on step 1
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
    engine.run()
    assert sum(engine.stats.verify_tokens) == 0
    for prompt, out in zip(prompts, [engine.outputs[i] for i in ids]):
        assert out.token_ids == plain_greedy(target, prompt, 20)
        drafted_rounds = [k for k, d in enumerate(out.stats.drafted) if d]
        gaps = [b - a for a, b in zip(drafted_rounds, drafted_rounds[1:])]
        assert drafted_rounds[0] == 0 and gaps == [probe * 2 ** (k + 1) + 1 for k in range(len(gaps))], gaps
        assert len(gaps) >= 1


def test_no_drafting_when_even_certain_drafts_cannot_pay(tiny_targets, trained_drafters):
    """At a batch size where not even certain drafts would be verified, nothing drafts, not even probes, and the
    drafter's context is never built (the target features stay pending); once few enough requests remain for drafts
    to pay, the pending features are projected and drafting starts. Outputs equal plain greedy."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 4)
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=PROHIBITIVE_SPS)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    for _ in range(5):
        engine.step()
    assert sum(engine.stats.drafting) == 0 and engine.batch.context.width == 0
    batch = engine.batch
    assert all(batch.context.num_pending(r) == len(request.prompt_ids) + 5 for r, request in enumerate(batch.rows))
    engine.run()
    for request_id, prompt in zip(ids, prompts):
        assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 12)
    # A batch-dependent profile: drafts may pay for one request, never for four.
    sizes = BatchedStepsPerSecond({1: StepsPerSecond([1, 2, 8], [100.0, 90.0, 50.0]),
                                   4: StepsPerSecond([4, 8, 32], [100.0, 1.0, 0.1])})
    max_new = [3, 3, 3, 20]
    result = generate_batch(target, prompts, drafter, [SamplingParams(max_new_tokens=m) for m in max_new],
                            policy="scheduler", sps=sizes)
    drafting = result.stats.drafting
    assert sum(drafting[:2]) == 0 and sum(drafting) > 0  # only once the last request is alone
    for prompt, m, out in zip(prompts, max_new, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, m)


def test_lone_drafts_wait_until_enough_rows_draft_together(tiny_targets, trained_drafters):
    """In the padded batch one request's draft widens every row: with this profile a certain draft of k rows pays
    only when k > 0.39 R (width 2 costs 100/72 of width 1), so no step drafts fewer rows than that. Exact outputs."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 6)
    sps = BatchedStepsPerSecond({1: StepsPerSecond([1, 2, 8], [100.0, 72.0, 20.0])})
    max_new = [24, 6, 18, 9, 24, 13]
    result = generate_batch(target, prompts, drafter, [SamplingParams(max_new_tokens=m) for m in max_new],
                            policy="scheduler", sps=sps, max_concurrency=4, cost_aware=False, probe_interval=1)
    steps = list(zip(result.stats.active, result.stats.drafting))
    assert all(k == 0 or 100 * k > 38.9 * r for r, k in steps), steps
    assert any(k for _, k in steps)
    for prompt, m, out in zip(prompts, max_new, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, m)


def test_joining_requests_start_from_the_confidence_prior(tiny_targets, trained_drafters):
    """A joining request is judged by the mean confidences of the drafts so far: a prior predicting no budget makes it
    wait for its first probe (``probe_interval`` steps); a confident prior, or no prior, lets it draft at once."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 2)
    g, probe = drafter.config.block_size, 3
    runs = {}
    for name, prior in (("off", None), ("none", "none"), ("zeros", 0.0), ("ones", 1.0)):
        engine = DSparkEngine(target, drafter, policy="scheduler", sps=DECREASING_SPS, cost_aware=False,
                              probe_interval=probe, confidence_prior=prior is not None)
        if isinstance(prior, float):
            engine.measurements.record_confidences([prior] * g, 1)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
        engine.run()
        runs[name] = engine.stats.drafting
        for request_id, prompt in zip(ids, prompts):
            assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 10)
    assert runs["off"][0] == runs["none"][0] == runs["ones"][0] == 2
    assert runs["zeros"][:probe + 1] == [0] * probe + [2]


def test_the_confidence_prior_carries_over_to_a_new_engine(tiny_targets, trained_drafters, tmp_path):
    """The mean confidences of every draft live in the ``EngineMeasurements``: an engine sharing them (or loading them
    from a file) starts its first requests from that prior instead of drafting each one to find out. Files written
    before the prior load without one; a prior of another block size is refused."""
    from hf_dspark.engine import EngineMeasurements

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    g, probe = drafter.config.block_size, 3
    prompts = in_distribution_prompts(target, 2)
    first = DSparkEngine(target, drafter, policy="scheduler", sps=DECREASING_SPS, cost_aware=False,
                         probe_interval=probe)
    for p in prompts:
        first.add_request(p, SamplingParams(max_new_tokens=10))
    first.run()
    drafted = sum(first.stats.drafting)
    assert first.measurements.confidence_count == drafted > 0
    prior = first.measurements.confidence_prior()
    assert len(prior) == g and all(0.0 <= v <= 1.0 for v in prior)
    path = first.measurements.save(tmp_path / "m.json")
    loaded = EngineMeasurements.load(path)
    assert loaded.confidence_prior() == pytest.approx(prior) and loaded.confidence_count == drafted
    loaded.confidence_sum, loaded.confidence_count = [0.0] * g, 1  # a prior predicting nothing: wait for a probe
    second = DSparkEngine(target, drafter, policy="scheduler", sps=DECREASING_SPS, cost_aware=False,
                          probe_interval=probe, measurements=loaded)
    ids = [second.add_request(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    second.run()
    assert second.stats.drafting[:probe] == [0] * probe
    for request_id, p in zip(ids, prompts):
        assert second.outputs[request_id].token_ids == plain_greedy(target, p, 10)
    old = first.measurements.to_dict()
    del old["confidence_prior"]
    assert EngineMeasurements.from_dict(old).confidence_prior() is None
    with pytest.raises(ValueError, match="positions"):
        loaded.record_confidences([0.5] * (g + 1), 1)


def test_skip_decisions_use_the_smoothed_confidences(tiny_targets, trained_drafters):
    """Whether a request drafts is judged by the moving average of its drafts' confidences: one unconfident draft
    after confident ones keeps it drafting under the default smoothing, and stops it with smoothing 1 (the last
    draft alone). The top-K capacity keeps reading the last draft's confidences."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    g = drafter.config.block_size
    for smoothing, drafts in ((0.1, True), (1.0, False)):
        engine = DSparkEngine(target, drafter, policy="scheduler", sps=DECREASING_SPS, cost_aware=False,
                              probe_interval=64, max_probe_interval=64, confidence_smoothing=smoothing,
                              online_correction=False)
        engine.add_request(in_distribution_prompts(target, 1)[0], SamplingParams(max_new_tokens=30))
        engine.step()
        request = engine.batch.rows[0]
        request.memory = ConfidenceMemory(64, 64, smoothing, prior=torch.full((g,), 0.9))
        request.memory.drafted(torch.full((g,), 0.01), verified=1)
        assert request.memory.smoothed[0].item() == pytest.approx((1 - smoothing) * 0.9 + smoothing * 0.01)
        caps = [min(g, r.remaining - 1) for r in engine.batch.rows]
        assert (drafting_rows(engine, caps) == [0]) is drafts
        assert engine.planner.stale_confidences([r.memory for r in engine.batch.rows])[0][0, 0].item() == pytest.approx(0.01, abs=1e-6)
    with pytest.raises(ValueError, match="confidence_smoothing"):
        DSparkEngine(target, drafter, policy="scheduler", confidence_smoothing=1.5)


def test_drafting_skipped_when_it_cannot_pay_for_itself(tiny_targets, trained_drafters):
    """Verification is free (flat SPS) but the drafter is (made) far too slow: with ``cost_aware`` the requests
    draft only when a probe is due; without it they draft every step. Outputs equal plain greedy either way."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 4)
    results = {}
    for cost_aware in (True, False):
        engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, probe_interval=4,
                              cost_aware=cost_aware)
        engine.measurements.draft_cost = {b: 10.0 for b in (1, 2, 4, 8)}  # seconds per drafter step: never worth it
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
        engine.run()
        for request_id, prompt in zip(ids, prompts):
            assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 24)
        results[cost_aware] = sum(engine.stats.drafting) / sum(engine.stats.active)
    assert results[False] > 0.9
    assert results[True] < 0.4, results


def test_engine_remeasures_a_losing_drafting_side_on_its_own_budget():
    """In a batch a re-measurement of drafting costs more than its steps' shortfall (its extra tokens make requests
    finish apart), so the engine spends a fifth of single-sequence generation's exploration budget and lets the wait
    grow to ``ENGINE_MAX_EXPLORE_INTERVAL`` steps. SmolLM2-like numbers at 16 requests: drafting steps of 80 ms
    emitting 22 tokens (275 tok/s) against plain steps of 44 ms (364 tok/s): re-measured after ~890 plain steps, where
    the single-sequence budget would re-measure after ~180; with a 0.1 s context catch-up to pay as well (16 rows
    that decoded plain since), after ~3150, which the cap (4096) leaves to the budget."""
    from hf_dspark.engine import ENGINE_EXPLORE_BUDGET, ENGINE_MAX_EXPLORE_INTERVAL
    from hf_dspark.gate import EXPLORE_BUDGET

    target = make_target("llama")
    drafter = make_drafter(target)

    def plain_steps_until_remeasured(catch_up: float = 0.0, **kwargs) -> int:
        engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, **kwargs)
        for _ in range(4):
            engine.measurements.record_step(16, True, emitted=22, seconds=0.08)
        steps, config = 0, engine.config
        while not engine.measurements.drafting_allowed(16, config.explore_interval, config.max_explore_interval,
                                                       config.explore_budget, True, catch_up):
            engine.measurements.record_step(16, False, emitted=16, seconds=0.044)
            steps += 1
            assert steps <= 5000
        return steps

    assert ENGINE_EXPLORE_BUDGET == pytest.approx(EXPLORE_BUDGET / 5) and ENGINE_MAX_EXPLORE_INTERVAL == 4096
    engine_default = plain_steps_until_remeasured()
    single_sequence = plain_steps_until_remeasured(explore_budget=EXPLORE_BUDGET, max_explore_interval=256)
    # expected loss 2 x 0.08 s x (1 - 275/364): re-measured once the plain steps' seconds reach it / budget
    loss = 2 * 0.08 * (1 - 275 / (16 / 0.044))
    assert abs(engine_default - loss / ENGINE_EXPLORE_BUDGET / 0.044) <= 2, engine_default
    assert abs(single_sequence - loss / EXPLORE_BUDGET / 0.044) <= 2, single_sequence
    assert engine_default > 4 * single_sequence
    with_catch_up = plain_steps_until_remeasured(catch_up=0.1)
    assert abs(with_catch_up - (loss + 0.1) / ENGINE_EXPLORE_BUDGET / 0.044) <= 2, with_catch_up
    # the cap still bounds the wait where the budget alone would wait longer
    assert plain_steps_until_remeasured(catch_up=1.0) == ENGINE_MAX_EXPLORE_INTERVAL


def test_realized_gate_decisions():
    """The realized gate's bookkeeping: drafting is free to go until measured twice; then plain steps at once until
    plain is measured twice at that batch size too; once both are measured, the faster side (tokens over seconds of its
    last 32 steps) wins, a losing drafting side is re-measured after a doubling wait, and while drafting wins the plain
    side is still refreshed every ``explore_interval`` steps. At 16 requests and more (32-step windows; smaller batch
    sizes keep longer ones, ``realized_window``)."""
    target = make_target("llama")
    drafter = make_drafter(target)
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, explore_interval=3,
                          max_explore_interval=12, explore_budget=0)  # the doubling wait alone
    assert engine.planner.realized_gate
    assert allows(engine, 16)
    engine.measurements.record_step(16, True, emitted=8, seconds=0.1)
    assert allows(engine, 16)  # one drafting step is not a measurement yet
    engine.measurements.record_step(16, True, emitted=8, seconds=0.1)
    assert not allows(engine, 16)  # drafting measured twice, plain never: measure plain now
    engine.measurements.record_step(16, False, emitted=4, seconds=0.04)  # plain: 100 tok/s beats drafting's 80
    assert not allows(engine, 16)  # plain measured once: measure it again (VERDICT_ROUNDS)
    assert allows(engine, 8)  # no verdict at 16 yet for 8 to take
    engine.measurements.record_step(16, False, emitted=4, seconds=0.04)
    assert not allows(engine, 16)  # the verdict: plain
    assert allows(engine, 4)  # a much smaller batch size is judged on its own
    # one within half of 16 (a draining batch) takes its verdict
    assert not allows(engine, 8)
    assert not allows(engine, 12)
    # a larger one not measured yet: drafting lost at 16, so not here
    assert not allows(engine, 32)
    engine.measurements.record_step(32, True, emitted=24, seconds=0.1)
    engine.measurements.record_step(32, True, emitted=24, seconds=0.1)
    # measured twice at 32 itself, plain never: plain at 32 now
    assert not allows(engine, 32)
    assert not allows(engine, 64)  # 32 has no plain steps: 16 (drafting lost) decides
    engine.measurements.record_step(16, False, emitted=4, seconds=0.04)
    assert allows(engine, 16)  # 3 steps since drafting last ran: re-measure it
    engine.measurements.record_step(16, True, emitted=8, seconds=0.1)
    assert allows(engine, 16)  # a re-measurement runs REMEASURE_ROUNDS (2) drafting steps
    engine.measurements.record_step(16, True, emitted=8, seconds=0.1)  # still 80 tok/s: the next one waits 6 steps
    for _ in range(5):
        engine.measurements.record_step(16, False, emitted=4, seconds=0.04)
        assert not allows(engine, 16)
    engine.measurements.record_step(16, False, emitted=4, seconds=0.04)
    assert allows(engine, 16)  # 6 steps: re-measure (the wait is now 12, at most 12)
    assert engine.measurements.explore_wait[16] == 12
    engine.measurements.record_step(16, True, emitted=8, seconds=0.1)
    engine.measurements.record_step(16, True, emitted=18, seconds=0.1)  # this re-measurement: 26 / 0.2 s = 130 tok/s
    assert engine.measurements.realized_rate(16, True) < 100  # the whole window (the old losing steps) would say lose
    # drafting wins: waits reset
    assert allows(engine, 16) and engine.measurements.explore_wait[16] == 3
    assert allows(engine, 24)  # and a larger batch size not yet measured may try again
    engine.measurements.record_step(16, True, emitted=40, seconds=0.1)
    assert not allows(engine, 16)  # winning, but plain last measured 3 steps ago: refresh it
    engine.measurements.record_step(16, False, emitted=4, seconds=0.04)
    assert allows(engine, 16)
    for _ in range(40):  # the window keeps the last 32 plain steps: one slow step moves the rate a little
        engine.measurements.record_step(16, False, emitted=4, seconds=0.04)
    engine.measurements.record_step(16, False, emitted=4, seconds=0.4)
    assert engine.measurements.realized_rate(16, False) == pytest.approx(128 / (31 * 0.04 + 0.4))
    assert not DSparkEngine(target, drafter, policy="scheduler", cost_aware=False).planner.realized_gate
    assert not DSparkEngine(target, drafter, policy="fixed").planner.realized_gate
    with pytest.raises(ValueError, match="explore_interval must be >= 1"):
        DSparkEngine(target, drafter, policy="scheduler", explore_interval=0)
    with pytest.raises(ValueError, match="explore_budget must be in"):
        DSparkEngine(target, drafter, policy="scheduler", explore_budget=-0.1)
    with pytest.raises(ValueError, match="max_explore_interval"):
        DSparkEngine(target, drafter, policy="scheduler", explore_interval=8, max_explore_interval=4)


def test_gate_refusal_skips_the_drafting_decision(monkeypatch):
    """Where the realized gate rules drafting out at a batch size, the step skips the confidences and schedules of
    the drafting decision (it could only end in "no drafting"); elsewhere the decision runs as before."""
    target = make_target("llama")
    engine = DSparkEngine(target, make_drafter(target), policy="scheduler", sps=FLAT_SPS, explore_budget=0)
    for drafted, emitted, seconds in ((True, 8, 0.1), (True, 8, 0.1), (False, 4, 0.04)):
        engine.measurements.record_step(4, drafted, emitted=emitted, seconds=seconds)  # drafting lost at 4 rows
    config = engine.config
    assert engine.measurements.drafting_verdict(4, config.explore_interval, config.max_explore_interval, 0) == (
        False, None)

    def decided(*args, **kwargs):
        raise AssertionError("the drafting decision ran")

    monkeypatch.setattr(engine.planner, "stale_confidences", decided)
    assert drafting_rows(engine, [3, 3, 3, 3]) == []  # refused at 4 rows: nothing else computed
    assert engine.planner.gate_ruled_out  # nor is the cost model checked on that step (it decided nothing)
    with pytest.raises(AssertionError, match="the drafting decision ran"):
        drafting_rows(engine, [3])  # 1 row: drafting free there, so the decision runs
    assert not engine.planner.gate_ruled_out


def test_steps_the_gate_ruled_out_do_not_check_the_cost_model(tiny_targets, trained_drafters):
    """The cost model's factor (``model_factor``) learns from the steps it decided. A step whose drafting the
    realized gate ruled out before asking the model is not one of them (and pricing it would re-price the SPS
    table every step); a plain step the model chose is."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = [p[:8] for p in in_distribution_prompts(target, 8) if len(p) >= 8][:4]
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, explore_budget=0,
                          max_explore_interval=10_000, explore_interval=10_000)
    for drafted, emitted, seconds in ((True, 8, 1.0), (True, 8, 1.0), (False, 4, 0.01), (False, 4, 0.01)):
        engine.measurements.record_step(4, drafted, emitted=emitted, seconds=seconds)  # drafting lost at 4 rows
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    engine.run()
    for request_id, prompt in zip(ids, prompts):
        assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 12)
    ruled_out = engine.stats.skips.get("gate", 0)
    at_four = sum(1 for rows in engine.stats.active if rows == 4)
    assert ruled_out >= at_four - 1 > 0 and not any(engine.stats.drafting)
    checked = sum(len(window) for (bucket, drafted), window in engine.measurements.model_checks.items()
                  if not drafted)
    assert checked == engine.stats.steps - ruled_out, (checked, engine.stats.steps, ruled_out)


def _fake_request(index: int, probe_wait: int = 4, confidence: float | None = None, block_size: int = 4):
    """An active request past its first step (the realized gate counts its steps), for the drafting decision alone;
    ``confidence``: what its earlier drafts predict at every position (None: nothing yet)."""
    from hf_dspark.stats import DSparkStats
    from hf_dspark.engine.requests import Request

    prior = None if confidence is None else torch.full((block_size,), confidence)
    return Request(str(index), [1, 2, 3], SamplingParams(max_new_tokens=16), frozenset(), DSparkStats(4), 0.0,
                   tokens=[5, 6, 7], length=5, memory=ConfidenceMemory(probe_wait, 64, prior=prior))


def test_probe_steps_check_the_cost_model():
    """A step that drafts only because probes are due still carries the cost model's prediction, so what it delivers
    checks the model too: checked only on the steps it chose to draft (those whose stale confidences looked best), the
    model would learn its own optimism (a winner's curse) and, its drafting factor pulled down, stop drafting where
    fixed-length drafting wins."""
    target = make_target("llama")
    probing = DSparkEngine(target, make_drafter(target), policy="scheduler", sps=FLAT_SPS, realized_gate=False,
                           probe_interval=2)
    probing.batch.rows[:] = [_fake_request(i, 2, 0.9, probing.block_size) for i in range(2)]
    probing.measurements.record_draft(2, 10.0)  # a drafter so slow that the model never drafts by itself
    assert drafting_rows(probing, [3, 3]) == [] and probing.planner.prediction is None
    probing.batch.rows[1].memory.idle = 2  # its probe is due
    assert drafting_rows(probing, [3, 3]) == [0, 1]
    # priced with the drafter's cost
    assert probing.planner.prediction is not None and probing.planner.prediction[1] > 10.0


@pytest.fixture
def slow_catch_up(tiny_targets, monkeypatch):
    """Drafting made to cost more than the model of ``cost_aware`` knows: the drafter context's catch-up sleeps, while
    that model is pinned to "drafting pays" (it does not see the catch-up's cost, and the drafter's own measured time
    must not decide these tests on a loaded machine). Returns four 8-token prompts for the llama target."""
    import time

    flush = DeferredDrafterContext.flush

    def slow_flush(self, *args, **kwargs):
        time.sleep(0.15)  # far above a plain step of the tiny model, even on a loaded machine
        return flush(self, *args, **kwargs)

    monkeypatch.setattr(DeferredDrafterContext, "flush", slow_flush)
    monkeypatch.setattr(Planner, "_pays", lambda self, *args, **kwargs: True)
    target = tiny_targets["llama"]
    return [p[:8] for p in in_distribution_prompts(target, 8) if len(p) >= 8][:4]


def test_realized_gate_stops_drafting_that_costs_more_than_the_model_knows(tiny_targets, trained_drafters,
                                                                          slow_catch_up):
    """A cost outside the model of ``cost_aware`` (here: the drafter context's catch-up, made slow) makes drafting
    steps deliver fewer tokens per second than plain ones: the realized gate then decodes plain (re-measuring
    drafting now and then); without it every step drafts. Outputs equal plain greedy either way."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = slow_catch_up
    results = {}
    for gate in (True, False):
        engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, realized_gate=gate,
                              explore_interval=3, probe_interval=1)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=64)) for p in prompts]
        engine.run()
        for request_id, prompt in zip(ids, prompts):
            assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 64)
        results[gate] = sum(engine.stats.drafting) / sum(engine.stats.active)
    assert results[False] > 0.9
    assert results[True] < 0.5, results


def test_measurements_carry_over_to_a_new_engine(tiny_targets, trained_drafters, slow_catch_up, tmp_path):
    """What one engine measured (drafting loses at R = 4, through a slow context catch-up) reaches a later engine
    through a saved ``EngineMeasurements``: the first engine drafts at its first step to find out, the second starts
    plain at that batch size. Outputs equal plain greedy in both; measurements of another setup are refused."""
    from hf_dspark.engine import EngineMeasurements

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = slow_catch_up
    path = tmp_path / "measurements.json"
    drafting = []
    for _ in range(2):
        measurements = EngineMeasurements.load(path) if path.exists() else None
        engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, explore_interval=3,
                              probe_interval=1, measurements=measurements)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=32)) for p in prompts]
        engine.run()
        for request_id, prompt in zip(ids, prompts):
            assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 32)
        drafting.append(engine.stats.drafting[:3])
        engine.measurements.save(path)
    # the first engine drafts from its second step (its first, every request's first, does not measure drafting)
    assert drafting[0][0] == 0 and drafting[0][1] > 0 and drafting[1] == [0, 0, 0], drafting
    loaded = EngineMeasurements.load(path)
    assert loaded.to_dict() == engine.measurements.to_dict()
    timed = EngineMeasurements(loaded.key)
    for _ in range(3):
        timed.record_verify(4, 2, 0.1)
    assert EngineMeasurements.from_dict(timed.to_dict()).verify_count == {(4, 2): 3}
    old_format = timed.to_dict()  # files written before timing counts: [rows, width, seconds], one timing each
    old_format["verify_cost"] = [entry[:3] for entry in old_format["verify_cost"]]
    assert set(EngineMeasurements.from_dict(old_format).verify_count.values()) == {1}
    old_format["verify_cost"][0] = old_format["verify_cost"][0][:2]
    with pytest.raises(ValueError, match="verify_cost entry"):
        EngineMeasurements.from_dict(old_format)
    assert loaded.realized_rate(4, True) < loaded.realized_rate(4, False)
    with pytest.raises(ValueError, match="other conditions.*model"):
        DSparkEngine(tiny_targets["qwen3"], trained_drafters["qwen3"], policy="scheduler", measurements=loaded)
    with pytest.raises(ValueError, match="not an engine measurements file"):
        EngineMeasurements.from_dict({"key": {}})


def test_context_catch_ups_are_timed_and_price_a_remeasurement(tiny_targets, trained_drafters, monkeypatch):
    """Each drafting step times the projection of its rows' pending target features (the context catch-up), and the
    engine prices the next one at the measured seconds per position: what the realized gate adds to a
    re-measurement's expected loss (``RealizedGate.drafting_allowed(catch_up=)``). The prices travel with saved
    measurements; files written before them load with none."""
    from hf_dspark.engine import EngineMeasurements

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = [p[:8] for p in in_distribution_prompts(target, 8) if len(p) >= 8][:4]
    asked = []
    allowed = EngineMeasurements.drafting_allowed

    def spy(self, *args, **kwargs):
        asked.append(args[5] if len(args) > 5 else kwargs.get("catch_up", 0.0))
        return allowed(self, *args, **kwargs)

    monkeypatch.setattr(EngineMeasurements, "drafting_allowed", spy)
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, probe_interval=1)
    pending_at_flush = []
    flush = DeferredDrafterContext.flush

    def recording_flush(self, drafter_, rows):
        pending_at_flush.append(sum(self.num_pending(r) for r in rows))
        return flush(self, drafter_, rows)

    monkeypatch.setattr(DeferredDrafterContext, "flush", recording_flush)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
    engine.run()
    for request_id, prompt in zip(ids, prompts):
        assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 24)
    measured = engine.measurements
    assert sum(engine.stats.drafting) > 0 and pending_at_flush[0] >= 4 * 8  # the first catch-up: the prompts
    assert [p for p, _ in measured.catch_up] == [p for p in pending_at_flush if p][-len(measured.catch_up):]
    per_position = sum(s for _, s in measured.catch_up) / sum(p for p, _ in measured.catch_up)
    assert per_position > 0 and measured.catch_up_seconds(100) == pytest.approx(100 * per_position)
    # the gate was asked with the price of the drafting rows' pending positions (none pending on the first ask)
    assert asked and all(c >= 0 for c in asked) and asked[0] == 0.0
    engine.add_request(prompts[0], SamplingParams(max_new_tokens=4))
    engine._admit()
    assert engine._catch_up([0]) == pytest.approx(measured.catch_up_seconds(len(prompts[0])))
    assert engine._catch_up([]) == 0.0
    loaded = EngineMeasurements.from_dict(measured.to_dict())
    assert list(loaded.catch_up) == list(measured.catch_up)
    old_file = measured.to_dict()
    del old_file["catch_up"]
    assert EngineMeasurements.from_dict(old_file).catch_up_seconds(100) == 0.0
    with pytest.raises(ValueError, match="catch-up needs"):
        measured.record_catch_up(0, 0.1)
    with pytest.raises(ValueError, match="catch_up entry"):
        EngineMeasurements.from_dict({**old_file, "catch_up": [[1, 2, 3]]})


def test_batch_progress_counts_what_the_batch_as_a_whole_advanced():
    """Hand-computed: rows times how much the step lowered the most new tokens any row has left."""
    from hf_dspark.engine import batch_progress

    assert batch_progress([10, 10, 10, 10], [1, 1, 1, 1]) == 4  # a plain step: its rows
    assert batch_progress([10, 10, 10, 10], [5, 3, 1, 2]) == 4  # in step: the slowest row decides
    assert batch_progress([10, 10, 10, 10], [5, 3, 2, 2]) == 8
    assert batch_progress([20, 19], [5, 1]) == 2 * 2  # 20 -> 15, but 19 -> 18 is now the most left
    assert batch_progress([20, 12], [5, 1]) == 2 * 5  # out of step: the furthest row's advance
    assert batch_progress([7], [4]) == 4  # one request: what it emitted
    assert batch_progress([30, 3], [1, 1]) == 2  # a row ended by EOS (or length) counts as having advanced
    with pytest.raises(ValueError, match="one emitted count per row"):
        batch_progress([3, 3], [1])


@pytest.mark.parametrize("gate_tokens", ["progress", "emitted"])
def test_realized_gate_counts_the_batch_progress_of_each_step(tiny_targets, trained_drafters, gate_tokens, tmp_path):
    """``gate_tokens="progress"`` (the default): the realized gate records each step's ``batch_progress``, so drafts
    accepted by some rows and not by the one furthest from done count for nothing (the batch still waits for it);
    ``"emitted"``: the tokens emitted. Outputs equal plain greedy either way. The count travels with the
    measurements, and windows counted the other way are refused."""
    from hf_dspark.engine import EngineMeasurements, batch_progress

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 4)
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, probe_interval=1,
                          gate_tokens=gate_tokens)
    recorded = []
    record = engine.measurements.record_step

    def spy(rows, drafted, output, seconds):
        recorded.append((rows, drafted, output))
        return record(rows, drafted, output, seconds)

    engine.measurements.record_step = spy
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
    expected, differs = [], 0
    engine.step()  # admission and the step where every request takes its first step (not recorded)
    recorded.clear()
    while engine.has_unfinished():
        left = {r.request_id: r.remaining for r in engine.batch.rows}
        events = engine.step()
        new = {e.request_id: len(e.token_ids) for e in events if e.request_id in left}
        progress = batch_progress(list(left.values()), [new[k] for k in left])
        emitted = sum(new.values())
        expected.append(progress if gate_tokens == "progress" else emitted)
        differs += progress != emitted
    assert [output for _, _, output in recorded] == expected
    assert differs > 0  # some drafting step's drafts were accepted beyond the furthest request's
    if gate_tokens == "progress":
        assert all(output == rows for rows, drafted, output in recorded if not drafted)
    for request_id, prompt in zip(ids, prompts):
        assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 20)
    saved = engine.measurements.save(tmp_path / "m.json")
    other = "emitted" if gate_tokens == "progress" else "progress"
    with pytest.raises(ValueError, match=f"count {gate_tokens!r} tokens"):
        DSparkEngine(target, drafter, gate_tokens=other, measurements=EngineMeasurements.load(saved))
    DSparkEngine(target, drafter, gate_tokens=gate_tokens, measurements=EngineMeasurements.load(saved))
    old_file = EngineMeasurements.load(saved).to_dict()
    del old_file["gate_tokens"]  # written before the count was kept: emitted tokens
    assert EngineMeasurements.from_dict(old_file).gate_tokens == "emitted"
    with pytest.raises(ValueError, match="gate_tokens"):
        DSparkEngine(target, drafter, gate_tokens="tokens")


def test_first_steps_after_the_prompt_neither_measure_nor_enter_the_realized_gate(tiny_targets, trained_drafters):
    """The step where every request takes its first step after the prompt neither drafts to measure drafting (nothing
    is measured yet) nor is recorded in the gate's windows; the next step drafts and is recorded. Exact outputs."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 2)
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS)
    assert engine.planner.realized_gate
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    engine.step()
    assert engine.stats.drafting == [0] and engine.measurements.realized == {}
    assert engine.stats.skips == {"gate": 1}  # counted as a step the gate kept from drafting
    engine.step()
    assert engine.stats.drafting[-1] == 2 and len(engine.measurements.realized[(2, True)]) == 1
    assert engine.stats.summary()["skips"] == {"gate": 1}
    engine.run()
    for request_id, prompt in zip(ids, prompts):
        assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 12)


def test_certain_draft_question_is_asked_once_when_every_row_drafts(tiny_targets, trained_drafters):
    """Whether certain drafts would be verified is asked of every row first, and again of the chosen rows only when
    they are a subset: asking for every row is the same question (checked over random caps and tables), so a step
    where every request drafts asks it once."""
    import random

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS)
    rng = random.Random(0)
    g = engine.block_size
    for _ in range(40):
        rows = rng.choice([1, 2, 4])
        # a steep table (verifying never pays) or a flat one (it always does)
        table = torch.tensor([1.0 / max(1, b) ** rng.choice([0.0, 2.0]) for b in range(rows * (g + 1) + 1)])
        caps = torch.tensor([rng.randint(0, g) for _ in range(rows)])
        can_pay = engine.planner.drafts_can_pay
        assert can_pay(caps, table, list(range(rows))) == can_pay(caps, table)
    asked = []
    original = engine.planner.drafts_can_pay

    def recording(caps, table, rows=None):
        asked.append(rows)
        return original(caps, table, rows)

    engine.planner.drafts_can_pay = recording
    for prompt in in_distribution_prompts(target, 2):
        engine.add_request(prompt, SamplingParams(max_new_tokens=12))
    engine.step()  # the first step after the prompts: the gate keeps it plain before any question
    assert engine.stats.drafting == [0] and asked == []
    engine.step()
    assert engine.stats.drafting[-1] == 2 and asked == [None]


def test_measurements_know_a_local_checkpoint_by_relative_or_absolute_path(tmp_path, monkeypatch):
    """Measurements keyed by a drafter folder named relatively (bench-serve run from the repository) bind to the same
    folder named absolutely (a script that resolved it), and the other way round; another folder is refused."""
    from hf_dspark.engine import EngineMeasurements

    (tmp_path / "drafter").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    key = {"model": "target", "drafter": "drafter", "threads": 2}
    absolute = {**key, "drafter": str(tmp_path / "drafter")}
    EngineMeasurements(dict(key)).bind(absolute)
    EngineMeasurements(dict(absolute)).bind(key)
    with pytest.raises(ValueError, match="other conditions.*drafter"):
        EngineMeasurements(dict(key)).bind({**key, "drafter": str(tmp_path / "other")})
    with pytest.raises(ValueError, match="other conditions.*threads"):
        EngineMeasurements(dict(key)).bind({**absolute, "threads": 4})


def test_verify_prices_are_medians_of_recent_timings():
    """A verify price is the median of its last ``VERIFY_WINDOW`` timings: one hiccup does not move it, a lasting
    change does; the timings behind it count up to the window."""
    from hf_dspark.engine.measurements import VERIFY_WINDOW, EngineMeasurements

    m = EngineMeasurements()
    assert m.timings(1, 2) == 0
    for _ in range(10):
        m.record_verify(1, 2, 0.01)
    m.record_verify(1, 2, 1.0)  # a hiccup
    assert m.verify_cost[(1, 2)] == pytest.approx(0.01) and m.timings(1, 2) == 11
    for _ in range(VERIFY_WINDOW):
        m.record_verify(1, 2, 0.02)  # the machine got slower for good
    assert m.verify_cost[(1, 2)] == pytest.approx(0.02) and m.timings(1, 2) == VERIFY_WINDOW
    loaded = EngineMeasurements.from_dict(m.to_dict())
    loaded.record_verify(1, 2, 1.0)  # the reloaded price is held by its window of timings, not by one
    assert loaded.verify_cost[(1, 2)] == pytest.approx(0.02)


def test_moving_average():
    from hf_dspark.engine.measurements import ema

    assert ema(None, 2.0) == 2.0 and ema(1.0, 2.0) == pytest.approx(1.3)


def test_every_registered_policy_runs_in_the_engine(tiny_targets):
    """An engine's policy is a name in generate()'s policy registry: a policy registered once decides for the
    engine's drafting rows too (here at most two drafts per row), its output equals plain decoding, and bench-serve
    takes its name. Settings come as one ``EngineConfig`` (keywords override its fields)."""
    from hf_dspark.engine import EngineConfig
    from hf_dspark.evaluation.engine_bench import parse_policy
    from hf_dspark.scheduling import VERIFICATION_POLICIES, VerificationPolicy, register_verification_policy

    @register_verification_policy("at-most-two")
    class AtMostTwo(VerificationPolicy):
        def num_to_verify(self, confidences, max_drafts):
            return min(2, max_drafts)

    target = tiny_targets["llama"]
    drafter = make_drafter(target)
    prompts = [p[0].tolist() for p in random_prompts(3, 8, target.config.vocab_size, seed=3)]
    params = SamplingParams(max_new_tokens=12)
    try:
        plain = generate_batch(target, prompts, params=params)
        config = EngineConfig(policy="fixed")
        out = generate_batch(target, prompts, drafter, params, config=config, policy="at-most-two")
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in plain.outputs]
        assert all(v <= 2 * a for v, a in zip(out.stats.verify_tokens, out.stats.active)) and sum(out.stats.drafting)
        threshold = generate_batch(target, prompts, drafter, params, config=EngineConfig(policy="threshold"))
        assert [o.token_ids for o in threshold.outputs] == [o.token_ids for o in plain.outputs]
        assert parse_policy("at-most-two") == {"policy": "at-most-two"}
        assert parse_policy("scheduler")["schedule"] == "padded"
    finally:
        del VERIFICATION_POLICIES["at-most-two"]


def test_policy_replaces_method_which_still_works_with_a_warning(tiny_targets):
    """``EngineConfig.policy`` (default: the one every entry point shares); the old ``method=`` and the old name
    ``"scheduled"`` still work, each with a FutureWarning; ``method`` still reads; two different values are refused.
    Without a drafter the default decodes plain."""
    from dataclasses import replace

    from hf_dspark.engine import EngineConfig
    from hf_dspark.policy_names import DEFAULT_POLICY

    assert EngineConfig().policy == EngineConfig().method == DEFAULT_POLICY == "hybrid"
    with pytest.warns(FutureWarning, match="method=.*policy="):
        config = EngineConfig(method="fixed")
    assert config.policy == config.method == "fixed"
    assert replace(config, seed=1).policy == "fixed" and replace(config, policy="threshold").policy == "threshold"
    with pytest.warns(FutureWarning, match="'scheduled' is deprecated; use 'scheduler'"):
        assert EngineConfig(policy="scheduled").policy == "scheduler"
    with pytest.raises(ValueError, match="policy='fixed' and method='scheduler' disagree"), pytest.warns(FutureWarning):
        EngineConfig(policy="fixed", method="scheduler")
    target = tiny_targets["llama"]
    assert DSparkEngine(target).config.policy == "plain"
    with pytest.warns(FutureWarning, match="method="):  # a keyword beside a config replaces its policy
        assert DSparkEngine(target, config=EngineConfig(policy="fixed"), method="plain").config.policy == "plain"


def test_engine_settings_that_override_the_drafters_warn(tiny_targets):
    """Where the drafter's generation config sets a lookup n-gram length or a fixed verification length of its own,
    the engine uses its ``EngineConfig`` value and says so."""
    target = tiny_targets["llama"]
    drafter = make_drafter(target)
    drafter.generation_config.lookup_max_ngram = 3
    with pytest.warns(UserWarning, match="EngineConfig.lookup_max_ngram=4, not the drafter's "
                                         "generation_config.lookup_max_ngram=3"):
        engine = DSparkEngine(target, drafter, policy="hybrid", sps=FLAT_SPS)
    assert engine.planner.policy.max_ngram == 4
    drafter.generation_config.num_verify_tokens = 2
    with pytest.warns(UserWarning, match="EngineConfig.num_verify_tokens=None, not the drafter's"):
        DSparkEngine(target, drafter, policy="fixed")


def test_bad_requests_raise(tiny_targets):
    target = tiny_targets["llama"]
    with pytest.raises(ValueError, match="needs a DSpark drafter"):
        DSparkEngine(target, None, policy="fixed")
    with pytest.raises(ValueError, match="confidence head"):
        DSparkEngine(target, make_drafter(target, confidence=False), policy="scheduler")
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        DSparkEngine(target, policy="plain", max_prefill_tokens=0)
    with pytest.raises(ValueError, match="prefill_cost must be a PrefillCost"):
        DSparkEngine(target, policy="plain", prefill_cost=(56, 1800))
    engine = DSparkEngine(target)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    engine.add_request([1, 2], request_id="a")
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request([3], request_id="a")
    with pytest.raises(ValueError, match="SPS profile covers"):
        small = DSparkEngine(target, make_drafter(target), policy="scheduler", sps=StepsPerSecond([1, 2], [2.0, 1.0]))
        for p in ([1], [2], [3]):
            small.add_request(p)
        small.step()


# ------------------------------------------------------------------------------------------------------------------
# Sampling: each request keeps its own target distribution
# ------------------------------------------------------------------------------------------------------------------
SAMPLES = 1500
SAMPLING_GROUPS = {"t1": SamplingParams(max_new_tokens=4, do_sample=True, temperature=1.0),
                   "t07k4": SamplingParams(max_new_tokens=4, do_sample=True, temperature=0.7, top_k=4)}


@pytest.fixture(scope="module")
def sampling_setup():
    target = make_target("llama", vocab_size=VOCAB, seed=3, init=0.3)
    drafter = train_drafter_on_target(target, steps=150, block_size=4)
    prompt = torch.tensor([[1, 2, 3, 4]])
    exact = {name: exact_pair_distribution(target, prompt, p.temperature, p.top_k)
             for name, p in SAMPLING_GROUPS.items()}
    return target, drafter, prompt[0].tolist(), exact


def sample_pairs_batched(target, drafter, prompt, engine_kwargs, seed):
    """One engine run: SAMPLES requests per sampling group, interleaved, plus greedy requests in the same batch.
    x1 comes from the prefill; x2 and x3 from the first verification step (two drafts verified plus a bonus)."""
    engine = DSparkEngine(target, drafter, seed=seed, **engine_kwargs)
    names = []
    for i in range(SAMPLES):
        for name, params in SAMPLING_GROUPS.items():
            names.append((engine.add_request(prompt, params), name))
        if i % 300 == 0:
            names.append((engine.add_request(prompt, SamplingParams(max_new_tokens=4)), "greedy"))
    engine.run()
    counts = {name: torch.zeros(VOCAB, VOCAB) for name in SAMPLING_GROUPS}
    accepted = {name: 0 for name in SAMPLING_GROUPS}
    greedy = plain_greedy(target, prompt, 4)
    for request_id, name in names:
        out = engine.outputs[request_id]
        if name == "greedy":
            assert out.token_ids == greedy
            continue
        x2, x3 = out.token_ids[1:3]
        counts[name][x2, x3] += 1
        accepted[name] += sum(out.stats.accepted)
    return counts, {name: a / SAMPLES for name, a in accepted.items()}, engine.stats


@pytest.mark.parametrize("method", ["fixed", "prefix", "padded"])
def test_sampling_matches_target_distribution_per_request(sampling_setup, method):
    target, drafter, prompt, exact = sampling_setup
    counts, accepted, stats = sample_pairs_batched(target, drafter, prompt, METHODS[method], seed=11)
    if method != "fixed":  # every request may verify 3 drafts (4 new tokens); the scheduler verifies fewer
        bound = 2 if method == "prefix" else 3
        assert 0 < sum(stats.verify_tokens) < sum(stats.drafting) * bound, "the scheduler should verify partial blocks"
    for name in SAMPLING_GROUPS:
        assert accepted[name] > 0.3, "drafts must be accepted often for the test to exercise verification"
        pvalue = chi_square_pvalue(counts[name], exact[name])
        assert pvalue > 1e-3, f"{name}: engine sampling deviates from the target distribution (p={pvalue:.2e})"


def test_wrong_q_is_detected(sampling_setup, monkeypatch):
    """Reporting the backbone logits as q (no sequential head, no temperature / top-k) must fail the same test."""
    target, drafter, prompt, exact = sampling_setup
    original = type(drafter).sample_block

    def sample_block_with_wrong_q(self, base_logits, *args, **kwargs):
        draft = original(self, base_logits, *args, **kwargs)
        draft.draft_logits = base_logits.float()
        return draft

    monkeypatch.setattr(type(drafter), "sample_block", sample_block_with_wrong_q)
    counts, _, _ = sample_pairs_batched(target, drafter, prompt, METHODS["fixed"], seed=11)
    pvalue = chi_square_pvalue(counts["t07k4"], exact["t07k4"])
    assert pvalue < 1e-3, f"the test has no power: a wrong q passed (p={pvalue:.2e})"


# ------------------------------------------------------------------------------------------------------------------
# Profiling batched steps, bench-serve
# ------------------------------------------------------------------------------------------------------------------
def test_load_or_profile_batched_measures_once(tiny_targets, tmp_path, monkeypatch):
    import hf_dspark.profiling as profiling

    target = tiny_targets["llama"]
    sps = profiling.load_or_profile_batched(target, [1, 3], 3, folder=tmp_path, context_length=8, repeats=1)
    assert sorted(sps.curves) == [1, 3] and sps.curves[3].batch_tokens == [3, 6, 9]
    assert sps.table(2, 6).shape[0] == 7 and (sps.table(2, 6)[1:] > 0).all()
    for curve in sps.curves.values():  # measured noise never makes more tokens look faster
        assert all(a >= b for a, b in zip(curve.steps_per_sec, curve.steps_per_sec[1:]))

    def no_measuring(*args, **kwargs):
        raise AssertionError("a cached profile was measured again")

    monkeypatch.setattr(profiling, "measure_batched_steps_per_second", no_measuring)
    again = profiling.load_or_profile_batched(target, [3], 2, folder=tmp_path, context_length=8, repeats=1)
    assert list(again.curves) == [3] and again.curves[3].to_dict() == sps.curves[3].to_dict()
    (cached,) = tmp_path.glob("sps-batched-*.json")
    assert sorted(json.loads(cached.read_text())["seconds"]) == ["1", "3"]  # what each size took


def test_profiled_widths_every_width_for_small_batches_then_powers_of_two():
    from hf_dspark.profiling import EVERY_WIDTH_TOKENS, profiled_widths

    assert EVERY_WIDTH_TOKENS == 32
    assert profiled_widths(1, 8) == profiled_widths(4, 8) == list(range(1, 9))
    assert profiled_widths(8, 8) == [1, 2, 3, 4, 8]
    assert profiled_widths(16, 8) == profiled_widths(64, 8) == [1, 2, 4, 8]
    assert profiled_widths(64, 6) == [1, 2, 4, 6]  # the widest always counts: it bounds the table
    assert profiled_widths(40, 1) == [1]
    for bad in ((0, 8), (4, 0)):
        with pytest.raises(ValueError, match="batched profile"):
            profiled_widths(*bad)


def test_batched_profile_shares_one_budget_and_keeps_finished_sizes(tiny_targets, tmp_path, monkeypatch):
    """The budget bounds the whole profile: each size gets an even share of what is left, so time a small size
    leaves unused goes to the larger ones; a size is written to the cache as soon as it is measured, so an
    interrupted profile keeps the sizes it finished."""
    import time

    import hf_dspark.profiling as profiling
    from hf_dspark.scheduling import StepsPerSecond

    target = tiny_targets["llama"]
    shares, widths = {}, {}

    def fake_measure(model, size, tokens, context, repeats, taps, budget):
        shares[size], widths[size] = budget, tokens
        if size == 2:
            time.sleep(0.3)
        if size == 64:
            raise KeyboardInterrupt
        return StepsPerSecond([size * q for q in tokens], [100.0 / q for q in tokens]), {str(q): [0.01] for q in tokens}

    monkeypatch.setattr(profiling, "measure_batched_steps_per_second", fake_measure)
    with pytest.raises(KeyboardInterrupt):
        profiling.load_or_profile_batched(target, [64, 1, 2, 16], 8, folder=tmp_path, time_budget_s=4.0)
    assert list(shares) == [1, 2, 16, 64]  # smallest first
    assert shares[1] == pytest.approx(1.0, abs=0.05) and shares[2] == pytest.approx(4 / 3, abs=0.05)
    assert shares[16] == pytest.approx((4.0 - 0.3) / 2, abs=0.1)  # what sizes 1 and 2 left unused passed on
    assert widths[1] == list(range(1, 9)) and widths[16] == [1, 2, 4, 8]
    (cached,) = tmp_path.glob("sps-batched-*.json")
    assert sorted(json.loads(cached.read_text())["curves"], key=int) == ["1", "2", "16"]

    def no_measuring(*args, **kwargs):
        raise AssertionError("a finished size was measured again")

    monkeypatch.setattr(profiling, "measure_batched_steps_per_second", no_measuring)
    kept = profiling.load_or_profile_batched(target, [1, 2, 16], 8, folder=tmp_path)
    assert sorted(kept.curves) == [1, 2, 16]


def test_batched_profile_prices_each_width_by_its_fastest_repeat(tiny_targets, monkeypatch):
    """A shared machine's noise only adds time: a spell of slow forwards during most repeats of one width (here 50 ms
    added to three of five 4-token forwards) must not make that width look expensive, as a median would."""
    import time

    import hf_dspark.profiling as profiling

    target = tiny_targets["llama"]
    forward, calls = target.forward, {}

    def noisy_forward(*args, **kwargs):
        q = kwargs["input_ids"].shape[1]
        calls[q] = calls.get(q, 0) + 1
        if q == 4 and calls[q] in (3, 4, 5):  # the warm-up round is call 1
            time.sleep(0.05)
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", noisy_forward)
    sps, raw = profiling.measure_batched_steps_per_second(target, 1, [1, 4], context_length=8, repeats=5)
    assert sum(t > 0.05 for t in raw["4"]) == 3  # the spell was timed ...
    one, four = sps.steps_per_sec
    assert one / four < 3  # ... and left out: the median would price 4 tokens at 50 ms, 10x a tiny model's step


def test_first_profile_is_not_timed_as_a_step(tiny_targets, monkeypatch):
    """An engine without a given SPS profiles the target on its first scheduled step; that one-off measurement must
    not count as the step's time, or the realized gate would see drafting deliver next to nothing and keep it off."""
    import time

    import hf_dspark.profiling as profiling

    target = tiny_targets["llama"]

    def slow_profile(*args, **kwargs):
        time.sleep(1.0)
        return DECREASING_SPS

    monkeypatch.setattr(profiling, "load_or_profile_batched", slow_profile)
    engine = DSparkEngine(target, make_drafter(target), policy="scheduler")
    engine.add_request(random_prompts(1, 6, target.config.vocab_size)[0], SamplingParams(max_new_tokens=4))
    engine.run()
    steps = [step for window in engine.measurements.realized.values() for step in window]
    assert steps and max(seconds for _, seconds in steps) < 0.5


def test_first_profile_holds_kernel_compiles_back_on_cuda(tiny_targets, monkeypatch):
    """On CUDA the engine's first SPS profile runs inside ``KernelWarmup.quiet``: the scheduler kernels it started
    compiling in the background wait, so no compile shares the host with the timed forwards."""
    import contextlib

    import hf_dspark.kernels.scheduler as scheduler
    import hf_dspark.profiling as profiling
    from hf_dspark.engine import pricing

    target = tiny_targets["llama"]
    held = []

    class Warmup(scheduler.KernelWarmup):
        @contextlib.contextmanager
        def quiet(self, timeout=None):
            held.append(timeout)
            yield True
            held.append("released")

    def profile(*args, **kwargs):
        held.append("profiled")
        return DECREASING_SPS

    monkeypatch.setattr(scheduler, "WARMUP", Warmup())
    monkeypatch.setattr(profiling, "load_or_profile_batched", profile)
    engine = DSparkEngine(target, make_drafter(target), policy="scheduler")
    engine.pricing.profiled_table(2)
    assert held == ["profiled"]  # on CPU nothing compiles: nothing to hold
    engine.pricing.sps, engine.pricing._tables = None, {}
    # as on a GPU (the table's copy to it is stubbed below)
    engine.device = engine.pricing.device = torch.device("cuda")
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: self)
    engine.pricing.profiled_table(2)
    assert held == ["profiled", pricing.KERNEL_QUIET_TIMEOUT_S, "profiled", "released"]


def test_monotone_decreasing_fit():
    from hf_dspark.profiling import monotone_fit

    def monotone_decreasing(values):
        return monotone_fit(values, decreasing=True)

    assert monotone_decreasing([5.0, 4.0, 3.0]) == [5.0, 4.0, 3.0]
    assert monotone_decreasing([5.0, 4.0, 6.0, 3.0]) == [5.0, 5.0, 5.0, 3.0]  # 4 and 6 pooled, then with 5
    assert monotone_decreasing([23.1, 12.3, 13.2, 11.8]) == pytest.approx([23.1, 12.75, 12.75, 11.8])
    assert monotone_decreasing([]) == []


_ALLOCATION_PROBE = """
import ctypes, sys
from hf_dspark.evaluation.engine_bench import fix_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] == "pinned":
    print(fix_allocator(mmap_threshold=4 << 20, pretouch=0))
for size in (6 << 20, 3 << 20):  # bytes in mmapped blocks before and after each allocation
    before = libc.mallinfo2().hblkhd
    libc.malloc(size)
    print(libc.mallinfo2().hblkhd - before >= size)
"""

_PRETOUCH_PROBE = """
import ctypes, resource, sys
from hf_dspark.evaluation.engine_bench import fix_allocator

print(fix_allocator(mmap_threshold=4 << 20, pretouch=int(sys.argv[1]) << 20))
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(16):  # 48 MiB written in blocks below the threshold: from the heap
    block = libc.malloc(3 << 20)
    ctypes.memset(block, 1, 3 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_fix_allocator_pretouches_the_heap_so_fresh_blocks_do_not_fault():
    import ctypes
    import subprocess
    import sys

    from hf_dspark.evaluation import engine_bench as bench

    if not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("needs glibc")

    def probe(mib: int) -> tuple[str, int]:
        done = subprocess.run([sys.executable, "-c", _PRETOUCH_PROBE, str(mib)], capture_output=True, text=True,
                              check=True)
        setting, faults = done.stdout.split("\n")[:2]
        return setting, int(faults)

    setting, cold = probe(0)
    assert setting.endswith("top pad 256 MiB") and "pre-touched" not in setting
    assert cold > 8000  # 12,288 pages of 4 KiB, each first written here (fewer only with transparent huge pages)
    setting, warm = probe(64)
    assert setting.endswith("top pad 256 MiB, 64 MiB of heap pre-touched")
    assert warm < 1000  # the pre-touched pages were kept: nothing new to fault in
    with pytest.raises(ValueError, match="pretouch must be >= 0"):
        bench.fix_allocator(pretouch=-1)
    with pytest.raises(ValueError, match="below the trim threshold"):
        bench.fix_allocator(trim_threshold=1 << 30, pretouch=1 << 30)


def test_fix_allocator_serves_blocks_below_its_mmap_threshold_from_the_heap(monkeypatch):
    import ctypes
    import subprocess
    import sys

    from hf_dspark.evaluation import engine_bench as bench

    if not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("needs glibc >= 2.33")

    def probe(mode: str) -> list[str]:  # a fresh process: glibc's threshold as it starts, 128 KiB
        done = subprocess.run([sys.executable, "-c", _ALLOCATION_PROBE, mode], capture_output=True, text=True,
                              check=True)
        return done.stdout.split("\n")[:-1]

    assert probe("default") == ["True", "True"]  # both mapped
    # pinned at 4 MiB: a 6 MiB block still its own mapping (asked first: the heap's top has no room yet), a 3 MiB
    # one from the heap
    assert probe("pinned") == ["glibc malloc pinned: mmap threshold 4 MiB, never trims, top pad 256 MiB",
                               "True", "False"]

    class Refusing:
        @staticmethod
        def mallopt(param, value):
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Refusing())
    with pytest.raises(RuntimeError, match="refused malloc mmap threshold"):
        bench.fix_allocator()

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert bench.fix_allocator() is None  # not glibc: nothing pinned
    monkeypatch.setattr(sys, "platform", "darwin")
    assert bench.fix_allocator() is None


def test_bench_serve_report_and_plot(tiny_targets, trained_drafters, tmp_path):
    from hf_dspark.evaluation.engine_bench import bench_serve, plot_bench

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 5)
    methods = ["plain", "fixed", "fixed=2", "scheduler", "scheduler=topk"]
    report = bench_serve(target, drafter, prompts, methods, [1, 3], max_new_tokens=12, sps=DECREASING_SPS,
                         repeats=2, log=lambda line: None)
    for method in methods:
        for concurrency in ("1", "3"):
            row = report["results"][method][concurrency]
            assert row["identical_to_plain"] == "5/5" and row["tokens"] == 60 and row["tokens_per_s"] > 0
            assert len(row["runs_tokens_per_s"]) == 2 and row["tokens_per_s"] == max(row["runs_tokens_per_s"])
            assert row["mean_tokens_per_s"] == pytest.approx(sum(row["runs_tokens_per_s"]) / 2)
            best = row["runs_tokens_per_s"].index(row["tokens_per_s"])
            assert row["runs_counts"][best]["steps"] == row["steps"]
            assert row["runs_counts"][best]["prefill_calls"] == row["prefill_calls"] >= 5 // int(concurrency)
            for counts in row["runs_counts"]:
                assert 0 <= counts["drafting_steps"] <= counts["steps"]
                if method == "plain" or method.startswith("fixed"):
                    assert (counts["drafting_steps"] > 0) == method.startswith("fixed")
            if method != "plain":
                plain_runs = report["results"]["plain"][concurrency]["runs_tokens_per_s"]
                assert row["vs_plain"]["paired"] == pytest.approx([a / b for a, b in zip(row["runs_tokens_per_s"],
                                                                                         plain_runs)])
                assert row["vs_plain"]["best"] == pytest.approx(row["tokens_per_s"] / max(plain_runs))
                logs = [math.log(r) for r in row["vs_plain"]["paired"]]
                assert row["vs_plain"]["paired_se_factor"] == pytest.approx(
                    math.exp(abs(logs[0] - logs[1]) / 2))  # two repeats: s.d. |a - b| / sqrt 2, over sqrt 2
            # scheduled methods against each fixed-length method (run k of each in the same repeat); no others
            for fixed in ("fixed", "fixed=2"):
                if method.startswith("scheduler"):
                    fixed_runs = report["results"][fixed][concurrency]["runs_tokens_per_s"]
                    assert row[f"vs_{fixed}"]["paired"] == pytest.approx(
                        [a / b for a, b in zip(row["runs_tokens_per_s"], fixed_runs)])
                else:
                    assert f"vs_{fixed}" not in row
            assert max(1, int(concurrency) - 1) <= row["mean_active_requests"] <= int(concurrency)
    assert report["results"]["plain"]["3"]["mean_verify_tokens_per_step"] == 0
    assert report["results"]["fixed"]["3"]["mean_verify_tokens_per_step"] > 3
    assert plot_bench(report, tmp_path / "serve.png").stat().st_size > 0
    # Each scheduled method's engines shared one set of measurements: steps at both concurrencies are in it.
    assert set(report["measurements"]) == {"scheduler", "scheduler=topk"}
    sizes = {rows for rows, _, *_ in report["measurements"]["scheduler"]["realized"]}
    assert {1, 3} <= sizes
    cold = bench_serve(target, drafter, prompts, ["scheduler"], [1], max_new_tokens=4, sps=DECREASING_SPS,
                       share_measurements=False, log=lambda line: None)
    assert cold["measurements"] == {}
    # A later bench starts where this report's engines left off (a server that learned the machine already)
    import json

    from hf_dspark.evaluation.engine_bench import measurements_from_report

    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    start = measurements_from_report(path, ["plain", "scheduler", "scheduler=topk"])
    assert set(start) == {"scheduler", "scheduler=topk"}
    assert start["scheduler"].to_dict()["realized"] == report["measurements"]["scheduler"]["realized"]
    warm = bench_serve(target, drafter, prompts, ["scheduler"], [3], max_new_tokens=4, sps=DECREASING_SPS,
                       warmup=False, measurements={"scheduler": start["scheduler"]}, log=lambda line: None)
    before = {(rows, drafted): len(w) for rows, drafted, w in report["measurements"]["scheduler"]["realized"]}
    after = {(rows, drafted): len(w) for rows, drafted, w in warm["measurements"]["scheduler"]["realized"]}
    assert all(after.get(key, 0) >= n for key, n in before.items())  # it kept what it started from, and added
    saved = tmp_path / "engine.json"
    start["scheduler"].save(saved)
    assert set(measurements_from_report(saved, ["scheduler", "scheduler=prefix"])) == {"scheduler", "scheduler=prefix"}
    with pytest.raises(ValueError, match="not for method"):
        measurements_from_report(path, ["scheduler=prefix"])
    with pytest.raises(ValueError, match="not scheduled methods"):
        bench_serve(target, drafter, prompts, ["scheduler"], [1], max_new_tokens=4, sps=DECREASING_SPS,
                    measurements={"plain": start["scheduler"]}, log=lambda line: None)
    with pytest.raises(ValueError, match="share_measurements"):
        bench_serve(target, drafter, prompts, ["scheduler"], [1], max_new_tokens=4, sps=DECREASING_SPS,
                    share_measurements=False, measurements={"scheduler": start["scheduler"]}, log=lambda line: None)


def test_against_baseline():
    from hf_dspark.evaluation.engine_bench import against_baseline

    ratios = against_baseline([10.0, 12.0, 9.0], [10.0, 8.0, 12.0])
    assert ratios["best"] == pytest.approx(1.0) and ratios["mean"] == pytest.approx(31 / 30)
    assert ratios["paired"] == pytest.approx([1.0, 1.5, 0.75])
    assert ratios["paired_geomean"] == pytest.approx((1.0 * 1.5 * 0.75) ** (1 / 3))
    logs = [0.0, math.log(1.5), math.log(0.75)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / 2)
    assert ratios["paired_se_factor"] == pytest.approx(math.exp(sd / math.sqrt(3)))
    assert against_baseline([10.0], [8.0])["paired_se_factor"] is None  # one repeat: no spread to judge
    with pytest.raises(ValueError, match="same number of runs"):
        against_baseline([1.0], [1.0, 2.0])


def test_bench_serve_lockstep_steps_the_engine_furthest_behind(tiny_targets, trained_drafters, monkeypatch):
    import time

    from hf_dspark.engine import batching
    from hf_dspark.evaluation import engine_bench as bench

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 5)
    steps, original = [], batching.DSparkEngine.step
    created, make = [], bench._engine
    max_new_tokens = 10
    done: dict = {}  # each engine's progress as lockstep counts it: tokens, a finished request its max_new_tokens

    def engine(*args, **kwargs):
        created.append(make(*args, **kwargs))
        return created[-1]

    def recording(self):
        assert isinstance(self._clock, bench.StepClock) and self._clock._started is not None  # its own clock runs
        first = 3 * (created.index(self) // 3)
        group = created[first: first + 3]  # this repeat's engines
        # the engine that steps is one furthest behind of those still running
        assert done.get(self, 0) <= min((done.get(e, 0) for e in group if e is not self and e.has_unfinished()),
                                         default=done.get(self, 0))
        started = time.perf_counter()
        events = original(self)
        steps.append((self, self.config.policy, time.perf_counter() - started))
        for event in events:
            done[self] = done.get(self, 0) + len(event.token_ids)
            if event.finished:
                done[self] += max_new_tokens - len(self.outputs[event.request_id].token_ids)
        return events

    monkeypatch.setattr(bench, "_engine", engine)
    monkeypatch.setattr(batching.DSparkEngine, "step", recording)
    methods = ["plain", "fixed", "scheduler"]
    started = time.perf_counter()
    report = bench.bench_serve(target, drafter, prompts, methods, [3], max_new_tokens=max_new_tokens,
                               sps=DECREASING_SPS, repeats=2, warmup=False, lockstep=True, log=lambda line: None)
    elapsed = time.perf_counter() - started
    engines = list(dict.fromkeys(engine for engine, _, _ in steps))
    assert len(engines) == 6  # one engine per method and repeat
    for repeat in range(2):
        mine = [(engine, method) for engine, method, _ in steps if engine in engines[3 * repeat: 3 * repeat + 3]]
        # nothing done yet: each engine steps once, in turn, the first one rotating with the repeat
        assert [method for _, method in mine[:3]] == methods[repeat:] + methods[:repeat]
        # plain emits fewer tokens a step, so it steps more often (each step went to an engine furthest behind,
        # checked as it stepped)
        counts = {method: sum(m == method for _, m in mine) for method in methods}
        assert counts["plain"] > counts["fixed"]
    for method in methods:
        row = report["results"][method]["3"]
        assert row["identical_to_plain"] == "5/5" and row["tokens"] == 50 and len(row["runs_tokens_per_s"]) == 2
        assert row["lockstep"]
        if method != "scheduler":  # each method's own engine's stats (whether scheduled drafts depends on timings)
            assert (row["mean_verify_tokens_per_step"] > 0) == (method == "fixed")
        # each run is timed on its own engine's steps only
        for repeat, rate in enumerate(row["runs_tokens_per_s"]):
            own = sum(d for engine, m, d in steps if engine in engines[3 * repeat: 3 * repeat + 3] and m == method)
            assert own <= 50 / rate <= own + 0.05
        if method != "plain":
            assert row["vs_plain"]["paired"] == pytest.approx(
                [a / b for a, b in zip(row["runs_tokens_per_s"], report["results"]["plain"]["3"]["runs_tokens_per_s"])])
    assert sum(50 / r for m in methods for r in report["results"][m]["3"]["runs_tokens_per_s"]) <= elapsed


def test_engine_request_times_follow_its_clock(tiny_targets):
    import time

    from hf_dspark.evaluation.engine_bench import StepClock

    target = tiny_targets["llama"]
    clock = StepClock()
    engine = DSparkEngine(target, None, policy="plain", clock=clock)
    request = engine.add_request(in_distribution_prompts(target, 1)[0], SamplingParams(max_new_tokens=4))
    steps = 0
    while engine.has_unfinished():
        with clock:
            engine.step()
        time.sleep(0.25)  # another engine's step: not this engine's requests' time
        steps += 1
    out = engine.outputs[request]
    assert steps >= 3 and out.arrival_s == 0.0
    assert 0.0 < out.start_s <= out.finish_s <= clock() == clock.spent
    assert out.finish_s - out.start_s < 0.25 * (steps - 1)  # a wall clock would count the sleeps between
    with clock, pytest.raises(RuntimeError, match="already running"):
        with clock:
            pass


def test_against_baseline_by_request():
    from hf_dspark.evaluation.engine_bench import against_baseline_by_request

    # Every request twice as fast: 2x whichever way it is summarised, and no spread
    ratios = against_baseline_by_request([10, 20, 5], [1.0, 2.0, 0.5], [10, 20, 5], [2.0, 4.0, 1.0])
    assert ratios["aggregate"] == pytest.approx(2.0) and ratios["per_request_geomean"] == pytest.approx(2.0)
    assert ratios["aggregate_se_factor"] == pytest.approx(1.0) and ratios["per_request_se_factor"] == pytest.approx(1.0)
    # The aggregate weighs requests by their time, the per-request mean weighs them alike
    tokens, seconds, base_tokens, base_seconds = [10, 10, 30], [1.0, 1.0, 4.0], [10, 10, 30], [2.0, 1.0, 2.0]
    ratios = against_baseline_by_request(tokens, seconds, base_tokens, base_seconds, resamples=500)
    assert ratios["aggregate"] == pytest.approx((50 / 6.0) / (50 / 5.0))
    logs = [math.log(2.0), 0.0, math.log(0.5)]
    assert ratios["per_request_geomean"] == pytest.approx(1.0)
    assert ratios["per_request_se_factor"] == pytest.approx(math.exp(statistics.stdev(logs) / math.sqrt(3)))
    assert ratios["per_request_range"] == pytest.approx([0.5, 2.0]) and ratios["requests"] == 3
    # the bootstrap spread of the aggregate over resamples of these three pairs: about x/÷ 1.46 (exact enumeration)
    assert 1.38 < ratios["aggregate_se_factor"] < 1.55
    assert against_baseline_by_request([10], [1.0], [10], [2.0])["aggregate_se_factor"] is None  # one pair
    # Pairs of one prompt (several passes) are one unit: two groups, each of two identical pairs
    grouped = against_baseline_by_request([10] * 4, [1.0, 1.0, 2.0, 2.0], [10] * 4, [2.0, 2.0, 1.0, 1.0],
                                          groups=[0, 0, 1, 1])
    assert grouped["groups"] == 2 and grouped["aggregate"] == pytest.approx(1.0)
    # resampling the two prompts: 2x, 0.5x or 1x with chances 1/4, 1/4, 1/2 (resampling pairs would give x/÷ 1.41)
    assert grouped["aggregate_se_factor"] == pytest.approx(math.exp(math.sqrt(0.5) * math.log(2)), rel=0.04)
    # the per-request mean weighs prompts alike, however many pairs each has
    uneven = against_baseline_by_request([10] * 3, [1.0, 1.0, 4.0], [10] * 3, [2.0, 2.0, 1.0], groups=[0, 0, 1])
    assert uneven["per_request_geomean"] == pytest.approx(math.sqrt(2.0 * 0.25))
    assert grouped["per_request_se_factor"] == pytest.approx(math.exp(math.log(4) / math.sqrt(2) / math.sqrt(2)))
    assert against_baseline_by_request([10] * 2, [1.0, 2.0], [10] * 2, [2.0, 1.0], groups=["a", "a"])[
        "per_request_se_factor"] is None  # one prompt: nothing to judge its spread by
    with pytest.raises(ValueError, match="same requests"):
        against_baseline_by_request([1, 2], [1.0, 1.0], [1], [1.0])
    with pytest.raises(ValueError, match="positive time"):
        against_baseline_by_request([1], [0.0], [1], [1.0])


def test_bench_interleaved_serves_each_prompt_with_every_method_in_turn(tiny_targets, trained_drafters, monkeypatch):
    from hf_dspark.evaluation import engine_bench as bench

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 4)
    calls, served = [], bench.serve_request

    def recording(engine, prompt, params, target=None):
        calls.append((engine.config.policy, prompts.index(prompt)))
        return served(engine, prompt, params, target)

    monkeypatch.setattr(bench, "serve_request", recording)
    methods = ["plain", "fixed", "scheduler"]
    report = bench.bench_interleaved(target, drafter, prompts, methods, max_new_tokens=10, sps=DECREASING_SPS,
                                     repeats=2, warmup=False, log=lambda line: None)
    # each prompt with every method back to back, the order rotating with the prompt; the odd pass serves each prompt
    # in the reverse of its order in the pass before, so a method follows each other as often as it precedes it
    assert [index for _, index in calls] == [i for _ in range(2) for i in range(4) for _ in range(3)]
    p, f, s = "plain", "fixed", "scheduler"
    assert [method for method, _ in calls] == [p, f, s, f, s, p, s, p, f, p, f, s,  # pass 1
                                               s, f, p, p, s, f, f, p, s, s, f, p]  # pass 2: each prompt's reversed
    for method in methods:
        row = report["results"][method]["1"]
        assert row["interleaved"] and row["requests"] == 8 and row["tokens"] == 80
        assert row["identical_to_plain"] == "8/8" and len(row["runs_tokens_per_s"]) == 2
        assert row["tokens_per_s"] == pytest.approx(80 / row["wall_s"])
        assert row["mean_tokens_per_s"] == pytest.approx(sum(row["runs_tokens_per_s"]) / 2)
        # equal tokens per pass: the pooled rate is the passes' harmonic mean
        assert row["tokens_per_s"] == pytest.approx(2 / sum(1 / r for r in row["runs_tokens_per_s"]))
        assert row["mean_active_requests"] == 1  # one long-lived engine per method, one request at a time
    assert set(report["results"]["fixed"]["1"]) >= {"vs_plain"} and "vs_fixed" not in report["results"]["fixed"]["1"]
    versus = report["results"]["scheduler"]["1"]["vs_fixed"]
    assert versus["requests"] == 8 and versus["groups"] == 4
    plain_rate = report["results"]["plain"]["1"]["tokens_per_s"]
    for method in ("fixed", "scheduler"):  # the method's pooled rate over plain's (the same tokens on both sides)
        row = report["results"][method]["1"]
        assert row["vs_plain"]["aggregate"] == pytest.approx(row["tokens_per_s"] / plain_rate)
    assert versus["aggregate"] == pytest.approx(report["results"]["scheduler"]["1"]["tokens_per_s"]
                                                / report["results"]["fixed"]["1"]["tokens_per_s"])
    assert report["results"]["plain"]["1"]["mean_verify_tokens_per_step"] == 0
    assert set(report["measurements"]) == {"scheduler"}
    calls.clear()  # two methods: each prompt's two passes go both ways
    bench.bench_interleaved(target, drafter, prompts[:2], ["plain", "fixed"], max_new_tokens=4, repeats=2,
                            warmup=False, log=lambda line: None)
    assert [method for method, _ in calls] == [p, f, f, p, f, p, p, f]


def test_bench_serve_lockstep_pairs_runs_each_comparison_in_its_own_two_engine_lockstep(tiny_targets, trained_drafters,
                                                                                       monkeypatch):
    from hf_dspark.evaluation import engine_bench as bench

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 4)
    locksteps, original = [], bench.run_lockstep

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        locksteps.append({name: summary["tokens_per_s"] for name, (summary, _) in out.items()})
        return out

    monkeypatch.setattr(bench, "run_lockstep", recording)
    methods = ["plain", "fixed", "scheduler"]
    assert bench.lockstep_pairs({m: bench.parse_policy(m) for m in methods}) == [
        ("plain", "fixed"), ("plain", "scheduler"), ("fixed", "scheduler")]
    report = bench.bench_serve(target, drafter, prompts, methods, [2], max_new_tokens=6, sps=DECREASING_SPS,
                               repeats=2, warmup=False, lockstep="pairs", log=lambda line: None)
    # two engines a lockstep, every comparison once a repeat, the first pair rotating with the repeat
    assert [sorted(run) for run in locksteps] == [sorted(p) for p in (
        ("plain", "fixed"), ("plain", "scheduler"), ("fixed", "scheduler"),
        ("plain", "scheduler"), ("fixed", "scheduler"), ("plain", "fixed"))]

    def beside(name, partner):  # name's tokens/s in the locksteps it shared with partner, in order
        return [run[name] for run in locksteps if set(run) == {name, partner}]

    rows = {m: report["results"][m]["2"] for m in methods}
    assert [rows[m]["lockstep_partner"] for m in methods] == ["fixed", "plain", "plain"]
    assert all(rows[m]["lockstep"] == "pairs" and rows[m]["identical_to_plain"] == "4/4" for m in methods)
    assert rows["plain"]["runs_tokens_per_s"] == beside("plain", "fixed")
    assert rows["scheduler"]["runs_tokens_per_s"] == beside("scheduler", "plain")
    assert {p: runs["runs_tokens_per_s"] for p, runs in rows["scheduler"]["runs_beside"].items()} == {
        "plain": beside("scheduler", "plain"), "fixed": beside("scheduler", "fixed")}
    assert [len(runs["runs_counts"]) for runs in rows["plain"]["runs_beside"].values()] == [2, 2]
    for name, other in (("fixed", "plain"), ("scheduler", "plain"), ("scheduler", "fixed")):
        assert rows[name][f"vs_{other}"]["paired"] == pytest.approx(
            [a / b for a, b in zip(beside(name, other), beside(other, name))])
    with pytest.raises(ValueError, match=r"\[.fixed., .fixed=2.\] would be compared with nothing"):
        bench.lockstep_pairs({m: bench.parse_policy(m) for m in ("fixed", "fixed=2")})
    with pytest.raises(ValueError, match="lockstep must be"):
        bench.bench_serve(target, drafter, prompts, methods, [2], max_new_tokens=6, sps=DECREASING_SPS,
                          warmup=False, lockstep="triples", log=lambda line: None)

def test_cli_bench_serve_interleave_needs_one_request_at_a_time(capsys):
    from hf_dspark.cli import main

    assert main(["bench-serve", "--prompts", "nowhere", "--interleave", "--concurrency", "1", "4"]) == 2
    err = capsys.readouterr().err
    assert "--interleave" in err and "needs --concurrency 1, got 1 4" in err
    assert main(["bench-serve", "--prompts", "nowhere", "--interleave", "--cold-engines"]) == 2
    err = capsys.readouterr().err
    assert "long-lived engine" in err and "--cold-engines" in err
    assert main(["bench-serve", "--prompts", "nowhere", "--interleave", "--lockstep"]) == 2
    assert "choose one" in capsys.readouterr().err
    assert main(["bench-serve", "--prompts", "nowhere", "--lockstep", "pairs", "--methods", "fixed", "fixed=2"]) == 2
    assert "would be compared with nothing" in capsys.readouterr().err
    assert main(["bench-serve", "--prompts", "nowhere", "--dynamic-allocator", "--pretouch", "64"]) == 2
    assert "--pretouch goes with the pinned allocator" in capsys.readouterr().err
    assert main(["bench-serve", "--prompts", "nowhere", "--pretouch", "-1"]) == 2
    assert "--pretouch must be >= 0 MiB" in capsys.readouterr().err


def test_nondecreasing_fit():
    from hf_dspark.profiling import monotone_fit as nondecreasing_fit

    assert nondecreasing_fit([1.0, 2.0, 3.0], [1, 1, 1]) == [1.0, 2.0, 3.0]
    assert nondecreasing_fit([1.0, 3.0, 2.0], [1, 1, 1]) == pytest.approx([1.0, 2.5, 2.5])
    # a heavy cheap width after a light dear one pulls the pool toward itself
    assert nondecreasing_fit([1.0, 5.0, 2.0, 2.0], [1, 1, 8, 1]) == pytest.approx([1.0, 2.3, 2.3, 2.3])
    with pytest.raises(ValueError, match="positive weight"):
        nondecreasing_fit([1.0], [0.0])


def test_serve_runs_every_prompt(tiny_targets):
    from hf_dspark.evaluation.engine_bench import serve

    target = tiny_targets["llama"]
    prompts = in_distribution_prompts(target, 3)
    engine = DSparkEngine(target, None, policy="plain", max_concurrency=2)
    tokens, wall = serve(engine, prompts, 5)
    assert tokens == 15 and wall > 0 and not engine.has_unfinished()
    assert [engine.outputs[str(i)].token_ids for i in range(3)] == [plain_greedy(target, p, 5) for p in prompts]


def test_measurement_script_arguments():
    import argparse

    from hf_dspark.evaluation.engine_bench import add_measurement_arguments

    parser = argparse.ArgumentParser()
    add_measurement_arguments(parser, num_prompts=4, dtype="float32")
    args = parser.parse_args([])
    assert (args.num_prompts, args.max_new_tokens, args.threads, args.dtype) == (4, 32, 2, "float32")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])


def test_cli_bench_serve_rejects_unknown_method(capsys):
    from hf_dspark.cli import main

    assert main(["bench-serve", "--prompts", "nowhere", "--policies", "plain", "speculative"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown policy 'speculative'" in err[0]


@pytest.mark.slow
def test_smollm2_engine_greedy_equality():
    """The real target and the embedded drafter: batched outputs equal plain generate() per request."""
    require_smollm2()
    pytest.importorskip("gguf")
    from hf_dspark.defaults import load_drafter_for
    from hf_dspark.target import load_smollm2

    target, tokenizer = load_smollm2(dtype=torch.float32)
    drafter, origin = load_drafter_for(target)
    questions = ["Write a Python function that returns the square of a number.", "What is 12 times 7?",
                 "Name three primary colors."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"][0].tolist()
               for q in questions]
    expected = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    for kwargs in (dict(policy="fixed"), dict(policy="scheduler", sps=DECREASING_SPS)):
        result = generate_batch(target, prompts, drafter, SamplingParams(max_new_tokens=16), max_concurrency=2,
                                **kwargs)
        assert [o.token_ids for o in result.outputs] == expected, origin


def _set_verify_costs(engine, costs: dict, timings: int) -> None:
    """Stand in for ``timings`` measured verify steps of each (rows, width) at the given seconds."""
    engine.measurements.verify_cost = dict(costs)
    engine.measurements.verify_count = {key: timings for key in costs}
    engine.measurements.version += 1  # what a new measurement does: the repriced tables are rebuilt


def test_measured_steps_reprice_the_budget(tiny_targets, trained_drafters):
    """With ``adapt_sps`` the widths the engine has run are priced by their measured verify time: a profile that
    calls wide blocks free stops being believed once wide blocks turn out slow. Outputs stay exact."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = in_distribution_prompts(target, 4)
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, adapt_sps=True, cost_aware=False)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=16)) for p in prompts]
    engine.step()  # prefill + a first step, at the profile's word
    rows = engine.num_active
    _set_verify_costs(engine, {(r, w): 0.01 if w == 1 else 10.0
                               for r in range(1, rows + 1) for w in range(1, drafter.config.block_size + 2)}, 1000)
    table = engine.pricing.sps_table(rows)
    # timed many times each (a full median window), the measured prices move the profile's flat shape a third of the
    # way (PRICE_PRIOR_TIMINGS): width 2 now costs 1000 ** (1 / 3) = 10x width 1, and every width is dearer than
    # the profile's level
    assert float(table[rows]) == pytest.approx(10.0 * float(table[2 * rows]), rel=1e-3)
    assert float(table[rows]) < 100.0 and float(table[2 * rows]) < 1.0
    before = len(engine.stats.widths)
    engine.run()
    assert all(w == 1 for w in engine.stats.widths[before:])  # every wider block now costs more than it can gain
    for request_id, prompt in zip(ids, prompts):
        assert engine.outputs[request_id].token_ids == plain_greedy(target, prompt, 16)
    assert not DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS).pricing.adapt_sps  # a given SPS kept


def test_repricing_combines_the_profile_shape_with_measured_timings(tiny_targets, trained_drafters):
    """Measured verify times are read as ratios to the profile (here 0.01 s at every width) and combined in log scale:
    the level of a batch size is its timing-weighted mean ratio (or the nearest measured size's); a width run there is
    pulled from the level toward its own ratio by its number of timings (``PRICE_PRIOR_TIMINGS`` for the level), so
    one noisy timing moves a price part of the way; a width not run there costs the level times its excess over the
    level at the nearest size that ran it. The table stays non-increasing and is cached until a new measurement."""
    import math

    from hf_dspark.engine.pricing import PRICE_PRIOR_TIMINGS

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=FLAT_SPS, adapt_sps=True)
    assert engine.pricing.sps_table(4) is engine.pricing.profiled_table(4)  # nothing measured: the profile as is
    base = 0.01  # the profile's seconds per step

    def price(table, rows, width):  # seconds per verify step
        return 1.0 / float(table[rows * width])

    # R = 4: width 1 timed 8 times at 2x the profile, width 3 once at 8x (a hiccup); width 2 never
    _set_verify_costs(engine, {(4, 1): 2 * base, (4, 3): 8 * base}, 8)
    engine.measurements.verify_count[(4, 3)] = 1
    table = engine.pricing.sps_table(4)
    level = (8 * math.log(2) + 1 * math.log(8)) / 9
    assert price(table, 4, 1) == pytest.approx(base * math.exp((8 * math.log(2) + PRICE_PRIOR_TIMINGS * level)
                                                               / (8 + PRICE_PRIOR_TIMINGS)))
    width3 = (math.log(8) + PRICE_PRIOR_TIMINGS * level) / (1 + PRICE_PRIOR_TIMINGS)  # one timing: part of the way
    assert price(table, 4, 2) == pytest.approx(base * math.exp(level))  # not run here: the level
    # widths 4.. (not run: the level, weight PRICE_PRIOR_TIMINGS each) are cheaper than width 3's price: the
    # non-decreasing fit pools them with width 3 (weight 1 + PRICE_PRIOR_TIMINGS) instead of lifting them all to it
    wider = drafter.config.block_size + 1 - 3
    pooled = ((1 + PRICE_PRIOR_TIMINGS) * width3 + wider * PRICE_PRIOR_TIMINGS * level) / (
        1 + PRICE_PRIOR_TIMINGS + wider * PRICE_PRIOR_TIMINGS)
    for w in range(3, drafter.config.block_size + 2):
        assert price(table, 4, w) == pytest.approx(base * math.exp(pooled))
    assert base * math.exp(level) < base * math.exp(pooled) < base * math.exp(width3) < 8 * base
    assert engine.pricing.sps_table(4) is table  # cached
    # a batch size with nothing measured takes the nearest one's level; a width 3x dearer than the level at R = 4
    # (timed there many times) is 3x dearer at R = 8 too
    _set_verify_costs(engine, {(4, 1): 2 * base, (4, 2): 6 * base}, 1000)
    table8 = engine.pricing.sps_table(8)
    level4 = math.log(4.0 * math.sqrt(0.75))  # the mean of log 2 and log 6
    assert price(table8, 8, 1) == pytest.approx(base * math.exp(level4))
    assert price(table8, 8, 2) == pytest.approx(6 * base)
    assert all(float(table8[8 * w]) >= float(table8[8 * (w + 1)]) for w in range(1, 5))
    # timings shared from a batch size this engine's profile does not cover (4096 tokens) are left out
    _set_verify_costs(engine, {(4, 1): 2 * base, (5000, 1): 1.0}, 16)
    assert price(engine.pricing.sps_table(4), 4, 1) == pytest.approx(2 * base)


def test_online_survival_correction():
    from hf_dspark.scheduling import OnlineSurvivalCorrection

    corr = OnlineSurvivalCorrection(block_size=3, prior=0.0 + 1e-9)
    conf = torch.tensor([[0.8, 0.5, 0.5], [0.8, 0.5, 0.0]])
    # survivals: [.8, .4, .2] and [.8, .4, 0]; both verified 2 drafts; one accepted 2, one accepted 0.
    corr.observe(conf, torch.tensor([2, 2]), torch.tensor([2, 0]))
    assert corr.predicted.tolist() == pytest.approx([1.6, 0.8, 0.0])
    assert corr.accepted.tolist() == [1.0, 1.0, 0.0]
    factors = corr.factors()
    assert factors[:2].tolist() == pytest.approx([1 / 1.6, 1 / 0.8])
    corrected = corr.correct(conf)
    survival = torch.cumprod(corrected, dim=-1)
    # a1 = .8 / 1.6 = .5; a2 = min(.4 * 1.25, a1) = .5 (non-increasing); position 3, never verified, inherits
    # position 2's factor: .2 * 1.25; zero stays zero.
    assert factors[2] == pytest.approx(1 / 0.8)
    assert survival[0].tolist() == pytest.approx([0.5, 0.5, 0.25], abs=1e-6)
    assert survival[1].tolist() == pytest.approx([0.5, 0.5, 0.0], abs=1e-6)
    assert ((corrected >= 0) & (corrected <= 1)).all()
    # With the default prior, a fresh correction changes nothing.
    assert torch.allclose(OnlineSurvivalCorrection(3).correct(conf), conf)
    # Pseudo-observations sit at the previous position's factor: a position seen a little moves from there.
    corr = OnlineSurvivalCorrection(block_size=3, prior=4.0)
    corr.predicted = torch.tensor([100.0, 1.0, 0.0], dtype=torch.float64)
    corr.accepted = torch.tensor([200.0, 0.0, 0.0], dtype=torch.float64)
    f1 = 204 / 104
    assert corr.factors().tolist() == pytest.approx([f1, 4 * f1 / 5, 4 * f1 / 5])
    # The factors are kept between observations (read a few times a step), and every observation renews them
    kept = corr.factors()
    kept.zero_()  # a caller's copy: the kept factors do not change
    assert corr.factors().tolist() == pytest.approx([f1, 4 * f1 / 5, 4 * f1 / 5])
    corr.observe(torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([3]), torch.tensor([0]))  # three drafts, none accepted
    f1 = 204 / 105
    assert corr.factors().tolist() == pytest.approx([f1, 4 * f1 / 6, (4 * f1 / 6 * 4) / 5])


def test_prefill_groups_are_the_cheapest_split_of_the_sorted_prompts():
    """Joining prompts (sorted by length) are split into prefill forwards by ``PrefillCost``: the split is the
    cheapest of all splits into consecutive groups within the padded-token cap (checked by enumerating them), a
    forward's fixed price groups equal prompts, padding splits mixed lengths, and the cap is kept."""
    import itertools

    from hf_dspark.engine import PrefillCost
    from hf_dspark.engine.admission import prefill_groups as _prefill_groups
    from hf_dspark.engine.requests import Request as _Request

    def requests(lengths):
        return [_Request(str(i), [1] * n, SamplingParams(), frozenset(), None, 0.0) for i, n in enumerate(lengths)]

    def split(lengths, max_tokens=16384, cost=PrefillCost()):
        return [[len(r.prompt_ids) for r in g] for g in _prefill_groups(requests(lengths), max_tokens, cost)]

    def price(groups, cost):
        return sum(cost(len(g), max(g)) for g in groups)

    cost = PrefillCost(fixed_tokens=56, attention_width=1800)
    lengths = sorted([20, 25, 30, 40, 60, 90, 120, 200, 210, 211, 290, 36])
    best = split(lengths, 1000, cost)
    assert [n for g in best for n in g] == lengths  # every prompt once, in order
    assert all(len(g) == 1 or len(g) * max(g) <= 1000 for g in best)
    candidates = []
    for cuts in itertools.product([False, True], repeat=len(lengths) - 1):
        groups, current = [], [lengths[0]]
        for n, cut in zip(lengths[1:], cuts):
            if cut:
                groups.append(current)
                current = []
            current.append(n)
        groups.append(current)
        if all(len(g) == 1 or len(g) * max(g) <= 1000 for g in groups):
            candidates.append(price(groups, cost))
    assert price(best, cost) == pytest.approx(min(candidates))
    assert 1 < len(best) < len(lengths)  # neither one padded batch nor one forward per prompt here

    assert split([50] * 10) == [[50] * 10]  # no padding: one forward
    assert split([100, 100, 300], 250) == [[100, 100], [300]]  # the cap
    assert split([10, 400], cost=PrefillCost(fixed_tokens=0)) == [[10], [400]]  # nothing to save: no padding
    assert split([10, 400], cost=PrefillCost(fixed_tokens=1e6)) == [[10, 400]]  # forwards dearer than padding
    assert split([]) == []
    with pytest.raises(ValueError, match="fixed_tokens"):
        PrefillCost(fixed_tokens=-1)
    with pytest.raises(ValueError, match="attention_width"):
        PrefillCost(attention_width=0)


def test_cache_layer_appends_in_place():
    """The engine's target cache layers write each step's columns into spare buffer columns instead of copying the
    layer (``DynamicLayer.update``), with the same contents; rows leaving keep the buffer, a replaced tensor (rows
    gathered, joined or compacted) is copied into a new one."""
    from transformers.cache_utils import DynamicLayer

    from hf_dspark.engine.cache import _GrowingLayer

    torch.manual_seed(0)
    layer, reference = _GrowingLayer(), DynamicLayer()

    def step(new: int) -> None:
        rows = layer.keys.shape[0] if layer.is_initialized else 3
        k, v = torch.randn(rows, 2, new, 4), torch.randn(rows, 2, new, 4)
        got, want = layer.update(k, v), reference.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(layer.keys, reference.keys) and torch.equal(layer.values, reference.values)

    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4)]
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        RaggedBatchCache(cache, torch.ones(1, 0, dtype=torch.bool))

    step(5)
    pointers = set()
    for i in range(12):
        step(1 + i % 3)
        pointers.add(layer.keys.data_ptr())
    assert len(pointers) == 1  # one buffer: no copy of the layer per step
    for t in (layer, reference):  # a request leaves from the tail: a narrowed view
        t.keys, t.values = t.keys[:2], t.values[:2]
    step(2)
    assert layer.keys.data_ptr() in pointers
    for t in (layer, reference):  # rows gathered into a new tensor
        t.keys, t.values = t.keys.index_select(0, torch.tensor([1, 0])), t.values.index_select(0, torch.tensor([1, 0]))
    step(1)
    assert layer.keys.data_ptr() not in pointers
    for _ in range(40):  # past the spare columns: a bigger buffer
        step(3)


def test_leaving_rows_are_filled_from_the_tail():
    """A request leaving the batch moves a tail row into its place (a few rows copied, the rest a narrowed view);
    the result equals a full gather in that order, and any other order still gathers."""
    from transformers import DynamicCache

    from hf_dspark.engine.admission import tail_filled_order
    from hf_dspark.engine.cache import RaggedBatchCache

    assert tail_filled_order([0, 1, 2, 3]) == [0, 1, 2, 3]
    assert tail_filled_order([0, 2, 4, 5]) == [0, 4, 2, 5]
    assert tail_filled_order([3, 4]) == [3, 4] and tail_filled_order([]) == []
    gen = torch.Generator().manual_seed(0)

    def cache_with(keys_values, valid):
        cache = DynamicCache()
        for layer, (k, v) in enumerate(keys_values):
            cache.update(k.clone(), v.clone(), layer)
        return RaggedBatchCache(cache, valid.clone())

    kv = [(torch.randn(6, 2, 5, 3, generator=gen), torch.randn(6, 2, 5, 3, generator=gen)) for _ in range(2)]
    valid = torch.rand(6, 5, generator=gen) > 0.3
    for keep in ([0, 2, 4, 5], [1, 2, 3], [5], [0, 1, 2, 3, 4, 5]):
        for order in (tail_filled_order(keep), sorted(keep, reverse=True)):
            fast = cache_with(kv, valid)
            fast.select_rows(torch.tensor(order))
            index = torch.tensor(order)
            for layer, (k, v) in zip(fast.target_cache.layers, kv):
                assert torch.equal(layer.keys, k.index_select(0, index))
                assert torch.equal(layer.values, v.index_select(0, index))
            assert torch.equal(fast.valid, valid.index_select(0, index))


def test_bench_method_specs():
    from hf_dspark.evaluation.engine_bench import parse_policy

    assert parse_policy("plain") == {"policy": "plain"}
    assert parse_policy("fixed=2") == {"policy": "fixed", "num_verify_tokens": 2}
    assert parse_policy("scheduler") == {"policy": "scheduler", "schedule": "padded"}
    assert parse_policy("scheduler=ungated") == {"policy": "scheduler", "schedule": "padded", "realized_gate": False}
    assert parse_policy("scheduler=topk,ungated") == {"policy": "scheduler", "schedule": "topk",
                                                      "realized_gate": False}
    assert parse_policy("scheduler,emitted") == {"policy": "scheduler", "schedule": "padded",
                                                 "gate_tokens": "emitted"}
    assert parse_policy("scheduler=prefix,emitted,ungated") == {"policy": "scheduler", "schedule": "prefix",
                                                                "gate_tokens": "emitted", "realized_gate": False}
    assert parse_policy("plain,hold=0") == {"policy": "plain", "admission_hold": 0.0}
    assert parse_policy("fixed=3,hold=1") == {"policy": "fixed", "num_verify_tokens": 3, "admission_hold": 1.0}
    assert parse_policy("scheduler=prefix,ungated,hold=0.25") == {
        "policy": "scheduler", "schedule": "prefix", "realized_gate": False, "admission_hold": 0.25}
    from hf_dspark.engine import PrefillCost

    assert parse_policy("plain,prefill=1e9,hold=0") == {"policy": "plain", "admission_hold": 0.0,
                                                         "prefill_cost": PrefillCost(fixed_tokens=1e9)}
    for bad in ("scheduler=fast", "scheduler=topk,prefix", "fixed=x", "greedy", "plain,hold=-1", "plain,hold=x",
                "plain,hold", "plain,ungated", "fixed,ungated", "plain,emitted", "plain,prefill=-1",
                "plain,prefill=inf"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_policy(bad)


def test_cost_model_is_scaled_by_what_its_decisions_delivered(tiny_targets, trained_drafters):
    """``EngineMeasurements.model_factor``: over the recent steps whose drafting decision the cost model made, the
    tokens per second each side delivered over what the model predicted for it, shrunk toward 1 by
    ``MODEL_PRIOR_STEPS`` (in log scale), from the nearest batch size bucket checked. ``_drafting_pays`` scales each
    side's expected rate by it: drafting steps that delivered a fifth of their prediction stop the drafts the bare
    model would take. A served engine records its checks, and its outputs stay exact."""
    import math

    from hf_dspark.engine import EngineMeasurements
    from hf_dspark.engine.measurements import MODEL_PRIOR_STEPS

    measurements = EngineMeasurements()
    assert measurements.model_factor(4, True) == 1.0  # nothing checked
    for _ in range(2):  # predicted 20 tokens in 0.1 s; delivered 10 in 0.1 s: half the rate
        measurements.record_model_check(4, True, 20.0, 0.1, 10, 0.1)
    half = math.exp(2 / (2 + MODEL_PRIOR_STEPS) * math.log(0.5))
    assert measurements.model_factor(4, True) == pytest.approx(half)
    assert measurements.model_factor(8, True) == pytest.approx(half)  # nearest bucket checked
    assert measurements.model_factor(4, False) == 1.0  # the other side is its own
    for _ in range(100):
        measurements.record_model_check(4, True, 20.0, 0.1, 10, 0.1)
    assert len(measurements.model_checks[(4, True)]) == 32  # a window of recent steps
    with pytest.raises(ValueError, match="positive"):
        measurements.record_model_check(4, True, 20.0, 0.0, 10, 0.1)

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=DECREASING_SPS)
    engine.measurements.record_draft(4, 0.001)  # a cheap drafter
    stale = torch.full((4, drafter.config.block_size), 0.9)
    table = engine.pricing.sps_table(4)
    predicted = [2] * 4
    assert engine.planner.drafting_pays(stale, predicted, table, 4)
    assert engine.planner.prediction is not None and engine.planner.prediction[0] > 4  # kept for the step to check
    for _ in range(32):  # its drafting steps delivered a fifth of what it predicted
        engine.measurements.record_model_check(4, True, 10.0, 0.01, 2, 0.01)
    assert not engine.planner.drafting_pays(stale, predicted, table, 4) and engine.planner.prediction is None

    served = DSparkEngine(target, drafter, policy="scheduler", sps=DECREASING_SPS)
    prompts = in_distribution_prompts(target, 3)
    ids = [served.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
    served.run()
    for request_id, prompt in zip(ids, prompts):
        assert served.outputs[request_id].token_ids == plain_greedy(target, prompt, 24)
    checks = served.measurements.model_checks
    assert checks and all(p > 0 and m > 0 and e >= 1 and t > 0 for w in checks.values() for p, m, e, t in w)


def test_bench_compiles_the_scheduler_kernels_before_anything_is_timed(monkeypatch):
    """On CUDA a bench compiles every kernel variant its scheduled methods can launch (top-K also uses Algorithm 1's
    kernel) and waits for them before its runs: an engine would otherwise compile them in the background during
    its first, timed, steps. Off CUDA, or without a scheduled method, nothing compiles."""
    import types

    import hf_dspark.kernels.scheduler as scheduler
    from hf_dspark.evaluation import engine_bench as bench

    calls = []

    class Warmup:
        failed = {}

        def wait(self, timeout=None):
            calls.append(("wait", timeout))
            return True

    monkeypatch.setattr(scheduler, "warm_scheduler_kernels",
                        lambda device, requests, block, kinds: calls.append((str(device), requests, block, kinds)))
    monkeypatch.setattr(scheduler, "WARMUP", Warmup())

    def model_on(device):  # what the bench reads of a target: its parameters' device
        return types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(device=torch.device(device))]))

    drafter = types.SimpleNamespace(config=types.SimpleNamespace(block_size=7))
    specs = {m: bench.parse_policy(m) for m in ("plain", "fixed", "scheduler=topk", "hybrid")}
    assert bench.compile_scheduler_kernels(model_on("cuda"), drafter, specs, [1, 16, 64], log=lambda m: None)
    assert calls == [("cuda", 64, 7, ("prefix", "topk", "width")), ("wait", bench.KERNEL_COMPILE_WAIT_S)]
    calls.clear()
    assert bench.compile_scheduler_kernels(model_on("cpu"), drafter, specs, [4], log=lambda m: None) is None
    plain_only = {m: bench.parse_policy(m) for m in ("plain", "fixed")}
    assert bench.compile_scheduler_kernels(model_on("cuda"), drafter, plain_only, [4], log=lambda m: None) is None
    assert calls == []
