"""The hardware-aware prefix scheduler: hand-computed cases, invariants, and the paper's Appendix A example."""

import itertools
import random

import pytest
import torch

from hf_dspark.scheduling import (
    PrefixSchedulerPolicy,
    StepsPerSecond,
    dynamic_topk_capacity,
    prefix_schedule,
    topk_schedule,
    width_schedule,
)


def reference_algorithm1(confidences: list[list[float]], sps, early_stop: bool = True) -> list[int]:
    """Algorithm 1 written as the paper's loop (the test's independent reference)."""
    num = len(confidences)
    survival = []
    for r, row in enumerate(confidences):
        a = 1.0
        for j, c in enumerate(row, 1):
            a *= c
            survival.append((a, j, r))
    entries = sorted([e for e in survival if e[0] > 0], key=lambda e: (-e[0], e[1], e[2]))
    lengths, batch, tau = [0] * num, num, float(num)
    best, best_lengths = num * sps(num), [0] * num
    for a, j, r in entries:
        if batch + 1 > sps.max_batch_tokens:
            break
        lengths[r], batch, tau = j, batch + 1, tau + a
        theta = tau * sps(batch)
        if theta > best:
            best, best_lengths = theta, list(lengths)
        elif early_stop:
            break
    return best_lengths


def test_hand_computed_single_request():
    sps = StepsPerSecond([1, 2, 3, 4], [10.0, 9.0, 8.0, 7.0])
    # a = 0.9, 0.72, 0.36: theta0 = 10; 1.9*9=17.1; 2.62*8=20.96; 2.98*7=20.86 -> stop, l = 2
    lengths = prefix_schedule(torch.tensor([[0.9, 0.8, 0.5]]), sps.table())
    assert lengths.tolist() == [2]


def test_two_requests_share_budget():
    sps = StepsPerSecond([2, 3, 4, 5, 6], [10.0, 9.5, 9.0, 6.0, 5.0])
    c = torch.tensor([[0.9, 0.9], [0.5, 0.9]])
    # entries: (0.9,r0j1) (0.81,r0j2) (0.5,r1j1) (0.45,r1j2)
    # theta0=2*10=20; +0.9 -> 2.9*9.5=27.55; +0.81 -> 3.71*9=33.39; +0.5 -> 4.21*6=25.26 stop
    assert prefix_schedule(c, sps.table()).tolist() == [2, 0]


def test_matches_reference_loop_on_random_cases():
    rng = random.Random(0)
    for _ in range(300):
        num, g = rng.randint(1, 5), rng.randint(1, 7)
        conf = [[rng.choice([0.0, 1.0, rng.random(), rng.random() ** 0.2]) for _ in range(g)] for _ in range(num)]
        samples = sorted(rng.sample(range(1, num * g + num + 2), k=min(4, num * g + 1)))
        if samples[0] > num:
            samples[0] = num
        base = rng.uniform(5, 20)
        sps = StepsPerSecond(samples, [base * (1 - 0.3 * rng.random()) / (1 + 0.05 * i) for i, _ in enumerate(samples)])
        expected = reference_algorithm1(conf, sps)
        assert prefix_schedule(torch.tensor(conf), sps.table()).tolist() == expected, (conf, sps.to_dict())


def test_invariants():
    rng = torch.Generator().manual_seed(1)
    sps = StepsPerSecond([1, 8, 16, 64], [100.0, 95.0, 90.0, 40.0])
    for _ in range(200):
        c = torch.rand(4, 7, generator=rng)
        c[torch.rand(4, 7, generator=rng) < 0.2] = 0.0
        lengths = prefix_schedule(c, sps.table())
        survival = torch.cumprod(c, dim=1)
        for r in range(4):
            l = int(lengths[r])
            assert l == 0 or survival[r, l - 1] > 0  # zero-survival tokens never admitted
        assert int(lengths.sum()) + 4 <= sps.max_batch_tokens  # budget cap


