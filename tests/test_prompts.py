"""Prompt selection: balanced / shuffled sampling and the ids other jobs already used."""

import json

import pytest

from hf_dspark.prompts import excluded_prompt_ids, sample_prompts

def test_sample_prompts_balanced_across_sets():
    records = [{"set": name, "id": f"{name}{i}"} for name, size in (("a", 10), ("b", 2), ("c", 5)) for i in range(size)]
    chosen = sample_prompts(records, 9, "balanced", seed=3)
    counts = {name: sum(r["set"] == name for r in chosen) for name in "abc"}
    assert counts == {"a": 4, "b": 2, "c": 3}
    assert len({r["id"] for r in chosen}) == 9
    assert sample_prompts(records, 9, "balanced", seed=3) == chosen  # reproducible
    shuffled = sample_prompts(records, 17, "shuffled", seed=0)
    assert sorted(r["id"] for r in shuffled) == sorted(r["id"] for r in records)
    with pytest.raises(ValueError, match="unknown sampling 'stratified'"):
        sample_prompts(records, 3, "stratified")
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        sample_prompts(records, 0)
    assert [r["id"] for r in sample_prompts(records, None, "shuffled", seed=0)] == [r["id"] for r in shuffled]


def test_excluded_prompt_ids_from_each_kind_of_source(tmp_path):
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("a1\n\nb2\n")
    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "shard-00000.jsonl").write_text(json.dumps({"id": "c3", "turn": 0}) + "\n"
                                             + json.dumps({"id": "c3", "turn": 1}) + "\n")
    (regen / "shard-00001.tmp").write_text(json.dumps({"id": "unfinished"}) + "\n")  # a shard in progress
    calibrated = tmp_path / "calibrated"
    calibrated.mkdir()
    (calibrated / "calibration_report.json").write_text(json.dumps({"prompt_ids": ["d4", "e5"]}))
    assert excluded_prompt_ids([ids_file, regen, calibrated]) == {"a1", "b2", "c3", "d4", "e5"}
    assert excluded_prompt_ids([]) == set()

    (calibrated / "calibration_report.json").write_text(json.dumps({"prompts": 2}))
    with pytest.raises(ValueError, match="does not list its prompt_ids"):
        excluded_prompt_ids([calibrated])
    with pytest.raises(ValueError, match="neither regenerated data"):
        excluded_prompt_ids([tmp_path])
    with pytest.raises(FileNotFoundError, match="exclude path not found"):
        excluded_prompt_ids([tmp_path / "missing"])
