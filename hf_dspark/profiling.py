"""SPS(B) profiling: target forward steps per second with B tokens in the verification batch.

Measured on the actual device, dtype and thread count, at a few context lengths, with warm-up and repeats whose
fastest run counts (a shared machine's noise only ever adds time), under a time budget. Profiles are cached as JSON keyed by
model / device / dtype / threads, so ``generate`` profiles automatically once and reuses the result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .attention import packed_attention
from .machine_load import BUSY_SHARE, OthersLoad, others_load_now
from .optimization import linears_state
from .scheduling import StepsPerSecond
from .target import cache_root, write_json_atomically

logger = logging.getLogger(__name__)


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
        # stock or oneDNN-prepacked linears (hf_dspark.optimization): each prices verification widths differently
        "linears": linears_state(model),
        # round-robin timing, fastest repeat, monotone fit, context model, packed attention; bump when the
        # measurement changes (old caches are ignored)
        "method": 4,
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The contexts a generate() profile times each B at: a short one and one long enough that the growth of a forward's
# cost with its context is measured rather than guessed (capped by the target's own context); the line through the
# two is each B's context model.
PROFILE_CONTEXTS = (256, 2048)
# The context the profiled curve stands for; other contexts are read from each B's line (StepsPerSecond.at_context).
REFERENCE_CONTEXT = 256
# A context model needs a measured context at least this long (else the profile is one curve for every context).
MIN_MODELLED_CONTEXT = 1024


# A profile's times are the fastest of their repeats (noise on a shared machine only adds time). Once a timed round
# confirms the fastest times so far (each width's time in it within ``SETTLED`` of that width's fastest before it),
# two rounds agree and the profile stops repeating: two timed rounds on a quiet machine, up to ``repeats`` on a
# noisy one, where rounds disagree.
SETTLED = 0.05
MIN_TIMED_ROUNDS = 2


def settled(fastest: dict, this_round: dict, share: float = SETTLED) -> bool:
    """Whether ``this_round``'s times confirm the ``fastest`` times of the rounds before it: every key was timed
    before, and this round's time is within ``share`` of it, faster or slower."""
    return all(key in fastest and abs(this_round[key] - fastest[key]) <= share * fastest[key] for key in this_round)


def context_model(raw: dict[int, dict[int, list[float]]], reference: int = REFERENCE_CONTEXT
                  ) -> tuple[list[float], list[float] | None]:
    """Per B, from its fastest forward at each context: steps/s at ``reference`` and seconds per context token, the
    least-squares line through (context, seconds). Without a context of ``MIN_MODELLED_CONTEXT`` tokens the curve
    is the median over contexts and there are no slopes. Rates are fitted non-increasing in B, slopes
    non-decreasing (a wider forward never gains less per cached token)."""
    contexts = sorted({c for per_context in raw.values() for c in per_context})
    if not contexts or contexts[-1] < MIN_MODELLED_CONTEXT:
        return monotone_fit([statistics.median(1.0 / min(t) for t in raw[b].values()) for b in raw],
                            decreasing=True), None
    rates, slopes = [], []
    for b in raw:
        xs = sorted(raw[b])
        ys = [min(raw[b][c]) for c in xs]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
                 / sum((x - mean_x) ** 2 for x in xs)) if len(xs) > 1 else 0.0
        slope = max(0.0, slope)
        rates.append(1.0 / max(mean_y + slope * (reference - mean_x), min(ys) * 0.5))
        slopes.append(slope)
    return monotone_fit(rates, decreasing=True), monotone_fit(slopes)