def test_ties_resolved_toward_earlier_positions():
    sps = StepsPerSecond([1, 2, 3], [10.0, 9.9, 6.0])
    # c = (1, 1): a1 = a2 = 1; admitting j=1 first improves (2*9.9), then j=2 does not (3*6).
    assert prefix_schedule(torch.tensor([[1.0, 1.0]]), sps.table()).tolist() == [1]


def test_budget_cap():
    sps = StepsPerSecond([1, 3], [10.0, 10.0], max_batch_tokens=3)
    assert prefix_schedule(torch.tensor([[1.0, 1.0, 1.0, 1.0]]), sps.table()).tolist() == [2]


def test_dynamic_topk():
    sps = StepsPerSecond([2, 3, 4, 5, 6], [10.0, 9.5, 9.0, 6.0, 5.0])
    stale = torch.tensor([[0.9, 0.9], [0.5, 0.9]])
    assert dynamic_topk_capacity(stale, sps.table()) == 2
    current = torch.tensor([[0.2, 0.9], [0.95, 0.95]])
    # current survivals: r0: .2 .18; r1: .95 .9025 -> top-2 = r1 j1, r1 j2
    assert topk_schedule(current, 2).tolist() == [0, 2]
    assert topk_schedule(torch.tensor([[0.0, 1.0]]), 2).tolist() == [0]  # zero survival never admitted


# --------------------------------------------------------------------------------------------------------------
# Appendix A: without the early stop the output distribution is biased.
# --------------------------------------------------------------------------------------------------------------
P_TARGET = {"A": 0.7, "B": 0.3}
P_DRAFT = {"A": 0.5, "B": 0.5}
APPENDIX_SPS = StepsPerSecond([1, 2, 3], [1.0, 0.5, 0.45])


def first_token_distribution(schedule) -> dict:
    """Exact enumeration of the first output token. c1 = 0.8; c2 depends on the sampled x1 (0.9 after A, 0 after
    B), so a scheduler that looks at c2 before deciding on x1 anticipates x1."""
    out = {"A": 0.0, "B": 0.0}
    for x1, q in P_DRAFT.items():
        c2 = 0.9 if x1 == "A" else 0.0
        length = schedule([[0.8, c2]])
        if length == 0:
            for y, p in P_TARGET.items():
                out[y] += q * p
            continue
        accept = min(1.0, P_TARGET[x1] / P_DRAFT[x1])
        out[x1] += q * accept
        residual = {y: max(0.0, P_TARGET[y] - P_DRAFT[y]) for y in P_TARGET}
        total = sum(residual.values())
        for y in P_TARGET:
            out[y] += q * (1 - accept) * residual[y] / total
    return out


def test_appendix_a_full_search_is_biased_and_early_stop_is_exact():
    full_search = lambda conf: reference_algorithm1(conf, APPENDIX_SPS, early_stop=False)[0]  # noqa: E731
    shipped = lambda conf: int(prefix_schedule(torch.tensor(conf), APPENDIX_SPS.table())[0])  # noqa: E731
    biased = first_token_distribution(full_search)
    assert biased["A"] == pytest.approx(0.85) and biased["B"] == pytest.approx(0.15)
    exact = first_token_distribution(shipped)
    assert exact["A"] == pytest.approx(0.7) and exact["B"] == pytest.approx(0.3)


def test_policy_single_request():
    sps = StepsPerSecond([1, 2, 3, 4], [10.0, 9.0, 8.0, 7.0])
    policy = PrefixSchedulerPolicy(sps)
    assert policy.num_to_verify(torch.tensor([0.9, 0.8, 0.5]), 3) == 2
    assert policy.num_to_verify(torch.tensor([0.9, 0.8, 0.5]), 1) == 1
    with pytest.raises(ValueError, match="SPS profile"):
        PrefixSchedulerPolicy().num_to_verify(torch.tensor([0.9]), 1)


