"""Bad input gets a clear error naming the problem."""

import json

import pytest
import torch

from hf_dspark import DSparkConfig, DSparkDrafter
from tests.helpers import make_drafter, make_target, random_prompts


def test_vocab_mismatch(tiny_targets):
    drafter = make_drafter(tiny_targets["llama"])
    other = make_target("llama", vocab_size=64)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        other.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, assistant_model=drafter)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        drafter.attach_target(other)


def test_hidden_size_mismatch(tiny_targets):
    target = tiny_targets["llama"]
    config = DSparkConfig.for_target(target.config, target_hidden_size=32, hidden_size=64, target_layer_ids=[0])
    drafter = DSparkDrafter(config)
    with pytest.raises(ValueError, match="hidden-size mismatch"):
        drafter.attach_target(target)


def test_target_layer_ids_out_of_range_or_last(tiny_targets):
    target = tiny_targets["llama"]  # 4 layers
    with pytest.raises(ValueError, match="last layer"):
        DSparkConfig.for_target(target.config, target_layer_ids=[0, 3])
    with pytest.raises(ValueError, match="out of range"):
        DSparkConfig.for_target(target.config, target_layer_ids=[0, 7])
    # A drafter built for a deeper target, attached to a shallower one.
    deep = make_target("llama", layers=8)
    drafter = make_drafter(deep, target_layer_ids=[1, 5])
    with pytest.raises(ValueError, match="out of range for this target"):
        drafter.attach_target(target)


def test_batch_and_beams_rejected(tiny_targets):
    target = tiny_targets["qwen3"]
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="one sequence at a time"):
        target.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=3, assistant_model=drafter)
    with pytest.raises(ValueError, match="num_beams"):
        target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, num_beams=2, assistant_model=drafter)


def test_unsupported_reference_head_type(tmp_path):
    config = DSparkConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, num_target_layers=4, target_layer_ids=[0, 1],
                          markov_rank=4).to_reference_dict()
    config["markov_head_type"] = "transformer"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="markov_head_type='transformer'"):
        DSparkDrafter.from_pretrained(tmp_path)


def test_bad_config_values():
    with pytest.raises(ValueError, match="sequential_head"):
        DSparkConfig(sequential_head="lstm")
    with pytest.raises(ValueError, match="block_size"):
        DSparkConfig(block_size=0)
    with pytest.raises(ValueError, match="confidence_temperatures"):
        DSparkConfig(block_size=3, confidence_temperatures=[1.0])


def test_unknown_policy_and_threshold_without_confidence_head(tiny_targets):
    target = tiny_targets["llama"]
    drafter = make_drafter(target, confidence=False)
    prompt = random_prompts(1, 5, target.config.vocab_size)[0]
    drafter.generation_config.verification_policy = "magic"
    with pytest.raises(ValueError, match="unknown verification_policy 'magic'"):
        target.generate(prompt, max_new_tokens=3, assistant_model=drafter)
    drafter.generation_config.verification_policy = "threshold"
    with pytest.raises(ValueError, match="no confidence head"):
        target.generate(prompt, max_new_tokens=3, assistant_model=drafter)


def test_unattached_drafter_explains(tiny_targets):
    drafter = DSparkDrafter(DSparkConfig.for_target(tiny_targets["llama"].config, target_layer_ids=[0]))
    with pytest.raises(RuntimeError, match="attach_target"):
        drafter.draft(torch.tensor([3]), 4, torch.zeros(1, 4, 64))


def test_context_must_cover_every_position_before_the_anchor(tiny_targets):
    drafter = make_drafter(tiny_targets["llama"])
    with pytest.raises(ValueError, match="context covers positions"):
        drafter.draft(torch.tensor([3]), 6, torch.zeros(1, 4, 128))


def test_other_assistants_untouched(tiny_targets):
    """The dispatch leaves transformers' own assistants alone (prompt lookup, a small assistant model)."""
    target = tiny_targets["llama"]
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    plain = target.generate(prompt, max_new_tokens=10, do_sample=False)
    lookup = target.generate(prompt, max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3)
    assistant = target.generate(prompt, max_new_tokens=10, do_sample=False, assistant_model=make_target("llama", seed=4))
    assert torch.equal(plain, lookup) and torch.equal(plain, assistant)


def run_cli(capsys, *argv) -> tuple[int, str]:
    """``hf-dspark argv``: its exit status and its one line of stderr."""
    from hf_dspark.cli import main

    status = main([str(a) for a in argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-dspark: error: "), lines
    return status, lines[0]


@pytest.mark.parametrize("command", ["bench", "eval", "data", "calibrate", "bench-serve"])
def test_cli_refuses_prompt_files_without_prompts(tmp_path, capsys, command):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "empty.jsonl").write_text("\n\n")
    flag = "--data" if command == "eval" else "--prompts"
    output = [] if command in ("bench", "bench-serve") else ["--output", tmp_path / "out"]
    for prompts in (tmp_path / "prompts" / "empty.jsonl", tmp_path / "prompts"):
        status, line = run_cli(capsys, command, flag, prompts, *output)
        assert status == 2 and f"{flag}: no prompts in {prompts}" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["train", "features"])
def test_cli_refuses_data_folders_without_shards(tmp_path, capsys, command):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "shard-00000.tmp").write_text("{}\n")  # a shard a crash left unfinished
    status, line = run_cli(capsys, command, "--data", tmp_path / "empty", "--output", tmp_path / "out")
    assert status == 2 and "--data: no finished shards (shard-*.jsonl) in" in line
    status, line = run_cli(capsys, command, "--data", tmp_path / "missing", "--output", tmp_path / "out")
    assert status == 2 and f"--data: no such folder: {tmp_path / 'missing'}" in line


def test_cli_refuses_an_empty_held_out_set(tiny_targets, tmp_path, capsys):
    from tests.test_trainer import write_regenerated

    write_regenerated(tmp_path / "data", tiny_targets["llama"], n=2)
    (tmp_path / "heldout").mkdir()
    status, line = run_cli(capsys, "train", "--data", tmp_path / "data", "--eval-data", tmp_path / "heldout",
                           "--output", tmp_path / "out")
    assert status == 2 and "--eval-data: no finished shards" in line


@pytest.mark.parametrize("value", ["./no-drafter", "/no/such/drafter", "~/no-such-drafter", "runs/a/drafter",
                                   "runs/"])
def test_cli_says_a_missing_local_folder_is_missing(tmp_path, capsys, monkeypatch, value):
    """A value that can only be a local path names the missing folder instead of failing the Hub's repo-id check."""
    monkeypatch.chdir(tmp_path)  # relative values resolve in an empty folder (a checkout may hold runs/)
    for argv in (["generate", "--drafter", value], ["bench", "--prompts", "p.jsonl", "--drafter", value],
                 ["generate", "--target", value], ["train", "--data", "d", "--output", "o", "--init-drafter", value]):
        status, line = run_cli(capsys, *argv)
        assert status == 2 and line.endswith(f"no such folder: {value}"), line
        assert "--" + argv[-2].lstrip("-") + ": " in line


def test_hub_repo_ids_are_not_local_paths():
    from hf_dspark.cli.common import looks_like_path

    assert not any(map(looks_like_path, ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "smollm2"]))
    assert all(map(looks_like_path, [".", "./d", "../d", "/d", "~/d", "a/b/c", "a/"]))
