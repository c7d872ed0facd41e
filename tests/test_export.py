"""Serving-engine export (``hf_dspark.export``, ``hf-dspark export``): layouts re-loaded and checked per engine.

The expected tensor names per engine restate what each engine's loader maps (see the ``hf_dspark.export``
docstring); vLLM's own model class is exercised by the opt-in ``tests/test_vllm_optin.py``.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_dspark import DSparkDrafter
from hf_dspark.cli import main
from hf_dspark.export import export_for_engine, read_sps, read_sts
from hf_dspark.scheduling import StepsPerSecond
from tests.helpers import make_drafter, random_prompts

SPS = StepsPerSecond([1, 2, 4, 8], [40.0, 38.0, 30.0, 18.0], 8)


def calibrated(drafter, temperatures=None):
    drafter.config.confidence_temperatures = temperatures or [0.5 + 0.25 * k for k in range(drafter.config.block_size)]
    return drafter


def sts_file(tmp_path, drafter, **extra):
    payload = {"temperatures": list(drafter.config.confidence_temperatures), "dataset": "gsm8k", "num_samples": 40,
               "ece_before": 0.12, "ece_after": 0.03,
               "ece_before_per_position": [0.1] * drafter.config.block_size,
               "ece_after_per_position": [0.02] * drafter.config.block_size, **extra}
    path = tmp_path / "sts.json"
    path.write_text(json.dumps(payload))
    return path


def drafts(a: DSparkDrafter, b: DSparkDrafter, target):
    prompt = random_prompts(1, 6, target.config.vocab_size, seed=2)[0]
    with torch.no_grad():
        hidden = target(prompt, output_hidden_states=True).hidden_states
    features = a.gather_target_hidden(hidden, a.config.target_layer_ids)
    return a.draft(prompt[:, -1], 6, features), b.draft(prompt[:, -1], 6, features)


def assert_same_weights(a, b) -> None:
    """Every tensor of the drafter ``a`` comes back bit for bit in ``b`` (same names, dtypes and values)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for name, tensor in sa.items():
        assert sb[name].dtype == tensor.dtype and torch.equal(sb[name], tensor), name


def sequential_names(drafter) -> set[str]:
    return {n for n in drafter.state_dict() if n.startswith("markov_head.")}


def backbone_names(config) -> set[str]:
    """The reference (DeepSpec) tensor names of the backbone: what SGLang's strict loader maps one by one."""
    names = {"embed_tokens.weight", "lm_head.weight", "fc.weight", "hidden_norm.weight", "norm.weight"}
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                 "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    return names | {f"layers.{i}.{p}.weight" for i in range(config.num_hidden_layers) for p in per_layer}


# ------------------------------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head,draft_vocab", [("markov", None), ("gated", None), ("rnn", None), ("none", None),
                                              ("markov", 40)])
def test_reference_export_reloads_to_identical_drafts(tiny_targets, tmp_path, head, draft_vocab):
    target = tiny_targets["qwen3"]
    drafter = calibrated(make_drafter(target, head=head, with_markov=head != "none", draft_vocab_size=draft_vocab))
    if draft_vocab:
        drafter.set_draft_vocab(torch.randperm(target.config.vocab_size)[:draft_vocab])
    result = export_for_engine(drafter, tmp_path / "ref", "reference", sps=SPS)
    assert result.files == ["config.json", "model.safetensors", "sts.json", "sps.json"]
    again = DSparkDrafter.from_pretrained(tmp_path / "ref").eval()
    assert again.config.confidence_temperatures == drafter.config.confidence_temperatures
    assert_same_weights(drafter, again)
    a, b = drafts(drafter, again, target)
    assert torch.equal(a.draft_ids, b.draft_ids)
    # Same weights, same code: equal up to float32 rounding (a reloaded tensor's memory alignment can pick another
    # SIMD kernel path on some CPUs, e.g. 1.2e-7 on an AMD EPYC).
    torch.testing.assert_close(a.draft_logits, b.draft_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(a.confidences, b.confidences, rtol=0, atol=1e-6)
    assert json.loads((tmp_path / "ref" / "sts.json").read_text()) == {
        "temperatures": drafter.config.confidence_temperatures}
    assert json.loads((tmp_path / "ref" / "sps.json").read_text()) == SPS.to_dict()


def test_reference_export_in_bfloat16_keeps_names_and_casts(tiny_targets, tmp_path):
    drafter = make_drafter(tiny_targets["llama"])
    export_for_engine(drafter, tmp_path / "ref", "reference", dtype=torch.bfloat16)
    tensors = load_file(tmp_path / "ref" / "model.safetensors")
    assert set(tensors) == set(drafter.state_dict()) | {"embed_tokens.weight", "lm_head.weight"}
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "ref" / "config.json").read_text())["dtype"] == "bfloat16"


