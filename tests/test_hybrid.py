"""The hybrid policy: the drafter's block and prompt lookup under one cost model, lossless for greedy and sampling."""

import copy

import pytest
import torch

from hf_dspark.draft_sources import Draft, prompt_lookup
from hf_dspark.generation import generate_planner
from hf_dspark.planner import RowState
from hf_dspark.scheduling import HybridPolicy, LookupSurvival, StepsPerSecond
from tests.helpers import random_prompts
from tests.test_greedy_equality import assert_same_greedy, set_policy
from tests.test_sampling import chi_square_pvalue, exact_pair_distribution, sample_pairs
from tests.test_sampling import setup  # noqa: F401  (the module fixture)

CHEAP_VERIFY = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 98.0]}


def test_prompt_lookup_takes_the_longest_suffix_match_and_its_latest_full_continuation():
    ids = torch.tensor([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    tokens, n = prompt_lookup(ids, max_ngram=4, max_tokens=3)
    assert n == 2 and tokens.tolist() == [7, 8, 4]  # "2 3" occurs twice before; the latest continues 7 8 4
    tokens, n = prompt_lookup(ids, max_ngram=4, max_tokens=6)
    assert n == 2 and tokens.tolist() == [9, 9, 1, 2, 3, 7]  # only the earlier occurrence has 6 tokens after it
    tokens, n = prompt_lookup(torch.tensor([1, 2, 3, 1, 2, 3, 1, 2]), max_ngram=3, max_tokens=2)
    assert n == 3 and tokens.tolist() == [3, 1]
    assert prompt_lookup(torch.tensor([1, 2, 3, 4]), max_ngram=3, max_tokens=2) is None
    assert prompt_lookup(torch.tensor([4]), max_ngram=3, max_tokens=2) is None


def test_lookup_survival_starts_at_the_prior_and_learns():
    survival = LookupSurvival(max_tokens=4, pseudo_count=4.0)
    assert survival.confidences(3, 4).tolist() == pytest.approx([0.6] * 4)
    for _ in range(12):
        survival.observe(3, verified=4, accepted=1)  # the first draft always survives, the second never
    c = survival.confidences(3, 4)
    assert c[0].item() == pytest.approx((12 + 4 * 0.6) / (12 + 4))
    assert c[1].item() == pytest.approx((0 + 4 * 0.6) / (12 + 4))
    assert c[2].item() == pytest.approx(0.6)  # never reached: still the prior
    assert survival.confidences(1, 2).tolist() == pytest.approx([0.3, 0.3])  # other buckets untouched


def _offer(confidences: list[float], source: str = "lookup") -> Draft:
    """A free source's one-row offer with these estimated conditional acceptances."""
    return Draft(torch.arange(len(confidences)).view(1, -1), None, torch.tensor([confidences]), source)


class FixedOffer:
    """A free source that always offers the same draft."""

    def __init__(self, confidences: list[float], name: str = "lookup"):
        self.name, self.offer = name, _offer(confidences, name)

    def propose(self, token_ids, max_tokens):
        return self.offer


def _hybrid_row(sps: StepsPerSecond, *offers: FixedOffer, draft_seconds: float | None = None):
    """generate()'s planner under the hybrid policy with these sources in place of the lookup, and its one row."""
    planner = generate_planner(HybridPolicy(sps), 4, None, lambda rows: draft_seconds)
    planner.sources = {offer.name: offer for offer in offers}
    return planner, planner.new_memory()


def _choice(planner, memory, sps: StepsPerSecond) -> tuple[str, int]:
    """(source, length) of one round: an offer's source and length, ("block", 0) or ("none", 0)."""
    table = sps.table()
    plan = planner.plan([RowState(4, memory, lambda: torch.arange(8), 4)], table)
    if plan.offers:
        return plan.offers[0].source, planner.lengths(plan, None, table)[0]
    return ("block", 0) if plan.drafting else ("none", 0)


def test_the_planner_prices_lookup_block_and_plain():
    cheap, sure = StepsPerSecond([1, 8], [100.0, 98.0]), [0.95, 0.95, 0.95, 0.9]
    assert _choice(*_hybrid_row(cheap, FixedOffer(sure)), cheap) == ("lookup", 4)
    # 1.001 x SPS(2) < SPS(1): the lookup does not pay; with nothing learnt about the block yet, it is probed
    assert _choice(*_hybrid_row(cheap, FixedOffer([0.001, 0.001])), cheap)[0] == "block"
    expensive = StepsPerSecond([1, 2, 8], [100.0, 40.0, 10.0])
    assert _choice(*_hybrid_row(expensive, FixedOffer([0.5, 0.5])), expensive)[0] != "lookup"  # 1.5 x 40 < 100
    # A block predicted far better than the lookup wins once it has a prediction.
    planner, memory = _hybrid_row(cheap, FixedOffer([0.3, 0.3]), draft_seconds=1e-4)
    memory.drafted(torch.tensor([0.99, 0.99, 0.99, 0.99]), 4)
    assert _choice(planner, memory, cheap) == ("block", 0)


def test_the_planner_takes_the_best_paying_offer():
    """Several free sources: the one whose drafts are expected to deliver the most tokens per second drafts."""
    cheap = StepsPerSecond([1, 8], [100.0, 98.0])
    lookup, other = FixedOffer([0.6, 0.6], "lookup"), FixedOffer([0.95, 0.95, 0.95], "other")
    assert _choice(*_hybrid_row(cheap, lookup, other), cheap) == ("other", 3)
    assert _choice(*_hybrid_row(cheap, lookup), cheap) == ("lookup", 2)


DEAR_VERIFY = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 60.0]}


