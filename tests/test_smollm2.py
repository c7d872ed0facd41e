"""End to end on the real target, SmolLM2-135M-Instruct (short form; runs in CI)."""

import pytest
import torch

import hf_dspark
from hf_dspark.defaults import load_drafter_for
from tests.helpers import require_smollm2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    require_smollm2()
    pytest.importorskip("gguf")
    from hf_dspark.target import load_smollm2

    return load_smollm2(dtype=torch.float32)


def test_smollm2_greedy_equality(smollm2):
    target, tokenizer = smollm2
    drafter, origin = load_drafter_for(target)
    assert drafter.config.vocab_size == 49152 and drafter.config.num_target_layers == 30
    messages = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = target.generate(**inputs, max_new_tokens=32, do_sample=False)
    assisted = target.generate(**inputs, max_new_tokens=32, do_sample=False, assistant_model=drafter)
    assert torch.equal(plain, assisted), origin
    stats = drafter.last_stats
    assert stats.rounds > 0 and stats.accepted_length >= 1.0


def test_stop_string_completed_inside_a_round(smollm2):
    """A stop string completed by an accepted draft ends the output where plain generate() ends it, on the
    generate() route (the embedded default, no settings) and in the batched engine."""
    from hf_dspark.engine import SamplingParams, generate_batch

    target, tokenizer = smollm2
    drafter, _ = load_drafter_for(target)
    assert drafter.generation_config.verification_policy == "hybrid"
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = dict(max_new_tokens=96, do_sample=False, stop_strings=["return"], tokenizer=tokenizer)
    plain = target.generate(**inputs, **settings)
    assisted = target.generate(**inputs, **settings, assistant_model=drafter)
    assert torch.equal(plain, assisted)
    new = plain[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(new) < 96 and tokenizer.decode(new).endswith("return")
    batch = generate_batch(target, [inputs["input_ids"][0].tolist()], drafter,
                           SamplingParams(max_new_tokens=96, stop_strings=("return",)), policy="fixed",
                           tokenizer=tokenizer)
    assert batch.outputs[0].token_ids == new and batch.outputs[0].finish_reason == "stop"


def test_load_default(smollm2):
    target, tokenizer, drafter = hf_dspark.load_default()
    assert drafter.embed_tokens is target.get_input_embeddings()
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("policy", [None, "threshold"])
def test_main_command_generate(capsys, smollm2, policy):
    """The README's main job (`hf-dspark generate`) on the embedded default: identical output, a JSON summary alone
    on stdout; by default the hybrid policy drafts (the embedded drafter has a confidence head)."""
    import json

    from hf_dspark.cli import main

    threads = torch.get_num_threads()
    try:
        extra = [] if policy is None else ["--policy", policy]
        assert main(["generate", "--max-new-tokens", "12", "--threads", "1", "--json", *extra]) == 0
    finally:
        torch.set_num_threads(threads)  # the CLI sets the process-wide thread count
    captured = capsys.readouterr()
    assert f"verification policy: {policy or 'hybrid'}" in captured.err
    summary = json.loads(captured.out)  # --json: stdout holds the summary alone
    assert summary["identical_output"]
    assert summary["plain"]["tokens"] == summary["dspark"]["tokens"] == 12
    assert summary["stats"]["rounds"] >= 1


def test_calibrate_command_balanced_with_heldout_ece(tmp_path, smollm2):
    """`hf-dspark calibrate` on the embedded drafter (short form): balanced prompts, batched rollouts, STS fit,
    cross-validated held-out ECE in sts.json, and a calibrated drafter folder that loads back."""
    import json

    from hf_dspark.cli import main
    from hf_dspark.modeling_dspark import DSparkDrafter
    from tests.helpers import SHARED

    prompts = sorted(str(p) for p in (SHARED / "data" / "train").glob("*.jsonl"))
    assert len(prompts) >= 2, f"no training prompt sets under {SHARED}"
    threads = torch.get_num_threads()
    try:
        assert main(["calibrate", "--prompts", *prompts, "--num-prompts", str(2 * len(prompts)),
                     "--max-new-tokens", "16", "--concurrency", "8", "--cv-folds", "2", "--threads", "1",
                     "--output", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "calibration_report.json").read_text())
    assert sorted(report["sets"].values()) == [2] * len(prompts)  # balanced: two prompts from every set
    assert len(set(report["rollouts"]["prompts"])) > 2
    from hf_dspark.prompts import excluded_prompt_ids

    assert len(excluded_prompt_ids([tmp_path])) == 2 * len(prompts)  # a later job can skip these prompts
    sts = json.loads((tmp_path / "sts.json").read_text())
    assert sts["heldout_folds"] == 2 and len(sts["ece_heldout_per_position"]) == len(sts["temperatures"])
    drafter = DSparkDrafter.from_pretrained(tmp_path)
    assert drafter.config.confidence_temperatures == sts["temperatures"]