# ------------------------------------------------------------------------------------------------------------------
# vLLM
# ------------------------------------------------------------------------------------------------------------------
def test_vllm_full_vocabulary_folder_is_the_reference_layout(tiny_targets, tmp_path):
    target = tiny_targets["qwen3"]
    drafter = make_drafter(target)
    result = export_for_engine(drafter, tmp_path / "v", "vllm")
    assert result.files == ["config.json", "model.safetensors"]
    assert '"method": "dspark"' in result.launch and '"num_speculative_tokens": 4' in result.launch
    tensors = load_file(tmp_path / "v" / "model.safetensors")
    assert set(tensors) == set(drafter.state_dict()) | {"embed_tokens.weight", "lm_head.weight"}
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_head_type"] == "vanilla"
    assert config["dflash_config"]["target_layer_ids"] == [0, 2] and config["sample_from_anchor"] is True
    again = DSparkDrafter.from_pretrained(tmp_path / "v").eval()
    assert_same_weights(drafter, again)
    a, b = drafts(drafter, again, target)
    assert torch.equal(a.draft_ids, b.draft_ids)
    torch.testing.assert_close(a.draft_logits, b.draft_logits, rtol=0, atol=1e-6)


def test_vllm_draft_vocabulary_ships_draft_rows_and_d2t(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    drafter = make_drafter(target, draft_vocab_size=40)
    vocab = torch.randperm(target.config.vocab_size)[:40]
    drafter.set_draft_vocab(vocab)
    export_for_engine(drafter, tmp_path / "v", "vllm")
    tensors = load_file(tmp_path / "v" / "model.safetensors")
    # vLLM raises on names it does not know (our draft_vocab buffer) and sizes its LM head by draft_vocab_size.
    assert "draft_vocab" not in tensors
    assert set(tensors) == (set(drafter.state_dict()) - {"draft_vocab"}) | {"embed_tokens.weight", "lm_head.weight",
                                                                           "d2t"}
    assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight[vocab])
    assert tensors["markov_head.markov_w2.weight"].shape == (40, drafter.config.markov_rank)
    assert torch.equal(tensors["d2t"] + torch.arange(40), vocab)  # target id = draft id + d2t[draft id]
    assert json.loads((tmp_path / "v" / "config.json").read_text())["draft_vocab_size"] == 40


def test_vllm_ablation_without_sequential_head_gets_an_all_zero_markov_head(tiny_targets, tmp_path):
    drafter = make_drafter(tiny_targets["qwen3"], head="none", with_markov=False)
    result = export_for_engine(drafter, tmp_path / "v", "vllm")
    tensors = load_file(tmp_path / "v" / "model.safetensors")
    assert tensors["markov_head.markov_w1.weight"].shape == (128, 1)
    assert not tensors["markov_head.markov_w2.weight"].any() and not tensors["markov_head.markov_w1.weight"].any()
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert (config["markov_rank"], config["confidence_head_with_markov"]) == (1, False)
    assert any("rank-1" in note for note in result.notes)


def test_vllm_refuses_what_it_cannot_serve(tiny_targets, tmp_path):
    target = tiny_targets["qwen3"]
    with pytest.raises(ValueError, match="vanilla Markov head"):
        export_for_engine(make_drafter(target, head="gated"), tmp_path / "g", "vllm")
    with pytest.raises(ValueError, match="reads no calibration or SPS"):
        export_for_engine(make_drafter(target), tmp_path / "s", "vllm", sps=SPS)
    assert not (tmp_path / "g" / "model.safetensors").exists()


# ------------------------------------------------------------------------------------------------------------------
# SGLang
# ------------------------------------------------------------------------------------------------------------------
def test_sglang_layout_maps_one_to_one_and_writes_its_sts_and_sps(tiny_targets, tmp_path):
    target = tiny_targets["qwen3"]
    drafter = calibrated(make_drafter(target, num_hidden_layers=2))
    result = export_for_engine(drafter, tmp_path / "s", "sglang", sts=sts_file(tmp_path, drafter), sps=SPS)
    tensors = load_file(tmp_path / "s" / "model.safetensors")
    expected = backbone_names(drafter.config) | sequential_names(drafter) | {"confidence_head.proj.weight",
                                                                             "confidence_head.proj.bias"}
    assert set(tensors) == expected  # SGLang's loader raises on any other name and on any name missing
    sts = json.loads((tmp_path / "s" / "sts.json").read_text())
    # SGLang's DSparkStsCalibration: positive temperatures, str dataset, int num_samples, per-position float lists.
    assert sts == {"temperatures": drafter.config.confidence_temperatures, "dataset": "gsm8k", "num_samples": 40,
                   "ece_before": [0.1] * 4, "ece_after": [0.02] * 4}
    sps = json.loads((tmp_path / "s" / "sps.json").read_text())
    assert set(sps) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    assert sps["sample_batch_tokens"] == sorted(set(sps["sample_batch_tokens"]))
    assert all(isinstance(b, int) for b in sps["sample_batch_tokens"])
    assert sps["max_batch_tokens"] >= sps["sample_batch_tokens"][-1]
    for flag in ("--speculative-algorithm DSPARK", "--speculative-dspark-block-size 4",
                 f"--speculative-dspark-confidence-sts-path {tmp_path / 's' / 'sts.json'}",
                 f"--speculative-dspark-sps-table-path {tmp_path / 's' / 'sps.json'}"):
        assert flag in result.launch