# --------------------------------------------------------------------------------------------------------------
# Width layers: Algorithm 1 for the engine's padded batch (cost R * (1 + longest length))
# --------------------------------------------------------------------------------------------------------------
def reference_width_schedule(confidences: list[list[float]], sps, early_stop: bool = True) -> list[int]:
    """The width-layer search written as a plain loop (the test's independent reference)."""
    num = len(confidences)
    survival = [[] for _ in range(num)]
    for r, row in enumerate(confidences):
        a = 1.0
        for c in row:
            a *= c
            survival[r].append(a)
    best, best_width, tau = num * sps(num), 0, float(num)
    for width in range(1, len(confidences[0]) + 1):
        if num * (1 + width) > sps.max_batch_tokens:
            break
        gain = sum(row[width - 1] for row in survival)
        tau += gain
        theta = tau * sps(num * (1 + width))
        if gain > 0 and theta > best:
            best, best_width = theta, width
        elif early_stop:
            break
    return [sum(1 for a in row[:best_width] if a > 0) for row in survival]


def test_width_schedule_hand_case():
    # B = R * (1 + L) with R = 2: SPS(2) = 10, SPS(4) = 8, SPS(6) = 5.
    sps = StepsPerSecond([2, 4, 6], [10.0, 8.0, 5.0])
    conf = torch.tensor([[0.9, 0.5], [0.6, 0.0]])
    # layer 1: tau = 2 + 0.9 + 0.6 = 3.5, 3.5 * 8 = 28 > 2 * 10 -> admitted;
    # layer 2: tau = 3.5 + 0.45 = 3.95, 3.95 * 5 = 19.75 < 28 -> stop. Request 1 has zero survival at position 2.
    assert width_schedule(conf, sps.table()).tolist() == [1, 1]
    # A layer that does not pay stops the search even if a later one would (the lossless early stop).
    steep_then_flat = StepsPerSecond([2, 4, 6], [10.0, 5.5, 5.5])
    assert width_schedule(torch.tensor([[0.5, 1.0], [0.5, 1.0]]), steep_then_flat.table()).tolist() == [0, 0]
    assert reference_width_schedule([[0.5, 1.0], [0.5, 1.0]], steep_then_flat, early_stop=False) == [2, 2]


def test_width_schedule_matches_reference_and_algorithm1_for_one_request():
    rng = random.Random(3)
    for _ in range(300):
        num, g = rng.randint(1, 5), rng.randint(1, 6)
        conf = [[rng.choice([0.0, 1.0, rng.random()]) for _ in range(g)] for _ in range(num)]
        points = sorted(rng.sample(range(1, num * (g + 1) + 1), k=min(4, num * (g + 1))))
        sps = StepsPerSecond(points, sorted((rng.uniform(1, 100) for _ in points), reverse=True))
        got = width_schedule(torch.tensor(conf), sps.table()).tolist()
        assert got == reference_width_schedule(conf, sps), (conf, sps.to_dict(), got)
        for r, length in enumerate(got):  # zero-survival entries never admitted; a common width for all rows
            assert all(c > 0 for c in conf[r][:length])
        if num == 1:
            assert got == prefix_schedule(torch.tensor(conf), sps.table()).tolist()


def test_width_schedule_appendix_a_in_a_batch():
    """Appendix A with a second (non-drafting) request in the padded batch: a full search over widths biases the
    first request's first token toward (0.85, 0.15); the shipped early-stop search keeps it exact (0.7, 0.3)."""
    sps = StepsPerSecond([2, 4, 6], [1.0, 0.7, 0.6])  # 2.8 * 0.7 < 2 * 1.0, but 3.52 * 0.6 > 2 * 1.0
    full = lambda conf: reference_width_schedule(conf + [[0.0, 0.0]], sps, early_stop=False)[0]  # noqa: E731
    shipped = lambda conf: int(width_schedule(torch.tensor(conf + [[0.0, 0.0]]), sps.table())[0])  # noqa: E731
    biased = first_token_distribution(full)
    assert biased["A"] == pytest.approx(0.85) and biased["B"] == pytest.approx(0.15)
    exact = first_token_distribution(shipped)
    assert exact["A"] == pytest.approx(0.7) and exact["B"] == pytest.approx(0.3)


