"""The hardware-aware prefix scheduler: hand-computed cases, invariants, and the paper's Appendix A example."""

import itertools
import random

import pytest
import torch

from hf_dspark.generation import generate_planner
from hf_dspark.gate import EXPLORE_BUDGET, REALIZED_WINDOW, REMEASURE_ROUNDS, RealizedGate, realized_window
from hf_dspark.planner import RowState
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
    assert OneRow(policy).verify(torch.tensor([0.9, 0.8, 0.5, 0.0]), 3) == 2  # generate()'s planner, no history
    assert OneRow(policy).verify(torch.tensor([0.9, 0.8, 0.5, 0.0]), 1) == 1
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


class OneRow:
    """``generate()``'s planner over one sequence (``generation.generate_planner``), driven round by round: ``drafts``
    asks whether this round drafts a block, ``verify`` the planner's length for the block's confidences, ``skip`` /
    ``verdict`` tell it what happened."""

    def __init__(self, policy, block_size: int = 4, gate=None, draft_seconds: float | None = None):
        self.policy, self.draft_seconds = policy, draft_seconds
        self.planner = generate_planner(policy, block_size, gate, lambda rows: self.draft_seconds)
        self.memory = self.planner.new_memory()
        self.plan = None

    def drafts(self, cap: int) -> bool:
        self.plan = self.planner.plan([RowState(cap, self.memory)], self.policy.sps_table())
        return bool(self.plan.drafting)

    def verify(self, confidences: torch.Tensor, cap: int | None = None) -> int:
        """A drafted block's length (planning the round first when ``drafts`` was not asked)."""
        if self.plan is None:
            assert self.drafts(confidences.shape[0] if cap is None else cap)
        self.confidences = confidences.view(1, -1)
        return self.planner.lengths(self.plan, self.confidences, self.policy.sps_table())[0]

    def verdict(self, length: int, accepted: int) -> None:
        drafted = bool(self.plan.drafting)
        self.planner.observe(self.plan, self.confidences if drafted else None, [length], [accepted])
        self.plan = None

    def skip(self) -> None:
        self.planner.observe(self.plan, None, [0], [0])
        self.plan = None

    def round(self, confidences: torch.Tensor, accepted: int = 0) -> int:
        """One block round: plan, length, verdict; returns the length."""
        length = self.verify(confidences)
        self.verdict(length, accepted)
        return length


# --------------------------------------------------------------------------------------------------------------
# R = 1 policy: skipping drafts that cannot pay, and the online survival correction
# --------------------------------------------------------------------------------------------------------------
def test_policy_skips_drafting_and_probes_with_backoff():
    dear = StepsPerSecond([1, 2, 8], [100.0, 60.0, 20.0])  # a draft pays only when a_1 > 2/3
    row = OneRow(PrefixSchedulerPolicy(dear, online_correction=False, probe_interval=2, max_probe_interval=8), 3)
    pattern = []
    for _ in range(40):
        drafted = row.drafts(3)
        pattern.append(int(drafted))
        if drafted:
            assert row.verify(torch.tensor([0.1, 0.1, 0.1])) == 0
            row.verdict(0, 0)
        else:
            row.skip()
    rounds = [i for i, x in enumerate(pattern) if x]
    gaps = [b - a for a, b in zip(rounds, rounds[1:])]
    assert pattern[0] == 1 and gaps[:4] == [5, 9, 9, 9], pattern  # waits 4, 8, 8, 8 (doubled from 2, capped at 8)
    assert row.planner.skips == {"no_budget": 40 - len(rounds)}
    # Where not even certain drafts would be verified, it does not draft at all, probes included.
    steep = StepsPerSecond([1, 2, 8], [100.0, 1.0, 0.1])
    never = OneRow(PrefixSchedulerPolicy(steep, online_correction=False, probe_interval=2), 3)
    for _ in range(10):
        assert not never.drafts(3)
        never.skip()
    assert never.planner.skips == {"cannot_pay": 10}
    # Without skipping it drafts every round.
    always = OneRow(PrefixSchedulerPolicy(steep, skip_drafting=False), 3)
    for _ in range(5):
        assert always.drafts(3)
        always.verify(torch.tensor([0.9, 0.9, 0.9]))
        always.verdict(0, 0)


