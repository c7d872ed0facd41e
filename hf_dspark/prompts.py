"""Prompt sets: JSON Lines of ``{"id": str, "domain": "chat"|"math"|"code", "turns": [str, ...]}``.

Every command that reads prompts takes a list of sources, each one of:

- a ``.jsonl`` file, or a folder of them (each file is one set, named by its stem);
- ``bundled`` (the package's own small sets: chat, code, math and repetitive text, eight prompts each, written for
  hf-dspark and under its Apache-2.0 license) or ``bundled:<set>`` for one of them;
- ``hf:<dataset>?split=<split>&field=<column>[&config=<name>][&id=<column>][&domain=chat|math|code][&set=<name>]``:
  a dataset on the Hugging Face Hub read with the ``datasets`` library (online, or from its local cache), one
  prompt per row; a ``field`` column holding a list of strings gives a multi-turn prompt. Rows without an ``id``
  column are numbered.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

DOMAINS = ("chat", "math", "code")
BUNDLED = "bundled"
HUB_PREFIX = "hf:"
HUB_KEYS = ("split", "field", "config", "id", "domain", "set")


def bundled_folder() -> Path:
    """The package's own prompt sets (``bundled``)."""
    return Path(__file__).resolve().parent / "prompt_sets"


def _bundled_files(spec: str) -> list[Path]:
    folder = bundled_folder()
    if spec == BUNDLED:
        return sorted(folder.glob("*.jsonl"))
    name = spec[len(BUNDLED) + 1 :]
    file = folder / f"{name}.jsonl"
    if not file.is_file():
        names = ", ".join(p.stem for p in sorted(folder.glob("*.jsonl")))
        raise FileNotFoundError(f"no bundled prompt set {name!r}: the bundled sets are {names}")
    return [file]


def is_hub_source(spec: str | Path) -> bool:
    return isinstance(spec, str) and spec.startswith(HUB_PREFIX)


def parse_hub_source(spec: str) -> dict:
    """``hf:<dataset>?split=...&field=...`` as ``{"path", "split", "field", "config", "id", "domain", "set"}``,
    refused with a message naming what is missing or unknown."""
    parts = urlsplit(spec[len(HUB_PREFIX) :])
    path = parts.path.strip("/")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - set(HUB_KEYS))
    if not path:
        raise ValueError(f"{spec!r}: name the dataset, e.g. hf:openai/gsm8k?config=main&split=test&field=question")
    if unknown:
        raise ValueError(f"{spec!r}: unknown key(s) {', '.join(unknown)}; expected {', '.join(HUB_KEYS)}")
    if not query.get("field"):
        raise ValueError(f"{spec!r}: say which column holds the prompt with field=<column>")
    domain = query.get("domain", "chat")
    if domain not in DOMAINS:
        raise ValueError(f"{spec!r}: domain {domain!r} is not one of {DOMAINS}")
    return {"path": path, "split": query.get("split") or "train", "field": query["field"],
            "config": query.get("config") or None, "id": query.get("id") or None, "domain": domain,
            "set": query.get("set") or path.rsplit("/", 1)[-1]}


def load_hub_prompts(spec: str) -> list[dict]:
    """The prompt records of one ``hf:`` source (see the module docstring)."""
    source = parse_hub_source(spec)
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"{spec!r} needs the datasets library: pip install datasets") from err
    rows = datasets.load_dataset(source["path"], source["config"], split=source["split"])
    columns = set(rows.column_names)
    for key in ("field", "id"):
        if source[key] is not None and source[key] not in columns:
            raise ValueError(f"{spec!r}: {key}={source[key]!r} is not a column of {source['path']} "
                             f"(columns: {', '.join(sorted(columns))})")
    records = []
    for index, row in enumerate(rows):
        value = row[source["field"]]
        turns = [value] if isinstance(value, str) else value
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{spec!r}: row {index}: column {source['field']!r} must hold a non-empty string or a "
                             "list of them")
        record_id = str(row[source["id"]]) if source["id"] else f"{source['set']}-{index:05d}"
        records.append({"id": record_id, "domain": source["domain"], "turns": turns, "set": source["set"]})
    return records


def prompt_files(paths: list[str | Path]) -> list[Path]:
    """Expand folders to their ``*.jsonl`` files (sorted) and ``bundled`` names to the package's sets; files are
    kept as given. ``hf:`` sources are not files: ``load_prompts`` reads them."""
    files: list[Path] = []
    for spec in paths:
        if isinstance(spec, str) and (spec == BUNDLED or spec.startswith(BUNDLED + ":")) and not Path(spec).exists():
            files.extend(_bundled_files(spec))
            continue
        path = Path(spec)
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
    """Read and validate prompt records from files, folders, ``bundled`` sets and ``hf:`` datasets, in the order
    given; each record gets ``"set"`` (its file's stem, or the dataset's set name)."""
    records = []
    for spec in paths:
        if is_hub_source(spec):
            records.extend(load_hub_prompts(spec))
        else:
            for file in prompt_files([spec]):
                records.extend(_read_prompt_file(file))
    return records


def _read_prompt_file(file: Path) -> list[dict]:
    records = []
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
