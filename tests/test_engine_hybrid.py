"""The engine's "hybrid" policy: per request, a prompt-lookup draft that pays replaces the drafter's block for the
step. Greedy outputs equal plain ``generate()``; sampled outputs keep the target's distribution (a lookup draft's q
is one-hot), and a wrong q is caught by the same test."""

import pytest
import torch

from hf_dspark.engine import DSparkEngine, SamplingParams, generate_batch
from hf_dspark.evaluation.engine_bench import parse_policy
from tests.helpers import make_drafter
from tests.test_engine import (
    DECREASING_SPS,
    FLAT_SPS,
    SAMPLING_GROUPS,
    in_distribution_prompts,
    plain_greedy,
    sample_pairs_batched,
)
from tests.test_engine import sampling_setup  # noqa: F401  (the module fixture)
from tests.test_sampling import chi_square_pvalue

# cost_aware=False: whether the drafter's block pays for its MEASURED time depends on the machine's load
HYBRID = dict(policy="hybrid", sps=DECREASING_SPS, cost_aware=False)


def repeated(prompt: list[int]) -> list[int]:
    """Text that prompt lookup can copy from."""
    return prompt + prompt[:5] + prompt


def sources_by_step(outputs) -> list[list[str]]:
    """Each step's round sources, one per request (requests that joined at the first step)."""
    steps = max(len(out.stats.sources) for out in outputs)
    return [[out.stats.sources[k] for out in outputs if k < len(out.stats.sources)] for k in range(steps)]


def test_hybrid_greedy_equals_plain_generate(tiny_targets, trained_drafters, family):
    target, drafter = tiny_targets[family], trained_drafters[family]
    base = in_distribution_prompts(target, 6)
    prompts = [repeated(p) if i % 2 == 0 else p for i, p in enumerate(base)]
    max_new = [30, 12, 25, 1, 30, 7]
    result = generate_batch(target, prompts, drafter, [SamplingParams(max_new_tokens=m) for m in max_new],
                            max_concurrency=4, **HYBRID)
    for prompt, m, out in zip(prompts, max_new, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, m), f"request {out.request_id} diverged"
    sources = [s for out in result.outputs for s in out.stats.sources]
    assert "lookup" in sources, "lookup must fire on repeated text for the test to exercise it"
    for out in result.outputs:
        by_source = out.stats.by_source()
        assert sum(row["rounds"] for row in by_source.values()) == out.stats.rounds
    # the engine counts the requests that verified a lookup draft, step by step
    assert sum(result.stats.lookups) == sources.count("lookup")
    assert result.stats.summary()["lookup_fraction"] > 0


def test_hybrid_mixes_lookup_and_block_rows_in_one_step(tiny_targets, trained_drafters, family, monkeypatch):
    target, drafter = tiny_targets[family], trained_drafters[family]
    base = in_distribution_prompts(target, 4)
    prompts = [repeated(base[0]), base[1], repeated(base[2]), base[3]]
    params = SamplingParams(max_new_tokens=24)
    # a flat SPS: any draft with a chance is worth verifying, so block and lookup rows both verify every step
    result = generate_batch(target, prompts, drafter, params, policy="hybrid", sps=FLAT_SPS, cost_aware=False)
    for prompt, out in zip(prompts, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, 24)
    assert any({"lookup", "block"} <= set(step) for step in sources_by_step(result.outputs)), \
        "some step must verify lookup drafts for some requests and the drafter's block for others"

    # A step where every request verifies a lookup draft runs no drafter forward at all.
    forwards = []
    original = type(drafter).forward
    monkeypatch.setattr(type(drafter), "forward",
                        lambda self, *args, **kwargs: forwards.append(1) or original(self, *args, **kwargs))
    alone = repeated(base[0] + base[0])
    result = generate_batch(target, [alone], drafter, params, policy="hybrid", sps=FLAT_SPS, cost_aware=False)
    assert result.outputs[0].token_ids == plain_greedy(target, alone, 24)
    assert any(lookups and not drafting for lookups, drafting in zip(result.stats.lookups, result.stats.drafting))
    assert len(forwards) == sum(1 for d in result.stats.drafting if d)


def test_hybrid_is_a_method_with_options():
    assert parse_policy("hybrid") == {"policy": "hybrid", "schedule": "padded"}
    assert parse_policy("hybrid=prefix,ungated") == {"policy": "hybrid", "schedule": "prefix", "realized_gate": False}
    with pytest.raises(ValueError, match="hybrid"):
        parse_policy("hybrid=nope")