def test_policy_skips_drafting_when_the_drafter_costs_too_much():
    flat = StepsPerSecond([1, 8], [100.0, 100.0])
    row = OneRow(PrefixSchedulerPolicy(flat, online_correction=False, probe_interval=3), 2)
    assert row.round(torch.tensor([0.5, 0.5]), accepted=1) == 2
    row.draft_seconds = 0.001
    assert row.drafts(2)  # (1 + .75) / (.01 + .001) > 100
    row.draft_seconds = 0.1
    assert not row.drafts(2)  # (1 + .75) / (.01 + .1) < 100
    assert row.planner.skips == {"cost": 1}
    for _ in range(3):
        row.skip()  # skipped rounds
        row.drafts(2)
    assert row.drafts(2)  # a probe is due


def test_policy_realized_gate_overrides_confident_drafting():
    """Confidences that always say "draft" do not draft while drafting rounds have delivered fewer tokens per second
    than plain rounds: drafting is re-measured after ``explore_interval`` rounds, the wait doubling up to
    ``max_explore_interval``; once drafting wins, the confidences decide again."""
    flat = StepsPerSecond([1, 8], [100.0, 100.0])  # verification is free: the confidences always say "draft"
    policy = PrefixSchedulerPolicy(flat, online_correction=False, realized_gate=True, explore_interval=2,
                                   max_explore_interval=4, explore_budget=0)  # the doubling wait alone
    assert policy.uses_realized_gate and OneRow(policy, 2).drafts(2)  # no gate handed over: the confidences decide
    gate = RealizedGate()
    row = OneRow(policy, 2, gate)
    assert row.round(torch.tensor([0.9, 0.9]), accepted=2) == 2
    assert row.drafts(2)  # nothing measured yet
    row.skip()
    for drafted, seconds in ((True, 1.0), (True, 1.0), (False, 0.1)):  # drafting: 1 token/s; plain: 10 tokens/s
        gate.record_step(1, drafted, 1, seconds)
    pattern = []
    for _ in range(12):
        drafted = row.drafts(2)
        pattern.append(int(drafted))
        row.skip()
        gate.record_step(1, drafted, 1, 1.0 if drafted else 0.1)
    # waits of 2, then 4 (capped) rounds, each followed by a re-measurement of REMEASURE_ROUNDS drafting rounds
    assert REMEASURE_ROUNDS == 2
    assert pattern == [0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0], pattern
    assert gate.realized_rate(1, True) == pytest.approx(1.0) and gate.realized_rate(1, False) == pytest.approx(10.0)
    for _ in range(40):  # drafting rounds now deliver 30 tokens/s
        gate.record_step(1, True, 3, 0.1)
    assert not row.drafts(2)  # drafting wins, but the plain side is stale: one plain round re-measures it
    row.skip()
    gate.record_step(1, False, 1, 0.1)
    assert row.drafts(2)
    ungated = PrefixSchedulerPolicy(flat, online_correction=False)  # the default: no gate
    assert not ungated.uses_realized_gate and OneRow(ungated, 2).planner.gate is None
    with pytest.raises(ValueError, match="explore_interval"):
        PrefixSchedulerPolicy(flat, explore_interval=8, max_explore_interval=4)


def test_realized_gate_needs_a_margin_to_draft():
    """Drafting that delivers about as much as plain (within ``DRAFTING_MARGIN``) loses the verdict: its wins are
    judged on few rounds, and a wrong "draft" costs more than a wrong "plain"."""
    from hf_dspark.gate import DRAFTING_MARGIN

    assert DRAFTING_MARGIN > 1
    for ratio, allowed in ((1.0, False), (DRAFTING_MARGIN * 0.99, False), (DRAFTING_MARGIN * 1.01, True)):
        gate = RealizedGate()
        for _ in range(4):
            gate.record_step(1, True, 10 * ratio, 1.0)
        gate.record_step(1, False, 10, 1.0)
        gate.record_step(1, False, 10, 1.0)
        assert gate.drafting_allowed(1, 3, 8) is allowed, ratio
        assert gate.drafting_lost_nearby(2) is not allowed  # a nearby size takes the same verdict