def test_sglang_leaves_out_ece_lists_with_gaps(tiny_targets, tmp_path):
    drafter = calibrated(make_drafter(tiny_targets["qwen3"]))
    path = sts_file(tmp_path, drafter, ece_before_per_position=[0.1, None, 0.1, 0.1])
    export_for_engine(drafter, tmp_path / "s", "sglang", sts=path)
    assert set(json.loads((tmp_path / "s" / "sts.json").read_text())) == {"temperatures", "dataset", "num_samples"}


@pytest.mark.parametrize("settings,problem", [
    (dict(head="gated"), "vanilla Markov head"),
    (dict(head="none", with_markov=False), "vanilla Markov head"),
    (dict(draft_vocab_size=40), "draft-vocabulary"),
    (dict(with_markov=False), "confidence_head_with_markov"),
])
def test_sglang_refuses_what_its_loader_cannot_map(tiny_targets, tmp_path, settings, problem):
    with pytest.raises(ValueError, match=problem):
        export_for_engine(make_drafter(tiny_targets["qwen3"], **settings), tmp_path / "s", "sglang")


# ------------------------------------------------------------------------------------------------------------------
# TensorRT-LLM
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_trtllm_writes_reference_weights_sts_cost_table_and_options(tiny_targets, tmp_path, head):
    drafter = calibrated(make_drafter(tiny_targets["qwen3"], head=head))
    result = export_for_engine(drafter, tmp_path / "t", "trtllm", sps=SPS)
    assert result.files == ["config.json", "model.safetensors", "sts.json", "sps_cost_table.json",
                            "extra_llm_api_options.yaml"]
    tensors = load_file(tmp_path / "t" / "model.safetensors")
    assert set(tensors) == set(drafter.state_dict()) | {"embed_tokens.weight", "lm_head.weight"}
    sts = json.loads((tmp_path / "t" / "sts.json").read_text())
    assert sts["sts_temperatures"] == sts["temperatures"] == drafter.config.confidence_temperatures
    table = json.loads((tmp_path / "t" / "sps_cost_table.json").read_text())
    assert table["token_counts"] == [1, 2, 4, 8] and table["fixed_overhead_ms"] == 0.0
    assert table["step_time_ms"] == pytest.approx([25.0, 1000 / 38, 1000 / 30, 1000 / 18])
    options = (tmp_path / "t" / "extra_llm_api_options.yaml").read_text().splitlines()
    assert options[0] == "speculative_config:"
    assert '  decoding_type: "DSpark"' in options and "  block_size: 4" in options
    assert f'  markov_head_type: "{ {"markov": "vanilla", "rnn": "rnn"}[head] }"' in options
    assert "  target_layer_ids: [0, 2]" in options and "  mask_token_id: 1" in options


def test_trtllm_refuses_draft_vocabulary(tiny_targets, tmp_path):
    with pytest.raises(ValueError, match="full vocabulary"):
        export_for_engine(make_drafter(tiny_targets["qwen3"], draft_vocab_size=40), tmp_path / "t", "trtllm")


