"""Trainer: learns, checkpoints, and resumes exactly after an interruption."""

import json
import sys

import pytest
import torch

from hf_dspark import DSparkDrafter
from hf_dspark.training.checkpoints import INIT_CARD
from hf_dspark.training.losses import leading_matches
from hf_dspark.training.trainer import DSparkTrainer, TrainingArguments, collate
from tests.helpers import random_prompts, target_greedy_sequences


def write_regenerated(folder, target, n=24, ids="x", seed=3):
    folder.mkdir(parents=True)
    sequences, prompt_len = target_greedy_sequences(target, random_prompts(n, 6, target.config.vocab_size, seed), 24)
    with open(folder / "shard-00000.jsonl", "w") as f:
        for i, row in enumerate(sequences.tolist()):
            f.write(json.dumps({"id": ids if ids == "x" else f"{ids}-{i}", "domain": "chat", "set": "t", "turn": 0,
                                "prompt_ids": row[:prompt_len], "response_ids": row[prompt_len:]}) + "\n")


def make_args(tmp_path, out, **kw):
    base = dict(output_dir=str(tmp_path / out), data_dirs=[str(tmp_path / "data")], block_size=4,
                num_hidden_layers=1, markov_rank=16, target_layer_ids=[0, 2], max_steps=6, learning_rate=3e-3,
                batch_size=4, num_anchors=8, save_every=3, log_every=1)
    base.update(kw)
    return TrainingArguments(**base)


def test_training_reduces_loss_and_resumes_exactly(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target)
    straight = DSparkTrainer(make_args(tmp_path, "straight"), target=target).train(progress=False)
    log = [json.loads(line) for line in open(tmp_path / "straight" / "train_log.jsonl")]
    assert len(log) == 6 and log[-1]["loss"] < log[0]["loss"]

    # Interrupted run: stop after 3 steps (a checkpoint), then a fresh trainer resumes to 6.
    interrupted = DSparkTrainer(make_args(tmp_path, "resumed"), target=target)
    interrupted.train(progress=False, stop_at_step=3)
    assert interrupted.elapsed_before > 0  # its time so far, for a later train() call on the same object
    assert interrupted._elapsed() == interrupted.elapsed_before  # the clock stops when train() returns
    resumed = DSparkTrainer(make_args(tmp_path, "resumed"), target=target)
    assert resumed.step == 3
    # the training time of the interrupted session carries over: logs (and model cards) count the whole run
    first_session = json.loads((tmp_path / "resumed" / "checkpoint-last" / "trainer_state.json").read_text())
    assert first_session["elapsed_s"] > 0 and resumed.elapsed_before == first_session["elapsed_s"]
    resumed.train(progress=False)
    elapsed = [json.loads(line)["elapsed_s"] for line in open(tmp_path / "resumed" / "train_log.jsonl")]
    assert len(elapsed) == 6 and elapsed == sorted(elapsed) and elapsed[3] > first_session["elapsed_s"]
    a = DSparkDrafter.from_pretrained(tmp_path / "straight" / "drafter")
    b = DSparkDrafter.from_pretrained(tmp_path / "resumed" / "drafter")
    for name, tensor in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[name], tensor, atol=1e-6, rtol=1e-5, msg=name)


def test_resume_refuses_changed_settings(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8)
    DSparkTrainer(make_args(tmp_path, "run", max_steps=3), target=target).train(progress=False)
    import pytest

    with pytest.raises(ValueError, match="block_size=4"):
        DSparkTrainer(make_args(tmp_path, "run", max_steps=3, block_size=5), target=target)


def test_draft_vocabulary_from_data(tiny_targets, tmp_path):
    target = tiny_targets["qwen3"]
    write_regenerated(tmp_path / "data", target, n=8)
    trainer = DSparkTrainer(make_args(tmp_path, "dv", max_steps=2, draft_vocab_size=20), target=target)
    assert trainer.drafter.draft_vocab.numel() == 20 and 0 < trainer.draft_vocab_coverage <= 1
    trainer.train(progress=False)
    reloaded = DSparkDrafter.from_pretrained(tmp_path / "dv" / "drafter")
    assert torch.equal(reloaded.draft_vocab, trainer.drafter.draft_vocab)


