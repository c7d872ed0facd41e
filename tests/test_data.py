"""Regeneration data job: sharded, resumable, split across workers, settings pinned."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from hf_dspark.training.data import RegenerationSettings, iter_regenerated, regenerate
from tests.helpers import make_target, require_smollm2


@pytest.fixture(scope="module")
def chat_tokenizer():
    require_smollm2()
    from hf_dspark.target import smollm2_folder

    return AutoTokenizer.from_pretrained(smollm2_folder())


@pytest.fixture
def target(chat_tokenizer):
    """A tiny random llama over the chat tokenizer's vocabulary, stopping at its end-of-turn token."""
    model = make_target("llama", vocab_size=len(chat_tokenizer))
    model.generation_config.eos_token_id = chat_tokenizer.eos_token_id
    return model


def write_prompts(path, n):
    with open(path, "w") as f:
        for i in range(n):
            turns = [f"Say hello {i}"] + ([f"And again {i}"] if i % 3 == 0 else [])
            f.write(json.dumps({"id": f"p{i}", "domain": "chat", "turns": turns}) + "\n")


def test_regeneration_shards_workers_and_resume(target, chat_tokenizer, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 7)
    settings = RegenerationSettings(prompt_paths=[str(tmp_path / "p.jsonl")], shard_size=2, batch_size=2,
                                    max_new_tokens=3)
    out = tmp_path / "regen"
    for worker in (0, 1):
        regenerate(target, chat_tokenizer, out, settings, progress=False, worker_index=worker, num_workers=2)
    shards = sorted(p.name for p in out.glob("shard-*.jsonl"))
    assert shards == [f"shard-{i:05d}.jsonl" for i in range(4)]
    lines = list(iter_regenerated(out))
    assert sorted({l["id"] for l in lines}) == sorted(f"p{i}" for i in range(7))
    assert len(lines) == 7 + 3  # multi-turn prompts (0, 3, 6) give a line per turn
    second = next(l for l in lines if l["id"] == "p3" and l["turn"] == 1)
    first = next(l for l in lines if l["id"] == "p3" and l["turn"] == 0)
    assert second["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]  # earlier turn in context
    assert all(0 < len(l["response_ids"]) <= 3 for l in lines)
    # Resume: finished shards are not redone; a lost shard is.
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.jsonl")}
    lost = (out / "shard-00002.jsonl").read_text().count("\n")
    (out / "shard-00002.jsonl").unlink()
    summary = regenerate(target, chat_tokenizer, out, settings, progress=False)
    assert summary["new_sequences"] == lost and (out / "shard-00002.jsonl").exists()
    assert all(mtimes[n] == (out / n).stat().st_mtime_ns for n in mtimes if n != "shard-00002.jsonl")
    changed = RegenerationSettings(**{**settings.__dict__, "max_new_tokens": 5})
    with pytest.raises(ValueError, match="different settings"):
        regenerate(target, chat_tokenizer, out, changed, progress=False)


def test_regeneration_excludes_prompts_and_pins_the_excluded_ids(target, chat_tokenizer, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 9)
    with open(tmp_path / "q.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"id": f"q{i}", "domain": "math", "turns": [f"Add {i}"]}) + "\n")
    ids = tmp_path / "calibration_ids.txt"
    ids.write_text("p1\np2\n")
    first = tmp_path / "first"
    regenerate(target, chat_tokenizer, first, RegenerationSettings(
        prompt_paths=[str(tmp_path / "p.jsonl")], shard_size=4, batch_size=4, max_new_tokens=2, max_prompts=3,
        exclude=[str(ids)]), progress=False)
    used_first = {l["id"] for l in iter_regenerated(first)}
    assert len(used_first) == 3 and not used_first & {"p1", "p2"}

    # Balanced over the two prompt files, skipping what the first folder used and the calibration ids.
    settings = RegenerationSettings(prompt_paths=[str(tmp_path / "p.jsonl"), str(tmp_path / "q.jsonl")],
                                    shard_size=2, batch_size=2, max_new_tokens=2, max_prompts=6,
                                    exclude=[str(first), str(ids)], sampling="balanced")
    second = tmp_path / "second"
    regenerate(target, chat_tokenizer, second, settings, progress=False)
    used = {l["id"] for l in iter_regenerated(second)}
    assert len(used) == 6 and not used & (used_first | {"p1", "p2"})
    assert sum(i.startswith("q") for i in used) == 3  # balanced: 3 + 3, though p has 4 usable prompts
    assert json.loads((second / "manifest.json").read_text())["settings"]["sampling"] == "balanced"

    # Resuming after the exclusion lists changed would pick other prompts: refused.
    (second / "shard-00002.jsonl").unlink()
    ids.write_text(f"p1\np2\n{sorted(used)[0]}\n")
    with pytest.raises(ValueError, match="different set of excluded prompt ids"):
        regenerate(target, chat_tokenizer, second, settings, progress=False)
    ids.write_text("p1\np2\n")
    assert regenerate(target, chat_tokenizer, second, settings, progress=False)["shards"] == 3


def test_folders_from_before_exclude_and_sampling_still_resume(target, chat_tokenizer, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 4)
    settings = RegenerationSettings(prompt_paths=[str(tmp_path / "p.jsonl")], shard_size=2, batch_size=2,
                                    max_new_tokens=2)
    out = tmp_path / "regen"
    regenerate(target, chat_tokenizer, out, settings, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["settings"]["exclude"], manifest["settings"]["sampling"]  # as an older hf-dspark wrote it
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "shard-00001.jsonl").unlink()
    assert regenerate(target, chat_tokenizer, out, settings, progress=False)["new_sequences"] > 0
    balanced = RegenerationSettings(**{**settings.__dict__, "sampling": "balanced"})
    with pytest.raises(ValueError, match="different settings"):
        regenerate(target, chat_tokenizer, out, balanced, progress=False)