@pytest.mark.parametrize("profile", [CHEAP_VERIFY, DEAR_VERIFY])
def test_hybrid_greedy_equality(tiny_targets, trained_drafters, family, profile):
    target, drafter = tiny_targets[family], trained_drafters[family]
    set_policy(drafter, "hybrid", sps_profile=profile)
    try:
        sources = set()
        for prompt in random_prompts(48, 8, target.config.vocab_size, seed=1)[:3]:
            repeated = torch.cat([prompt, prompt[:, :5], prompt], dim=1)  # text that lookup can copy from
            assert_same_greedy(target, drafter, repeated, max_new_tokens=30)
            stats = drafter.last_stats
            sources |= set(stats.sources)
            by_source = stats.by_source()
            assert sum(row["rounds"] for row in by_source.values()) == stats.rounds
        assert "lookup" in sources
    finally:
        set_policy(drafter, "fixed")
        del drafter.generation_config.sps_profile


def test_lookup_drafts_may_be_longer_than_the_block(tiny_targets, trained_drafters, family):
    """``lookup_max_tokens`` bounds the lookup's drafts, not the block: where verification width is nearly free the
    hybrid verifies copies longer than the block, and the output still equals plain greedy decoding."""
    target, drafter = tiny_targets[family], trained_drafters[family]
    block = drafter.config.block_size
    wide = {"sample_batch_tokens": [1, 2 * block + 1], "sample_steps_per_sec": [100.0, 99.0]}
    set_policy(drafter, "hybrid", sps_profile=wide, lookup_max_tokens=block + 4)
    drafter.__dict__.pop("_dspark_lookup_survival", None)
    try:
        longest = 0
        for prompt in random_prompts(40, 8, target.config.vocab_size, seed=4)[:3]:
            assert_same_greedy(target, drafter, torch.cat([prompt, prompt], dim=1), max_new_tokens=30)
            stats = drafter.last_stats
            longest = max([longest] + [v for v, source in zip(stats.verified, stats.sources) if source == "lookup"])
        assert block < longest <= block + 4
        drafter.generation_config.lookup_max_tokens = 0
        with pytest.raises(ValueError, match="lookup_max_tokens"):
            target.generate(prompt, do_sample=False, max_new_tokens=4, assistant_model=drafter)
    finally:
        set_policy(drafter, "fixed")
        del drafter.generation_config.sps_profile
        del drafter.generation_config.lookup_max_tokens


def test_rounds_without_a_block_defer_the_drafter_context(tiny_targets, trained_drafters, family, monkeypatch):
    """Lookup and plain rounds run no drafter forward at all: their target features reach the drafter's context in
    the next block draft's own forward (draft() rejects a context with a gap, so the block rounds prove it whole)."""
    target, drafter = tiny_targets[family], trained_drafters[family]
    calls = []
    original = type(drafter).extend_context
    monkeypatch.setattr(type(drafter), "extend_context",
                        lambda self, *args, **kwargs: calls.append(1) or original(self, *args, **kwargs))
    set_policy(drafter, "hybrid", sps_profile=DEAR_VERIFY)
    try:
        sources = set()
        for prompt in random_prompts(48, 8, target.config.vocab_size, seed=2)[:3]:
            repeated = torch.cat([prompt, prompt[:, :5], prompt], dim=1)
            calls.clear()
            assert_same_greedy(target, drafter, repeated, max_new_tokens=30)
            stats = drafter.last_stats
            sources |= set(stats.sources)
            assert len(calls) <= stats.sources.count("block")  # no context pass of its own on other rounds
        assert {"lookup", "block"} <= sources
    finally:
        set_policy(drafter, "fixed")
        del drafter.generation_config.sps_profile


