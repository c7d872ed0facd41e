"""scripts/bench_context.py: prompts cut from long documents, and the ratios and table built from hand-made runs."""


import pytest
import torch

from tests.helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_context")


def _run(seconds, ttft, output, sources=None):
    run = {"tokens": 5, "seconds": seconds, "ttft_s": ttft, "output": output}
    if sources is not None:
        run["sources"] = sources
    return run


def test_ratios_against_plain_over_the_repeats(bench):
    runs = {
        "plain": [_run(10.0, 4.0, [1, 2]), _run(12.0, 4.0, [1, 2])],  # decode 6 + 8 = 14 s
        "hybrid": [_run(8.0, 4.4, [1, 2], {"lookup": {"rounds": 2, "accepted": 3, "seconds": 1.0}}),
                   _run(9.0, 3.6, [1, 3], {"none": {"rounds": 1, "accepted": 0, "seconds": 0.5}})],
    }
    summary = bench.summarise(runs, max_new_tokens=5)
    hybrid = summary["hybrid"]
    assert hybrid["end_to_end"] == pytest.approx(22.0 / 17.0)
    assert hybrid["decode_only"] == pytest.approx(14.0 / 9.0)
    assert hybrid["ttft_ratio"] == pytest.approx(1.0)
    assert hybrid["identical"] is False  # the second repeat's output differs from plain's
    assert hybrid["sources"] == {"lookup": {"rounds": 2, "accepted": 3, "seconds": 1.0},
                                 "none": {"rounds": 1, "accepted": 0, "seconds": 0.5}}
    assert summary["plain"]["decode_step_s"] == pytest.approx(14.0 / (2 * 4))
    report = {"settings": {"documents": ["README.md"], "max_new_tokens": 5, "dtype": "float32", "threads": 2,
                           "repeats": 2},
              "command": "python scripts/bench_context.py --repeats 2", "commit": "abc1234",
              "lengths": {"1024": {"prompt_tokens": 1040, "methods": summary}}}
    table = bench.markdown(report)
    assert table.splitlines()[1] == "# Speed across context lengths: float32, 5 new tokens"
    assert "`python scripts/bench_context.py --repeats 2`" in table
    # round cost: the lookup rounds took 0.5 s each against plain's 1.75 s per token
    assert "| 1040 | hybrid | 1.29x | 1.56x | 1.000 | 4.00 | 0.29 (1; 0) |  | 0.29 (2; 3) | False |" in table


class _Tokenizer:
    """Words as tokens, and a chat template that wraps the message in two tokens."""

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": list(range(len(text.split())))})()

    def decode(self, ids):
        return " ".join("w" for _ in ids)

    def apply_chat_template(self, messages, add_generation_prompt, return_tensors, return_dict):
        return {"input_ids": torch.zeros(1, len(messages[0]["content"].split()) + 2, dtype=torch.long)}


def test_prompts_are_document_prefixes_that_fit_the_context(bench, tmp_path):
    document = tmp_path / "doc.md"
    document.write_text(" ".join(["word"] * 500))
    prompts = bench.build_prompts(_Tokenizer(), [str(document)], ["100", "max"], max_new_tokens=20, context=300)
    instruction = len(bench.INSTRUCTION.split())
    assert prompts["100"].shape[1] == 100 + instruction + 2
    assert prompts["max"].shape[1] + 20 <= 300
    with pytest.raises(SystemExit, match="holds at most"):
        bench.build_prompts(_Tokenizer(), [str(document)], ["400"], max_new_tokens=20, context=300)
    with pytest.raises(SystemExit, match="hold only 500 tokens"):
        bench.build_prompts(_Tokenizer(), [str(document)], ["600"], max_new_tokens=20, context=3000)