def test_cached_features_match_online(tiny_targets, tmp_path):
    from hf_dspark.training.features import cache_features

    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8)
    cache_features(target, [str(tmp_path / "data" / "shard-00000.jsonl")], tmp_path / "feat", [0, 2], 512,
                   dtype=torch.float32, progress=False)
    online = DSparkTrainer(make_args(tmp_path, "online", max_steps=3), target=target)
    cached = DSparkTrainer(make_args(tmp_path, "cached", max_steps=3, features_dir=str(tmp_path / "feat")),
                           target=target)
    batch = online._next_batch()
    cached._next_batch()
    a, b = online._target_features(batch), cached._target_features(batch)
    n = int(batch["attention_mask"][0].sum())
    torch.testing.assert_close(a[0][0, :n], b[0][0, :n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1][0, :n], b[1][0, :n], atol=1e-5, rtol=1e-5)
    online.train(progress=False)
    cached.train(progress=False)
    x = DSparkDrafter.from_pretrained(tmp_path / "online" / "drafter").state_dict()
    y = DSparkDrafter.from_pretrained(tmp_path / "cached" / "drafter").state_dict()
    for name in x:
        torch.testing.assert_close(x[name], y[name], atol=1e-4, rtol=1e-4, msg=name)


def test_lora_fine_tuning_merges(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8)
    DSparkTrainer(make_args(tmp_path, "base", max_steps=2), target=target).train(progress=False)
    base = str(tmp_path / "base" / "drafter")
    trainer = DSparkTrainer(make_args(tmp_path, "lora", max_steps=4, init_drafter=base, lora=True, lora_rank=4),
                            target=target)
    trainable = [n for n, p in trainer.drafter.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train(progress=False, stop_at_step=2)
    resumed = DSparkTrainer(make_args(tmp_path, "lora", max_steps=4, init_drafter=base, lora=True, lora_rank=4),
                            target=target)
    assert resumed.step == 2
    resumed.train(progress=False)
    merged = DSparkDrafter.from_pretrained(tmp_path / "lora" / "drafter")
    original = DSparkDrafter.from_pretrained(base)
    assert set(merged.state_dict()) == set(original.state_dict())  # plain drafter after merge
    changed = [n for n in original.state_dict() if not torch.equal(original.state_dict()[n], merged.state_dict()[n])]
    assert any("q_proj" in n for n in changed) and not any("markov" in n for n in changed)
    assert (tmp_path / "lora" / "adapter" / "adapter_config.json").is_file()


def test_confidence_head_fine_tune_freezes_the_rest(tiny_targets, tmp_path):
    import pytest

    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8)
    DSparkTrainer(make_args(tmp_path, "base", max_steps=2), target=target).train(progress=False)
    base = DSparkDrafter.from_pretrained(tmp_path / "base" / "drafter")
    base.config.confidence_temperatures = [1.5] * base.config.block_size  # as if calibrated
    base.save_pretrained(tmp_path / "calibrated")
    args = make_args(tmp_path, "conf", max_steps=3, init_drafter=str(tmp_path / "calibrated"),
                     confidence_target="greedy", train_modules=["confidence_head"])
    trainer = DSparkTrainer(args, target=target)
    trainable = [n for n, p in trainer.drafter.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("confidence_head.") for n in trainable)
    trainer.train(progress=False)
    tuned = DSparkDrafter.from_pretrained(tmp_path / "conf" / "drafter")
    assert tuned.config.confidence_target == "greedy"
    assert not (tmp_path / "conf" / INIT_CARD).exists()  # the starting folder had no card to keep
    assert tuned.config.confidence_temperatures is None  # fitted to the old head: dropped
    changed = {n for n, t in base.state_dict().items() if not torch.equal(t, tuned.state_dict()[n])}
    assert changed and all(n.startswith("confidence_head.") for n in changed)

    # A start with a model card: the run keeps a copy from its start, which re-packaging that folder cannot change.
    (tmp_path / "calibrated" / "README.md").write_text("# start\n\n## Training\n\n- Budget: 2 steps.\n")
    DSparkTrainer(make_args(tmp_path, "carded", max_steps=1, init_drafter=str(tmp_path / "calibrated")),
                  target=target).train(progress=False)
    (tmp_path / "calibrated" / "README.md").write_text("# repackaged\n")
    assert (tmp_path / "carded" / INIT_CARD).read_text() == "# start\n\n## Training\n\n- Budget: 2 steps.\n"

    # Training another module leaves the head's temperatures and label alone.
    other = DSparkTrainer(make_args(tmp_path, "markov", max_steps=1, init_drafter=str(tmp_path / "calibrated"),
                                    confidence_target="greedy", train_modules=["markov_head"]), target=target)
    assert other.drafter.config.confidence_temperatures == [1.5] * base.config.block_size
    assert other.drafter.config.confidence_target == "sampling"
    with pytest.raises(ValueError, match="no drafter module named"):
        DSparkTrainer(make_args(tmp_path, "bad", init_drafter=str(tmp_path / "calibrated"),
                                train_modules=["confidence"]), target=target)
    with pytest.raises(ValueError, match="resume with the same settings"):
        DSparkTrainer(make_args(tmp_path, "conf", max_steps=3, init_drafter=str(tmp_path / "calibrated"),
                                confidence_target="sampling", train_modules=["confidence_head"]), target=target)


