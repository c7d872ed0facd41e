"""Speculative-decoding metrics over per-round records, with the paper's definitions (DSPARK.md section 6).

A *round* is one target verification forward: it verifies ``verified`` draft tokens (the first ``verified`` of the
block) and accepts the leading ``accepted <= verified`` of them, then the target emits one token of its own (the
bonus token if every verified draft was accepted, the correction otherwise).

- accepted length tau = (sum accepted + rounds) / rounds: tokens emitted per target forward, bonus included;
- acceptance rate = sum accepted / sum verified;
- position-wise conditional acceptance at k = P(draft k accepted | drafts 1..k-1 accepted and draft k verified);
- the static-threshold sweep replays full-block rounds under ``verify while c_k >= t`` (the threshold policy's rule);
- calibration: per position k, the predicted prefix survival a_k = prod_{i<=k} c_i against the event "drafts 1..k
  accepted", over rounds that verified position k (ECE, ROC-AUC; ``Rollouts`` holds the rounds), which
  ``calibration`` fits its temperatures against.

Everything here is pure (lists / tensors in, numbers out) so ``evaluate`` modules and tests can use it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..scheduling import threshold_length


@dataclass
class Rollouts:
    """Per round: raw confidence logits [g], verified count, accepted count, and the index of the prompt the round
    came from (rounds of one prompt are correlated, so held-out splits keep them together)."""

    confidence_logits: list[list[float]] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)

    def extend_from_stats(self, stats, prompt: int | None = None) -> None:
        """Append the rounds of one prompt (``stats``: anything with ``confidence_logits``/``verified``/``accepted``
        lists, e.g. ``DSparkStats`` or an evaluation ``MethodResult``); ``prompt`` defaults to a new index."""
        if prompt is None:
            prompt = (max(self.prompts) + 1) if self.prompts else 0
        for logits, v, a in zip(stats.confidence_logits, stats.verified, stats.accepted):
            if logits:
                self.confidence_logits.append(list(logits))
                self.verified.append(int(v))
                self.accepted.append(int(a))
                self.prompts.append(int(prompt))

    def tensors(self):
        return (torch.tensor(self.confidence_logits, dtype=torch.float64), torch.tensor(self.verified),
                torch.tensor(self.accepted))

    def subset(self, rows) -> "Rollouts":
        rows = list(rows)
        return Rollouts([self.confidence_logits[i] for i in rows], [self.verified[i] for i in rows],
                        [self.accepted[i] for i in rows], [self.prompts[i] for i in rows] if self.prompts else [])

    def to_dict(self):
        return {"confidence_logits": self.confidence_logits, "verified": self.verified, "accepted": self.accepted,
                "prompts": self.prompts}

    @classmethod
    def from_dict(cls, data):
        """Also reads reports written before rounds carried their prompt index (``prompts`` then stays empty)."""
        return cls(data["confidence_logits"], data["verified"], data["accepted"], data.get("prompts", []))


def expected_calibration_error(probs: torch.Tensor, events: torch.Tensor, num_bins: int = 15) -> float:
    """ECE with equal-width bins: sum_b (n_b / n) |mean(event) - mean(prob)| over non-empty bins."""
    probs, events = probs.double().flatten(), events.double().flatten()
    if probs.numel() == 0:
        return float("nan")
    bins = torch.clamp((probs * num_bins).long(), max=num_bins - 1)
    total = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, torch.ones_like(probs))
    conf = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, probs)
    acc = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, bins, events)
    nonempty = total > 0
    gap = (acc[nonempty] - conf[nonempty]).abs()
    return float(gap.sum() / probs.numel())


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN if one class is missing."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    unique, inverse, counts = torch.unique(sorted_scores, return_inverse=True, return_counts=True)
    if unique.numel() < scores.numel():  # average ranks over ties
        rank_sum = torch.zeros(unique.numel(), dtype=torch.float64).index_add_(
            0, inverse, torch.arange(1, scores.numel() + 1, dtype=torch.float64))
        ranks[order] = (rank_sum / counts)[inverse]
    u = ranks[labels].sum() - positives * (positives + 1) / 2
    return float(u / (positives * negatives))


def prefix_survival(logits: torch.Tensor, temperatures: list[float] | None = None) -> torch.Tensor:
    """a_k = prod_{i<=k} sigmoid(z_i / T_i): [N, g] -> [N, g]."""
    if temperatures is not None:
        logits = logits / torch.tensor(temperatures, dtype=logits.dtype)[: logits.shape[-1]]
    return torch.cumprod(torch.sigmoid(logits), dim=-1)


def _check_rounds(verified: Sequence[int], accepted: Sequence[int]) -> None:
    if len(verified) != len(accepted):
        raise ValueError(f"verified has {len(verified)} rounds but accepted has {len(accepted)}")
    for i, (v, a) in enumerate(zip(verified, accepted)):
        if not 0 <= a <= v:
            raise ValueError(f"round {i}: accepted={a} must lie in [0, verified={v}]")


def accepted_length(verified: Sequence[int], accepted: Sequence[int]) -> float:
    """tau, bonus token included. NaN without rounds."""
    _check_rounds(verified, accepted)
    return (sum(accepted) + len(accepted)) / len(accepted) if accepted else float("nan")


def acceptance_rate(verified: Sequence[int], accepted: Sequence[int]) -> float:
    _check_rounds(verified, accepted)
    total = sum(verified)
    return sum(accepted) / total if total else float("nan")


def position_acceptance(verified: Sequence[int], accepted: Sequence[int], block_size: int) -> dict:
    """Conditional acceptance per position 1..block_size, with the number of rounds that reached each position."""
    _check_rounds(verified, accepted)
    reached, hits = [0] * block_size, [0] * block_size
    for v, a in zip(verified, accepted):
        for k in range(1, min(v, a + 1, block_size) + 1):  # position k reached: verified and 1..k-1 accepted
            reached[k - 1] += 1
            hits[k - 1] += a >= k
    return {"acceptance": [h / r if r else None for h, r in zip(hits, reached)], "reached": reached}


def threshold_sweep(confidence_logits: Sequence[Sequence[float]], verified: Sequence[int], accepted: Sequence[int],
                    thresholds: Sequence[float], temperatures: Sequence[float] | None = None) -> list[dict]:
    """Replay full-block rounds under the static threshold policy, per threshold t.

    Rounds should come from whole-block verification, so the acceptance count is observed for every prefix: under
    threshold t the round verifies l = leading positions with c_k >= t and accepts min(accepted, l). Rounds of the
    same greedy trajectory would be cut differently by a live run; this replay keeps the rounds fixed, which is the
    per-round view Figure 5 of the paper plots (verified / accepted tokens and acceptance rate per threshold)."""
    _check_rounds(verified, accepted)
    if len(confidence_logits) != len(verified):
        raise ValueError("threshold_sweep needs one confidence-logit row per round")
    temps = None if temperatures is None else torch.tensor(list(temperatures), dtype=torch.float64)
    conf = []
    for row in confidence_logits:
        z = torch.tensor(list(row), dtype=torch.float64)
        conf.append(torch.sigmoid(z if temps is None else z / temps[: z.numel()]))
    rows = []
    for t in thresholds:
        total_v = total_a = 0
        for c, v, a in zip(conf, verified, accepted):
            length = min(v, threshold_length(c, float(t)))  # v < g only where max_new_tokens cut the block
            total_v += length
            total_a += min(a, length)
        n = max(1, len(verified))
        rows.append({"threshold": float(t), "verified_per_round": total_v / n, "accepted_per_round": total_a / n,
                     "acceptance_rate": total_a / total_v if total_v else None,
                     "accepted_length": (total_a + len(verified)) / n if verified else None})
    return rows


def rounds_with_confidences(confidence_logits, verified, accepted) -> Rollouts:
    """The rounds that drafted (rounds with no room left before ``max_new_tokens`` carry no confidences)."""
    rollouts = Rollouts()
    for z, v, a in zip(confidence_logits, verified, accepted):
        if len(z):
            rollouts.confidence_logits.append(list(z))
            rollouts.verified.append(int(v))
            rollouts.accepted.append(int(a))
    return rollouts


def calibration_metrics(confidence_logits: Sequence[Sequence[float]], verified: Sequence[int],
                        accepted: Sequence[int], temperatures: Sequence[float] | None = None,
                        num_bins: int = 15) -> dict:
    """ECE and ROC-AUC of the prefix survival per position, raw (T = 1) and with ``temperatures`` if given."""
    _check_rounds(verified, accepted)
    logits, v, a = rounds_with_confidences(confidence_logits, verified, accepted).tensors()
    g = logits.shape[1] if logits.numel() else 0
    out = {"ece_raw": [], "ece_calibrated": [], "auc": [], "num_samples": []}
    for k in range(1, g + 1):
        rows = v >= k
        events = (a[rows] >= k).double()
        z = logits[rows, :k]
        if z.shape[0] == 0:
            for key in out:
                out[key].append(0 if key == "num_samples" else None)
            continue
        raw = prefix_survival(z)[:, -1]
        out["ece_raw"].append(expected_calibration_error(raw, events, num_bins))
        out["ece_calibrated"].append(expected_calibration_error(prefix_survival(z, list(temperatures))[:, -1],
                                                                events, num_bins) if temperatures else None)
        auc = roc_auc(raw, events)
        out["auc"].append(None if auc != auc else auc)
        out["num_samples"].append(int(z.shape[0]))
    return out