def test_time_split_covers_the_rounds(tiny_targets, trained_drafters, family):
    import time

    target, drafter = tiny_targets[family], trained_drafters[family]
    set_policy(drafter, "hybrid", sps_profile=CHEAP_VERIFY)
    try:
        prompt = random_prompts(1, 8, target.config.vocab_size, seed=3)[0]
        started = time.perf_counter()
        target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter)
        wall = time.perf_counter() - started
        stats = drafter.last_stats
        split = stats.time_split()
        assert len(stats.stamps) == stats.rounds
        assert all(seconds > 0 for seconds in split.values()), split
        assert sum(split.values()) < wall
        assert stats.to_dict()["time_split"] == pytest.approx(split)
    finally:
        set_policy(drafter, "fixed")
        del drafter.generation_config.sps_profile


def _hybrid(drafter, monkeypatch):
    """The hybrid policy with lookup drafts preferred whenever they pay over plain decoding: the block's predicted
    rate depends on the drafter's measured time, which varies by machine, and the distribution tests need many
    verified lookup rounds everywhere (block rounds still come where no lookup draft is found or pays)."""
    from hf_dspark.planner import Planner

    monkeypatch.setattr(Planner, "_block_beats_offer", lambda self, *args: False)
    drafter.generation_config.verification_policy = "hybrid"
    drafter.generation_config.sps_profile = CHEAP_VERIFY
    drafter.__dict__.pop("_dspark_lookup_survival", None)


@pytest.mark.parametrize("width", ["variable", "fixed"])
def test_hybrid_sampling_matches_target_distribution(setup, monkeypatch, width):  # noqa: F811
    """Also at a fixed verification width, where every round verifies as many tokens as fit (a lookup draft padded
    with its last token, each with a one-hot q; a block whole)."""
    target, drafter, prompt = setup
    _hybrid(drafter, monkeypatch)
    drafter.generation_config.verification_width = width
    try:
        exact = exact_pair_distribution(target, prompt, 0.7, 4)
        counts, _ = sample_pairs(target, drafter, prompt, 0.7, 4, 1500, seed=11)
        survival = next(iter(drafter._dspark_lookup_survival.values()))
        assert survival.reached.sum() > 500, "lookup rounds must be verified often for the test to have power"
        if width == "fixed":  # each round of the last call drafted nothing or verified all the room it had
            stats, length = drafter.last_stats, prompt.shape[1] + 1
            for verified, accepted in zip(stats.verified, stats.accepted):
                assert verified in (0, prompt.shape[1] + 4 - length - 1), (stats.verified, stats.sources)
                length += accepted + 1
        pvalue = chi_square_pvalue(counts, exact)
        assert pvalue > 1e-3, f"hybrid sampling deviates from the target distribution (p={pvalue:.2e})"
    finally:
        drafter.generation_config.verification_policy = "fixed"
        drafter.generation_config.verification_width = None


def test_hybrid_wrong_lookup_q_is_detected(setup, monkeypatch):  # noqa: F811
    """A uniform q for the lookup's drafts instead of the one-hot it is sampled from must fail the same test."""
    from hf_dspark.generation import DSparkCandidateGenerator

    target, drafter, prompt = setup
    _hybrid(drafter, monkeypatch)
    original = DSparkCandidateGenerator._offer_candidates

    def uniform_q(self, *args, **kwargs):
        candidates, logits = original(self, *args, **kwargs)
        return candidates, None if logits is None else torch.zeros_like(logits)

    monkeypatch.setattr(DSparkCandidateGenerator, "_offer_candidates", uniform_q)
    try:
        exact = exact_pair_distribution(target, prompt, 0.7, 4)
        counts, _ = sample_pairs(target, drafter, prompt, 0.7, 4, 1500, seed=11)
        pvalue = chi_square_pvalue(counts, exact)
        assert pvalue < 1e-3, f"the test has no power: a wrong lookup q passed (p={pvalue:.2e})"
    finally:
        drafter.generation_config.verification_policy = "fixed"