def test_held_out_evaluation_logs_without_changing_training(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, ids="train")
    write_regenerated(tmp_path / "heldout", target, n=8, ids="heldout", seed=11)
    plain = DSparkTrainer(make_args(tmp_path, "plain"), target=target)
    plain.train(progress=False)
    evaluated = DSparkTrainer(make_args(tmp_path, "evaluated", eval_data_dirs=[str(tmp_path / "heldout")],
                                       eval_every=3, eval_sequences=6), target=target)
    evaluated.train(progress=False)
    # Evaluating draws nothing from the training run's randomness: the weights come out the same.
    for name, tensor in plain._unwrapped.state_dict().items():
        torch.testing.assert_close(evaluated._unwrapped.state_dict()[name], tensor, msg=name)
    log = [json.loads(line) for line in open(tmp_path / "evaluated" / "eval_log.jsonl")]
    assert [row["step"] for row in log] == [0, 3, 6]
    for row in log:
        assert row["eval_sequences"] == 6 and row["eval_blocks"] > 0
        assert 1.0 <= row["eval_accepted_length"] <= 1.0 + 4
        assert len(row["eval_position_match"]) == 4
        assert all(0.0 <= p <= 1.0 for p in row["eval_position_match"])
        assert {"eval_loss", "eval_ce", "eval_tv", "eval_confidence", "eval_accuracy"} <= set(row)
    assert log[-1]["eval_loss"] < log[0]["eval_loss"]  # training on the target's outputs helps on new prompts too
    # The same drafter evaluated twice gives the same numbers (fixed sample, fixed anchors).
    again = evaluated.evaluate()
    assert again["eval_accepted_length"] == log[-1]["eval_accepted_length"]
    assert again["eval_loss"] == pytest.approx(log[-1]["eval_loss"], rel=1e-6)


def test_held_out_evaluation_refuses_training_prompts(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8, ids="same")
    write_regenerated(tmp_path / "heldout", target, n=8, ids="same", seed=11)
    with pytest.raises(ValueError, match="shares 8 prompts with the training data"):
        DSparkTrainer(make_args(tmp_path, "run", eval_data_dirs=[str(tmp_path / "heldout")]), target=target)


def test_leading_matches_counts_whole_blocks_only():
    matches = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    valid = torch.ones_like(matches)
    valid[3, 3] = False  # cut short by the end of the response: left out
    assert leading_matches(matches, valid).tolist() == [2, 0, 4]


def test_layers_start_from_target_layers(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8)
    last = target.config.num_hidden_layers - 1
    trainer = DSparkTrainer(make_args(tmp_path, "init", max_steps=1, init_layers_from_target=[last]), target=target)
    source = target.model.layers[last].state_dict()
    layer = trainer._unwrapped.layers[0]
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"):
        torch.testing.assert_close(layer.state_dict()[name], source[name].float(), msg=name)
    assert torch.equal(layer.self_attn.q_norm.weight, torch.ones_like(layer.self_attn.q_norm.weight))  # its own
    fresh = DSparkTrainer(make_args(tmp_path, "fresh", max_steps=1), target=target)._unwrapped.layers[0]
    assert not torch.equal(fresh.mlp.up_proj.weight, layer.mlp.up_proj.weight)

    with pytest.raises(ValueError, match="one target layer per drafter layer"):
        DSparkTrainer(make_args(tmp_path, "two", init_layers_from_target=[0, 1]), target=target)
    with pytest.raises(ValueError, match=f"target layer {last + 1} does not exist"):
        DSparkTrainer(make_args(tmp_path, "range", init_layers_from_target=[last + 1]), target=target)
    trainer._unwrapped.save_pretrained(tmp_path / "saved")
    with pytest.raises(ValueError, match="cannot be combined with init_drafter"):
        DSparkTrainer(make_args(tmp_path, "both", init_drafter=str(tmp_path / "saved"),
                                init_layers_from_target=[last]), target=target)


