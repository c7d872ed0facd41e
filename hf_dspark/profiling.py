"""SPS(B) profiling: target forward steps per second with B tokens in the verification batch.

Measured on the actual device, dtype and thread count, at a few context lengths, with warm-up, repeats and
medians (robust to a noisy shared machine), under a time budget. Profiles are cached as JSON keyed by
model / device / dtype / threads, so ``generate`` profiles automatically once and reuses the result.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from .scheduling import StepsPerSecond
from .target import cache_root


def profile_key(model) -> dict:
    device = next(model.parameters()).device
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    return {
        "model": str(name),
        "architecture": type(model).__name__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "device": str(device.type) + (f":{torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_steps_per_second(model, batch_tokens: list[int], context_lengths: list[int] = (64, 256),
                             repeats: int = 5, time_budget_s: float = 60.0) -> tuple[StepsPerSecond, dict]:
    """Median steps/s for each B (averaged over context lengths by median); returns the curve and raw timings."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    raw: dict[int, dict[int, list[float]]] = {b: {} for b in batch_tokens}
    for context in context_lengths:
        ids = torch.randint(0, vocab, (1, context), generator=generator).to(device)
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        for b in batch_tokens:
            step_ids = torch.randint(0, vocab, (1, b), generator=generator).to(device)
            positions = torch.arange(context, context + b, device=device).unsqueeze(0)
            times = []
            for r in range(repeats + 1):  # the first run is a warm-up
                _sync(device)
                t0 = time.perf_counter()
                model(input_ids=step_ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=b)
                _sync(device)
                elapsed = time.perf_counter() - t0
                cache.crop(-b)
                if r:
                    times.append(elapsed)
            raw[b][context] = times
            if time.perf_counter() - started > time_budget_s and len(raw[batch_tokens[0]]) > 0:
                break
        if time.perf_counter() - started > time_budget_s:
            break
    measured = [b for b in batch_tokens if raw[b]]
    sps = [statistics.median(1.0 / statistics.median(t) for t in raw[b].values()) for b in measured]
    return StepsPerSecond(measured, sps, max(measured)), {str(b): {str(c): t for c, t in v.items()} for b, v in raw.items()}


def profile_path(model, folder: Path | None = None) -> Path:
    key = profile_key(model)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (folder or cache_root() / "profiles") / f"sps-{digest}.json"


def load_or_profile(model, max_batch_tokens: int, folder: Path | None = None, time_budget_s: float = 60.0,
                    repeats: int = 5, context_lengths: list[int] = (64, 256)) -> StepsPerSecond:
    """The cached profile for this model/device/dtype/threads covering ``max_batch_tokens``; profiles if absent."""
    path = profile_path(model, folder)
    if path.is_file():
        data = json.loads(path.read_text())
        sps = StepsPerSecond.from_dict(data["profile"])
        if sps.max_batch_tokens >= max_batch_tokens:
            return sps
    batch_tokens = sorted(set([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]) & set(
        range(1, max_batch_tokens + 1)) | {max_batch_tokens})
    sps, raw = measure_steps_per_second(model, batch_tokens, list(context_lengths), repeats, time_budget_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"key": profile_key(model), "profile": sps.to_dict(), "raw_seconds": raw,
               "context_lengths": list(context_lengths), "repeats": repeats, "created": time.time()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)
    return sps


def export_sps(sps: StepsPerSecond, path: str | Path) -> Path:
    """Write the serving-engine SPS format: sample_batch_tokens / sample_steps_per_sec / max_batch_tokens."""
    path = Path(path)
    path.write_text(json.dumps(sps.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path
