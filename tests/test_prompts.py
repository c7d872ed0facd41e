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


# ------------------------------------------------------------------------------------------------------------------
# Bundled sets and Hub datasets
# ------------------------------------------------------------------------------------------------------------------
def test_bundled_sets_load_by_name():
    from hf_dspark.prompts import load_prompts

    records = load_prompts(["bundled"])
    by_set = {}
    for record in records:
        by_set.setdefault(record["set"], []).append(record)
    assert sorted(by_set) == ["chat", "code", "math", "repetitive"] and all(len(v) == 8 for v in by_set.values())
    assert len({r["id"] for r in records}) == len(records)
    assert {r["domain"] for r in by_set["math"]} == {"math"} and {r["domain"] for r in by_set["code"]} == {"code"}
    assert [r["set"] for r in load_prompts(["bundled:code"])] == ["code"] * 8
    with pytest.raises(FileNotFoundError, match="no bundled prompt set 'poetry'.*chat, code, math, repetitive"):
        load_prompts(["bundled:poetry"])


def test_hub_source_is_parsed_and_refused_clearly():
    from hf_dspark.prompts import parse_hub_source

    parsed = parse_hub_source("hf:openai/gsm8k?config=main&split=test&field=question&domain=math")
    assert parsed == {"path": "openai/gsm8k", "split": "test", "field": "question", "config": "main", "id": None,
                      "domain": "math", "set": "gsm8k"}
    with pytest.raises(ValueError, match="field=<column>"):
        parse_hub_source("hf:openai/gsm8k?split=test")
    with pytest.raises(ValueError, match="unknown key"):
        parse_hub_source("hf:openai/gsm8k?field=question&colum=x")
    with pytest.raises(ValueError, match="domain 'poems'"):
        parse_hub_source("hf:openai/gsm8k?field=question&domain=poems")
    with pytest.raises(ValueError, match="name the dataset"):
        parse_hub_source("hf:?field=question")


def test_hub_dataset_rows_become_prompts(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from hf_dspark.prompts import load_prompts

    rows = datasets.Dataset.from_list([{"q": "What is 2+2?", "key": 7}, {"q": "And 3+3?", "key": 9}])
    calls = []

    def fake_load(path, config, split):
        calls.append((path, config, split))
        return rows

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    records = load_prompts(["hf:org/arith?split=validation&field=q&id=key&domain=math", "bundled:chat"])
    assert calls == [("org/arith", None, "validation")]
    assert records[:2] == [{"id": "7", "domain": "math", "turns": ["What is 2+2?"], "set": "arith"},
                           {"id": "9", "domain": "math", "turns": ["And 3+3?"], "set": "arith"}]
    assert [r["set"] for r in records[2:]] == ["chat"] * 8  # sources keep the order given
    with pytest.raises(ValueError, match="field='question' is not a column of org/arith"):
        load_prompts(["hf:org/arith?field=question"])