def test_feature_cache_keeps_data_folders_apart(tiny_targets, tmp_path):
    """Two data folders each have a shard-00000.jsonl: one features folder serves each its own features, a
    features file of other data is refused, and a pre-digest file is read and adopted."""
    import os

    from hf_dspark.training.features import FeatureStore, _legacy_name, cache_features, features_name

    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "a", target, n=6, ids="a", seed=3)
    write_regenerated(tmp_path / "b", target, n=5, ids="b", seed=7)
    shards = [str(tmp_path / "a" / "shard-00000.jsonl"), str(tmp_path / "b" / "shard-00000.jsonl")]
    summary = cache_features(target, shards, tmp_path / "feat", [0, 2], 512, dtype=torch.float32, progress=False)
    assert summary["written"] == 2
    store = FeatureStore(tmp_path / "feat", shards, [0, 2], 512)
    trainer = DSparkTrainer(make_args(tmp_path, "online", data_dirs=[str(tmp_path / "a"), str(tmp_path / "b")],
                                      max_steps=1), target=target)
    assert len(store) == len(trainer.sequences) == 11
    for i in (0, 6, 10):  # sequences of both folders
        batch = collate([trainer.sequences[i]], 0)
        hidden, last = trainer._online_features(batch)
        stored_hidden, stored_last = store.sequence(i)[:2]
        torch.testing.assert_close(stored_hidden, hidden[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stored_last, last[0], atol=1e-5, rtol=1e-5)

    # Features of other data under this shard's name are refused, not served.
    feat = tmp_path / "feat"
    os.replace(feat / features_name(shards[1]), feat / "keep.safetensors")
    os.replace(feat / features_name(shards[0]), feat / _legacy_name(shards[1]))
    with pytest.raises(ValueError, match="do not match data shard"):
        FeatureStore(feat, shards[1:], [0, 2], 512)
    # A pre-digest file of the right shard is read, and cache_features adopts it instead of recomputing.
    os.replace(feat / _legacy_name(shards[1]), feat / features_name(shards[0]))
    os.replace(feat / "keep.safetensors", feat / _legacy_name(shards[1]))
    FeatureStore(feat, shards, [0, 2], 512)
    assert cache_features(target, shards, feat, [0, 2], 512, dtype=torch.float32, progress=False)["written"] == 0
    assert (feat / features_name(shards[1])).is_file() and not (feat / _legacy_name(shards[1])).exists()


@pytest.mark.parametrize("draft_vocab_size", [None, 24])
def test_fast_target_path_computes_the_reference_losses(tiny_targets, tmp_path, draft_vocab_size):
    """The training step's target view (distinct positions, chunked; or a cached log-normaliser with the draft
    vocabulary's LM-head rows only), its blockwise attention (``BlockLayout``) and its compiled form (decoder layers,
    loss terms, target normalisation) give the losses and gradients of full-vocabulary target logits per block
    position under the dense block mask, to float32 tolerance."""
    from hf_dspark.training.losses import drafter_training_step, log_normalizer_and_argmax

    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8)
    trainer = DSparkTrainer(make_args(tmp_path, "run", draft_vocab_size=draft_vocab_size), target=target)
    drafter = trainer.drafter
    batch = trainer._next_batch()
    hidden, last = trainer._online_features(batch)
    lse, argmax = log_normalizer_and_argmax(last.flatten(0, 1), target.get_output_embeddings().weight)
    results = {}
    cached = {"target_lse": lse.view(last.shape[:2]), "target_argmax": argmax.view(last.shape[:2])}
    for mode, extra in {"reference": {"reference_target": True, "dense_attention": True}, "fast": {},
                        "cached": cached, "compiled": {"compiled": True, **cached}}.items():
        if mode == "compiled":
            for layer in drafter.layers:  # as the trainer's torch_compile does
                layer.compile()
        drafter.zero_grad()
        out = drafter_training_step(drafter, hidden, last, batch["input_ids"], batch["loss_mask"], num_anchors=8,
                                    generator=torch.Generator().manual_seed(5), **extra)
        out["loss"].backward()
        results[mode] = out, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    reference, reference_grads = results["reference"]
    for mode in ("fast", "cached", "compiled"):
        out, grads = results[mode]
        for key in ("loss", "ce", "tv", "confidence", "accuracy"):
            torch.testing.assert_close(out[key], reference[key], atol=1e-5, rtol=1e-5, msg=f"{mode} {key}")
        assert torch.equal(out["greedy_matches"], reference["greedy_matches"])
        for name, grad in reference_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=f"{mode} {name}")