def test_realized_gate_measures_each_side_twice_before_a_verdict():
    """Two drafting rounds and one plain round are no verdict yet: one lucky comparison would keep drafting on for a
    whole ``explore_interval``. The gate asks for plain rounds until that side has ``VERDICT_ROUNDS`` too, and a
    nearby batch size does not take a verdict from a size measured less than that."""
    from hf_dspark.gate import VERDICT_ROUNDS

    assert VERDICT_ROUNDS == 2
    gate = RealizedGate()
    for _ in range(2):
        assert gate.drafting_allowed(16, 16, 256, 0)  # nothing measured: free
        gate.record_step(16, True, 30, 1.0)  # drafting: 30 tokens/s
    assert not gate.drafting_allowed(16, 16, 256, 0)  # drafting measured, plain not: measure plain
    gate.record_step(16, False, 16, 1.0)  # one slow plain round (16 tokens/s): drafting would win on it
    assert not gate.drafting_allowed(16, 16, 256, 0)  # but plain is measured once only: measure it again
    assert gate.nearby_loss(12) is None and gate.drafting_allowed(12, 16, 256, 0)  # no verdict at 16 for 12 to take
    gate.record_step(16, False, 48, 1.0)  # plain: 64 tokens in 2 s, 32 tokens/s against drafting's 30
    assert not gate.drafting_allowed(16, 16, 256, 0)  # the verdict: plain
    assert gate.nearby_loss(12) == 16 and not gate.drafting_allowed(12, 16, 256, 0)
    won = RealizedGate()
    for drafted, tokens in ((True, 40), (True, 40), (False, 16), (False, 16)):
        won.record_step(16, drafted, tokens, 1.0)
    assert won.drafting_allowed(16, 16, 256, 0)  # drafting 40 tokens/s against plain's 16: draft


def test_a_size_presumed_to_lose_from_a_neighbour_is_measured_itself():
    """Drafting lost at 5 requests (say, a draining batch's last capped drafts). At 4 it is presumed to lose too, but
    only until the wait and the budget allow a re-measurement at 4 itself; drafting that wins there stays on."""
    gate = RealizedGate()
    for _ in range(3):
        gate.record_step(5, True, 5, 1.0)  # drafting at 5: 5 tokens/s
    for _ in range(2):
        gate.record_step(5, False, 5, 0.5)  # plain at 5: 10 tokens/s
    assert gate.nearby_loss(4) == 5 and gate.drafting_lost_nearby(4)
    pattern = []
    for _ in range(6):
        allowed = gate.drafting_allowed(4, 4, 64, 0)  # no budget: the wait alone
        pattern.append(int(allowed))
        gate.record_step(4, allowed, 4 if not allowed else 12, 0.5)  # at 4: plain 8 tokens/s, drafting 24
    assert pattern == [0, 0, 0, 0, 1, 1], pattern  # waits 4 rounds, then REMEASURE_ROUNDS drafting rounds
    assert gate.explore_wait[4] == 8 and gate.realized_rate(4, True) == pytest.approx(24.0)
    assert gate.nearby_loss(4) == 5  # the neighbour still lost, but 4 has its own verdict now: drafting wins
    assert gate.drafting_allowed(4, 4, 64, 0) and gate.explore_wait[4] == 4
    # with a budget, the neighbour's shortfall prices the re-measurement: 2 rounds x 1 s x 50% = 1 s, which 1%
    # buys after 100 s of plain rounds at this size
    budgeted = RealizedGate()
    for _ in range(3):
        budgeted.record_step(5, True, 5, 1.0)
    for _ in range(2):
        budgeted.record_step(5, False, 5, 0.5)
    rounds = 0
    while not budgeted.drafting_allowed(4, 4, 10_000, 0.01):
        budgeted.record_step(4, False, 4, 0.5)
        rounds += 1
    assert rounds == 200 and budgeted.fresh_rounds[4] == 0


def test_a_verdict_compares_both_sides_over_the_same_stretch():
    """While drafting wins, plain rounds come one every ``explore_interval``, so the plain window spans far more
    rounds than the drafting one. A machine that ran slower while the plain window was measured must not keep
    drafting on: the verdict compares the last ``MATCHED_PLAIN_ROUNDS`` plain rounds with the drafting rounds since
    the first of them. Here the machine speeds up 1.5x; drafting then delivers 1.25x the slow plain window but less
    than the plain rounds of its own stretch."""
    from hf_dspark.gate import MATCHED_PLAIN_ROUNDS, VERDICT_ROUNDS

    assert MATCHED_PLAIN_ROUNDS == 4
    rows, refresh = 16, 16

    def run(matched: bool) -> list[bool]:
        gate = RealizedGate()
        for _ in range(32):
            gate.record_step(rows, False, 16, 1.0)  # plain in a slow minute: 16 tokens/s
        for _ in range(2):
            gate.record_step(rows, True, 30, 1.0)  # drafting then: 30 tokens/s, it wins
        decisions = []
        for step in range(6 * refresh):
            allowed = gate.drafting_allowed(rows, refresh, 1024, 0)
            decisions.append(allowed)
            # the machine is now 1.5x faster: plain 24 tokens/s, drafting 20 (it truly loses)
            gate.record_step(rows, allowed, 20 if allowed else 24, 1.0)
            if not matched:
                gate.round_numbers.clear()  # as if no round were numbered: whole windows decide
        return decisions

    stale = run(matched=False)
    assert sum(stale) > 5 * refresh  # the old plain window keeps drafting on, a plain round every refresh
    fresh = run(matched=True)
    # drafting goes off once MATCHED_PLAIN_ROUNDS refreshed plain rounds exist (and stays off until a re-measurement)
    assert sum(fresh) <= MATCHED_PLAIN_ROUNDS * (refresh + 1) and not any(fresh[-refresh:]), fresh
    gate = RealizedGate()  # too few drafting rounds in the stretch: the windows decide
    for drafted in [False] * 4 + [True] * (VERDICT_ROUNDS - 1):
        gate.record_step(rows, drafted, 16, 1.0)
    assert gate.compared_rates(rows) == (gate.drafting_rate(rows), gate.realized_rate(rows, False))


