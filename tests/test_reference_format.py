"""Parity with the public reference implementation and checkpoint-format round trips."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from hf_dspark import DSparkConfig, DSparkDrafter
from hf_dspark.hub import export_reference_format
from tests.helpers import FIXTURE, make_drafter, random_prompts



@pytest.fixture(scope="module")
def reference():
    assert FIXTURE.is_dir(), f"reference fixture not found at {FIXTURE}: set HF_DSPARK_SHARED to the shared folder"
    target = AutoModelForCausalLM.from_pretrained(FIXTURE / "target").eval()
    drafter = DSparkDrafter.from_pretrained(FIXTURE / "drafter").eval()
    return target, drafter, load_file(FIXTURE / "reference_step.safetensors")


def close(actual, expected):
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-5, rtol=1e-5)


def test_reference_config_is_read(reference):
    _, drafter, _ = reference
    c = drafter.config
    assert (c.sequential_head, c.markov_rank, c.block_size, c.mask_token_id) == ("markov", 16, 4, 999)
    assert c.target_layer_ids == [0, 2] and c.confidence_head_with_markov and c.enable_confidence_head
    assert drafter.embed_tokens is not None and drafter.lm_head is not None  # the folder's own copies


def test_two_rounds_match_reference(reference):
    target, drafter, ref = reference
    drafter.attach_target(target)
    with torch.no_grad():
        out = target(ref["prompt_ids"], output_hidden_states=drafter.target_hidden_states_indices())
    features = drafter.gather_target_hidden(out.hidden_states, drafter.config.target_layer_ids)
    close(features, ref["context_features"])
    assert out.logits[0, -1].argmax().item() == ref["anchor_id"].item()

    cache = drafter.new_context_cache()
    draft = drafter.draft(ref["anchor_id"], 10, features, cache)
    close(draft.hidden_states, ref["block_hidden"])
    close(draft.base_logits, ref["base_logits"])
    close(draft.draft_logits, ref["corrected_logits"])
    close(draft.confidence_logits, ref["confidence_logits"])
    assert torch.equal(draft.draft_ids, ref["greedy_draft_ids"])
    forced = drafter.sequential_logits(draft.base_logits, draft.hidden_states, ref["forced_prev_ids"])
    close(forced, ref["forced_block_logits"])

    # Round 2: the target verified [anchor, d0, d1]; their features extend the cached context.
    with torch.no_grad():
        out2 = target(torch.cat([ref["prompt_ids"], ref["round2_verified_ids"]], dim=1), output_hidden_states=True)
    features2 = drafter.gather_target_hidden(out2.hidden_states, drafter.config.target_layer_ids)[:, 10:]
    close(features2, ref["round2_context_features"])
    draft2 = drafter.draft(ref["round2_anchor_id"], 13, features2, cache)
    assert cache.length == 13
    close(draft2.base_logits, ref["round2_base_logits"])
    close(draft2.draft_logits, ref["round2_corrected_logits"])
    assert torch.equal(draft2.draft_ids, ref["round2_greedy_draft_ids"])


def test_reference_drafter_generates_losslessly(reference):
    target, drafter, ref = reference
    prompt = ref["prompt_ids"]
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    assisted = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert torch.equal(plain, assisted)


def test_export_reference_round_trip(reference, tmp_path):
    target, drafter, ref = reference
    folder = export_reference_format(drafter, tmp_path / "ref")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    for key in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
                "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "target_hidden_size"):
        assert key in config, key
    assert config["sample_from_anchor"] is True
    assert config["dflash_config"] == {"mask_token_id": 999, "target_layer_ids": [0, 2], "block_size": 4}
    assert config["markov_head_type"] == "vanilla"
    exported = load_file(folder / "model.safetensors")
    original = load_file(FIXTURE / "drafter" / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert "confidence_head.proj.bias" in exported
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    again = DSparkDrafter.from_pretrained(folder).eval()
    draft = again.draft(ref["anchor_id"], 10, ref["context_features"], again.new_context_cache())
    close(draft.draft_logits, ref["corrected_logits"])


@pytest.mark.parametrize("head", ["none", "markov", "gated", "rnn"])
def test_hf_format_round_trip(tiny_targets, head, tmp_path):
    target = tiny_targets["qwen3"]
    drafter = make_drafter(target, head=head, block_size=4, with_markov=head != "none")
    drafter.generation_config.verification_policy = "threshold"
    drafter.generation_config.confidence_threshold = 0.3
    drafter.save_pretrained(tmp_path / "d")
    files = {p.name for p in (tmp_path / "d").rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "configuration_dspark.py", "modeling_dspark.py", "generate.py",
            "scheduling.py", "requirements.txt", "generation_config.json"} <= files
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["model_type"] == "dspark"
    assert config["auto_map"] == {"AutoConfig": "configuration_dspark.DSparkConfig",
                                  "AutoModel": "modeling_dspark.DSparkDrafter"}
    weights = load_file(tmp_path / "d" / "model.safetensors")
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in weights), "target weights must not be saved"
    loaded = DSparkDrafter.from_pretrained(tmp_path / "d").eval().attach_target(target)
    assert loaded.generation_config.verification_policy == "threshold"
    assert loaded.generation_config.confidence_threshold == 0.3
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    auto = AutoModel.from_pretrained(tmp_path / "d")
    assert isinstance(auto, DSparkDrafter)
    assert isinstance(AutoConfig.from_pretrained(tmp_path / "d"), DSparkConfig)
    # Reference export of every head type reloads to the same outputs.
    ref_folder = export_reference_format(drafter, tmp_path / "ref")
    reloaded = DSparkDrafter.from_pretrained(ref_folder).eval()
    assert reloaded.config.sequential_head == head
    prompt = random_prompts(1, 6, target.config.vocab_size)[0]
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    features = drafter.gather_target_hidden(hidden, drafter.config.target_layer_ids)
    a = drafter.draft(prompt[:, -1], 6, features)
    b = reloaded.draft(prompt[:, -1], 6, features)
    torch.testing.assert_close(a.draft_logits, b.draft_logits)
    if a.confidence_logits is not None:
        torch.testing.assert_close(a.confidence_logits, b.confidence_logits)


def test_shared_modules_are_not_copied(tiny_targets):
    target = tiny_targets["llama"]
    drafter = make_drafter(target)
    assert drafter.embed_tokens is target.get_input_embeddings()
    assert drafter.lm_head is target.get_output_embeddings()
    names = [n for n, _ in drafter.named_parameters()]
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in drafter.parameters())


def test_draft_vocabulary_reference_round_trip(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    drafter = make_drafter(target, head="markov", block_size=4, draft_vocab_size=32)
    drafter.set_draft_vocab(torch.arange(5, 37))
    folder = export_reference_format(drafter, tmp_path / "ref")
    tensors = load_file(folder / "model.safetensors")
    assert torch.equal(tensors["d2t"], torch.full((32,), 5))
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == 32
    again = DSparkDrafter.from_pretrained(folder).eval()
    assert torch.equal(again.draft_vocab, drafter.draft_vocab)
    prompt = random_prompts(1, 6, target.config.vocab_size)[0]
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    features = drafter.gather_target_hidden(hidden, drafter.config.target_layer_ids)
    torch.testing.assert_close(drafter.draft(prompt[:, -1], 6, features).draft_logits,
                               again.draft(prompt[:, -1], 6, features).draft_logits)
