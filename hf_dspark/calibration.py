"""Confidence calibration: Sequential Temperature Scaling (STS), reliability diagrams, calibration rollouts.

STS: on held-out speculative-decoding rollouts, for block positions k = 1..g in order, pick one temperature T_k
for the confidence logit (c_k = sigmoid(z_k / T_k)) minimising the Expected Calibration Error of the prefix
survival a_k = prod_{i<=k} c_i against the observed event "drafts 1..k all accepted", T_1..T_{k-1} fixed.
Dividing a logit by a positive temperature preserves order, so ROC-AUC per position is unchanged by design.
ECE, ROC-AUC and prefix survival are ``evaluation.metrics``'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from .evaluation.figures import pyplot, save_figure
# Rollouts and the calibration metrics live with the other metrics (evaluation.metrics); imported from here too.
from .evaluation.metrics import Rollouts, expected_calibration_error, prefix_survival, roc_auc
from .evaluation.rollouts import batched_rollouts

DEFAULT_TEMPERATURE_GRID = torch.logspace(-1.3, 1.3, 131).tolist()  # 0.05 .. 20


def _position_data(logits, verified, accepted, k: int):
    """Rounds that verified position k (1-based): their logits and the event "prefix 1..k accepted"."""
    rows = verified >= k
    return logits[rows], (accepted[rows] >= k)


def fit_sts(rollouts: Rollouts, grid: list[float] | None = None, num_bins: int = 15) -> dict:
    """Sequential Temperature Scaling. Returns temperatures and per-position ECE before/after, ROC-AUC, counts."""
    logits, verified, accepted = rollouts.tensors()
    if logits.numel() == 0:
        raise ValueError("no rollouts with confidences to calibrate on")
    grid = grid or DEFAULT_TEMPERATURE_GRID
    g = logits.shape[1]
    temperatures: list[float] = []
    report = {"ece_before": [], "ece_after": [], "auc": [], "num_samples": [], "positive_rate": []}
    for k in range(1, g + 1):
        z, events = _position_data(logits, verified, accepted, k)
        if z.shape[0] == 0:
            temperatures.append(1.0)
            for key in report:
                report[key].append(None if key != "num_samples" else 0)
            continue
        before = prefix_survival(z[:, :k])[:, -1]
        fixed = prefix_survival(z[:, : k - 1], temperatures)[:, -1] if k > 1 else torch.ones(z.shape[0], dtype=z.dtype)
        best_t, best_ece = 1.0, float("inf")
        for t in grid:
            candidate = fixed * torch.sigmoid(z[:, k - 1] / t)
            ece = expected_calibration_error(candidate, events, num_bins)
            if ece < best_ece - 1e-12:
                best_t, best_ece = float(t), ece
        temperatures.append(best_t)
        report["ece_before"].append(expected_calibration_error(before, events, num_bins))
        report["ece_after"].append(best_ece)
        report["auc"].append(roc_auc(before, events))
        report["num_samples"].append(int(z.shape[0]))
        report["positive_rate"].append(float(events.double().mean()))
    return {"temperatures": temperatures, **report}


def cross_validated_sts(rollouts: Rollouts, folds: int = 5, seed: int = 0, grid: list[float] | None = None,
                        num_bins: int = 15) -> dict:
    """Held-out ECE of STS by k-fold cross-validation over PROMPTS: each fold's rounds are scored with temperatures
    fitted on the other folds, and ECE per position is taken over all out-of-fold predictions (so the estimate uses
    every round, none of them seen by the fit that scores it). Returns ``ece_before``/``ece_after`` per position,
    the per-fold temperatures, and the number of prompts."""
    if folds < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {folds}")
    if not rollouts.prompts or len(rollouts.prompts) != len(rollouts.verified):
        raise ValueError("cross-validation needs each round's prompt index (rollouts.prompts); "
                         "collect the rollouts again with this version")
    prompt_ids = sorted(set(rollouts.prompts))
    if len(prompt_ids) < folds:
        raise ValueError(f"{folds} folds need at least {folds} prompts with rounds, got {len(prompt_ids)}")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(prompt_ids), generator=generator).tolist()
    fold_of = {prompt_ids[p]: i % folds for i, p in enumerate(order)}
    logits, verified, accepted = rollouts.tensors()
    round_fold = torch.tensor([fold_of[p] for p in rollouts.prompts])
    calibrated = torch.empty_like(logits)
    fold_temperatures = []
    for fold in range(folds):
        held = (round_fold == fold).nonzero().flatten()
        train = (round_fold != fold).nonzero().flatten().tolist()
        temperatures = fit_sts(rollouts.subset(train), grid, num_bins)["temperatures"]
        fold_temperatures.append(temperatures)
        calibrated[held] = prefix_survival(logits[held], temperatures)
    raw = prefix_survival(logits)
    out = {"folds": folds, "prompts": len(prompt_ids), "fold_temperatures": fold_temperatures,
           "ece_before": [], "ece_after": []}
    for k in range(1, logits.shape[1] + 1):
        rows = verified >= k
        events = accepted[rows] >= k
        empty = not bool(rows.any())
        out["ece_before"].append(None if empty else expected_calibration_error(raw[rows, k - 1], events, num_bins))
        out["ece_after"].append(None if empty else expected_calibration_error(calibrated[rows, k - 1], events,
                                                                              num_bins))
    return out


def sts_json(fit: dict, dataset: str) -> dict:
    """The ``sts.json`` serving engines read."""
    valid_before = [e for e in fit["ece_before"] if e is not None]
    valid_after = [e for e in fit["ece_after"] if e is not None]
    weights = [n for n, e in zip(fit["num_samples"], fit["ece_before"]) if e is not None]
    total = max(1, sum(weights))
    return {
        "temperatures": fit["temperatures"],
        "dataset": dataset,
        "num_samples": int(fit["num_samples"][0]) if fit["num_samples"] else 0,
        "ece_before": sum(e * w for e, w in zip(valid_before, weights)) / total,
        "ece_after": sum(e * w for e, w in zip(valid_after, weights)) / total,
        "ece_before_per_position": fit["ece_before"],
        "ece_after_per_position": fit["ece_after"],
        "auc_per_position": fit["auc"],
        **({"ece_heldout_per_position": fit["cross_validation"]["ece_after"],
            "heldout_folds": fit["cross_validation"]["folds"]} if "cross_validation" in fit else {}),
    }


def reliability_diagram(rollouts: Rollouts, temperatures: list[float] | None, path: str | Path,
                        num_bins: int = 15) -> Path:
    """Reliability diagram of prefix survival per position, before and (if given) after STS."""
    plt = pyplot()
    logits, verified, accepted = rollouts.tensors()
    g = logits.shape[1]
    fig, axes = plt.subplots(1, g, figsize=(2.6 * g, 2.8), sharey=True)
    axes = [axes] if g == 1 else list(axes)
    for k, ax in enumerate(axes, 1):
        z, events = _position_data(logits, verified, accepted, k)
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        curves = [("before", prefix_survival(z[:, :k])[:, -1] if len(z) else torch.zeros(0), "tab:red")]
        if temperatures is not None and len(z):
            curves.append(("after STS", prefix_survival(z[:, :k], temperatures)[:, -1], "tab:blue"))
        for label, probs, color in curves:
            if probs.numel() == 0:
                continue
            bins = torch.clamp((probs * num_bins).long(), max=num_bins - 1)
            xs, ys = [], []
            for b in range(num_bins):
                sel = bins == b
                if sel.any():
                    xs.append(float(probs[sel].mean()))
                    ys.append(float(events[sel].double().mean()))
            ax.plot(xs, ys, marker="o", ms=3, color=color, label=label)
        ax.set_title(f"k={k} (n={len(z)})", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted a_k", fontsize=8)
    axes[0].set_ylabel("observed P(prefix accepted)", fontsize=8)
    axes[0].legend(fontsize=7)
    return save_figure(fig, path, dpi=110)


def write_sts(folder: str | Path, fit: dict, dataset: str) -> Path:
    path = Path(folder) / "sts.json"
    path.write_text(json.dumps(sts_json(fit, dataset), indent=2) + "\n", encoding="utf-8")
    return path


CHECKPOINT_CHUNK = 64  # records rolled out between two checkpoint writes (the batched engine drains at each)
ROLLOUT_CHECKPOINT = "rollouts.partial.jsonl"  # ``hf-dspark calibrate`` keeps finished records here until it is done


def collect_rollouts(target, tokenizer, drafter, records: list[dict], max_new_tokens: int = 128,
                     temperature: float = 0.0, seed: int = 0, progress: bool = True, concurrency: int = 1,
                     checkpoint: str | Path | None = None, checkpoint_key: dict | None = None) -> Rollouts:
    """Speculative-decoding rollouts of each record's first turn, verifying the WHOLE block every round (so every
    position is observed). Rounds carry their record's index in ``records``.

    ``concurrency`` 1 runs ``generate()`` prompt by prompt; above 1 the batched engine (``policy="fixed"``) serves
    that many prompts at once, which is several times faster on a CPU and records the same per-round events.

    ``checkpoint``: a JSON-lines file the rounds of every finished record are appended to (``CHECKPOINT_CHUNK``
    records at a time); a later call with the same file skips the records it holds, so an interrupted calibration
    resumes instead of starting over. Its first line is the run's key (``checkpoint_key`` plus the records' ids,
    ``max_new_tokens``, ``temperature`` and ``seed``); a file written for another run is refused."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    done: dict[int, dict] = {}
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        key = {**(checkpoint_key or {}), "ids": [str(r.get("id", i)) for i, r in enumerate(records)],
               "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
        done = _read_checkpoint(checkpoint, key)
    todo = [i for i in range(len(records)) if i not in done]
    chunk = CHECKPOINT_CHUNK if checkpoint is not None else max(len(todo), 1)
    for start in range(0, len(todo), chunk):
        indices = todo[start:start + chunk]
        rounds = _rollout_rounds(target, tokenizer, drafter, [records[i] for i in indices], max_new_tokens,
                                 temperature, seed, progress, concurrency, indices)
        done.update(zip(indices, rounds))
        if checkpoint is not None:
            with open(checkpoint, "a", encoding="utf-8") as f:
                for index, entry in zip(indices, rounds):
                    f.write(json.dumps({"index": index, **entry}) + "\n")
    rollouts = Rollouts()
    for index in range(len(records)):
        rollouts.extend_from_stats(SimpleNamespace(**done[index]), prompt=index)
    return rollouts


def _read_checkpoint(path: Path, key: dict) -> dict[int, dict]:
    """The records a rollout checkpoint holds ({index: rounds}); writes the key line when the file is new."""
    if not path.exists() or path.stat().st_size == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key}) + "\n", encoding="utf-8")
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    saved = json.loads(lines[0]).get("key") if lines else None
    if saved != key:
        differing = sorted(k for k in set(saved or {}) | set(key) if (saved or {}).get(k) != key.get(k))
        raise ValueError(f"rollout checkpoint {path} was written for another run (differs in {differing}); "
                         "delete it or write the calibration elsewhere")
    done = {}
    for number, line in enumerate(lines[1:], 2):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # a write cut short by the interruption: that record runs again
                break
            raise ValueError(f"rollout checkpoint {path}: line {number} is not JSON") from None
        done[int(entry.pop("index"))] = entry
    return done


