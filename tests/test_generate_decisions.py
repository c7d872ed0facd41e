"""scripts/generate_decisions.py: generate()'s decisions under a fixed profile and a ticking clock are a deterministic
trace, and they follow the profile and the drafter's measured time."""

import copy

import pytest

from tests.helpers import load_script, random_prompts
from tests.test_engine import plain_greedy

CHEAP = {"sample_batch_tokens": [1, 2, 3, 5, 9], "sample_steps_per_sec": [100.0, 95.0, 90.0, 80.0, 60.0]}
DEAR = {"sample_batch_tokens": [1, 2, 9], "sample_steps_per_sec": [100.0, 40.0, 10.0]}


@pytest.fixture(scope="module")
def script():
    return load_script("generate_decisions")


@pytest.mark.parametrize("policy", ["scheduler", "hybrid"])
def test_the_trace_repeats_and_follows_the_profile_and_the_clock(script, tiny_targets, trained_drafters, policy):
    target, drafter = tiny_targets["llama"], copy.deepcopy(trained_drafters["llama"])
    prompts = [p[0].tolist() for p in random_prompts(3, 6, target.config.vocab_size, seed=7)]
    first = script.decision_trace(target, drafter, prompts, CHEAP, policy, max_new_tokens=12)
    again = script.decision_trace(target, drafter, prompts, CHEAP, policy, max_new_tokens=12)
    assert first == again  # nothing in it depends on how long a round took
    assert first["outputs"] == [plain_greedy(target, p, 12) for p in prompts]
    verified = lambda trace: sum(sum(rounds[1]) for rounds in trace["rounds"])  # noqa: E731
    assert verified(first) > 0
    # a profile where a second token costs 2.5x the first verifies fewer drafts: the digest sees the rule's inputs
    dear = script.decision_trace(target, drafter, prompts, DEAR, policy, max_new_tokens=12)
    assert verified(dear) < verified(first) and dear["decisions_digest"] != first["decisions_digest"]
    assert dear["outputs_digest"] == first["outputs_digest"]
    # a drafter that seems to take a second per block stops drafting once it has been measured
    slow = script.decision_trace(target, drafter, prompts, CHEAP, policy, max_new_tokens=12, tick=1.0)
    blocks = lambda trace: sum(rounds[0].count("block") for rounds in trace["rounds"])  # noqa: E731
    assert blocks(slow) < blocks(first) and slow["outputs_digest"] == first["outputs_digest"]