# --------------------------------------------------------------------------------------------------------------
# R = 1 policy: skipping drafts that cannot pay, and the online survival correction
# --------------------------------------------------------------------------------------------------------------
def test_policy_skips_drafting_and_probes_with_backoff():
    steep = StepsPerSecond([1, 2, 8], [100.0, 1.0, 0.1])  # nothing is ever worth verifying
    policy = PrefixSchedulerPolicy(steep, online_correction=False, probe_interval=2, max_probe_interval=8)
    pattern = []
    for _ in range(40):
        drafted = policy.should_draft(3)
        pattern.append(int(drafted))
        if drafted:
            assert policy.num_to_verify(torch.tensor([0.9, 0.9, 0.9]), 3) == 0
        policy.observe(0, 0)
    rounds = [i for i, x in enumerate(pattern) if x]
    gaps = [b - a for a, b in zip(rounds, rounds[1:])]
    assert pattern[0] == 1 and gaps[:4] == [5, 9, 9, 9], pattern  # waits 4, 8, 8, 8 (doubled from 2, capped at 8)
    # Without skipping it drafts every round.
    always = PrefixSchedulerPolicy(steep, skip_drafting=False)
    assert all(always.should_draft(3) for _ in range(5))


def test_policy_skips_drafting_when_the_drafter_costs_too_much():
    flat = StepsPerSecond([1, 8], [100.0, 100.0])
    policy = PrefixSchedulerPolicy(flat, online_correction=False, probe_interval=3)
    assert policy.num_to_verify(torch.tensor([0.5, 0.5]), 2) == 2
    policy.observe(2, 1)
    assert policy.should_draft(2, draft_seconds=0.001)  # (1 + .75) / (.01 + .001) > 100
    assert not policy.should_draft(2, draft_seconds=0.1)  # (1 + .75) / (.01 + .1) < 100
    for _ in range(3):
        policy.observe(0, 0)  # skipped rounds
    assert policy.should_draft(2, draft_seconds=0.1)  # a probe is due


def test_policy_skip_decision_smooths_the_drafts_confidences():
    """One unconfident draft after many confident ones does not stop drafting under the default moving average;
    with ``confidence_smoothing=1`` (the last draft alone) it does. A run of unconfident drafts stops it either way."""
    sps = StepsPerSecond([1, 2, 3], [10.0, 8.0, 6.0])  # a draft pays when a_1 > 0.25

    def feed(policy, values):
        for value in values:
            policy.num_to_verify(torch.tensor([value, 0.0]), 2)
            policy.observe(0, 0)

    smooth, last = (PrefixSchedulerPolicy(sps, online_correction=False, confidence_smoothing=c) for c in (0.1, 1.0))
    for policy in (smooth, last):
        feed(policy, [0.8] * 10 + [0.1])
    assert smooth.should_draft(2) and not last.should_draft(2)
    feed(smooth, [0.1] * 20)
    assert not smooth.should_draft(2)
    with pytest.raises(ValueError, match="confidence_smoothing"):
        PrefixSchedulerPolicy(sps, confidence_smoothing=0.0)


def test_policy_online_correction_learns_overconfidence():
    sps = StepsPerSecond([1, 2, 3], [10.0, 8.0, 6.0])
    policy = PrefixSchedulerPolicy(sps, skip_drafting=False)
    conf = torch.tensor([0.6, 0.2])
    assert policy.num_to_verify(conf, 2) == 1  # (1 + .6) * 8 = 12.8 > 10
    for _ in range(40):  # verified one draft each time, never accepted
        policy.num_to_verify(conf, 2)
        policy.observe(1, 0)
    assert policy.num_to_verify(conf, 2) == 0  # the learnt factor pulls a_1 below the break-even 0.25
    plain = PrefixSchedulerPolicy(sps, online_correction=False, skip_drafting=False)
    for _ in range(40):
        plain.num_to_verify(conf, 2)
        plain.observe(1, 0)
    assert plain.num_to_verify(conf, 2) == 1