def test_a_remeasurement_prices_the_context_catch_up_it_pays_first():
    """A re-measurement's first round first projects what plain rounds verified while drafting was off (the
    drafter's context catch-up): when drafting still loses, that is lost too, so the budget must cover it on top of
    the rounds' shortfall. Without a budget the doubling wait alone decides; ``max_explore_interval`` still caps the
    wait; a catch-up that is not a number of seconds is refused."""

    def rounds_until_remeasured(catch_up: float, budget: float = 0.01, max_wait: int = 10_000) -> int:
        gate = RealizedGate()
        for _ in range(2):
            gate.record_step(16, True, 8, 1.0)  # drafting: 8 tokens/s
            gate.record_step(16, False, 8, 0.5)  # plain: 16 tokens/s, so drafting's shortfall is 50%
        rounds = 0
        while not gate.drafting_allowed(16, 4, max_wait, budget, catch_up=catch_up):
            gate.record_step(16, False, 8, 0.5)
            rounds += 1
        assert gate.fresh_rounds[16] == 0  # a re-measurement starts
        return rounds

    # the rounds alone: 2 rounds x 1 s x 50% = 1 s, which 1% buys after 100 s of plain rounds since drafting last
    # ran (the last measuring plain round and 199 more, of 0.5 s each)
    assert rounds_until_remeasured(0.0) == 199
    # a 1 s catch-up on top: 2 s, 200 s of plain rounds
    assert rounds_until_remeasured(1.0) == 399
    # no budget: the wait alone (4 rounds since drafting ran: the last measuring plain round and 3 more)
    assert rounds_until_remeasured(1.0, budget=0) == 3
    assert rounds_until_remeasured(1e9, max_wait=64) == 63  # never past the longest wait
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="catch_up"):
            RealizedGate().drafting_verdict(16, 4, 64, 0.01, catch_up=bad)


def test_realized_gate_judges_a_remeasurement_on_its_own_rounds():
    """After a hard stretch filled the drafting window with slow rounds, a re-measurement is judged on its own
    rounds: drafting that now wins is back on at once, although the whole window (mostly the old stretch) still
    reads slower than plain. The fresh rounds keep counting until they fill the window."""
    rows = 16  # a batch size whose window is REALIZED_WINDOW rounds
    assert realized_window(rows) == REALIZED_WINDOW
    gate = RealizedGate()
    for _ in range(REALIZED_WINDOW):
        gate.record_step(rows, True, 1, 1.0)  # the hard stretch: 1 token/s
    gate.record_step(rows, False, 1, 0.1)  # plain: 10 tokens/s
    assert not gate.drafting_allowed(rows, 2, 8, 0)  # drafting lost, last ran 1 round ago
    gate.record_step(rows, False, 1, 0.1)
    assert gate.drafting_allowed(rows, 2, 8, 0) and gate.fresh_rounds[rows] == 0  # re-measure now
    for k in range(REMEASURE_ROUNDS):
        assert gate.drafting_allowed(rows, 2, 8, 0)  # the re-measurement runs its rounds whatever they show
        gate.record_step(rows, True, 3, 0.1)  # easy text now: 30 tokens/s
    assert gate.realized_rate(rows, True) < gate.realized_rate(rows, False)  # the old window would still say "lose"
    assert gate.realized_rate(rows, True, last=REMEASURE_ROUNDS) == pytest.approx(30.0)
    assert not gate.drafting_allowed(rows, 2, 8, 0)  # drafting wins; the plain side is stale (2 rounds): refresh it
    gate.record_step(rows, False, 1, 0.1)
    assert gate.drafting_allowed(rows, 2, 8, 0) and gate.explore_wait[rows] == 2  # wins: waits reset
    for _ in range(REALIZED_WINDOW):
        gate.record_step(rows, True, 3, 0.1)
    assert rows not in gate.fresh_rounds  # the window is all fresh rounds now
    # a re-measurement that loses again waits twice as long
    slow = RealizedGate()
    for _ in range(4):
        slow.record_step(rows, True, 1, 1.0)
    slow.record_step(rows, False, 1, 0.1)
    slow.record_step(rows, False, 1, 0.1)
    assert slow.drafting_allowed(rows, 2, 8, 0)
    for _ in range(REMEASURE_ROUNDS):
        slow.record_step(rows, True, 1, 1.0)
    assert not slow.drafting_allowed(rows, 2, 8, 0) and slow.explore_wait[rows] == 4


