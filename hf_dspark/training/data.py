"""Target regeneration: answer training prompts with the target itself (the paper's data recipe).

Output: a folder of JSONL shards ``shard-00000.jsonl ...``; one line per (conversation, turn):
``{"id", "domain", "set", "turn", "prompt_ids", "response_ids"}``; the trainer supervises ``response_ids`` given
``prompt_ids`` (which already holds the earlier turns with the target's own answers). Multi-turn prompts feed every
user turn, each after the model's previous answer.

Resumable and idempotent: prompts are shuffled once (seeded) and cut into shards; a shard is written to a temp
file, put on disk and renamed when complete (``checkpoints.publish``), so killing the job loses at most the shard in
progress, and a restart skips every finished shard and overwrites the temp file. ``manifest.json`` (written the same
way) pins the settings; resuming with different settings is refused.

Reading it back: ``list_shards`` (from ``settings``) / ``load_sequences`` here (what the trainer and the feature cache
train on), ``prompts.iter_regenerated`` for the records (``excluded_prompt_ids`` reads their ids; re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..prompts import iter_regenerated  # noqa: F401  (re-exported: it lived here)
from ..prompts import excluded_prompt_ids, load_prompts, sample_prompts
from .checkpoints import publish, write_atomic
from .settings import RegenerationSettings, list_shards  # noqa: F401  (list_shards re-exported: it lived here)

logger = logging.getLogger(__name__)


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


@torch.no_grad()
def _generate_batch(target, tokenizer, prompts: list[list[int]], settings: RegenerationSettings, generator_seed: int):
    """Left-padded batched sampling; returns the response ids of each prompt (cut after EOS)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    torch.manual_seed(generator_seed)
    out = target.generate(
        input_ids=input_ids.to(target.device),
        attention_mask=attention_mask.to(target.device),
        do_sample=settings.temperature > 0,
        temperature=settings.temperature if settings.temperature > 0 else None,
        top_p=settings.top_p if settings.temperature > 0 else None,
        max_new_tokens=settings.max_new_tokens,
        pad_token_id=pad,
    )
    eos = set(target.generation_config.eos_token_id if isinstance(target.generation_config.eos_token_id, list)
              else [target.generation_config.eos_token_id])
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses


def _regenerate_shard(target, tokenizer, records: list[dict], settings: RegenerationSettings, seed: int) -> list[dict]:
    conversations = [{"record": r, "messages": [], "out": []} for r in records]
    max_turns = max(len(r["turns"]) for r in records)
    for turn in range(max_turns):
        active = [c for c in conversations if len(c["record"]["turns"]) > turn]
        for c in active:
            c["messages"].append({"role": "user", "content": c["record"]["turns"][turn]})
            c["prompt_ids"] = _chat_ids(tokenizer, c["messages"])
        active.sort(key=lambda c: len(c["prompt_ids"]))  # similar lengths share a batch: less padding
        for start in range(0, len(active), settings.batch_size):
            batch = active[start : start + settings.batch_size]
            responses = _generate_batch(
                target, tokenizer, [c["prompt_ids"] for c in batch], settings, seed * 1000 + turn * 100 + start
            )
            for c, response in zip(batch, responses):
                text = tokenizer.decode(response, skip_special_tokens=True)
                c["messages"].append({"role": "assistant", "content": text})
                r = c["record"]
                c["out"].append(
                    {"id": r["id"], "domain": r["domain"], "set": r["set"], "turn": turn,
                     "prompt_ids": c["prompt_ids"], "response_ids": response}
                )
    return [line for c in conversations for line in c["out"]]