@torch.no_grad()
def measure_steps_per_second(model, batch_tokens: list[int], context_lengths: list[int] = PROFILE_CONTEXTS,
                             repeats: int = 5, time_budget_s: float = 60.0) -> tuple[StepsPerSecond, dict]:
    """Steps/s for each B from its fastest repeat at each context (at most ``repeats`` timed rounds per context,
    fewer once a round confirms the fastest: ``settled``), with the context model of ``context_model``
    when a long context was reached within the budget; returns the curve and raw timings. The forwards run under
    ``packed_attention``, as DSpark-assisted generate() runs its verifications."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    from tqdm.auto import tqdm

    started = time.perf_counter()
    longest = model.config.get_text_config().max_position_embeddings - max(batch_tokens) - 1
    context_lengths = sorted({min(int(c), longest) for c in context_lengths})
    raw: dict[int, dict[int, list[float]]] = {b: {} for b in batch_tokens}
    bar = tqdm(total=len(context_lengths) * (repeats + 1), desc="profiling SPS(B)", unit="round", leave=False)
    for context in context_lengths:
        ids = torch.randint(0, vocab, (1, context), generator=generator).to(device)
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        cache.activate_past_recording()  # sliding-window layers keep what each timed forward adds, so it crops back
        inputs = {b: (torch.randint(0, vocab, (1, b), generator=generator).to(device),
                      torch.arange(context, context + b, device=device).unsqueeze(0)) for b in batch_tokens}
        # Round-robin over B (one warm-up round first), so that load drift does not bias particular B.
        for r in range(repeats + 1):
            before = {b: min(raw[b][context]) for b in batch_tokens if raw[b].get(context)}
            for b in batch_tokens:
                step_ids, positions = inputs[b]
                _sync(device)
                t0 = time.perf_counter()
                with packed_attention(model):
                    model(input_ids=step_ids, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=b)
                _sync(device)
                elapsed = time.perf_counter() - t0
                cache.crop(-b)
                if r:
                    raw[b].setdefault(context, []).append(elapsed)
            bar.update()
            if r and time.perf_counter() - started > time_budget_s:
                break
            if r >= MIN_TIMED_ROUNDS and settled(before, {b: raw[b][context][-1] for b in batch_tokens}):
                bar.update(repeats - r)
                break
        if time.perf_counter() - started > time_budget_s:
            break
    bar.close()
    # a context is used only where every B was timed there (the budget may stop inside one)
    complete = [c for c in context_lengths if all(c in raw[b] for b in batch_tokens)]
    measured = ({b: {c: raw[b][c] for c in complete} for b in batch_tokens} if complete
                else {b: raw[b] for b in batch_tokens if raw[b]})
    sps, slopes = context_model(measured)
    curve = StepsPerSecond(list(measured), sps, max(measured),
                           None if slopes is None else REFERENCE_CONTEXT, slopes)
    return curve, {str(b): {str(c): t for c, t in v.items()} for b, v in raw.items()}


def monotone_fit(values: Sequence[float], weights: Sequence[float] | None = None,
                 decreasing: bool = False) -> list[float]:
    """The weighted least-squares monotone fit of ``values`` (pool adjacent violators): runs that go the wrong way
    are replaced by their weighted mean (``weights``: 1 each when None), merging until the sequence never decreases
    (never increases with ``decreasing``). More tokens per forward are never faster, so a measured rise of steps
    per second (or a fall of cost) is noise; averaging it with its neighbours keeps the curve honest without
    favouring any point."""
    weights = [1.0] * len(values) if weights is None else weights
    if len(values) != len(weights) or any(w <= 0 for w in weights):
        raise ValueError("need one positive weight per value")
    sign = -1.0 if decreasing else 1.0
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(values, weights):
        blocks.append([sign * float(value), float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean2, weight2, count2 = blocks.pop()
            mean1, weight1, count1 = blocks.pop()
            blocks.append([(mean1 * weight1 + mean2 * weight2) / (weight1 + weight2), weight1 + weight2,
                           count1 + count2])
    return [sign * mean for mean, _, count in blocks for _ in range(int(count))]


def profile_path(model, folder: Path | None = None) -> Path:
    key = profile_key(model)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (folder or cache_root() / "profiles") / f"sps-{digest}.json"


def load_or_profile(model, max_batch_tokens: int, folder: Path | None = None, time_budget_s: float = 60.0,
                    repeats: int = 5, context_lengths: list[int] = PROFILE_CONTEXTS,
                    remeasure: bool = False) -> StepsPerSecond:
    """The cached profile for this model/device/dtype/threads covering ``max_batch_tokens``; profiles if absent, if
    ``remeasure``, or if the cached one is stale (``stale_reason``)."""
    path = profile_path(model, folder)
    if path.is_file() and not remeasure:
        data = json.loads(path.read_text())
        sps = StepsPerSecond.from_dict(data["profile"])
        stale = stale_reason(data)
        if stale is None and sps.max_batch_tokens >= max_batch_tokens:
            return sps
        if stale is not None:
            logger.warning("re-measuring the cached SPS profile %s: %s", path.name, stale)
        after_contradiction = bool(data.get("contradicted"))
    else:
        after_contradiction = False
    batch_tokens = sorted(set([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]) & set(
        range(1, max_batch_tokens + 1)) | {max_batch_tokens})
    with OthersLoad() as load:
        sps, raw = measure_steps_per_second(model, batch_tokens, list(context_lengths), repeats, time_budget_s)
    if load.busy:
        logger.warning("the SPS profile was measured while other processes used %.0f%% of the CPUs, so it prices "
                       "rounds as a busy machine runs them; it is re-measured once the machine is quiet "
                       "(`hf-dspark profile --remeasure` does it at once)", 100 * load.share)
    payload = {"key": profile_key(model), "profile": sps.to_dict(), "raw_seconds": raw,
               "context_lengths": list(context_lengths), "repeats": repeats, "created": time.time(),
               "others_load": load.share, "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
               # a profile measured again because rounds contradicted the last one is not marked again (no loop of
               # re-measuring where rounds and profile differ for a steady reason)
               "after_contradiction": after_contradiction}
    write_json_atomically(path, payload)
    return sps


# A cached profile whose rounds ran this many times faster or slower than it predicts is re-measured.
CONTRADICTION = 1.6
# Rounds a generate() call needs before its timings can contradict the profile.
MIN_CHECKED_ROUNDS = 8


# A busy profile's "is the machine quiet now" check sleeps a moment; it runs at most this often per profile.
QUIET_RECHECK_S = 60.0
_QUIET_CHECKED: dict[str, float] = {}


def stale_reason(data: dict) -> str | None:
    """Why a cached profile must be measured again, or None: measured rounds contradicted it
    (``check_against_rounds``), or it was measured on a busy machine and the machine is quiet now."""
    contradicted = data.get("contradicted")
    if contradicted:
        return (f"{contradicted['rounds']} generate() rounds ran at {contradicted['ratio']:.2f}x the time it "
                f"predicts")
    share = data.get("others_load")
    if share is not None and share > BUSY_SHARE and time.monotonic() >= _QUIET_CHECKED.get(str(data.get("created")), 0):
        _QUIET_CHECKED[str(data.get("created"))] = time.monotonic() + QUIET_RECHECK_S
        now = others_load_now()
        if now is not None and now <= BUSY_SHARE / 2:
            return (f"it was measured while other processes used {100 * share:.0f}% of the CPUs, and they use "
                    f"{100 * now:.0f}% now")
    return None


def check_against_rounds(model, stats, prompt_length: int, folder: Path | None = None) -> float | None:
    """Compare a generate() call's verification times (``stats``: ``DSparkStats``) with what the model's cached
    profile predicts for each round's width at its context; returns the median ratio measured / predicted (None
    without a cached profile, CPU clock stamps or ``MIN_CHECKED_ROUNDS`` rounds). A ratio past ``CONTRADICTION``
    either way marks the cached profile contradicted, so the next ``load_or_profile`` measures it again."""
    path = profile_path(model, folder)
    stamps = stats.stamps
    if not path.is_file() or len(stamps) < MIN_CHECKED_ROUNDS or not isinstance(stamps[0][1], float):
        return None
    data = json.loads(path.read_text())
    sps = StepsPerSecond.from_dict(data["profile"])
    ratios, context = [], prompt_length
    for stamp, verified, accepted in zip(stamps, stats.verified, stats.accepted):
        width = verified + 1
        if width <= sps.max_batch_tokens:
            ratios.append((stamp[2] - stamp[1]) * sps.at_context(context)(width))
        context += accepted + 1
    if len(ratios) < MIN_CHECKED_ROUNDS:
        return None
    ratio = statistics.median(ratios)
    if ((ratio > CONTRADICTION or ratio < 1 / CONTRADICTION) and not data.get("contradicted")
            and not data.get("after_contradiction")):
        logger.warning("generate()'s rounds ran at %.2fx the time the cached SPS profile %s predicts; it is "
                       "re-measured at its next use", ratio, path.name)
        data["contradicted"] = {"ratio": ratio, "rounds": len(ratios), "at": time.time()}
        write_json_atomically(path, data)
    return ratio


# ------------------------------------------------------------------------------------------------------------------
# Batched verification steps (hf_dspark.engine)
# ------------------------------------------------------------------------------------------------------------------
class BatchedStepsPerSecond:
    """SPS of batched verification steps over the TOTAL verification tokens B of the batch, profiled at a few
    batch sizes (number of requests R).

    The engine runs a padded batch, so a step's cost depends on R and on the tokens per request; for R requests the
    curve is read from the nearest profiled batch size R' >= R (else the largest) at the same tokens per request:
    ``SPS_R(B) = SPS_R'(B * R' / R)``. Values between profiled points are linearly interpolated, and B never goes
    past the profiled range.
    """

    def __init__(self, curves: dict[int, StepsPerSecond]):
        if not curves:
            raise ValueError("a batched SPS profile needs at least one batch size")
        self.curves = {int(r): c for r, c in sorted(curves.items())}

    def curve_for(self, num_requests: int) -> tuple[int, StepsPerSecond]:
        sizes = list(self.curves)
        size = next((s for s in sizes if s >= num_requests), sizes[-1])
        return size, self.curves[size]

    def table(self, num_requests: int, max_batch_tokens: int | None = None, device=None) -> torch.Tensor:
        """SPS for B = 0..max_batch_tokens total tokens with ``num_requests`` requests (index 0 unused: 0)."""
        import numpy as np

        if num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {num_requests}")
        size, curve = self.curve_for(num_requests)
        scale = size / num_requests
        profiled = int(curve.max_batch_tokens / scale)
        top = profiled if max_batch_tokens is None else min(int(max_batch_tokens), profiled)
        b = np.arange(top + 1, dtype=np.float64) * scale
        values = np.interp(b, curve.batch_tokens, curve.steps_per_sec)
        values[0] = 0.0
        return torch.tensor(values, dtype=torch.float32, device=device)

    def to_dict(self) -> dict:
        return {"curves": {str(r): c.to_dict() for r, c in self.curves.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "BatchedStepsPerSecond":
        if "curves" not in data:
            raise ValueError("batched SPS profile lacks 'curves'")
        return cls({int(r): StepsPerSecond.from_dict(c) for r, c in data["curves"].items()})


def powers_of_two_with(values) -> list[int]:
    """The powers of two up to the largest of ``values``, and the values themselves, sorted: the batch sizes a
    batched profile covers for a set of concurrencies (and the wide widths it times)."""
    top = max(int(v) for v in values)
    return sorted({1 << k for k in range(top.bit_length())} | {int(v) for v in values})


# A batched profile's most timed rounds: fewer than a generate() profile's, since the engine reprices every width it
# runs from its own verify timings (``engine/pricing.py``) and the profile only has to start it near the truth.
BATCHED_REPEATS = 3
# Up to this many tokens in the batch, a batched profile times every width q (see ``profiled_widths``).
EVERY_WIDTH_TOKENS = 32


def profiled_widths(num_requests: int, tokens_per_request: int) -> list[int]:
    """The new tokens per row q that a batched profile times for ``num_requests`` rows of up to
    ``tokens_per_request``: every q while the batch holds at most ``EVERY_WIDTH_TOKENS`` tokens, where a step's cost
    moves in steps as the matmul kernels change their blocking (on one CPU SmolLM2's step costs 1.4x more at 4
    tokens than at 3, and linear interpolation from the powers of two would price 2 rows x 5-7 tokens 11-13% too
    cheap); past that, the powers of two and the widest, between which a padded step's cost grows close to linearly
    in R * q (``table`` interpolates, and the engine reprices the curve from the steps it runs: ``adapt_sps``)."""
    if num_requests < 1 or tokens_per_request < 1:
        raise ValueError(f"a batched profile needs >= 1 row and >= 1 token per row, got {num_requests} x "
                         f"{tokens_per_request}")
    every = {q for q in range(1, tokens_per_request + 1) if num_requests * q <= EVERY_WIDTH_TOKENS}
    return sorted(every | set(powers_of_two_with([tokens_per_request])))


@torch.no_grad()
def measure_batched_steps_per_second(model, num_requests: int, tokens_per_request: list[int], context_length: int = 256,
                                     repeats: int = BATCHED_REPEATS, hidden_state_indices: list[int] | None = None,
                                     time_budget_s: float = 60.0) -> tuple[StepsPerSecond, dict]:
    """Steps/s of the engine's verification forward: ``num_requests`` rows of ``context_length`` cached tokens each,
    ``q`` new tokens per row (the padded batch the engine runs), for each q in ``tokens_per_request``.

    Returns SPS over the total tokens B = R * q, and the raw timings (the fastest of ``repeats`` after a warm-up
    counts: noise on a shared machine only adds time, and a median of five taken while it drifts priced SmolLM2's
    8-token step at one request 1.58x a 1-token step where the engine's own steps measured 1.1-1.3x, so the
    scheduler verified short and never timed the wide steps that would have shown it). Repeats stop once a round
    confirms the fastest times (``settled``); past ``time_budget_s`` no further repeat starts (the warm-up and one timed
    round always run).
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    ids = torch.randint(0, vocab, (num_requests, context_length), generator=generator).to(device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    cache.activate_past_recording()  # sliding-window layers keep what each timed forward adds, so it crops back
    extra = {"output_hidden_states": list(hidden_state_indices)} if hidden_state_indices else {}
    raw: dict[int, list[float]] = {q: [] for q in tokens_per_request}
    inputs = {}
    for q in tokens_per_request:
        inputs[q] = (torch.randint(0, vocab, (num_requests, q), generator=generator).to(device),
                     torch.arange(context_length, context_length + q, device=device).expand(num_requests, -1),
                     torch.ones(num_requests, context_length + q, dtype=torch.long, device=device))
    # Round-robin over q (one warm-up round first): drift in machine load hits every q alike instead of biasing
    # whichever q was measured during a slow spell.
    for r in range(repeats + 1):
        before = {q: min(raw[q]) for q in tokens_per_request if raw[q]}
        for q in tokens_per_request:
            step_ids, positions, mask = inputs[q]
            _sync(device)
            t0 = time.perf_counter()
            with packed_attention(model):  # as the engine runs its forwards
                model(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                      **extra)
            _sync(device)
            elapsed = time.perf_counter() - t0
            cache.crop(-q)
            if r:
                raw[q].append(elapsed)
        if r and time.perf_counter() - started > time_budget_s:
            break
        if r >= MIN_TIMED_ROUNDS and settled(before, {q: raw[q][-1] for q in tokens_per_request}):
            break
    measured = sorted(q for q in raw if raw[q])
    batch_tokens = [num_requests * q for q in measured]
    sps = monotone_fit([1.0 / min(raw[q]) for q in measured], decreasing=True)
    return StepsPerSecond(batch_tokens, sps, max(batch_tokens)), {str(q): t for q, t in raw.items()}


def load_or_profile_batched(model, batch_sizes: list[int], tokens_per_request: int, folder: Path | None = None,
                            context_length: int = 256, repeats: int = BATCHED_REPEATS,
                            hidden_state_indices: list[int] | None = None,
                            time_budget_s: float = 60.0, progress=None) -> BatchedStepsPerSecond:
    """The cached batched SPS profile covering ``batch_sizes`` requests with up to ``tokens_per_request`` tokens each
    (the widths of ``profiled_widths``); measures only what the cache lacks, per batch size, smallest first.

    ``time_budget_s`` bounds the whole profile: each batch size still to measure gets an even share of what is left
    (what a small size leaves unused goes to the larger ones), and a size past its share stops repeating after its
    first timed round. The seconds each size took are kept in the cache file (``"seconds"``) and logged.

    ``progress(done, sizes, seconds)``, when given, hears before the first size and after each one: the batch sizes
    measured so far, all those to measure, and the seconds spent (nothing when the cache covers every size)."""
    # "attention": the engine's verify forwards fold grouped query heads (hf_dspark.attention); profiles timed
    # with transformers' per-head KV copy price wide steps too high and are not reused. "widths": which q are timed.
    key = {**profile_key(model), "kind": "batched", "context_length": context_length, "attention": "packed-gqa",
           "widths": f"every-to-{EVERY_WIDTH_TOKENS},pow2"}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = (folder or cache_root() / "profiles") / f"sps-batched-{digest}.json"
    data = json.loads(path.read_text()) if path.is_file() else {"key": key, "curves": {}, "raw_seconds": {}}
    data.setdefault("seconds", {})
    missing = []
    for size in sorted(set(int(s) for s in batch_sizes)):
        cached = data["curves"].get(str(size))
        if cached is None or cached["max_batch_tokens"] < size * tokens_per_request:
            missing.append(size)
    started = time.perf_counter()
    for i, size in enumerate(missing):
        if progress is not None:
            progress(missing[:i], missing, time.perf_counter() - started)
        share = max(0.0, time_budget_s - (time.perf_counter() - started)) / (len(missing) - i)
        size_started = time.perf_counter()
        sps, raw = measure_batched_steps_per_second(model, size, profiled_widths(size, tokens_per_request),
                                                    context_length, repeats, hidden_state_indices, share)
        seconds = time.perf_counter() - size_started
        logger.info("batched SPS profile: %d request(s) x q = %s in %.1f s", size, list(map(int, raw)), seconds)
        data["curves"][str(size)] = sps.to_dict()
        data["raw_seconds"][str(size)] = raw
        data["seconds"][str(size)] = round(seconds, 3)
        # Kept after every size: an interrupted profile loses at most the size it was measuring.
        data["created"] = time.time()
        write_json_atomically(path, data)
    if progress is not None and missing:
        progress(missing, missing, time.perf_counter() - started)
    wanted = {str(int(s)) for s in batch_sizes}
    return BatchedStepsPerSecond.from_dict({"curves": {r: c for r, c in data["curves"].items() if r in wanted}})


def export_sps(sps: StepsPerSecond, path: str | Path) -> Path:
    """Write the serving-engine SPS format: sample_batch_tokens / sample_steps_per_sec / max_batch_tokens."""
    path = Path(path)
    path.write_text(json.dumps(sps.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path