def test_realized_gate_windows_hold_enough_request_rounds():
    """At few requests a window of 32 rounds is one or two answers' text: a hard answer that made drafting deliver no
    more than plain rounds would rule drafting out over the next ones, which the cost model already judges step by
    step. Windows hold at least ``REALIZED_REQUEST_ROUNDS`` request-rounds: one hard stretch of 32 rounds does not
    overturn what drafting delivered over hundreds at one request, and still does at 16 requests (32-round windows).
    The plain side is refreshed at the same pace relative to its window."""
    from hf_dspark.gate import REALIZED_REQUEST_ROUNDS

    assert [realized_window(r) for r in (1, 4, 16, 64)] == [REALIZED_REQUEST_ROUNDS, REALIZED_REQUEST_ROUNDS // 4,
                                                           REALIZED_WINDOW, REALIZED_WINDOW]
    with pytest.raises(ValueError, match="rows"):
        realized_window(0)
    verdicts = {}
    for rows in (1, 16):
        gate = RealizedGate()
        for _ in range(200):
            gate.record_step(rows, True, 3 * rows, 0.1)  # easy text: drafting delivers 3x plain
        for _ in range(REALIZED_WINDOW):
            gate.record_step(rows, True, rows, 0.1)  # a hard answer: drafting delivers what plain does
        gate.record_step(rows, False, rows, 0.1)
        gate.record_step(rows, False, rows, 0.1)
        verdicts[rows] = gate.drafting_allowed(rows, 16, 256, 0)
        assert len(gate.realized[(rows, True)]) == min(200 + REALIZED_WINDOW, realized_window(rows))
    assert verdicts == {1: True, 16: False}
    # the plain side's refresh while drafting wins: every 16 rounds at 16 requests, every 256 at one request
    for rows, refresh in ((16, 16), (1, 256)):
        gate = RealizedGate()
        for _ in range(2):
            gate.record_step(rows, True, 3 * rows, 0.1)
            gate.record_step(rows, False, rows, 0.1)
        drafted = 0
        while gate.drafting_allowed(rows, 16, 256, 0):
            gate.record_step(rows, True, 3 * rows, 0.1)
            drafted += 1
        assert drafted == refresh


def test_round_window_keeps_its_totals():
    """A realized window's running totals and rates equal sums over the rounds it holds, as rounds are evicted."""
    from hf_dspark.gate import RoundWindow

    rng = random.Random(0)
    window = RoundWindow(maxlen=5)
    assert window.rate() is None and window.rate(last=3) is None
    rounds = []
    for _ in range(40):
        rounds.append((float(rng.randint(1, 9)), rng.uniform(0.01, 0.2)))
        window.append(rounds[-1])
        held = rounds[-5:]
        assert list(window) == held
        assert window.tokens == pytest.approx(sum(e for e, _ in held))
        assert window.seconds == pytest.approx(sum(s for _, s in held))
        assert window.rate() == pytest.approx(sum(e for e, _ in held) / sum(s for _, s in held))
        assert window.rate(last=2) == pytest.approx(sum(e for e, _ in held[-2:]) / sum(s for _, s in held[-2:]))
    assert window.rate(last=0) is None
    copy = RoundWindow(list(window), maxlen=5)  # as a saved file restores it
    assert copy.tokens == pytest.approx(window.tokens) and copy.seconds == pytest.approx(window.seconds)
    import copy as copying
    import pickle

    for other in (copying.copy(window), copying.deepcopy(window), pickle.loads(pickle.dumps(window))):
        assert list(other) == list(window) and other.maxlen == 5
        assert other.tokens == pytest.approx(window.tokens) and other.seconds == pytest.approx(window.seconds)
    with pytest.raises(TypeError, match="only takes rounds through append"):
        window.extend([(1.0, 1.0)])
    with pytest.raises(TypeError, match="only takes rounds through append"):
        window.popleft()