def test_hybrid_validation(tiny_targets):
    target = tiny_targets["llama"]
    with pytest.raises(ValueError, match="hybrid"):
        DSparkEngine(target, policy="nope")  # the expected policies are listed
    with pytest.raises(ValueError, match="confidence head"):
        DSparkEngine(target, make_drafter(target, confidence=False), policy="hybrid")
    with pytest.raises(ValueError, match="lookup_max_ngram"):
        DSparkEngine(target, make_drafter(target), policy="hybrid", lookup_max_ngram=0)


# ------------------------------------------------------------------------------------------------------------------
# Sampling: a lookup draft's q is one-hot
# ------------------------------------------------------------------------------------------------------------------
SAMPLING_HYBRID = dict(policy="hybrid", sps=DECREASING_SPS, cost_aware=False)  # per-request curve: 3000 rows


def test_hybrid_sampling_matches_target_distribution_per_request(sampling_setup):  # noqa: F811
    target, drafter, prompt, exact = sampling_setup
    counts, _, stats = sample_pairs_batched(target, drafter, prompt, SAMPLING_HYBRID, seed=11)
    assert sum(stats.lookups) > 1000, "lookup drafts must be verified often for the test to have power"
    for name in SAMPLING_GROUPS:
        pvalue = chi_square_pvalue(counts[name], exact[name])
        assert pvalue > 1e-3, f"{name}: hybrid sampling deviates from the target distribution (p={pvalue:.2e})"


def test_hybrid_wrong_lookup_q_is_detected(sampling_setup, monkeypatch):  # noqa: F811
    """A uniform q for the lookup's drafts instead of the one-hot they are drawn from must fail the same test."""
    from hf_dspark.engine import verification

    target, drafter, prompt, exact = sampling_setup
    monkeypatch.setattr(verification, "one_hot_probs",
                        lambda ids, vocab: torch.full((*ids.shape, vocab), 1.0 / vocab, device=ids.device))
    counts, _, _ = sample_pairs_batched(target, drafter, prompt, SAMPLING_HYBRID, seed=11)
    pvalue = chi_square_pvalue(counts["t07k4"], exact["t07k4"])
    assert pvalue < 1e-3, f"the test has no power: a wrong lookup q passed (p={pvalue:.2e})"


def test_the_realized_gate_judges_offers_with_the_block(tiny_targets, trained_drafters):
    """Under the realized gate a step that verifies offers counts as a drafting step, and where the gate has ruled
    drafting out at a batch size, no row takes an offer there either; outputs stay plain greedy's."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = [repeated(p) for p in in_distribution_prompts(target, 2)]
    params = SamplingParams(max_new_tokens=20)
    open_engine = DSparkEngine(target, drafter, policy="hybrid", sps=FLAT_SPS, explore_budget=0)
    for prompt in prompts:
        open_engine.add_request(prompt, params)
    recorded = []
    record = open_engine.measurements.record_step
    open_engine.measurements.record_step = lambda rows, drafted, *a: recorded.append(drafted) or record(rows, drafted, *a)
    while open_engine.has_unfinished():
        open_engine.step()
    offered = [bool(n) for n in open_engine.stats.lookups]
    assert any(offered), "lookup must fire on repeated text for the test to exercise it"
    assert True in recorded  # steps with offers (or blocks) enter the gate's drafting side

    closed = DSparkEngine(target, drafter, policy="hybrid", sps=FLAT_SPS, explore_budget=0, explore_interval=64,
                          max_explore_interval=64)  # no re-measurement within these 20 tokens
    for drafted_step, emitted, seconds in ((True, 8, 0.1), (True, 8, 0.1), (False, 4, 0.04), (False, 4, 0.04)):
        closed.measurements.record_step(2, drafted_step, emitted=emitted, seconds=seconds)  # drafting lost at 2 rows
    ids = [closed.add_request(prompt, params) for prompt in prompts]
    closed.step()  # both requests join: their first step after the prompt is not representative
    while closed.has_unfinished() and len(closed.batch.rows) == 2:
        closed.step()
        assert closed.stats.lookups[-1] == 0 and closed.stats.drafting[-1] == 0
    while closed.has_unfinished():
        closed.step()
    for prompt, request_id in zip(prompts, ids):
        assert closed.outputs[request_id].token_ids == plain_greedy(target, prompt, 20)
