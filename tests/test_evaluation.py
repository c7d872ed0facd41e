"""Rollout evaluation: report schema and the accepted-length / position-wise acceptance math."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from hf_dspark import DSparkStats
from hf_dspark.evaluation import MethodResult, run_rollouts
from tests.helpers import make_drafter, make_target, require_smollm2


def test_method_result_aggregation():
    stats = DSparkStats(block_size=2)
    for v, a in [(2, 2), (2, 0), (1, 1)]:
        stats.add_round(2, v, a)
    result = MethodResult()
    result.add(tokens=7, seconds=2.0, stats=stats)
    summary = result.summary()
    assert summary["accepted_length"] == pytest.approx((3 + 3) / 3)
    assert summary["position_acceptance"] == pytest.approx([2 / 3, 1.0])
    assert summary["tokens_per_s"] == pytest.approx(3.5)


def test_rollout_report(tmp_path):
    require_smollm2()
    from hf_dspark.target import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    target = make_target("llama", vocab_size=len(tokenizer))
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    with open(tmp_path / "mini.jsonl", "w") as f:
        f.write(json.dumps({"id": "a", "domain": "math", "turns": ["2+2?", "and 3+3?"]}) + "\n")
    first, second = make_drafter(target, block_size=3), make_drafter(target, head="none", block_size=3, seed=1)
    methods = {"plain": {"assistant": False}, "a": {"assistant": True, "drafter": first},
               "b": {"assistant": True, "drafter": second, "verification_policy": "threshold"}}
    report = run_rollouts(target, tokenizer, None, [tmp_path / "mini.jsonl"], methods, max_new_tokens=6,
                          progress=False)
    assert set(report) == {"all", "set/mini", "domain/math"}
    assert report["all"]["plain"]["speedup"] == 1.0
    assert report["all"]["a"]["tokens"] == report["all"]["plain"]["tokens"] == 12  # two turns, greedy equality
    assert "accepted_length" in report["all"]["b"] and second.generation_config.verification_policy == "fixed"


def test_batched_quality_rollouts_match_generate(tmp_path):
    """The quality phase through the batched engine records the same rounds as generate() record by record,
    multi-turn histories included (each method is fed its own answers)."""
    require_smollm2()
    from hf_dspark.evaluation.rollouts import batched_rollouts, rollout_record
    from hf_dspark.target import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    target = make_target("llama", vocab_size=len(tokenizer))
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    records = [{"id": "a", "turns": ["2+2?", "and 3+3?"]}, {"id": "b", "turns": ["Write a haiku about the sea."]},
               {"id": "c", "turns": ["hi", "why?"]}]
    first, second = make_drafter(target, block_size=3), make_drafter(target, head="none", block_size=3, seed=1)
    methods = {"a": {"assistant": True, "drafter": first, "verification_policy": "fixed", "num_verify_tokens": None},
               "b": {"assistant": True, "drafter": second, "verification_policy": "fixed", "num_verify_tokens": 2}}
    batched = batched_rollouts(target, tokenizer, records, methods, max_new_tokens=8, concurrency=2, progress=False)
    for record, got in zip(records, batched):
        want = rollout_record(target, tokenizer, record, methods, max_new_tokens=8)
        for name in methods:
            assert got[name].tokens == want[name].tokens == 8 * len(record["turns"])
            assert got[name].verified == want[name].verified and got[name].accepted == want[name].accepted
            assert [len(c) for c in got[name].confidence_logits] == [len(c) for c in want[name].confidence_logits]
            assert torch.allclose(torch.tensor([x for c in got[name].confidence_logits for x in c]),
                                  torch.tensor([x for c in want[name].confidence_logits for x in c]), atol=1e-4)
    assert max(got["b"].verified) == 2
    with pytest.raises(ValueError, match="fixed verification length"):
        batched_rollouts(target, tokenizer, records, {"plain": {"assistant": False}}, progress=False)


def test_a_method_on_the_stock_linears_of_an_optimised_target():
    """``stock_linears``: that method runs on torch's stock linears, the others on the prepacked ones, outputs equal;
    with it first, every method also gets its speedup over ``plain``."""
    require_smollm2()
    from transformers import AutoTokenizer

    from hf_dspark.evaluation.rollouts import rollout_record, summarise
    from hf_dspark.optimization import linears_state, optimize_target
    from hf_dspark.target import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    target = make_target("llama", vocab_size=len(tokenizer))
    optimize_target(target, "on")
    seen = []
    original = target.generate

    def generate(*args, **kwargs):
        seen.append(linears_state(target))
        return original(*args, **kwargs)

    target.generate = generate
    methods = {"plain_stock": {"assistant": False, "stock_linears": True}, "plain": {"assistant": False}}
    results = rollout_record(target, tokenizer, {"id": "a", "turns": ["2+2?"]}, methods, max_new_tokens=6)
    assert seen == ["stock", "onednn-prepacked"] and linears_state(target) == "onednn-prepacked"
    assert results["plain"].identical == results["plain"].compared == 1
    summary = summarise(results, "plain_stock")
    assert summary["plain"]["speedup_vs_plain"] == 1.0 and "speedup" in summary["plain_stock"]
