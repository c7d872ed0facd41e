"""Calibration math: ECE, ROC-AUC and Sequential Temperature Scaling on synthetic rollouts."""

import math

import pytest
import torch

from hf_dspark.calibration import (
    Rollouts,
    cross_validated_sts,
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


def test_cross_validated_sts_scores_each_fold_with_the_other_folds_fit():
    rollouts = synthetic_rollouts(n=3000)
    rollouts.prompts = [i // 10 for i in range(3000)]  # 300 prompts of 10 rounds each
    cv = cross_validated_sts(rollouts, folds=3, seed=1)
    assert cv["prompts"] == 300 and len(cv["fold_temperatures"]) == 3
    for before, after in zip(cv["ece_before"], cv["ece_after"]):
        assert after < before
    assert max(cv["ece_after"]) < 0.04 and cv["ece_before"][0] > 0.05
    # rebuild the out-of-fold predictions by hand: the fold of each prompt, fitted on the rest
    generator = torch.Generator().manual_seed(1)
    order = torch.randperm(300, generator=generator).tolist()
    fold_of = {p: i % 3 for i, p in enumerate(order)}
    logits, verified, accepted = rollouts.tensors()
    predictions = torch.empty_like(logits)
    for fold in range(3):
        held = [i for i, p in enumerate(rollouts.prompts) if fold_of[p] == fold]
        rest = [i for i, p in enumerate(rollouts.prompts) if fold_of[p] != fold]
        temperatures = fit_sts(rollouts.subset(rest))["temperatures"]
        assert temperatures == cv["fold_temperatures"][fold]
        predictions[held] = prefix_survival(logits[held], temperatures)
    assert cv["ece_after"][1] == pytest.approx(expected_calibration_error(predictions[:, 1], accepted >= 2))
    assert cv["ece_after"][1] != pytest.approx(fit_sts(rollouts)["ece_after"][1])  # not the in-sample figure
    payload = sts_json({**fit_sts(rollouts), "cross_validation": cv}, "synthetic")
    assert payload["ece_heldout_per_position"] == cv["ece_after"] and payload["heldout_folds"] == 3


def test_cross_validated_sts_rejects_what_it_cannot_split():
    rollouts = synthetic_rollouts(n=40)
    with pytest.raises(ValueError, match="prompt index"):
        cross_validated_sts(rollouts)
    rollouts.prompts = [i % 3 for i in range(40)]
    with pytest.raises(ValueError, match="5 folds need at least 5 prompts"):
        cross_validated_sts(rollouts, folds=5)
    with pytest.raises(ValueError, match="at least 2 folds"):
        cross_validated_sts(rollouts, folds=1)
    assert Rollouts.from_dict({"confidence_logits": [[0.0]], "verified": [1], "accepted": [0]}).prompts == []


class _ByteChat:
    """A stand-in tokenizer: the chat template is the message's bytes folded into the tiny target's vocabulary."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def apply_chat_template(self, messages, add_generation_prompt=True, return_tensors="pt", return_dict=True):
        ids = [3 + b % (self.vocab - 3) for b in messages[-1]["content"].encode()]
        return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}


def test_batched_rollouts_record_the_same_rounds_as_generate(tiny_targets, trained_drafters):
    """Calibration rollouts through the batched engine (whole block, fixed) observe the same rounds as generate()
    prompt by prompt: same verified / accepted counts, same raw confidence logits."""
    from hf_dspark.calibration import collect_rollouts

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    tokenizer = _ByteChat(target.config.vocab_size)
    records = [{"turns": [text]} for text in ("a short one", "a rather longer prompt than that", "mid size")]
    single = collect_rollouts(target, tokenizer, drafter, records, max_new_tokens=12, progress=False)
    batched = collect_rollouts(target, tokenizer, drafter, records, max_new_tokens=12, progress=False, concurrency=2)
    assert len(single.verified) > 3 * 2 and sum(single.accepted) > 0  # the drafter is trained: drafts get accepted
    assert batched.verified == single.verified and batched.accepted == single.accepted
    assert batched.prompts == single.prompts and set(single.prompts) == {0, 1, 2}
    assert torch.allclose(torch.tensor(batched.confidence_logits), torch.tensor(single.confidence_logits), atol=1e-4)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        collect_rollouts(target, tokenizer, drafter, records, concurrency=0)


@pytest.mark.parametrize("concurrency", [1, 2])
def test_rollouts_resume_from_their_checkpoint(tiny_targets, trained_drafters, tmp_path, monkeypatch, concurrency):
    """An interrupted calibration keeps its finished records: a rerun with the same checkpoint rolls out only the
    rest, and ends with exactly the rounds of an uninterrupted run. A half-written last line (the interruption) is
    rolled out again; a checkpoint of another run is refused."""
    import json

    import hf_dspark.calibration as calibration

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    tokenizer = _ByteChat(target.config.vocab_size)
    records = [{"id": f"r{i}", "turns": [text]} for i, text in enumerate(
        ("a short one", "a rather longer prompt than that", "mid size", "and one more", "last"))]
    whole = calibration.collect_rollouts(target, tokenizer, drafter, records, max_new_tokens=10, progress=False,
                                         concurrency=concurrency)
    monkeypatch.setattr(calibration, "CHECKPOINT_CHUNK", 2)
    path = tmp_path / "rollouts.partial.jsonl"
    rolled = []
    original = calibration._rollout_rounds

    def counting(*args):
        rolled.extend(args[-1])  # the records' indices
        if len(rolled) > 2:
            raise KeyboardInterrupt  # interrupted during the second chunk
        return original(*args)

    monkeypatch.setattr(calibration, "_rollout_rounds", counting)
    with pytest.raises(KeyboardInterrupt):
        calibration.collect_rollouts(target, tokenizer, drafter, records, max_new_tokens=10, progress=False,
                                     concurrency=concurrency, checkpoint=path, checkpoint_key={"drafter": "tiny"})
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["key"]["ids"] == ["r0", "r1", "r2", "r3", "r4"]
    path.write_text("\n".join(lines[:2]) + "\n" + lines[2][:15])  # the last record's line was cut short
    spy = []
    monkeypatch.setattr(calibration, "_rollout_rounds", lambda *args: spy.extend(args[-1]) or original(*args))
    resumed = calibration.collect_rollouts(target, tokenizer, drafter, records, max_new_tokens=10, progress=False,
                                           concurrency=concurrency, checkpoint=path, checkpoint_key={"drafter": "tiny"})
    assert spy == [1, 2, 3, 4]  # record 0 was kept; record 1's line was cut short
    assert resumed.verified == whole.verified and resumed.accepted == whole.accepted
    assert resumed.prompts == whole.prompts
    assert torch.allclose(torch.tensor(resumed.confidence_logits), torch.tensor(whole.confidence_logits), atol=1e-4)
    with pytest.raises(ValueError, match="written for another run .*max_new_tokens"):
        calibration.collect_rollouts(target, tokenizer, drafter, records, max_new_tokens=12, progress=False,
                                     checkpoint=path, checkpoint_key={"drafter": "tiny"})
