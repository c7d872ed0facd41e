"""A cached SPS profile is measured again when it was measured on a busy machine that is quiet now, when a
generate() call's rounds contradict it, or when asked (``remeasure``); it records how busy the machine was."""

from __future__ import annotations

import json

import pytest

from hf_dspark import machine_load, profiling
from hf_dspark.stats import DSparkStats
from hf_dspark.scheduling import StepsPerSecond
from tests.architectures import make_family_target

PROFILE = StepsPerSecond([1, 2, 4, 8], [100.0, 90.0, 80.0, 60.0])


@pytest.fixture
def counted(monkeypatch):
    """measure_steps_per_second replaced by one returning PROFILE and counting its calls."""
    calls = []

    def fake(model, batch_tokens, *args, **kwargs):
        calls.append(list(batch_tokens))
        return PROFILE, {}

    monkeypatch.setattr(profiling, "measure_steps_per_second", fake)
    return calls


def test_others_load_is_a_share_of_the_cpus():
    share = machine_load.others_load_now(0.05)
    assert share is None or 0.0 <= share <= 1.0


def test_a_profile_records_the_load_and_is_reused(tmp_path, counted):
    target = make_family_target("llama")
    profiling.load_or_profile(target, 8, folder=tmp_path)
    profiling.load_or_profile(target, 8, folder=tmp_path)
    assert len(counted) == 1
    saved = json.loads(profiling.profile_path(target, tmp_path).read_text())
    assert "others_load" in saved and "load_average" in saved and saved["key"]["linears"] == "stock"
    profiling.load_or_profile(target, 8, folder=tmp_path, remeasure=True)
    assert len(counted) == 2


def _mark(target, folder, **fields):
    path = profiling.profile_path(target, folder)
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def test_a_busy_profile_is_remeasured_once_the_machine_is_quiet(tmp_path, counted, monkeypatch):
    target = make_family_target("llama")
    profiling.load_or_profile(target, 8, folder=tmp_path)
    _mark(target, tmp_path, others_load=0.6)
    monkeypatch.setattr(profiling, "QUIET_RECHECK_S", 0.0)
    monkeypatch.setattr(profiling, "others_load_now", lambda: 0.5)  # still busy: keep it
    profiling.load_or_profile(target, 8, folder=tmp_path)
    assert len(counted) == 1
    monkeypatch.setattr(profiling, "others_load_now", lambda: 0.02)
    profiling.load_or_profile(target, 8, folder=tmp_path)
    assert len(counted) == 2


def _stats(seconds_per_width: dict[int, float], rounds: int = 10) -> DSparkStats:
    stats = DSparkStats(block_size=7)
    clock = 0.0
    for i in range(rounds):
        width = (1, 4, 8)[i % 3]
        stats.add_round(drafted=width - 1, verified=width - 1, accepted=1)
        stats.add_stamps(clock, clock + 0.001, clock + 0.001 + seconds_per_width[width])
        clock += 1.0
    return stats


def test_rounds_that_contradict_the_profile_mark_it_for_remeasuring(tmp_path, counted):
    target = make_family_target("llama")
    profiling.load_or_profile(target, 8, folder=tmp_path)
    agreeing = _stats({w: 1.0 / PROFILE(w) for w in (1, 4, 8)})
    assert profiling.check_against_rounds(target, agreeing, 10, tmp_path) == pytest.approx(1.0)
    profiling.load_or_profile(target, 8, folder=tmp_path)
    assert len(counted) == 1
    slow = _stats({w: 2.5 / PROFILE(w) for w in (1, 4, 8)})  # the profile was measured far faster than rounds run
    assert profiling.check_against_rounds(target, slow, 10, tmp_path) == pytest.approx(2.5)
    assert "contradicted" in json.loads(profiling.profile_path(target, tmp_path).read_text())
    profiling.load_or_profile(target, 8, folder=tmp_path)
    assert len(counted) == 2
    remeasured = json.loads(profiling.profile_path(target, tmp_path).read_text())
    assert "contradicted" not in remeasured and remeasured["after_contradiction"]
    # the re-measured profile is not marked again: no loop where rounds and profile differ for a steady reason
    assert profiling.check_against_rounds(target, slow, 10, tmp_path) == pytest.approx(2.5)
    profiling.load_or_profile(target, 8, folder=tmp_path)
    assert len(counted) == 2


def test_too_few_rounds_say_nothing(tmp_path, counted):
    target = make_family_target("llama")
    profiling.load_or_profile(target, 8, folder=tmp_path)
    assert profiling.check_against_rounds(target, _stats({1: 1, 4: 1, 8: 1}, rounds=3), 10, tmp_path) is None


def test_a_round_that_confirms_the_fastest_times_settles_the_profile():
    assert profiling.settled({1: 1.0, 4: 2.0}, {1: 0.99, 4: 2.04})  # within SETTLED, either way
    assert not profiling.settled({1: 1.0, 4: 2.0}, {1: 0.9, 4: 2.0})  # 10% faster: keep repeating
    assert not profiling.settled({1: 1.0, 4: 2.0}, {1: 1.0, 4: 2.5})  # a slow round (a busy spell) confirms nothing
    assert not profiling.settled({1: 1.0}, {1: 1.0, 4: 2.0})  # a width not timed before


@pytest.mark.parametrize("batched", [False, True])
def test_a_steady_target_is_timed_in_fewer_rounds_than_the_most(batched, monkeypatch):
    """Forwards that take the same time every round stop repeating after MIN_TIMED_ROUNDS timed rounds; a forward
    that keeps getting faster is repeated up to ``repeats``."""
    import itertools

    target = make_family_target("llama")
    ticks = itertools.count()
    steady = {"on": True}

    def clock():  # each forward "takes" 1 s when steady, 10% less every round otherwise
        tick = next(ticks)
        return float(tick) if steady["on"] else sum(0.9 ** (k // 2) for k in range(tick))

    def forwards(widths):
        calls = []
        forward = target.forward

        def counting(*args, **kwargs):
            calls.append(kwargs["input_ids"].shape[1])
            return forward(*args, **kwargs)

        monkeypatch.setattr(target, "forward", counting)
        monkeypatch.setattr(profiling.time, "perf_counter", clock)
        if batched:
            profiling.measure_batched_steps_per_second(target, 1, widths, context_length=8, repeats=5,
                                                       time_budget_s=1e9)
        else:
            profiling.measure_steps_per_second(target, widths, context_lengths=[8], repeats=5, time_budget_s=1e9)
        return calls

    widths = [1, 2]
    prefill = 1
    assert len(forwards(widths)) == prefill + (1 + profiling.MIN_TIMED_ROUNDS) * len(widths)
    steady["on"] = False
    assert len(forwards(widths)) == prefill + (1 + 5) * len(widths)
