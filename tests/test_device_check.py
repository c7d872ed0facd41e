"""scripts/device_check.py --quick runs on CPU: CUDA checks SKIP, the tiny greedy and round-cost checks PASS, one table,
exit 0."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


def test_device_check_quick_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    output = tmp_path / "device_check.json"
    result = subprocess.run([sys.executable, "scripts/device_check.py", "--quick", "--output", str(output)], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("check ") == 1 and "device  result" in result.stdout  # one table
    rows = {row["check"]: row for row in json.loads(output.read_text())}
    assert rows["triton_scheduler"]["result"] == "SKIP"
    assert rows["smollm2"]["result"] == "SKIP"
    cost = rows["round_cost"]
    assert cost["result"] == "PASS", cost
    for name in ("target_1tok_ms", "greedy_eager_ms", "greedy_static_ms", "sample_eager_ms", "sample_static_ms"):
        assert cost["numbers"][name] > 0, (name, cost)
    assert "greedy_graph_ms" not in cost["numbers"]  # CUDA only
    for policy in ("fixed", "scheduler", "hybrid"):
        row = rows[f"greedy[{policy}]"]
        assert row["result"] == "PASS" and row["device"] == "cpu", row
        assert row["numbers"]["rounds"] > 0 and "drafting_s" in row["numbers"]
        assert f"greedy[{policy}]" in result.stdout
    assert rows["greedy[hybrid]"]["numbers"]["by_source"].get("lookup", 0) > 0
    profile = rows["engine[profile]"]
    assert profile["result"] == "PASS" and sorted(profile["numbers"]["by_size_s"], key=int) == ["1", "2", "4"]
    for concurrency in (1, 4):
        engine = rows[f"engine[c={concurrency}]"]
        assert engine["result"] == "PASS" and engine["numbers"]["plain_tok_s"] > 0, engine
        for method in ("fixed", "scheduler", "hybrid"):
            numbers = engine["numbers"][method]
            assert numbers["vs_plain"] > 0 and numbers["identical"] == f"{engine['numbers']['requests']}/" \
                f"{engine['numbers']['requests']}", (method, engine)
    assert "engine[kernels]" not in rows  # CUDA only


def test_device_prompts_are_the_balanced_sample_of_the_eval_sets():
    """The committed prompts are exactly what --write-prompts makes of the shared evaluation sets, and the SmolLM2
    check's order covers every set before any set's second prompt."""
    sys.path.insert(0, str(REPO / "scripts"))
    import device_check

    records = device_check.read_device_prompts()
    assert len(records) == device_check.NUM_DEVICE_PROMPTS
    if device_check.EVAL_DIR.is_dir():
        assert records == device_check.device_prompt_records()
    sets = sorted({r["set"] for r in records})
    assert len(sets) >= 2
    order = device_check.prompts_per_set(records, 2)
    assert [j for j, _ in order] == [0] * len(sets) + [1] * len(sets)
    assert sorted(r["set"] for _, r in order[:len(sets)]) == sets
    assert device_check.prompts_per_set(records, 1) == order[:len(sets)]


def test_device_check_deadline_and_subset(tmp_path):
    """--checks runs only the named checks; a check that would start past --deadline reports SKIP, not FAIL, and the
    JSON lists every row."""
    sys.path.insert(0, str(REPO / "scripts"))
    import device_check

    output = tmp_path / "subset.json"
    assert device_check.main(["--quick", "--checks", "greedy", "round_cost", "--deadline", "0",
                              "--output", str(output)]) == 0
    rows = json.loads(output.read_text())
    assert [row["check"] for row in rows] == ["greedy[fixed]", "greedy[scheduler]", "greedy[hybrid]", "round_cost"]
    assert all(row["result"] == "SKIP" and "deadline" in row["numbers"]["reason"] for row in rows)


def test_divergence_gap_measures_the_targets_margin_where_outputs_part(tiny_targets):
    """The float32 check tells a near-tie flip from a real difference by the target's logit gap at the first token
    where the outputs part; outputs that only differ in length are never a near-tie."""
    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    import device_check

    target = tiny_targets["llama"]
    prompt = torch.tensor([[5, 9, 13, 2, 7]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=6)
    with torch.no_grad():
        logits = target(plain[:, :7]).logits[0, -1].float()
    other = plain.clone()
    runner_up = int(logits.topk(2).indices[1])
    other[0, 7] = runner_up
    gap = device_check.divergence_gap(target, plain, other)
    assert gap == pytest.approx(float(logits[plain[0, 7]] - logits[runner_up])) and gap >= 0
    assert device_check.divergence_gap(target, plain, plain[:, :-2]) == float("inf")


def test_engine_sync_numbers_counts_per_step_after_admission(tiny_targets):
    """The engine's sync row (CUDA) divides what the counter saw by the steps it ran, after admission."""
    sys.path.insert(0, str(REPO / "scripts"))
    import device_check
    from tests.helpers import make_drafter, random_prompts

    target = tiny_targets["llama"]
    prompts = [p[0].tolist() for p in random_prompts(4, 10, target.config.vocab_size, seed=1)]
    seen = []

    def count(fn):  # a stand-in for set_sync_debug_mode("warn"): 3 "syncs" per step it ran
        results = fn()
        seen.append(len(results))
        return 3 * len(results), {"batching.py:1": 3 * len(results)}

    numbers = device_check.engine_sync_numbers(target, make_drafter(target), None, prompts, requests=4, steps=5,
                                               count=count)
    assert seen == [5] and numbers == {"requests": 4, "steps": 5, "syncs_per_step": 3.0,
                                       "top_sites": {"batching.py:1": 15}}
