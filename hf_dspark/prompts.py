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
