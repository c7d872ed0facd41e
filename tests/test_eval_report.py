"""Evaluation suite: metric math on hand-computed rollouts, the evaluate modules, the report schema, a tiny run."""

import json
import math
import shutil
import sys

import pytest
from transformers import AutoTokenizer

from hf_dspark.evaluation import evaluate_module_path, metrics
from hf_dspark.evaluation.report import EvalSettings, run_eval
from tests.helpers import make_drafter, make_target, require_smollm2

# Three rounds of a g=3 drafter, whole block verified: accepted 3, 1, 0 drafts.
VERIFIED, ACCEPTED = [3, 3, 3], [3, 1, 0]
LOGITS = [[2.0, 1.0, 0.0], [1.0, -1.0, 0.5], [-2.0, 0.0, 0.0]]


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_accepted_length_and_rates_by_hand():
    assert metrics.accepted_length(VERIFIED, ACCEPTED) == pytest.approx((4 + 3) / 3)  # bonus token per round
    assert metrics.acceptance_rate(VERIFIED, ACCEPTED) == pytest.approx(4 / 9)
    pos = metrics.position_acceptance(VERIFIED, ACCEPTED, 3)
    # k=1: all 3 rounds reach it, 2 accept; k=2: rounds 1,2 reach it, 1 accepts; k=3: round 1 only, accepts.
    assert pos["reached"] == [3, 2, 1]
    assert pos["acceptance"] == pytest.approx([2 / 3, 1 / 2, 1.0])
    # a round that verified only 1 draft never reaches position 2
    assert metrics.position_acceptance([1], [1], 3)["reached"] == [1, 0, 0]


def test_metric_input_errors():
    with pytest.raises(ValueError, match="accepted=4"):
        metrics.accepted_length([3], [4])
    with pytest.raises(ValueError, match="rounds"):
        metrics.acceptance_rate([3, 3], [1])
    assert math.isnan(metrics.accepted_length([], []))


def test_threshold_sweep_by_hand():
    rows = metrics.threshold_sweep(LOGITS, VERIFIED, ACCEPTED, [0.0, 0.6, 0.99])
    # t=0: whole blocks; t=0.6: c = sigmoid(z) >= 0.6 <=> z >= 0.405: round 1 verifies 2 (z=2,1), round 2 verifies
    # 1 (z=1), round 3 verifies 0. Accepted min(a, l): 2, 1, 0.
    assert rows[0] == {"threshold": 0.0, "verified_per_round": 3.0, "accepted_per_round": 4 / 3,
                       "acceptance_rate": pytest.approx(4 / 9), "accepted_length": pytest.approx(7 / 3)}
    assert rows[1]["verified_per_round"] == pytest.approx(1.0)
    assert rows[1]["accepted_per_round"] == pytest.approx(1.0)
    assert rows[1]["acceptance_rate"] == pytest.approx(1.0)
    assert rows[2]["verified_per_round"] == 0 and rows[2]["acceptance_rate"] is None
    # temperatures rescale the logits first: T_1 = 4 makes z=2 -> sigmoid(0.5) = 0.62 >= 0.6 but z=1 -> 0.56 < 0.6
    scaled = metrics.threshold_sweep(LOGITS, VERIFIED, ACCEPTED, [0.6], temperatures=[4.0, 1.0, 1.0])[0]
    assert scaled["verified_per_round"] == pytest.approx(2 / 3)


def test_calibration_metrics_by_hand():
    out = metrics.calibration_metrics(LOGITS, VERIFIED, ACCEPTED, num_bins=1)
    # one bin: ECE = |mean(prob) - mean(event)|
    a1 = [sigmoid(2.0), sigmoid(1.0), sigmoid(-2.0)]
    assert out["ece_raw"][0] == pytest.approx(abs(sum(a1) / 3 - 2 / 3))
    a3 = [sigmoid(2.0) * sigmoid(1.0) * sigmoid(0.0), sigmoid(1.0) * sigmoid(-1.0) * sigmoid(0.5),
          sigmoid(-2.0) * sigmoid(0.0) * sigmoid(0.0)]
    assert out["ece_raw"][2] == pytest.approx(abs(sum(a3) / 3 - 1 / 3))
    assert out["auc"][0] == pytest.approx(1.0)  # accepted rounds have the two highest a_1
    assert out["num_samples"] == [3, 3, 3] and out["ece_calibrated"] == [None] * 3
    rows_without_drafts = metrics.calibration_metrics(LOGITS + [[]], VERIFIED + [0], ACCEPTED + [0], num_bins=1)
    assert rows_without_drafts["ece_raw"] == pytest.approx(out["ece_raw"])