def _rollout_rounds(target, tokenizer, drafter, records: list[dict], max_new_tokens: int, temperature: float,
                    seed: int, progress: bool, concurrency: int, indices: list[int]) -> list[dict]:
    """Each record's rounds: ``{"confidence_logits", "verified", "accepted"}`` lists. ``indices`` (the records'
    places in the whole run) seed ``generate()``'s sampling per record, so a resumed run draws what an uninterrupted
    one would have; the batched engine's draws depend on the batch, so there a resumed sampled run (temperature > 0)
    draws differently, from the same distribution. Greedy rollouts do not depend on it."""
    def rounds(stats) -> dict:
        return {"confidence_logits": [list(map(float, c)) if c else c for c in stats.confidence_logits],
                "verified": list(map(int, stats.verified)), "accepted": list(map(int, stats.accepted))}

    if concurrency > 1:
        methods = {"whole block": {"assistant": True, "drafter": drafter, "verification_policy": "fixed"}}
        results = batched_rollouts(target, tokenizer, records, methods, max_new_tokens, temperature,
                                   seed + indices[0], multi_turn=False, concurrency=concurrency,
                                   progress=progress, desc="calibration rollouts")
        return [rounds(per_method["whole block"]) for per_method in results]

    from tqdm.auto import tqdm

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": record["turns"][0]}],
                                             add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"] for record in records]
    saved = (drafter.generation_config.verification_policy, getattr(drafter.generation_config, "num_verify_tokens", None))
    drafter.generation_config.verification_policy, drafter.generation_config.num_verify_tokens = "fixed", None
    out = []
    try:
        for index, input_ids in zip(indices, tqdm(prompts, desc="calibration rollouts", disable=not progress)):
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, assistant_model=drafter)
            if temperature > 0:
                kwargs.update(temperature=temperature, top_p=None, top_k=None)
            torch.manual_seed(seed * 100_003 + index)
            target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
            out.append(rounds(drafter.last_stats))
    finally:
        drafter.generation_config.verification_policy, drafter.generation_config.num_verify_tokens = saved
    return out
