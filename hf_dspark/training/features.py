"""Cached target features: the hidden states of ``target_layer_ids`` (concatenated) and the final pre-LM-head
hidden state for every token of the regenerated data, in fp16/bf16 safetensors shards (one per data shard), with
the target's full-vocabulary log-normaliser and argmax at every token.

Training then reads features instead of running the target each epoch; target probabilities are recomputed from the
final hidden state only at supervised block positions (storing full-vocabulary logits would be prohibitive), and
with the stored log-normaliser only over the draft vocabulary (``losses.target_view``). The log-normaliser is
computed from the final hidden state as stored (rounded to the cache's dtype), so it normalises exactly the logits
training recomputes. Files written before it was stored are still read; training then computes it per batch.
Resumable: a features shard is written to a temporary file, put on disk and renamed (``checkpoints.publish``), so
after a crash a features file is whole or absent; finished shards are skipped, a leftover temporary file is overwritten.

A features file is named after its data shard's file name AND a digest of the shard's contents, so shards of several
data folders (each has a ``shard-00000.jsonl``) share one features folder without colliding, and an edited shard is
recomputed rather than served stale features. Reading checks every file's sequence lengths against its shard.
Files from before the digest (``features-<stem>.safetensors``) are still read, and renamed by ``cache_features``,
once their lengths match the shard.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .checkpoints import publish, write_atomic
from .data import load_sequences
from .losses import log_normalizer_and_argmax


def shard_digest(shard: str | Path) -> str:
    """First 16 hex digits of the SHA-256 of a data shard's bytes."""
    digest = hashlib.sha256()
    with open(shard, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def features_name(shard: str | Path, digest: str | None = None) -> str:
    """``features-<stem>-<digest>.safetensors`` (``digest``: the shard's ``shard_digest``, computed if not given)."""
    return f"features-{Path(shard).stem}-{digest or shard_digest(shard)}.safetensors"


def _legacy_name(shard: str | Path) -> str:
    return f"features-{Path(shard).stem}.safetensors"


def _check_lengths(path: Path, offsets: torch.Tensor, shard: str | Path, lengths: list[int]) -> None:
    cached = (offsets[1:] - offsets[:-1]).tolist()
    if cached != lengths:
        raise ValueError(
            f"cached features {path} do not match data shard {shard} ({len(cached)} sequences cached, {len(lengths)} "
            "in the shard, or other lengths): they were computed for other data; delete the file and rerun "
            "`hf-dspark features`"
        )


def _adopt_legacy(final: Path, shard: str | Path, lengths: list[int]) -> bool:
    """Rename a pre-digest features file of this shard to ``final``, its digest name, once its lengths match the
    shard. A legacy file of another shard with the same name (another data folder) is left alone."""
    legacy = final.parent / _legacy_name(shard)
    if not legacy.is_file():
        return False
    offsets = load_file(str(legacy))["offsets"]
    try:
        _check_lengths(legacy, offsets, shard, lengths)
    except ValueError:
        return False
    os.replace(legacy, final)
    return True


@torch.no_grad()
def cache_features(target, shards: list[str], output_dir: str | Path, target_layer_ids: list[int], max_length: int,
                   dtype: torch.dtype = torch.bfloat16, batch_size: int = 4, progress: bool = True,
                   worker_index: int = 0, num_workers: int = 1) -> dict:
    from tqdm.auto import tqdm

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    meta_path = output_dir / "features.json"
    meta = {"target_layer_ids": list(target_layer_ids), "max_length": max_length, "dtype": str(dtype),
            "target": getattr(target.config, "_name_or_path", "")}
    if meta_path.exists():
        if json.loads(meta_path.read_text()) != meta:
            raise ValueError(f"{output_dir} holds features with other settings ({meta_path.read_text()}); use a new "
                             "folder")
    else:
        write_atomic(meta_path, json.dumps(meta, indent=2))
    indices = [i + 1 for i in target_layer_ids]
    last = target.config.get_text_config().num_hidden_layers
    lm_head = target.get_output_embeddings()
    written = 0
    mine = [shard for i, shard in enumerate(shards) if i % num_workers == worker_index]
    for shard in tqdm(mine, desc="target features", disable=not progress):
        digest = shard_digest(shard)
        final = output_dir / features_name(shard, digest)
        if final.exists():
            continue
        sequences = load_sequences([shard], max_length)
        if _adopt_legacy(final, shard, [len(s["input_ids"]) for s in sequences]):
            continue
        hidden_rows, last_rows, lse_rows, argmax_rows, lengths = [], [], [], [], []
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start : start + batch_size]
            width = max(len(s["input_ids"]) for s in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            attention = torch.zeros(len(batch), width, dtype=torch.long)
            for row, s in enumerate(batch):
                ids[row, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
                attention[row, : len(s["input_ids"])] = 1
            out = target(input_ids=ids.to(target.device), attention_mask=attention.to(target.device),
                         output_hidden_states=indices + [last], logits_to_keep=1)
            taps = torch.cat([out.hidden_states[i] for i in indices], dim=-1)
            for row, s in enumerate(batch):
                n = len(s["input_ids"])
                hidden_rows.append(taps[row, :n].to(dtype).cpu())
                stored = out.hidden_states[last][row, :n].to(dtype)
                lse, top = log_normalizer_and_argmax(stored, lm_head.weight)
                last_rows.append(stored.cpu())
                lse_rows.append(lse.cpu())
                argmax_rows.append(top.cpu())
                lengths.append(n)
        offsets = torch.tensor([0] + lengths).cumsum(0)
        tmp = final.with_suffix(".tmp")
        save_file({"hidden": torch.cat(hidden_rows), "last": torch.cat(last_rows), "lse": torch.cat(lse_rows),
                   "argmax": torch.cat(argmax_rows), "offsets": offsets},
                  str(tmp), metadata={"shard": Path(shard).name, "shard_sha256_16": digest})
        publish(tmp, final)
        written += 1
    return {"output_dir": str(output_dir), "written": written, "shards": len(shards)}


class FeatureStore:
    """Features of the sequences of ``shards`` (same order as ``load_sequences``), read from the memory-mapped files.

    A batch copies only its own rows out of the files, so a process holds no more than the batch in memory, and
    trainers that read the same folder share one copy of it in the page cache (two trainers of 12 GB of features run
    side by side on a 24 GB machine). ``has_log_normalizer`` says whether every file holds the target's
    log-normaliser and argmax."""

    def __init__(self, features_dir: str | Path, shards: list[str], target_layer_ids: list[int], max_length: int):
        features_dir = Path(features_dir)
        meta = json.loads((features_dir / "features.json").read_text())
        if meta["target_layer_ids"] != list(target_layer_ids) or meta["max_length"] != max_length:
            raise ValueError(
                f"features in {features_dir} were cached for target_layer_ids={meta['target_layer_ids']}, "
                f"max_length={meta['max_length']}; the run wants {list(target_layer_ids)}, {max_length}"
            )
        self._files = []
        self._rows: list[tuple[int, int, int]] = []  # (file, first row, end row) of every sequence
        self.has_log_normalizer = True
        for shard in shards:
            path = features_dir / features_name(shard)
            if not path.is_file():
                path = features_dir / _legacy_name(shard)  # cached before the digest: checked by lengths below
            if not path.is_file():
                raise FileNotFoundError(f"missing cached features for {shard}: run `hf-dspark features` first")
            handle = safe_open(str(path), framework="pt")
            offsets = handle.get_tensor("offsets")
            lengths = [len(s["input_ids"]) for s in load_sequences([shard], max_length)]
            _check_lengths(path, offsets, shard, lengths)
            self.has_log_normalizer &= {"lse", "argmax"} <= set(handle.keys())
            offsets = offsets.tolist()
            self._rows.extend((len(self._files), a, b) for a, b in zip(offsets[:-1], offsets[1:]))
            self._files.append(handle)
        self.hidden_size = self._files[0].get_slice("hidden").get_shape()[-1] if self._files else 0
        self.last_size = self._files[0].get_slice("last").get_shape()[-1] if self._files else 0

    def __len__(self) -> int:
        return len(self._rows)

    def sequence(self, index: int) -> tuple[torch.Tensor, ...]:
        """``(hidden, last)`` of sequence ``index``, plus ``(lse, argmax)`` when every file holds them, as stored."""
        file, a, b = self._rows[index]
        names = ("hidden", "last", "lse", "argmax") if self.has_log_normalizer else ("hidden", "last")
        return tuple(self._files[file].get_slice(name)[a:b] for name in names)

    def batch(self, indices: list[int], width: int):
        """``(hidden, last, lse, argmax)`` of sequences ``indices``, zero-padded to ``width`` positions; ``lse``
        and ``argmax`` are None unless every file holds them."""
        hidden = torch.zeros(len(indices), width, self.hidden_size)
        last = torch.zeros(len(indices), width, self.last_size)
        lse = torch.zeros(len(indices), width) if self.has_log_normalizer else None
        argmax = torch.zeros(len(indices), width, dtype=torch.long) if self.has_log_normalizer else None
        for row, i in enumerate(indices):
            stored = self.sequence(i)
            n = stored[0].shape[0]
            hidden[row, :n] = stored[0].float()
            last[row, :n] = stored[1].float()
            if lse is not None:
                lse[row, :n] = stored[2]
                argmax[row, :n] = stored[3].long()
        return hidden, last, lse, argmax
