"""Calibration math: ECE, ROC-AUC and Sequential Temperature Scaling on synthetic rollouts."""

import math

import pytest
import torch

from hf_dspark.calibration import (
    Rollouts,
    expected_calibration_error,
    fit_sts,
    prefix_survival,
    reliability_diagram,
    roc_auc,
    sts_json,
)


def test_ece_hand_computed():
    probs = torch.tensor([0.1, 0.1, 0.9, 0.9])
    events = torch.tensor([0, 1, 1, 1])
    # bin of 0.1: acc 0.5 vs conf 0.1 -> 0.4 * 2/4; bin of 0.9: acc 1 vs 0.9 -> 0.1 * 2/4
    assert expected_calibration_error(probs, events, num_bins=10) == pytest.approx(0.25)
    assert expected_calibration_error(torch.tensor([1.0, 0.0]), torch.tensor([1, 0])) == pytest.approx(0.0)


def test_auc_hand_computed():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == pytest.approx(0.5)
    assert math.isnan(roc_auc(torch.tensor([0.5]), torch.tensor([1])))


def synthetic_rollouts(n=4000, g=4, true_temps=(2.0, 0.5, 3.0, 1.0), seed=0):
    """Confidence logits whose TRUE conditional acceptance is sigmoid(z / T_true)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, g, generator=gen, dtype=torch.float64) * 2
    true_c = torch.sigmoid(z / torch.tensor(true_temps, dtype=torch.float64))
    accepted_each = torch.rand(n, g, generator=gen, dtype=torch.float64) < true_c
    accepted = torch.cumprod(accepted_each.long(), dim=1).sum(dim=1)
    return Rollouts(z.tolist(), [g] * n, accepted.tolist())


def test_sts_recovers_temperatures_and_lowers_ece():
    rollouts = synthetic_rollouts()
    fit = fit_sts(rollouts)
    for got, want in zip(fit["temperatures"], (2.0, 0.5, 3.0, 1.0)):
        assert got == pytest.approx(want, rel=0.35)
    for before, after in zip(fit["ece_before"], fit["ece_after"]):
        assert after <= before + 1e-12
    assert max(fit["ece_after"]) < 0.03
    assert fit["ece_before"][0] > 0.05
    # order preserving: AUC of calibrated survival equals AUC before
    logits, verified, accepted = rollouts.tensors()
    calibrated = prefix_survival(logits, fit["temperatures"])[:, 0]
    assert roc_auc(calibrated, accepted >= 1) == pytest.approx(fit["auc"][0])
    payload = sts_json(fit, "synthetic")
    assert set(payload) >= {"temperatures", "dataset", "num_samples", "ece_before", "ece_after"}
    assert payload["ece_after"] < payload["ece_before"]


def test_unverified_positions_are_not_counted(tmp_path):
    rollouts = Rollouts([[3.0, 3.0], [3.0, -3.0], [0.0, 0.0]], [1, 2, 0], [1, 1, 0])
    fit = fit_sts(rollouts)
    assert fit["num_samples"] == [2, 1]
    path = reliability_diagram(synthetic_rollouts(n=300), fit_sts(synthetic_rollouts(n=300))["temperatures"],
                               tmp_path / "rel.png")
    assert path.stat().st_size > 1000