def test_realized_gate_verdict_is_pure():
    """``drafting_verdict`` says what ``drafting_allowed`` would, in every branch, and changes nothing; only
    ``drafting_allowed`` starts a re-measurement or resets the wait."""
    import copy

    def state(gate):
        return (dict(gate.explore_wait), dict(gate.fresh_rounds), dict(gate.steps_since), dict(gate.plain_seconds))

    gate = RealizedGate()
    seen, drafting_rounds = set(), 0
    for _ in range(80):  # an engine at one batch size: drafting loses at first (hard text), then wins (easy text)
        before = state(gate)
        verdict = gate.drafting_verdict(1, 2, 8, 0.02)
        assert state(gate) == before  # asking changes nothing
        allowed = gate.drafting_allowed(1, 2, 8, 0.02)
        assert allowed is verdict[0]
        if verdict[1] == "remeasure":
            assert gate.fresh_rounds[1] == 0
        seen.add(verdict)
        if allowed:
            drafting_rounds += 1
            gate.record_step(1, True, 1, 1.0) if drafting_rounds <= 4 else gate.record_step(1, True, 3, 0.1)
        else:
            gate.record_step(1, False, 1, 0.1)
    assert {(True, None), (False, None), (True, "remeasure"), (True, "reset"), (False, "reset")} <= seen


def test_realized_gate_spends_an_exploration_budget():
    """A losing drafting side is re-measured once the plain rounds since it last drafted have run long enough that
    the re-measurement's expected loss (REMEASURE_ROUNDS drafting rounds at the measured shortfall) is within the
    budget's fraction of their time: soon after a narrow loss, late after a heavy one, and never later than
    ``max_explore_interval`` rounds."""
    assert EXPLORE_BUDGET == 0.005

    def losing_gate(drafting_rate: float) -> RealizedGate:
        gate = RealizedGate()
        for _ in range(4):
            gate.record_step(8, True, drafting_rate, 1.0)  # drafting rounds of 1 s
        return gate

    def rounds_until_remeasured(drafting_rate: float, budget: float, max_wait: int = 10_000) -> int:
        gate = losing_gate(drafting_rate)
        rounds = 0
        while True:
            gate.record_step(8, False, 1.0, 0.125)  # plain rounds: 8 tokens/s
            rounds += 1
            if gate.drafting_allowed(8, 2, max_wait, budget):
                return rounds

    # shortfall 50%: a re-measurement loses 2 x 1 s x 0.5 = 1 s, which 2% buys after 50 s of plain rounds (400)
    assert losing_gate(4.0).remeasure_loss(8, 8.0) == pytest.approx(1.0)
    assert abs(rounds_until_remeasured(4.0, 0.02) - 400) <= 1
    assert abs(rounds_until_remeasured(4.0, 0.10) - 80) <= 1
    # shortfall 12.5%: 0.25 s, bought after 12.5 s (100 rounds); without a budget the doubling wait alone (2 rounds)
    assert abs(rounds_until_remeasured(7.0, 0.02) - 100) <= 1
    assert rounds_until_remeasured(7.0, 0.0) == 2
    assert rounds_until_remeasured(4.0, 0.02, max_wait=64) == 64  # max_explore_interval bounds the wait
    # the default budget: 0.25 s bought after 50 s of plain rounds (400)
    assert abs(rounds_until_remeasured(7.0, EXPLORE_BUDGET) - 400) <= 1
    # a drafting round resets the plain time: the next budget counts from there
    gate = losing_gate(7.0)
    for _ in range(90):
        gate.record_step(8, False, 1.0, 0.125)
    assert gate.plain_seconds[8] == pytest.approx(11.25) and not gate.drafting_allowed(8, 2, 1000, 0.02)
    for _ in range(12):
        gate.record_step(8, False, 1.0, 0.125)
    assert gate.drafting_allowed(8, 2, 1000, 0.02)
    gate.record_step(8, True, 7.0, 1.0)
    assert gate.plain_seconds[8] == 0.0
    assert RealizedGate().remeasure_loss(8, 8.0) == 0.0  # nothing measured: nothing to lose
    assert losing_gate(9.0).remeasure_loss(8, 8.0) == 0.0  # drafting wins: no shortfall


