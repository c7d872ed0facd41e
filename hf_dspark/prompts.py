"""Prompt sets: JSON Lines of ``{"id": str, "domain": "chat"|"math"|"code", "turns": [str, ...]}``."""

from __future__ import annotations

import json
from pathlib import Path

DOMAINS = ("chat", "math", "code")


def prompt_files(paths: list[str | Path]) -> list[Path]:
    """Expand folders to their ``*.jsonl`` files (sorted); files are kept as given."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise FileNotFoundError(f"no .jsonl prompt files in {path}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"prompt file or folder not found: {path}")
    return files


def load_prompts(paths: list[str | Path]) -> list[dict]:
    """Read and validate prompt records; each gets ``"set"`` (its file's stem)."""
    records = []
    for file in prompt_files(paths):
        with open(file, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{file}:{line_no}: not valid JSON ({err.msg})") from None
                turns = record.get("turns")
                if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                    raise ValueError(f"{file}:{line_no}: 'turns' must be a non-empty list of strings")
                if "id" not in record:
                    raise ValueError(f"{file}:{line_no}: missing 'id'")
                domain = record.get("domain", "chat")
                if domain not in DOMAINS:
                    raise ValueError(f"{file}:{line_no}: domain {domain!r} is not one of {DOMAINS}")
                records.append({"id": str(record["id"]), "domain": domain, "turns": turns, "set": file.stem})
    return records


SAMPLINGS = ("balanced", "shuffled")


def sample_prompts(records: list[dict], num_prompts: int | None, sampling: str = "balanced",
                   seed: int = 0) -> list[dict]:
    """Pick ``num_prompts`` records (all of them when None), reproducibly for a seed.

    ``"shuffled"``: a uniform random order (big sets dominate a cut); ``"balanced"``: round-robin over the sets
    (``record["set"]``) in random order within each, so every set gives the same number of prompts until the smaller
    ones run out."""
    import random

    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"unknown sampling {sampling!r}: expected one of {SAMPLINGS}")
    num_prompts = len(records) if num_prompts is None else num_prompts
    rng = random.Random(seed)
    if sampling == "shuffled":
        records = list(records)
        rng.shuffle(records)
        return records[:num_prompts]
    by_set: dict[str, list[dict]] = {}
    for record in records:
        by_set.setdefault(record["set"], []).append(record)
    for members in by_set.values():
        rng.shuffle(members)
    chosen: list[dict] = []
    for i in range(max((len(m) for m in by_set.values()), default=0)):
        for name in sorted(by_set):
            if i < len(by_set[name]) and len(chosen) < num_prompts:
                chosen.append(by_set[name][i])
    return chosen


def iter_regenerated(data_dir: str | Path):
    """Yield the records of a regenerated-data folder (``hf-dspark data``): finished shards only, in shard order."""
    for shard in sorted(Path(data_dir).glob("shard-*.jsonl")):
        with open(shard, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)


def excluded_prompt_ids(paths: list[str | Path]) -> set[str]:
    """Prompt ids to leave out, gathered from: regenerated-data folders (``hf-dspark data``: every id in their
    finished shards), calibrated-drafter folders (``hf-dspark calibrate``: the ``prompt_ids`` of their
    ``calibration_report.json``), or text files with one prompt id per line."""
    ids: set[str] = set()
    for path in map(Path, paths):
        if path.is_file():
            ids |= {line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}
        elif path.is_dir() and any(path.glob("shard-*.jsonl")):
            ids |= {str(r["id"]) for r in iter_regenerated(path)}
        elif (path / "calibration_report.json").is_file():
            report = json.loads((path / "calibration_report.json").read_text(encoding="utf-8"))
            if "prompt_ids" not in report:
                raise ValueError(f"{path / 'calibration_report.json'} does not list its prompt_ids (written by an "
                                 "older hf-dspark calibrate); pass a text file of the ids instead")
            ids |= set(map(str, report["prompt_ids"]))
        elif path.is_dir():
            raise ValueError(f"{path} is neither regenerated data (shard-*.jsonl) nor a calibrated drafter "
                             "(calibration_report.json)")
        else:
            raise FileNotFoundError(f"exclude path not found: {path}")
    return ids
