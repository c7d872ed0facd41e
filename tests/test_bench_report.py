"""The Markdown of an ``hf-dspark bench`` report."""

import pytest

from hf_dspark.evaluation.bench_report import render_bench_markdown


def _row(speedup, **extra):
    return {"tokens": 100, "seconds": 10.0, "tokens_per_s": 10.0 * speedup, "speedup": speedup, **extra}


def test_bench_markdown_tables():
    hybrid = dict(accepted_length=1.5, identical_to_baseline="2/2",
                  sources={"block": {"rounds": 2, "verified": 4, "accepted": 1},
                           "lookup": {"rounds": 6, "verified": 12, "accepted": 9},
                           "none": {"rounds": 2, "verified": 0, "accepted": 0}},
                  time_split={"drafting_s": 0.5, "verification_s": 8.0, "bookkeeping_s": 1.0})
    report = {
        "set/a": {"plain": _row(1.0), "dspark:hybrid": _row(1.21, **hybrid), "prompt_lookup": _row(1.1)},
        "set/b": {"plain": _row(1.0), "dspark:hybrid": _row(0.99, **hybrid), "prompt_lookup": _row(0.8)},
        "all": {"plain": _row(1.0), "dspark:hybrid": _row(1.1, **hybrid), "prompt_lookup": _row(0.95)},
    }
    payload = {"settings": {"dtype": "float32", "max_new_tokens": 64, "num_prompts": 2, "threads": 2},
               "results": {"report": report}}
    text = render_bench_markdown(payload, {"command": "hf-dspark bench ...", "cpu": "cpu", "cpu_count": 2})
    lines = text.splitlines()
    assert "| set | plain | dspark:hybrid | prompt_lookup |" in lines
    assert "| a | 1.00x | 1.21x (tau 1.50) 2/2 same | 1.10x |" in lines
    geomean = next(line for line in lines if line.startswith("| geometric mean"))
    assert f"{(1.21 * 0.99) ** 0.5:.2f}x" in geomean and f"{(1.1 * 0.8) ** 0.5:.2f}x" in geomean
    assert "| a | dspark:hybrid | 20% / 60% / 20% | 1/4, 9/12 | 5% / 80% / 10% |" in lines
    assert not any("prompt_lookup |" in line and "%" in line for line in lines)  # no rounds table for lookup


def test_bench_markdown_needs_sets():
    with pytest.raises(ValueError, match="no prompt-set results"):
        render_bench_markdown({"settings": {}, "results": {"report": {}}}, {})