def test_policy_realized_gate_settings_from_generation_config():
    from transformers import GenerationConfig

    config = GenerationConfig()
    assert not PrefixSchedulerPolicy.from_generation_config(config, 4).uses_realized_gate  # default off
    config.realized_gate = None  # what a restored, never-set attribute looks like
    assert not PrefixSchedulerPolicy.from_generation_config(config, 4).uses_realized_gate
    assert PrefixSchedulerPolicy.from_generation_config(config, 4).explore_budget == EXPLORE_BUDGET
    config.realized_gate, config.explore_interval, config.max_explore_interval = True, 3, 9
    config.explore_budget = 0.0  # kept: no budget
    policy = PrefixSchedulerPolicy.from_generation_config(config, 4)
    assert policy.uses_realized_gate and (policy.explore_interval, policy.max_explore_interval) == (3, 9)
    assert policy.explore_budget == 0.0
    with pytest.raises(ValueError, match="explore_budget"):
        PrefixSchedulerPolicy(explore_budget=1.0)
    config.realized_gate, config.skip_drafting = True, False
    assert not PrefixSchedulerPolicy.from_generation_config(config, 4).uses_realized_gate  # it only gates skipping


def test_policy_skip_decision_smooths_the_drafts_confidences():
    """One unconfident draft after many confident ones does not stop drafting under the default moving average;
    with ``confidence_smoothing=1`` (the last draft alone) it does. A run of unconfident drafts stops it either way."""
    sps = StepsPerSecond([1, 2, 3], [10.0, 8.0, 6.0])  # a draft pays when a_1 > 0.25

    def feed(row, values):
        for value in values:
            row.plan = row.planner.plan([RowState(2, row.memory)], sps.table())._replace(drafting=[0])  # as a probe
            row.verify(torch.tensor([value, 0.0]))
            row.verdict(0, 0)

    smooth, last = (OneRow(PrefixSchedulerPolicy(sps, online_correction=False, confidence_smoothing=c), 2)
                    for c in (0.1, 1.0))
    for row in (smooth, last):
        feed(row, [0.8] * 10 + [0.1])
    assert smooth.drafts(2) and not last.drafts(2)
    smooth.skip()
    feed(smooth, [0.1] * 20)
    assert not smooth.drafts(2)
    with pytest.raises(ValueError, match="confidence_smoothing"):
        PrefixSchedulerPolicy(sps, confidence_smoothing=0.0)


def test_policy_online_correction_learns_overconfidence():
    sps = StepsPerSecond([1, 2, 3], [10.0, 8.0, 6.0])
    row = OneRow(PrefixSchedulerPolicy(sps, skip_drafting=False), 2)
    conf = torch.tensor([0.6, 0.2])
    assert row.round(conf) == 1  # (1 + .6) * 8 = 12.8 > 10
    for _ in range(40):  # verified one draft each time, never accepted
        row.round(conf)
    assert row.round(conf) == 0  # the learnt factor pulls a_1 below the break-even 0.25
    plain = OneRow(PrefixSchedulerPolicy(sps, online_correction=False, skip_drafting=False), 2)
    for _ in range(40):
        plain.round(conf)
    assert plain.round(conf) == 1


def test_realized_gate_measures_drafting_on_representative_rounds_only():
    """A round marked unrepresentative (most requests at their first step after the prompt, whose drafts are
    accepted far more often than later ones) never measures drafting: not while drafting is unmeasured, not to start
    a re-measurement, not inside one; it waits, changing nothing. A verdict already measured holds for it."""
    gate = RealizedGate()
    assert not gate.drafting_allowed(16, 16, 256, 0, representative=False)  # unmeasured: wait for a later round
    assert gate.drafting_verdict(16, 16, 256, 0, representative=False) == (False, None)
    assert gate.drafting_allowed(16, 16, 256, 0)  # the next, representative round measures
    won = RealizedGate()
    for drafted, tokens in ((True, 40), (True, 40), (False, 16), (False, 16)):
        won.record_step(16, drafted, tokens, 1.0)
    assert won.drafting_allowed(16, 16, 256, 0, representative=False)  # drafting measured to win: it drafts
    lost = RealizedGate()
    for drafted, tokens in ((True, 10), (True, 10), (False, 16), (False, 16)):
        lost.record_step(16, drafted, tokens, 1.0)
    for _ in range(16):
        lost.record_step(16, False, 16, 1.0)  # the wait for a re-measurement is over
    assert lost.drafting_verdict(16, 16, 256, 0) == (True, "remeasure")
    assert not lost.drafting_allowed(16, 16, 256, 0, representative=False)
    assert 16 not in lost.fresh_rounds  # no re-measurement started
    assert lost.drafting_allowed(16, 16, 256, 0) and lost.fresh_rounds[16] == 0  # it starts on the next round
    assert not lost.drafting_allowed(16, 16, 256, 0, representative=False)  # and skips an unrepresentative one
    lost.record_step(16, False, 16, 1.0)
    assert lost.fresh_rounds[16] == 0 and lost.drafting_allowed(16, 16, 256, 0)