# ------------------------------------------------------------------------------------------------------------------
# Inputs and errors
# ------------------------------------------------------------------------------------------------------------------
def test_sts_and_sps_inputs_are_checked(tiny_targets, tmp_path):
    drafter = calibrated(make_drafter(tiny_targets["qwen3"]))
    with pytest.raises(FileNotFoundError):
        read_sts(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"temperatures": [1.0, -1.0]}))
    with pytest.raises(ValueError, match="positive"):
        read_sts(tmp_path / "bad.json")
    (tmp_path / "nokey.json").write_text(json.dumps({"dataset": "x"}))
    with pytest.raises(ValueError, match="temperatures"):
        read_sts(tmp_path / "nokey.json")
    with pytest.raises(ValueError, match="differ"):
        export_for_engine(drafter, tmp_path / "o", "reference", sts={"temperatures": [1.0] * 4})
    with pytest.raises(ValueError, match="block_size"):
        export_for_engine(drafter, tmp_path / "o", "reference", sts={"temperatures": [1.0] * 3})
    no_head = make_drafter(tiny_targets["qwen3"], confidence=False)
    with pytest.raises(ValueError, match="no confidence head"):
        export_for_engine(no_head, tmp_path / "o", "reference", sts={"temperatures": [1.0] * 4})
    (tmp_path / "cache.json").write_text(json.dumps({"key": {}, "profile": SPS.to_dict()}))
    assert read_sps(tmp_path / "cache.json").to_dict() == SPS.to_dict()
    (tmp_path / "dup.json").write_text(json.dumps({"sample_batch_tokens": [1, 1], "sample_steps_per_sec": [2, 2]}))
    with pytest.raises(ValueError, match="must not repeat"):
        read_sps(tmp_path / "dup.json")
    (tmp_path / "nosps.json").write_text(json.dumps({"sample_batch_tokens": [1]}))
    with pytest.raises(ValueError, match="sample_steps_per_sec"):
        read_sps(tmp_path / "nosps.json")
    with pytest.raises(ValueError, match="unknown engine"):
        export_for_engine(drafter, tmp_path / "o", "tgi")
    detached = DSparkDrafter(drafter.config)
    with pytest.raises(ValueError, match="attach_target"):
        export_for_engine(detached, tmp_path / "o", "vllm")


def test_calibration_given_for_an_uncalibrated_drafter_lands_in_the_config_too(tiny_targets, tmp_path):
    drafter = make_drafter(tiny_targets["qwen3"])
    export_for_engine(drafter, tmp_path / "t", "trtllm", sts={"temperatures": [2.0, 1.5, 1.0, 0.5]})
    again = DSparkDrafter.from_pretrained(tmp_path / "t")
    assert again.config.confidence_temperatures == [2.0, 1.5, 1.0, 0.5]
    assert drafter.config.confidence_temperatures is None  # the drafter itself is left alone


def test_cli_export_picks_up_the_calibration_next_to_the_drafter(tiny_targets, tmp_path, capsys):
    target = tiny_targets["qwen3"]
    target.save_pretrained(tmp_path / "target")
    drafter = calibrated(make_drafter(target))
    drafter.save_pretrained(tmp_path / "drafter")
    sts_file(tmp_path / "drafter", drafter)
    (tmp_path / "sps.json").write_text(json.dumps(SPS.to_dict()))
    args = ["export", "--drafter", str(tmp_path / "drafter"), "--target", str(tmp_path / "target"),
            "--dtype", "float32"]
    sps = ["--sps", str(tmp_path / "sps.json")]
    assert main(args + ["--engine", "sglang", "--output", str(tmp_path / "s")] + sps) == 0
    out = capsys.readouterr().out
    assert "--speculative-dspark-confidence-sts-path" in out and "serve: python -m sglang.launch_server" in out
    assert json.loads((tmp_path / "s" / "sts.json").read_text())["dataset"] == "gsm8k"
    again = DSparkDrafter.from_pretrained(tmp_path / "s").eval()
    a, b = drafts(drafter, again, target)
    torch.testing.assert_close(a.confidences, b.confidences, rtol=0, atol=0)
    assert main(args + ["--engine", "vllm", "--output", str(tmp_path / "v")]) == 0  # vLLM: the sts.json is not read
    assert not (tmp_path / "v" / "sts.json").exists()
    assert main(args + ["--engine", "vllm", "--output", str(tmp_path / "v2")] + sps) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-dspark:")]
    assert len(errors) == 1 and "reads no calibration or SPS file" in errors[0]


@pytest.mark.slow
def test_embedded_drafter_exports_for_vllm_and_is_refused_by_full_vocabulary_engines(tmp_path, capsys):
    from hf_dspark.defaults import embedded_drafter_path

    if embedded_drafter_path() is None:
        pytest.skip("no embedded drafter")
    assert main(["export", "--engine", "vllm", "--output", str(tmp_path / "v")]) == 0
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    tensors = load_file(tmp_path / "v" / "model.safetensors")
    assert tensors["lm_head.weight"].shape == (config["draft_vocab_size"], config["hidden_size"])
    assert tensors["d2t"].shape == (config["draft_vocab_size"],) and tensors["fc.weight"].dtype == torch.bfloat16
    assert main(["export", "--engine", "sglang", "--output", str(tmp_path / "s")]) == 1
    assert "draft-vocabulary" in capsys.readouterr().err
