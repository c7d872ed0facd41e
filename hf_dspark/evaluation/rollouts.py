"""Speculative-decoding rollouts over prompt sets: accepted length, position-wise acceptance, speed vs plain.

Definitions follow the paper: tau (accepted length) counts accepted drafts plus the target's own token per round;
position-wise conditional acceptance is P(draft k accepted | drafts 1..k-1 accepted, k verified). Speed is
measured as a ratio against plain ``generate()`` in the same run, prompt by prompt, methods interleaved so a
noisy machine affects every method alike.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..prompts import load_prompts
from ..stats import DSparkStats, totals_by_source
from . import metrics


@dataclass
class MethodResult:
    """Totals of one method over some prompts, and its raw rounds (so shards merge exactly and every metric is
    recomputed from the same records)."""

    tokens: int = 0
    seconds: float = 0.0
    block_size: int = 0
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    confidence_logits: list[list[float]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # per round: "block", "lookup" or "none"
    compared: int = 0  # outputs compared with the baseline method's for the same turn
    identical: int = 0  # ... and equal to it token for token
    time_split: dict[str, float] = field(default_factory=dict)  # DSparkStats.time_split, summed over calls

    def add(self, tokens: int, seconds: float, stats: DSparkStats | None, same_as_baseline: bool | None = None) -> None:
        self.tokens += tokens
        self.seconds += seconds
        if same_as_baseline is not None:
            self.compared += 1
            self.identical += int(same_as_baseline)
        if stats is None:
            return
        self.block_size = max(self.block_size, stats.block_size)
        self.verified.extend(stats.verified)
        self.accepted.extend(stats.accepted)
        self.confidence_logits.extend(stats.confidence_logits)
        self.sources.extend(stats.sources)
        for key, seconds in stats.time_split().items():
            self.time_split[key] = self.time_split.get(key, 0.0) + seconds

    def merge(self, other: "MethodResult") -> "MethodResult":
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.block_size = max(self.block_size, other.block_size)
        self.verified += other.verified
        self.accepted += other.accepted
        self.confidence_logits += other.confidence_logits
        self.sources += other.sources
        self.compared += other.compared
        self.identical += other.identical
        for key, seconds in other.time_split.items():
            self.time_split[key] = self.time_split.get(key, 0.0) + seconds
        return self

    @property
    def rounds(self) -> int:
        return len(self.verified)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MethodResult":
        return cls(**data)

    def summary(self) -> dict:
        out = {"tokens": self.tokens, "seconds": round(self.seconds, 3),
               "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0}
        if self.rounds:
            positions = metrics.position_acceptance(self.verified, self.accepted, self.block_size)
            out.update(
                accepted_length=metrics.accepted_length(self.verified, self.accepted),
                acceptance_rate=metrics.acceptance_rate(self.verified, self.accepted),
                rounds=self.rounds,
                verified_per_round=sum(self.verified) / self.rounds,
                position_acceptance=positions["acceptance"],
                position_reached=positions["reached"],
            )
            if len(self.sources) == self.rounds:
                out["sources"] = self.by_source()
            if self.time_split:
                out["time_split"] = {key: round(seconds, 3) for key, seconds in self.time_split.items()}
        if self.compared:
            out["identical_to_baseline"] = f"{self.identical}/{self.compared}"
        return out

    def by_source(self) -> dict[str, dict[str, int]]:
        """Rounds, verified drafts and accepted drafts per draft source."""
        return totals_by_source(self.sources, verified=self.verified, accepted=self.accepted)


def chat_inputs(tokenizer, messages):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


GENERATION_SETTINGS = ("verification_policy", "num_verify_tokens", "confidence_threshold", "realized_gate",
                       "draft_round", "draft_tree", "sps_profile")


@contextlib.contextmanager
def drafter_settings(drafter, settings: dict):
    """Apply a method's drafter generation settings for one call and restore the drafter's own afterwards."""
    config = drafter.generation_config
    saved = {key: getattr(config, key, None) for key in settings}
    try:
        for key, value in settings.items():
            setattr(config, key, value)
        yield drafter
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


def rollout_record(target, tokenizer, record: dict, methods: dict[str, dict], drafter=None, max_new_tokens: int = 256,
                   temperature: float = 0.0, seed: int = 0, multi_turn: bool = True) -> dict[str, MethodResult]:
    """Run every method on one prompt record, turn by turn, methods interleaved (a noisy machine slows them alike).

    Multi-turn records feed each method its OWN previous answers. ``methods`` maps a name to its settings:
    ``{"assistant": True, "verification_policy": "fixed", ...}`` runs DSpark with those drafter generation settings
    (``"drafter": obj`` picks another drafter than ``drafter``); ``{"assistant": False}`` is plain ``generate()``;
    ``{"prompt_lookup": 7}`` transformers' prompt-lookup decoding. ``"stock_linears": True`` runs a method on the
    target's stock linears where ``hf_dspark.optimize_target`` prepacked them (the baseline without this library)."""
    from ..optimization import stock_linears

    sample = temperature > 0
    turns = record["turns"] if multi_turn else record["turns"][:1]
    histories = {name: [] for name in methods}
    results = {name: MethodResult() for name in methods}
    baseline = next(iter(methods))
    for turn_index, turn in enumerate(turns):
        baseline_ids, baseline_history = None, histories[baseline]
        for name, settings in methods.items():
            messages = histories[name] + [{"role": "user", "content": turn}]
            inputs = chat_inputs(tokenizer, messages)
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sample)
            if sample:
                kwargs.update(temperature=temperature, top_p=None, top_k=None)
            method_drafter = settings.get("drafter", drafter)
            overrides = {k: v for k, v in settings.items() if k in GENERATION_SETTINGS}
            unknown = set(settings) - set(GENERATION_SETTINGS) - {"assistant", "drafter", "prompt_lookup", "stock_linears"}
            if unknown:
                raise ValueError(f"method {name!r}: unknown settings {sorted(unknown)}")
            if settings.get("assistant"):
                if method_drafter is None:
                    raise ValueError(f"method {name!r} needs a drafter")
                kwargs["assistant_model"] = method_drafter
            elif settings.get("prompt_lookup"):
                kwargs["prompt_lookup_num_tokens"] = settings["prompt_lookup"]
            context = drafter_settings(method_drafter, overrides) if settings.get("assistant") else contextlib.nullcontext()
            with context, stock_linears(target) if settings.get("stock_linears") else contextlib.nullcontext():
                torch.manual_seed(seed * 100_003 + turn_index)
                start = time.perf_counter()
                out = target.generate(**inputs, **kwargs)
                elapsed = time.perf_counter() - start
            new = out[0, inputs["input_ids"].shape[1]:]
            if name == baseline:
                baseline_ids, same = new, None
            else:  # compared while the histories agree (an earlier turn that differed changes this turn's prompt)
                same = (None if baseline_ids is None or histories[name] != baseline_history
                        else bool(torch.equal(new, baseline_ids)))
            results[name].add(len(new), elapsed, method_drafter.last_stats if settings.get("assistant") else None,
                              same)
            histories[name] = messages + [{"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)}]
    return results


def batched_rollouts(target, tokenizer, records: list[dict], methods: dict[str, dict], max_new_tokens: int = 256,
                     temperature: float = 0.0, seed: int = 0, multi_turn: bool = True, concurrency: int = 16,
                     progress: bool = True, desc: str = "") -> list[dict[str, MethodResult]]:
    """``rollout_record`` for many records at once through the batched engine: each method serves ``concurrency``
    requests together, turn by turn (turn t of every record once all its turn t-1 answers exist; multi-turn records
    feed each method its OWN previous answers, as ``rollout_record`` does).

    Only drafting methods with a fixed verification length fit here (``{"assistant": True, "drafter": d,
    "verification_policy": "fixed", "num_verify_tokens": n or None}``): they record the same per-round events as
    ``generate()`` and are what the quality analyses need. Timings are not comparable to ``generate()`` (batched), so
    each result's seconds are the request's own time in the batch. Returns one ``{method: MethodResult}`` per record."""
    from tqdm.auto import tqdm

    from ..engine import DSparkEngine, SamplingParams

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    for name, settings in methods.items():
        if (not settings.get("assistant") or settings.get("drafter") is None
                or settings.get("verification_policy", "fixed") != "fixed"
                or set(settings) - {"assistant", "drafter", "verification_policy", "num_verify_tokens"}):
            raise ValueError(f"method {name!r}: batched rollouts run drafting methods with a fixed verification "
                             f"length and an explicit drafter only, got {sorted(settings)}")
    params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                            temperature=temperature if temperature > 0 else 1.0)
    turns = [r["turns"] if multi_turn else r["turns"][:1] for r in records]
    results = [{name: MethodResult() for name in methods} for _ in records]
    total = len(methods) * sum(len(t) for t in turns)
    with tqdm(total=total, desc=desc or "rollouts", unit="turn", disable=not progress) as bar:
        for m, (name, settings) in enumerate(methods.items()):
            histories: list[list[dict]] = [[] for _ in records]
            for turn_index in range(max(len(t) for t in turns)):
                engine = DSparkEngine(target, settings["drafter"], policy="fixed", optimize_target=None,
                                      num_verify_tokens=settings.get("num_verify_tokens"),
                                      max_concurrency=concurrency, seed=seed * 1_000_003 + 1000 * m + turn_index)
                waiting: dict[str, tuple[int, list[dict]]] = {}
                for i, record_turns in enumerate(turns):
                    if turn_index < len(record_turns):
                        messages = histories[i] + [{"role": "user", "content": record_turns[turn_index]}]
                        prompt = chat_inputs(tokenizer, messages)["input_ids"][0].tolist()
                        waiting[engine.add_request(prompt, params)] = (i, messages)
                for event in engine.stream():
                    bar.update(int(event.finished))
                for request_id, (i, messages) in waiting.items():
                    out = engine.outputs[request_id]
                    results[i][name].add(len(out.token_ids), out.finish_s - out.start_s, out.stats)
                    if turn_index + 1 < len(turns[i]):  # the answer is only needed as the next turn's history
                        answer = tokenizer.decode(out.token_ids, skip_special_tokens=True)
                        histories[i] = messages + [{"role": "assistant", "content": answer}]
    return results


def summarise(per_method: dict[str, MethodResult], baseline: str | None = None) -> dict[str, dict]:
    """Summaries per method; with a baseline, each gets ``speedup`` = its tokens/s over the baseline's, and where
    the baseline is another method than ``plain`` (plain on stock linears), ``speedup_vs_plain`` over ``plain``'s."""
    out = {name: r.summary() for name, r in per_method.items()}
    for reference, key in ((baseline, "speedup"), ("plain" if baseline != "plain" else None, "speedup_vs_plain")):
        if reference is not None and reference in out:
            base = out[reference]["tokens_per_s"]
            for name in out:
                out[name][key] = out[name]["tokens_per_s"] / base if base else None
    return out


def run_rollouts(target, tokenizer, drafter, prompt_paths, methods: dict[str, dict], num_prompts: int | None = 50,
                 max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0, multi_turn: bool = True,
                 progress: bool = True, log_path: str | Path | None = None) -> dict:
    """``rollout_record`` over the first ``num_prompts`` prompts of each set, aggregated per set (``set/<name>``),
    per domain (``domain/<name>``) and overall (``all``). The first method is the speed baseline."""
    from tqdm.auto import tqdm

    records = load_prompts(prompt_paths)
    by_set: dict[str, list[dict]] = {}
    for r in records:
        by_set.setdefault(r["set"], []).append(r)
    chosen = [r for rs in by_set.values() for r in (rs[:num_prompts] if num_prompts else rs)]
    results: dict[str, dict[str, MethodResult]] = {}
    for index, record in enumerate(tqdm(chosen, desc="rollouts", unit="prompt", disable=not progress)):
        per_method = rollout_record(target, tokenizer, record, methods, drafter, max_new_tokens, temperature,
                                    seed * 1_000_003 + index, multi_turn)
        for group in (f"set/{record['set']}", f"domain/{record['domain']}", "all"):
            for name, result in per_method.items():
                results.setdefault(group, {}).setdefault(name, MethodResult()).merge(result)
        if log_path is not None:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"done": index + 1, "total": len(chosen), "id": record["id"]}) + "\n")
    return {group: summarise(per_method, next(iter(methods))) for group, per_method in results.items()}
