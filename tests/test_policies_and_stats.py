"""Pure math: verification-length policies and statistics, hand-computed."""

import pytest
import torch
from transformers import GenerationConfig

from hf_dspark import ConfidenceThresholdPolicy, DSparkStats, FixedLengthPolicy, VerificationPolicy
from hf_dspark.scheduling import policy_from_generation_config, register_verification_policy, threshold_length


def test_fixed_policy():
    assert FixedLengthPolicy().num_to_verify(None, 7) == 7
    assert FixedLengthPolicy(3).num_to_verify(None, 7) == 3
    assert FixedLengthPolicy(9).num_to_verify(None, 4) == 4
    assert FixedLengthPolicy(0).num_to_verify(None, 4) == 0


def test_threshold_policy_cuts_at_first_low_confidence():
    c = torch.tensor([0.9, 0.8, 0.4, 0.95, 0.9])
    assert ConfidenceThresholdPolicy(0.5).num_to_verify(c, 5) == 2  # later high values do not matter
    assert ConfidenceThresholdPolicy(0.95).num_to_verify(c, 5) == 0
    assert ConfidenceThresholdPolicy(0.3).num_to_verify(c, 5) == 5
    assert ConfidenceThresholdPolicy(0.3).num_to_verify(c, 3) == 3
    assert threshold_length(torch.tensor([0.5, 0.49]), 0.5) == 1  # c == t is kept


def test_policy_from_generation_config_and_registry():
    gc = GenerationConfig(verification_policy="threshold", confidence_threshold=0.7)
    policy = policy_from_generation_config(gc, 7, True)
    assert isinstance(policy, ConfidenceThresholdPolicy) and policy.threshold == 0.7

    @register_verification_policy("first-two")
    class FirstTwo(VerificationPolicy):
        def num_to_verify(self, confidences, max_drafts):
            return min(2, max_drafts)

    assert policy_from_generation_config(GenerationConfig(verification_policy="first-two"), 7, False).num_to_verify(
        None, 7
    ) == 2
    with pytest.raises(ValueError, match="confidence_threshold"):
        ConfidenceThresholdPolicy(1.5)


def test_stats_hand_computed():
    stats = DSparkStats(block_size=3)
    # (verified, accepted): (3,3) all accepted; (3,1) rejected at 2; (2,0) rejected at 1; (0,0) no drafts
    for verified, accepted in [(3, 3), (3, 1), (2, 0), (0, 0)]:
        stats.add_round(3, verified, accepted, None)
    assert stats.rounds == 4
    assert stats.accepted_length == pytest.approx((4 + 2 + 1 + 1) / 4)
    assert stats.acceptance_rate == pytest.approx(4 / 8)
    # position 1 reached in rounds 1-3, accepted in 1-2; position 2 reached in 1-2, accepted in 1;
    # position 3 reached in round 1, accepted.
    assert stats.position_acceptance() == pytest.approx([2 / 3, 1 / 2, 1.0])
    assert stats.to_dict()["rounds"] == 4


# ------------------------------------------------------------------------------------------------------------------
# Settings in one place: the moving average, each setting group's check, the one policy builder
# ------------------------------------------------------------------------------------------------------------------
def test_ema_weights_the_newest_value():
    from hf_dspark.scheduling import EMA_WEIGHT, ema

    assert EMA_WEIGHT == 0.3
    assert ema(None, 2.0) == 2.0
    assert ema(1.0, 2.0) == pytest.approx(0.7 * 1.0 + 0.3 * 2.0)


def test_check_probe_settings():
    from hf_dspark.scheduling import check_probe_settings

    check_probe_settings(1, 1, 1.0)
    check_probe_settings(4, 64, 0.1)
    with pytest.raises(ValueError, match="probe_interval must be >= 1, got 0"):
        check_probe_settings(0, 4, 0.1)
    with pytest.raises(ValueError, match=r"max_probe_interval \(2\) must be >= probe_interval \(4\)"):
        check_probe_settings(4, 2, 0.1)
    for smoothing in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"confidence_smoothing must be in \(0, 1\]"):
            check_probe_settings(4, 64, smoothing)


def test_check_explore_settings():
    from hf_dspark.scheduling import check_explore_settings

    check_explore_settings(1, 1, 0.0)
    check_explore_settings(16, 256, 0.999)
    with pytest.raises(ValueError, match="explore_interval must be >= 1, got 0"):
        check_explore_settings(0, 4, 0.1)
    with pytest.raises(ValueError, match=r"max_explore_interval \(4\) must be >= explore_interval \(8\)"):
        check_explore_settings(8, 4, 0.1)
    for budget in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"explore_budget must be in \[0, 1\)"):
            check_explore_settings(16, 256, budget)


def test_check_lookup_settings():
    from hf_dspark.draft_sources import check_lookup_ngram
    from hf_dspark.scheduling import check_lookup_settings

    check_lookup_ngram(1)
    check_lookup_settings(1, 1)
    with pytest.raises(ValueError, match="lookup_max_ngram must be >= 1, got 0"):
        check_lookup_ngram(0)
    with pytest.raises(ValueError, match="lookup_max_ngram must be >= 1, got 0"):
        check_lookup_settings(0, 16)
    with pytest.raises(ValueError, match="lookup_max_tokens must be >= 1, got 0"):
        check_lookup_settings(4, 0)


def test_build_policy_reads_the_generation_config_under_overrides():
    from hf_dspark.scheduling import HybridPolicy, PrefixSchedulerPolicy, StepsPerSecond, build_policy

    assert build_policy("fixed", None, 4).num_tokens is None  # no generation config: the defaults
    gc = GenerationConfig(num_verify_tokens=2, confidence_threshold=0.7, lookup_max_ngram=3)
    assert build_policy("fixed", gc, 4).num_tokens == 2
    assert build_policy("fixed", gc, 4, num_verify_tokens=None).num_tokens is None  # an override of None counts
    assert build_policy("threshold", gc, 4, confidence_threshold=0.2).threshold == 0.2
    assert gc.confidence_threshold == 0.7  # the generation config is left as it was
    sps = StepsPerSecond([1, 2], [10.0, 8.0])
    scheduler = build_policy("scheduler", None, 4, sps_profile=sps)  # a StepsPerSecond itself, or its dict
    assert isinstance(scheduler, PrefixSchedulerPolicy) and scheduler.sps is sps
    assert build_policy("scheduler", None, 4, sps_profile=sps.to_dict()).sps.steps_per_sec == [10.0, 8.0]
    hybrid = build_policy("hybrid", gc, 4)
    assert isinstance(hybrid, HybridPolicy) and (hybrid.max_ngram, hybrid.max_lookup_tokens) == (3, 16)
    assert build_policy("hybrid", gc, 4, lookup_max_ngram=5).max_ngram == 5
    with pytest.raises(ValueError, match="lookup_max_ngram must be >= 1"):
        build_policy("hybrid", gc, 4, lookup_max_ngram=0)
    with pytest.raises(ValueError, match="unknown verification_policy 'nope'"):
        build_policy("nope", gc, 4)
