"""Speculative-decoding rollouts over prompt sets: accepted length, position-wise acceptance, speed vs plain.

Definitions follow the paper: tau (accepted length) counts accepted drafts plus the target's own token per round;
position-wise conditional acceptance is P(draft k accepted | drafts 1..k-1 accepted, k verified). Speed is
measured as a ratio against plain ``generate()`` in the same run, prompt by prompt, methods interleaved so a
noisy machine affects every method alike.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .generation import DSparkStats
from .prompts import load_prompts


@dataclass
class MethodResult:
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    accepted: int = 0
    verified: int = 0
    position_reached: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def add(self, tokens: int, seconds: float, stats: DSparkStats | None) -> None:
        self.tokens += tokens
        self.seconds += seconds
        if stats is None:
            return
        self.rounds += stats.rounds
        self.accepted += sum(stats.accepted)
        self.verified += sum(stats.verified)
        g = stats.block_size
        if not self.position_reached:
            self.position_reached, self.position_accepted = [0] * g, [0] * g
        for v, a in zip(stats.verified, stats.accepted):
            for k in range(1, g + 1):
                if v >= k and a >= k - 1:
                    self.position_reached[k - 1] += 1
                    self.position_accepted[k - 1] += a >= k

    def summary(self) -> dict:
        out = {"tokens": self.tokens, "seconds": round(self.seconds, 3),
               "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0}
        if self.rounds:
            out.update(
                accepted_length=(self.accepted + self.rounds) / self.rounds,
                acceptance_rate=self.accepted / self.verified if self.verified else 0.0,
                rounds=self.rounds,
                position_acceptance=[a / r if r else None for a, r in zip(self.position_accepted, self.position_reached)],
            )
        return out


def chat_inputs(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def run_rollouts(target, tokenizer, drafter, prompt_paths, methods: dict[str, dict], num_prompts: int | None = 50,
                 max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0, multi_turn: bool = True,
                 progress: bool = True, log_path: str | Path | None = None) -> dict:
    """Run every method on every prompt (interleaved) and aggregate per set, per domain and overall.

    ``methods`` maps a name to its settings: ``{"assistant": True, "verification_policy": "fixed", ...}`` runs DSpark
    with those drafter generation settings (``"drafter": obj`` picks another drafter than ``drafter``);
    ``{"assistant": False}`` is plain ``generate()``; ``{"prompt_lookup": 7}`` transformers' prompt-lookup
    decoding. The first method should be the plain baseline.
    """
    from tqdm.auto import tqdm

    records = load_prompts(prompt_paths)
    by_set: dict[str, list[dict]] = {}
    for r in records:
        by_set.setdefault(r["set"], []).append(r)
    chosen = [r for rs in by_set.values() for r in (rs[:num_prompts] if num_prompts else rs)]
    results: dict[str, dict[str, MethodResult]] = {}
    sample = temperature > 0
    bar = tqdm(chosen, desc="rollouts", unit="prompt", disable=not progress)
    drafters = {id(d): d for d in [drafter] + [m["drafter"] for m in methods.values() if "drafter" in m] if d is not None}
    original_settings = {key: d.generation_config.to_dict() for key, d in drafters.items()}
    for index, record in enumerate(bar):
        turns = record["turns"] if multi_turn else record["turns"][:1]
        histories = {name: [] for name in methods}
        for turn in turns:
            for name, settings in methods.items():
                messages = histories[name] + [{"role": "user", "content": turn}]
                inputs = chat_inputs(tokenizer, messages)
                kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sample)
                if sample:
                    kwargs.update(temperature=temperature, top_p=None, top_k=None)
                method_drafter = settings.get("drafter", drafter)
                if settings.get("assistant"):
                    for key, value in settings.items():
                        if key not in ("assistant", "drafter"):
                            setattr(method_drafter.generation_config, key, value)
                    kwargs["assistant_model"] = method_drafter
                elif settings.get("prompt_lookup"):
                    kwargs["prompt_lookup_num_tokens"] = settings["prompt_lookup"]
                torch.manual_seed(seed * 100_003 + index)
                start = time.perf_counter()
                out = target.generate(**inputs, **kwargs)
                elapsed = time.perf_counter() - start
                new = out[0, inputs["input_ids"].shape[1]:]
                stats = method_drafter.last_stats if settings.get("assistant") else None
                for group in (f"set/{record['set']}", f"domain/{record['domain']}", "all"):
                    results.setdefault(group, {}).setdefault(name, MethodResult()).add(len(new), elapsed, stats)
                histories[name] = messages + [{"role": "assistant",
                                               "content": tokenizer.decode(new, skip_special_tokens=True)}]
        if log_path is not None:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"done": index + 1, "total": len(chosen), "id": record["id"]}) + "\n")
    for key, d in drafters.items():
        for name in ("verification_policy", "num_verify_tokens", "confidence_threshold"):
            if name in original_settings[key]:
                setattr(d.generation_config, name, original_settings[key][name])
    baseline = next(iter(methods))
    report = {}
    for group, per_method in results.items():
        report[group] = {name: r.summary() for name, r in per_method.items()}
        base = report[group][baseline]["tokens_per_s"]
        for name in per_method:
            report[group][name]["speedup"] = report[group][name]["tokens_per_s"] / base if base else None
    return report