# --------------------------------------------------------------------------------------------------------------
# Rounds priced at their context: the SPS profile's context model
# --------------------------------------------------------------------------------------------------------------
def test_sps_at_context_reads_each_width_along_its_line():
    # seconds at the reference context 256: 0.1, 0.125, 0.2; per cached token: 1e-5, 3e-5, 6e-5
    sps = StepsPerSecond([1, 2, 4], [10.0, 8.0, 5.0], 4, context_length=256,
                         seconds_per_context_token=[1e-5, 3e-5, 6e-5])
    assert sps.models_context
    far = sps.at_context(256 + 5000)
    assert far.steps_per_sec == pytest.approx([1 / 0.15, 1 / 0.275, 1 / 0.5])
    assert not far.models_context and far.max_batch_tokens == 4
    assert sps.at_context(256).steps_per_sec == pytest.approx(sps.steps_per_sec)
    near = sps.at_context(0)  # shorter than profiled: cheaper, never below half the profiled seconds
    assert near.steps_per_sec[0] == pytest.approx(1 / (0.1 - 256e-5))
    # a width whose line predicts it cheaper than a narrower one reads as fast as that one, never faster
    odd = StepsPerSecond([1, 2], [10.0, 9.9], context_length=0, seconds_per_context_token=[1e-4, 0.0])
    assert odd.at_context(-500).steps_per_sec == pytest.approx([20.0, 9.9])
    assert odd.at_context(1000).steps_per_sec == pytest.approx([5.0, 5.0])


def test_sps_context_model_round_trips_and_is_checked():
    sps = StepsPerSecond([1, 2], [10.0, 8.0], context_length=256, seconds_per_context_token=[1e-5, 2e-5])
    again = StepsPerSecond.from_dict(sps.to_dict())
    assert again.context_length == 256 and again.seconds_per_context_token == [1e-5, 2e-5]
    assert StepsPerSecond.from_dict({"sample_batch_tokens": [1], "sample_steps_per_sec": [3.0]}).to_dict() == {
        "sample_batch_tokens": [1], "sample_steps_per_sec": [3.0], "max_batch_tokens": 1}
    with pytest.raises(ValueError, match="both context_length and seconds_per_context_token"):
        StepsPerSecond([1], [3.0], context_length=256)
    with pytest.raises(ValueError, match="one value per"):
        StepsPerSecond([1, 2], [3.0, 2.0], context_length=256, seconds_per_context_token=[0.0])


def test_profile_context_model_fits_lines_through_the_timings():
    from hf_dspark.profiling import context_model

    truth = {1: (0.030, 1e-5), 4: (0.045, 2e-5), 8: (0.060, 4e-5)}  # seconds at context 0, per cached token
    raw = {b: {c: [a + k * c + 0.002, a + k * c] for c in (64, 256, 2048)} for b, (a, k) in truth.items()}
    rates, slopes = context_model(raw)
    assert slopes == pytest.approx([k for _, k in truth.values()])
    assert rates == pytest.approx([1 / (a + k * 256) for a, k in truth.values()])
    short = {b: {c: t for c, t in per.items() if c < 1024} for b, per in raw.items()}
    rates, slopes = context_model(short)  # no long context measured: one curve for every context
    assert slopes is None and rates[0] == pytest.approx(1 / (0.030 + 1e-5 * 160), rel=0.01)


def test_scheduler_prices_its_rounds_at_the_sequences_context():
    # Wide forwards are nearly free at a short context and dear at a long one (a CPU reading a long cache).
    sps = StepsPerSecond([1, 2, 3, 4, 5], [10.0, 9.8, 9.6, 9.4, 9.2], 5, context_length=256,
                         seconds_per_context_token=[1e-5, 4e-5, 6e-5, 8e-5, 1e-4])
    policy = PrefixSchedulerPolicy(sps, online_correction=False)
    confidences = torch.tensor([0.5, 0.4, 0.3, 0.2])
    policy.set_context(300)
    assert policy.num_to_verify(confidences, 4) > 0
    policy.set_context(7000)
    assert policy.num_to_verify(confidences, 4) == 0  # at 7k tokens verifying any draft costs more than it wins
    assert float(policy.sps_table()[1]) == pytest.approx(sps.at_context(7000 // 128 * 128 + 64).steps_per_sec[0])
    plain = PrefixSchedulerPolicy(StepsPerSecond([1, 2, 3, 4, 5], [10.0, 9.8, 9.6, 9.4, 9.2]),
                                  online_correction=False)
    plain.set_context(7000)  # a profile without a context model reads the same everywhere
    assert plain.num_to_verify(confidences, 4) > 0