def test_torch_compile_compiles_the_decoder_layers_and_uses_fused_adamw(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=4)
    plain = DSparkTrainer(make_args(tmp_path, "plain"), target=target)
    assert all(layer._compiled_call_impl is None for layer in plain.drafter.layers)
    assert not plain.loss_module.compiled
    compiled = DSparkTrainer(make_args(tmp_path, "compiled", torch_compile=True), target=target)
    assert all(layer._compiled_call_impl is not None for layer in compiled.drafter.layers)
    assert compiled.loss_module.compiled
    for trainer in (plain, compiled):
        assert trainer.optimizer.optimizer.defaults["fused"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_applies_on_glibc():
    from hf_dspark.allocator import keep_freed_memory

    assert keep_freed_memory()
    assert torch.ones(16 << 20).sum() == 16 << 20  # a 64 MB tensor still allocates and frees


def test_features_cache_stores_the_log_normalizer_and_training_uses_it(tiny_targets, tmp_path, monkeypatch):
    from hf_dspark.training import losses
    from hf_dspark.training.features import FeatureStore, cache_features

    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8)
    shards = [str(tmp_path / "data" / "shard-00000.jsonl")]
    cache_features(target, shards, tmp_path / "feat", [0, 2], 512, dtype=torch.float32, progress=False)
    store = FeatureStore(tmp_path / "feat", shards, [0, 2], 512)
    assert store.has_log_normalizer
    weight = target.get_output_embeddings().weight
    _, last, lse, argmax = store.sequence(0)
    logits = last @ weight.T
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    assert torch.equal(argmax.long(), logits.argmax(-1))

    seen = []
    original = losses.target_view
    monkeypatch.setattr(losses, "target_view", lambda *a, **k: seen.append(a[3] is not None) or original(*a, **k))
    trainer = DSparkTrainer(make_args(tmp_path, "cached", max_steps=2, draft_vocab_size=24,
                                      features_dir=str(tmp_path / "feat")), target=target)
    trainer.train(progress=False)
    assert seen == [True, True]  # each step read the cached log-normaliser


def test_training_log_reports_throughput_and_time_split(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8)
    DSparkTrainer(make_args(tmp_path, "run", max_steps=2), target=target).train(progress=False)
    for entry in map(json.loads, open(tmp_path / "run" / "train_log.jsonl")):
        assert entry["blocks_per_s"] > 0
        shares = [entry[f"time_{phase}"] for phase in ("target", "drafter", "optimizer")]
        assert all(0 < s < 1 for s in shares) and abs(sum(shares) - 1) < 1e-9


def test_mixed_precision_auto_follows_the_hardware(monkeypatch):
    from hf_dspark.training import trainer as module

    assert module.resolve_mixed_precision("no", "cpu") == "no"
    assert module.resolve_mixed_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="mixed_precision"):
        module.resolve_mixed_precision("fp8", "cpu")
    for flags, expected in ((["avx2", "fma"], "no"), (["avx512f", "avx512_bf16"], "bf16"), (["amx_bf16"], "bf16")):
        monkeypatch.setattr(module, "cpu_flags", lambda flags=flags: flags)
        assert module.resolve_mixed_precision("auto", "cpu") == expected


def test_grown_drafter_starts_as_the_same_function_and_trains(tiny_targets, tmp_path):
    from hf_dspark.training.losses import drafter_training_step

    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "data", target, n=8)
    DSparkTrainer(make_args(tmp_path, "base", max_steps=2), target=target).train(progress=False)
    base = tmp_path / "base" / "drafter"
    grown = DSparkTrainer(make_args(tmp_path, "grown", max_steps=2, init_drafter=str(base), add_layers=1),
                          target=target)
    assert len(grown.drafter.layers) == grown.drafter.config.num_hidden_layers == 2
    original = DSparkDrafter.from_pretrained(base)
    original.attach_target(target)
    batch = grown._next_batch()
    hidden, last = grown._online_features(batch)
    outs = [drafter_training_step(d, hidden, last, batch["input_ids"], batch["loss_mask"], num_anchors=8,
                                  generator=torch.Generator().manual_seed(2)) for d in (original, grown.drafter)]
    for key in ("loss", "ce", "tv", "confidence"):
        torch.testing.assert_close(outs[1][key], outs[0][key], msg=key)
    grown.train(progress=False)
    saved = DSparkDrafter.from_pretrained(tmp_path / "grown" / "drafter")
    assert saved.config.num_hidden_layers == 2
    assert float(saved.layers[1].self_attn.o_proj.weight.detach().abs().sum()) > 0  # the new layer learned
    with pytest.raises(ValueError, match="init_drafter"):
        DSparkTrainer(make_args(tmp_path, "fresh", add_layers=1), target=target)