def test_two_point_profile_without_the_package(tiny_targets):
    """The custom_generate route without hf_dspark measures SPS at B = 1 and B = max itself."""
    from hf_dspark.generation import _two_point_profile

    sps = _two_point_profile(tiny_targets["llama"], 8)
    assert sps.batch_tokens == [1, 8] and sps.max_batch_tokens == 8
    assert sps.steps_per_sec[0] >= sps.steps_per_sec[1] > 0


def _lookup_by_hand(ids: list[int], max_ngram: int, max_tokens: int):
    """prompt_lookup's rule, written out: the largest n whose suffix occurs earlier, then the latest occurrence with
    a full continuation, else the latest."""
    length = len(ids)
    for n in range(min(max_ngram, length - 1), 0, -1):
        follows = [s + n for s in range(0, length - n) if ids[s:s + n] == ids[length - n:]]
        if follows:
            full = [f for f in follows if f + max_tokens <= length]
            begin = (full or follows)[-1]
            return ids[begin:begin + max_tokens], n
    return None


def test_prompt_lookup_equals_the_rule_written_out():
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        length = int(torch.randint(1, 40, (1,), generator=generator))
        ids = torch.randint(0, 1 + trial % 6, (length,), generator=generator)  # small alphabets: many matches
        max_ngram, max_tokens = 1 + trial % 5, 1 + trial % 7
        found = prompt_lookup(ids, max_ngram, max_tokens)
        expected = _lookup_by_hand(ids.tolist(), max_ngram, max_tokens)
        if expected is None:
            assert found is None, (ids.tolist(), max_ngram, max_tokens)
        else:
            assert found is not None and (found[0].tolist(), found[1]) == expected, (ids.tolist(), max_ngram)


class _Event:
    """A stand-in for a timing ``torch.cuda.Event``: recorded at ``t`` seconds, finished or not."""

    def __init__(self, t: float, done: bool = True):
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_Event") -> float:
        return (end.t - self.t) * 1000.0  # milliseconds, as CUDA events report


def test_time_marks_are_host_seconds_on_cpu_and_event_milliseconds_on_cuda():
    """The generator's and the engine's clock: ``time_mark`` gives host seconds off CUDA; ``seconds_between`` reads
    either that or a pair of timing events (milliseconds, as CUDA reports them)."""
    from hf_dspark.clock import seconds_between, time_mark

    assert seconds_between(_Event(2.0), _Event(2.25)) == pytest.approx(0.25)
    assert seconds_between(10.0, 10.5) == pytest.approx(0.5)
    assert isinstance(time_mark(torch.device("cpu")), float)


def test_drafting_time_on_cuda_comes_from_events_read_after_verification(tiny_targets, trained_drafters):
    """On CUDA a drafter call returns before its kernels finish: the policies' drafting time is the events' time,
    read at the next round (verification has synchronised by then), and an event not reached yet is never waited
    for."""
    from hf_dspark.generation import DSparkCandidateGenerator

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    config = copy.deepcopy(target.generation_config)
    config.max_length = 64
    generator = DSparkCandidateGenerator(drafter, target, config)
    clock = generator.clock
    assert generator.planner.draft_cost(1) is None  # the planner reads the clock's drafter time
    clock.device = torch.device("cuda")
    clock.drafted(_Event(1.0), _Event(1.004))
    assert clock.draft_seconds is None  # nothing read while the round's kernels may still run
    clock.next_round()
    assert clock.draft_seconds == pytest.approx(0.004) and generator.planner.draft_cost(1) == clock.draft_seconds
    clock.drafted(_Event(2.0), _Event(2.014, done=False))
    clock.next_round()
    assert clock.draft_seconds == pytest.approx(0.004) and clock._draft_events is None
    clock.drafted(_Event(3.0), _Event(3.014))
    clock.next_round()
    assert clock.draft_seconds == pytest.approx(0.7 * 0.004 + 0.3 * 0.014)
    clock.device = torch.device("cpu")  # CPU: host time, folded at once
    clock.drafted(10.0, 10.002)
    assert clock.draft_seconds == pytest.approx(0.7 * (0.7 * 0.004 + 0.3 * 0.014) + 0.3 * 0.002)