def regenerate(target, tokenizer, output_dir: str | Path, settings: RegenerationSettings, progress: bool = True,
               worker_index: int = 0, num_workers: int = 1, time_budget_s: float | None = None) -> dict:
    """Regenerate responses for ``settings.prompt_paths`` into ``output_dir`` (resumable). Returns a summary.

    ``num_workers`` processes with distinct ``worker_index`` split the shards (shard i goes to worker i mod n), so
    several single-threaded workers can share a machine's cores without duplicating work. With ``time_budget_s`` no
    shard starts once that many seconds have passed (finished shards are kept; re-running continues)."""
    _check_worker_split(worker_index, num_workers, time_budget_s)
    from tqdm.auto import tqdm

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    records = load_prompts(settings.prompt_paths)
    excluded = excluded_prompt_ids(settings.exclude)
    records = [r for r in records if r["id"] not in excluded]
    _pin_manifest(output_dir, settings, excluded)
    records = sample_prompts(records, settings.max_prompts, settings.sampling, settings.seed)
    shards = [records[i : i + settings.shard_size] for i in range(0, len(records), settings.shard_size)]
    done = {p.name for p in output_dir.glob("shard-*.jsonl")}
    mine = [i for i in range(len(shards)) if i % num_workers == worker_index]
    todo = [i for i in mine if f"shard-{i:05d}.jsonl" not in done]
    log_file = output_dir / ("progress.log" if num_workers == 1 else f"progress-worker{worker_index}.log")
    bar = tqdm(total=sum(len(shards[i]) for i in mine), initial=sum(len(shards[i]) for i in mine if i not in todo),
               desc="regenerate", unit="prompt", disable=not progress)
    started, new_lines = time.time(), 0
    for index in todo:
        if time_budget_s is not None and time.time() - started >= time_budget_s:
            logger.info("time budget of %.0f s spent: stopping before shard %d", time_budget_s, index)
            break
        lines = _regenerate_shard(target, tokenizer, shards[index], settings, settings.seed + index)
        _write_shard(output_dir / f"shard-{index:05d}.jsonl", lines)
        new_lines += len(lines)
        bar.update(len(shards[index]))
        _log_shard_done(log_file, index, bar, started, len(records))
    bar.close()
    finished = sorted(output_dir.glob("shard-*.jsonl"))
    return {"output_dir": str(output_dir), "shards": len(finished), "shards_total": len(shards),
            "new_sequences": new_lines, "elapsed_s": time.time() - started}


def _check_worker_split(worker_index: int, num_workers: int, time_budget_s: float | None) -> None:
    """Refuse a worker index outside ``[0, num_workers)`` or a time budget that is not positive."""
    if not 0 <= worker_index < num_workers:
        raise ValueError(f"worker_index must be in [0, {num_workers}), got {worker_index}")
    if time_budget_s is not None and time_budget_s <= 0:
        raise ValueError(f"time_budget_s must be > 0 seconds, got {time_budget_s}")


def _pin_manifest(output_dir: Path, settings: RegenerationSettings, excluded: set[str]) -> None:
    """Write ``manifest.json`` for a new folder; for one already started, refuse settings or excluded prompt ids
    that differ from those it was started with."""
    manifest_path = output_dir / "manifest.json"
    manifest = {"settings": asdict(settings), "format": "hf-dspark-regenerated-v1"}
    if excluded:
        # the exclusion lists may grow (another regeneration still running): pin the ids this folder left out
        manifest["excluded_ids_sha256"] = hashlib.sha256("\n".join(sorted(excluded)).encode()).hexdigest()
    if manifest_path.exists():
        existing = json.loads(manifest_path.read_text())
        added_later = {"exclude": [], "sampling": "shuffled"}  # folders written before these settings existed
        if {**added_later, **existing["settings"]} != manifest["settings"]:
            raise ValueError(
                f"{output_dir} was started with different settings ({existing['settings']}); use a new folder"
            )
        if existing.get("excluded_ids_sha256") != manifest.get("excluded_ids_sha256"):
            raise ValueError(f"{output_dir} was started with a different set of excluded prompt ids (the folders or "
                             "files given to exclude have changed since); use a new folder")
    else:
        write_atomic(manifest_path, json.dumps(manifest, indent=2))


def _write_shard(final: Path, lines: list[dict]) -> None:
    """One JSON line per record, written to a temp file and put in place as ``final`` once complete."""
    tmp = final.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    publish(tmp, final)


def _log_shard_done(log_file: Path, index: int, bar, started: float, num_prompts: int) -> None:
    """Append the progress after shard ``index`` to ``log_file`` and report it with the rate so far."""
    rate = bar.n / max(bar.format_dict.get("elapsed", 1e-9), 1e-9)
    with open(log_file, "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": time.time(), "shard": index, "prompts_done": bar.n,
                            "prompts_total": bar.total, "elapsed_s": time.time() - started}) + "\n")
    logger.info("shard %d done (%d/%d prompts, %.2f prompts/s)", index, bar.n, num_prompts, rate)


def load_sequences(shards: list[str], max_length: int) -> list[dict]:
    """(input_ids, loss_mask) per regenerated (conversation, turn); truncated to ``max_length``."""
    sequences = []
    for shard in shards:
        with open(shard, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                ids = record["prompt_ids"] + record["response_ids"]
                mask = [0] * len(record["prompt_ids"]) + [1] * len(record["response_ids"])
                if len(ids) > max_length:
                    ids, mask = ids[:max_length], mask[:max_length]
                if sum(mask) >= 2:
                    sequences.append({"input_ids": ids, "loss_mask": mask, "domain": record.get("domain", "chat"),
                                      "id": record.get("id")})
    if not sequences:
        raise ValueError("the training data holds no sequence with at least two response tokens")
    return sequences
