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