def test_evaluate_modules_load_offline():
    evaluate = pytest.importorskip("evaluate")
    acceptance = evaluate.load(evaluate_module_path("dspark_acceptance"))
    result = acceptance.compute(verified=VERIFIED, accepted=ACCEPTED, block_size=3)
    assert result["accepted_length"] == pytest.approx(7 / 3)
    assert result["position_acceptance"] == pytest.approx([2 / 3, 1 / 2, 1.0])
    calibration = evaluate.load(evaluate_module_path("dspark_calibration"))
    result = calibration.compute(confidence_logits=LOGITS, verified=VERIFIED, accepted=ACCEPTED, num_bins=1,
                                 temperatures=[1.0, 1.0, 1.0], thresholds=[0.6])
    assert result["ece_calibrated"] == pytest.approx(result["ece_raw"])
    assert result["threshold_sweep"][0]["verified_per_round"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no evaluate module named"):
        evaluate_module_path("nope")


@pytest.fixture(scope="module")
def tiny_setup():
    require_smollm2()
    from hf_dspark.target import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    target = make_target("llama", vocab_size=len(tokenizer))
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    return target, tokenizer


def test_tiny_end_to_end_report(tmp_path, tiny_setup, monkeypatch, capsys):
    target, tokenizer = tiny_setup
    data = tmp_path / "data"
    data.mkdir()
    (data / "mathset.jsonl").write_text(json.dumps({"id": "m1", "domain": "math", "turns": ["2+2?"]}) + "\n"
                                        + json.dumps({"id": "m2", "domain": "math", "turns": ["3+5?"]}) + "\n")
    (data / "chatset.jsonl").write_text(json.dumps({"id": "c1", "domain": "chat", "turns": ["hi", "more"]}) + "\n")
    drafter = make_drafter(target, block_size=3)
    drafter.config.confidence_temperatures = [1.5, 1.0, 0.8]
    drafter.generation_config.sps_profile = {"sample_batch_tokens": [1, 2, 4], "sample_steps_per_sec": [10.0, 9.0, 7.0]}
    ablation = make_drafter(target, head="none", block_size=3, seed=1)
    settings = EvalSettings(data=[str(data)], num_prompts=2, speed_prompts=1, max_new_tokens=6,
                            temperatures=[0.0, 1.0], speed_temperatures=[0.0], thresholds=[0.0, 0.5],
                            prompt_lookup=2)
    out = tmp_path / "report"
    # shard 1 of 2 first: it leaves the report incomplete, naming what is missing
    partial = run_eval(target, tokenizer, drafter, out, settings, ablation=ablation, num_shards=2, shard_index=1,
                       progress=False)
    assert partial["missing"]
    bench = tmp_path / "bench.md"
    bench.write_text("<!-- generated by `hf-dspark bench --markdown`; do not edit by hand -->\n# Draft sources\n\n"
                     "| set | plain |\n")
    report = run_eval(target, tokenizer, drafter, out, settings, ablation=ablation, num_shards=2, shard_index=0,
                      progress=False, description={"target": "tiny"}, benchmarks_path=tmp_path / "BENCH.md",
                      benchmarks_include=[bench])
    assert report["missing"] == [] and report["schema"] == "hf-dspark-eval-v1"
    assert set(report["temperatures"]) == {"0.0", "1.0"}
    t0 = report["temperatures"]["0.0"]
    assert set(t0["acceptance"]["sets"]) == {"mathset", "chatset"}
    assert set(t0["acceptance"]["domains"]) == {"chat", "math"}
    assert set(t0["acceptance"]["macro"]) == {"dspark", "dflash"}
    assert "macro" in t0["acceptance"]["tau_ratio_dspark_over_dflash"]
    assert len(t0["acceptance"]["all"]["dspark"]["position_acceptance"]) == 3
    assert [r["threshold"] for r in t0["threshold_sweep"]["all"]["calibrated"]] == [0.0, 0.5]
    assert t0["calibration"]["temperatures"] == [1.5, 1.0, 0.8] and len(t0["calibration"]["ece_raw"]) == 3
    speed = t0["speed"]["all"]
    assert speed["plain"]["speedup"] == 1.0
    assert {"dspark:fixed", "dspark:threshold", "dspark:scheduler", "dflash:fixed", "prompt_lookup"} <= set(speed)
    # greedy: every method emits exactly the plain tokens
    assert len({r["tokens"] for r in speed.values()}) == 1
    assert "speed" not in report["temperatures"]["1.0"]
    for name in ("report.json", "report.md", "position_acceptance_t0.0.png", "threshold_sweep_t0.0.png",
                 "reliability_t0.0.png", "speed_t0.0.png"):
        assert (out / name).stat().st_size > 0, name
    md = (tmp_path / "BENCH.md").read_text()
    assert "generated by `hf-dspark eval`" in md and "report/speed_t0.0.png" in md
    assert md.count("generated by") == 1 and md.rstrip().endswith("## Draft sources\n\n| set | plain |")
    assert "Draft sources" not in (out / "report.md").read_text()
    # the model card's evaluation section is computed from this report
    from hf_dspark.hub import evaluation_text

    card = evaluation_text(report)
    assert "| macro |" in card and "| dspark:fixed |" in card and "Temperature 1.0" in card
    # resumable: a rerun reuses every unit (no generation) and reproduces the numbers
    mtimes = {p.name: p.stat().st_mtime_ns for p in (out / "units").glob("*.json")}
    stored = json.loads((out / "report.json").read_text())
    stored["environment"]["date"] = "2026-01-01 00:00 UTC"
    (out / "report.json").write_text(json.dumps(stored))
    again = run_eval(target, tokenizer, drafter, out, settings, ablation=ablation, num_shards=1, shard_index=0,
                     progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "units").glob("*.json")} == mtimes
    assert again["temperatures"]["0.0"]["acceptance"] == t0["acceptance"]
    assert again["environment"]["date"] == "2026-01-01 00:00 UTC"  # re-rendered: the measuring run's date stays
    # a different configuration in the same folder is refused
    with pytest.raises(ValueError, match="other settings"):
        run_eval(target, tokenizer, drafter, out, EvalSettings(data=[str(data)], num_prompts=1, speed_prompts=1),
                 num_shards=1, shard_index=0, progress=False)
    # the CLI re-renders the page from report.json alone (no units, no models), with the included sections
    from hf_dspark.cli import main

    shutil.rmtree(out / "units")
    page = tmp_path / "PAGE.md"
    argv = ["eval", "--output", str(out), "--render-only", "--benchmarks", str(page), "--benchmarks-include", str(bench)]
    monkeypatch.setattr(sys, "argv", ["hf-dspark", *argv])  # the page names the command that wrote it
    assert main(argv) == 0
    rendered = page.read_text()
    assert "2026-01-01 00:00 UTC" in rendered and "--render-only" in rendered
    assert rendered.rstrip().endswith("## Draft sources\n\n| set | plain |")
    assert "report/speed_t0.0.png" in rendered  # the plots already there are linked
    capsys.readouterr()
    assert main(["eval", "--output", str(out), "--render-only", "--benchmarks", str(page),
                 "--benchmarks-include", str(tmp_path / "missing.md")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["eval", "--output", str(tmp_path / "new")]) == 2
    assert "needs --data" in capsys.readouterr().err


def test_incomplete_report_names_the_phases_to_rerun(tmp_path):
    from hf_dspark.evaluation.report import render_markdown

    report = {
        "environment": {"cpu": "m", "cpu_count": 2, "torch_threads": 2, "platform": "p", "cuda": None, "python": "3",
                        "torch": "t", "transformers": "x", "hf_dspark": "h", "date": "d", "command": "c"},
        "models": {"target": "tiny", "block_size": 3, "sequential_head": "markov", "calibrated": False},
        "settings": {"data": ["d"], "num_prompts": 1, "speed_prompts": 1, "max_new_tokens": 4, "multi_turn": True},
        "temperatures": {},
        "missing": ["quality-t0-alpaca", "quality-t1-alpaca"],
    }
    md = render_markdown(report, {}, tmp_path)
    assert "2 units not run yet" in md and "with `--phases quality` to finish them" in md
    report["missing"].append("speed-t0-alpaca")
    assert "with `--phases quality speed` to finish them" in render_markdown(report, {}, tmp_path)
