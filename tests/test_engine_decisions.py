"""scripts/engine_decisions.py: the engine's decisions with the timing-fed parts off are a deterministic trace."""

import json
import random
import time

import pytest

from hf_dspark.profiling import BatchedStepsPerSecond, StepsPerSecond
from tests.helpers import load_script, random_prompts
from tests.test_engine import plain_greedy

CHEAP = BatchedStepsPerSecond({1: StepsPerSecond([1, 2, 3, 5, 9], [100.0, 95.0, 90.0, 80.0, 60.0])})
DEAR = BatchedStepsPerSecond({1: StepsPerSecond([1, 2, 9], [100.0, 40.0, 10.0])})


@pytest.fixture(scope="module")
def script():
    return load_script("engine_decisions")


def test_the_trace_repeats_and_follows_the_profile(script, tiny_targets, trained_drafters):
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = [p[0].tolist() for p in random_prompts(3, 6, target.config.vocab_size, seed=7)]
    first = script.decision_trace(target, drafter, prompts, CHEAP, max_new_tokens=12)
    again = script.decision_trace(target, drafter, prompts, CHEAP, max_new_tokens=12)
    assert first == again  # nothing in it depends on how long a step took
    assert sum(first["verify_tokens"]) > 0 and any(first["drafting"])
    assert first["outputs"] == [plain_greedy(target, p, 12) for p in prompts]
    # a profile where a second token costs 2.5x the first verifies fewer drafts: the digest sees the rule's inputs
    dear = script.decision_trace(target, drafter, prompts, DEAR, max_new_tokens=12)
    assert sum(dear["verify_tokens"]) < sum(first["verify_tokens"])
    assert dear["decisions_digest"] != first["decisions_digest"]
    assert dear["outputs_digest"] == first["outputs_digest"]


def test_a_noisy_clock_moves_only_the_timing_fed_decisions(script, tiny_targets, trained_drafters, monkeypatch):
    """Under a clock whose every step takes a random time, the trace with the timing-fed parts off does not move,
    and the engine with them on (realized gate, cost check, repricing) decides differently."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts = [p[0].tolist() for p in random_prompts(3, 6, target.config.vocab_size, seed=7)]

    def traces(timing_free: dict) -> tuple[dict, dict]:
        monkeypatch.setattr(script, "TIMING_FREE", timing_free)
        steady = script.decision_trace(target, drafter, prompts, CHEAP, max_new_tokens=12)
        rng, now = random.Random(0), [0.0]

        def noisy() -> float:
            now[0] += rng.expovariate(1 / 0.05)
            return now[0]

        with monkeypatch.context() as patch:
            patch.setattr(time, "perf_counter", noisy)
            shaken = script.decision_trace(target, drafter, prompts, CHEAP, max_new_tokens=12)
        return steady, shaken

    steady, shaken = traces(script.TIMING_FREE)
    assert shaken == steady
    steady, shaken = traces({})
    assert shaken["decisions_digest"] != steady["decisions_digest"]
    assert shaken["outputs"] == steady["outputs"]  # decisions never change the output


def test_a_file_without_curves_is_refused(script, tmp_path, capsys):
    flat = tmp_path / "profile.json"
    flat.write_text(json.dumps({"sample_batch_tokens": [1], "sample_steps_per_sec": [1.0]}))
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--sps", str(flat), "--output", str(tmp_path / "trace.json")])
    assert exit_info.value.code == 2
    assert "not a batched SPS profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--sps", str(tmp_path / "missing.json"), "--output", str(tmp_path / "trace.json")])
    assert "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--sps", str(flat), "--output", str(tmp_path / "trace.json"), "--drafter", str(tmp_path)])
    assert "no model.safetensors" in capsys.readouterr().err
