"""What a ``DSparkEngine`` measures about its hardware, kept apart from any one engine.

The engine prices its decisions with timings of past steps: the drafter's forward per number of drafting rows, the
verify forward per (rows, block width), and the tokens per second whole steps delivered at each batch size with and
without drafting (the realized gate). An engine that starts from nothing pays to learn these: its first steps at a
new batch size draft before anything says whether drafting pays there. A server learns them once; so can a set of
engines that share one ``EngineMeasurements`` (pass the same object to each), and ``save`` / ``load`` carry them
across processes. A file is keyed by target, drafter, device, dtype and thread count: measurements taken under
other conditions are refused, not reused.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from pathlib import Path

from ..gate import RealizedGate, RoundWindow, realized_window
from ..scheduling import EMA_WEIGHT, ema

VERIFY_WINDOW = 16  # recent verify timings per (rows, width) whose median is its price
CATCH_UP_WINDOW = 16  # recent context catch-ups behind the price of a catch-up per position
MODEL_WINDOW = 32  # recent steps per (batch size bucket, drafted) behind the cost model's realized factor
MODEL_PRIOR_STEPS = 2.0  # a factor from n steps moves n / (n + this) of the way from 1 (in log scale)


def rows_bucket(rows: int) -> int:
    """Power-of-two bucket of a number of rows (the drafter's cost and the cost model's checks are kept per bucket)."""
    return 1 << max(0, (rows - 1).bit_length())


def measurement_key(target, drafter) -> dict:
    """What the measurements depend on: the target's profile key (model, device, dtype, threads, torch) and the
    drafter (name, size, block size)."""
    from ..profiling import profile_key

    key = {**profile_key(target), "kind": "engine"}
    if drafter is not None:
        key["drafter"] = str(getattr(drafter.config, "_name_or_path", "") or type(drafter).__name__)
        key["drafter_parameters"] = sum(p.numel() for p in drafter.parameters())
        key["block_size"] = int(drafter.config.block_size)
    return key


def _comparable(field: str, value):
    """A key's value as compared: a model or drafter named by a local folder by that folder's real path, so the same
    checkpoint named relatively (from one working directory) and absolutely (from a script) is one setup."""
    if field in ("model", "drafter") and isinstance(value, str) and value and os.path.isdir(value):
        return os.path.realpath(value)
    return value


class EngineMeasurements(RealizedGate):
    """An engine's recent step timings, shareable across engines and savable as JSON.

    - ``draft_cost[bucket]``: seconds of one drafter forward for a number of drafting rows (power-of-2 bucket);
    - ``verify_cost[(rows, width)]``: seconds of one verify forward of ``rows`` requests ``width`` tokens wide: the
      median of its last ``VERIFY_WINDOW`` timings (a hiccup of a shared machine does not move it, where a moving
      average of a rarely run width is mostly its last few timings), and ``verify_count[(rows, width)]`` how many
      timings it has seen (``timings``: how many stand behind the price, which decides how far the engine trusts it
      over the profile);
    - ``realized[(rows, drafted)]``: ``(tokens, seconds)`` of the last ``realized_window(rows)`` whole steps
      (drafter, context catch-up, verification and bookkeeping) at ``rows`` active requests, with some request
      drafting or none; their rate is total tokens over total seconds, so one slow step (a hiccup of a shared
      machine) moves it by a thirty-second (less in longer windows), not by the 30% a moving average would. The
      tokens are counted as ``gate_tokens`` says (``DSparkEngine(gate_tokens=)``: the batch's progress, or the
      tokens emitted; files written before it have emitted tokens);

    - ``catch_up``: the last ``CATCH_UP_WINDOW`` context catch-ups, ``(positions, seconds)``: a drafting step first
      projects the target features its rows verified while they did not draft; ``catch_up_seconds(positions)`` prices
      the next one at their total seconds over total positions (the realized gate's price of a re-measurement);

    - ``confidence_sum`` / ``confidence_count``: the summed per-position confidences of every draft measured, whose
      mean (``confidence_prior``) a joining request starts from (``DSparkEngine(confidence_prior=True)``): a new
      engine sharing these measurements does not draft every first request just to learn what earlier ones showed;
    - ``model_checks[(bucket, drafted)]``: for the last ``MODEL_WINDOW`` steps whose drafting decision the engine's
      cost model made, at a power-of-two bucket of batch sizes: ``(predicted tokens, modeled seconds, emitted
      tokens, seconds)``; ``model_factor`` is what they delivered over what the model predicted (in memory only).

    ``version`` increases with every verify timing (the engine rebuilds its repriced SPS tables on a change).
    """

    def __init__(self, key: dict | None = None):
        super().__init__()
        self.key = key
        self.draft_cost: dict[int, float] = {}
        self.verify_cost: dict[tuple[int, int], float] = {}
        self.verify_count: dict[tuple[int, int], int] = {}
        self._verify_window: dict[tuple[int, int], deque[float]] = {}
        self.model_checks: dict[tuple[int, bool], deque[tuple[float, float, float, float]]] = {}
        # (positions, seconds) pairs with running totals: the same window as the realized gate's (tokens, seconds)
        self.catch_up = RoundWindow(maxlen=CATCH_UP_WINDOW)
        self.confidence_sum: list[float] | None = None
        self.confidence_count = 0
        self.version = 0
        # how the realized windows count a step's tokens (``DSparkEngine(gate_tokens=)``); None until an engine binds
        self.gate_tokens: str | None = None

    # -- recording -----------------------------------------------------------------------------------------------
    def record_draft(self, bucket: int, seconds: float) -> None:
        self.draft_cost[bucket] = ema(self.draft_cost.get(bucket), seconds)

    def record_verify(self, rows: int, width: int, seconds: float) -> None:
        key = (rows, width)
        window = self._verify_window.setdefault(key, deque(maxlen=VERIFY_WINDOW))
        window.append(float(seconds))
        self.verify_cost[key] = statistics.median(window)
        self.verify_count[key] = self.verify_count.get(key, 0) + 1
        self.version += 1

    def record_catch_up(self, positions: int, seconds: float) -> None:
        """One context catch-up: ``positions`` pending target positions projected in ``seconds``."""
        if positions < 1 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a catch-up needs positions >= 1 and finite seconds >= 0, got {positions}, {seconds}")
        self.catch_up.append((int(positions), float(seconds)))

    def catch_up_seconds(self, positions: int) -> float:
        """The expected seconds of catching up ``positions`` pending positions (0 before any catch-up was timed)."""
        rate = self.catch_up.rate()  # positions per second (None before the first, inf for free ones)
        return positions / rate if rate else 0.0

    def record_confidences(self, total: list[float], count: int) -> None:
        """Add ``count`` drafts whose per-position confidences sum to ``total``."""
        if self.confidence_sum is not None and len(total) != len(self.confidence_sum):
            raise ValueError(f"confidences of {len(total)} positions, the measurements hold {len(self.confidence_sum)}")
        self.confidence_sum = (list(map(float, total)) if self.confidence_sum is None
                               else [a + float(b) for a, b in zip(self.confidence_sum, total)])
        self.confidence_count += int(count)

    def confidence_prior(self) -> list[float] | None:
        """The mean per-position confidences of every draft measured, or None before the first."""
        if not self.confidence_count or self.confidence_sum is None:
            return None
        return [v / self.confidence_count for v in self.confidence_sum]

    def record_model_check(self, bucket: int, drafted: bool, predicted_tokens: float, modeled_seconds: float,
                           emitted: int, seconds: float) -> None:
        """One step the cost model decided at batch size ``bucket``: the tokens and seconds it predicted for the side
        it chose (``drafted`` or plain), and what the step emitted and took (the whole step)."""
        if predicted_tokens <= 0 or modeled_seconds <= 0 or seconds <= 0:
            raise ValueError(f"a model check needs positive predictions and timing, got {predicted_tokens}, "
                             f"{modeled_seconds}, {seconds}")
        self.model_checks.setdefault((bucket, drafted), deque(maxlen=MODEL_WINDOW)).append(
            (float(predicted_tokens), float(modeled_seconds), float(emitted), float(seconds)))

    def model_factor(self, bucket: int, drafted: bool) -> float:
        """Tokens per second the recent steps of one side delivered over what the cost model predicted for them
        (total over total), at ``bucket`` or the nearest bucket with steps of that side; shrunk toward 1 by
        ``MODEL_PRIOR_STEPS`` in log scale; 1 when nothing was checked. The model prices the verify forward and the
        drafter; the factor carries what it leaves out (context catch-up, bookkeeping, compaction) and how far the
        stale confidences' predicted acceptance missed."""
        buckets = [b for (b, d) in self.model_checks if d == drafted]
        if not buckets:
            return 1.0
        nearest = min(buckets, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), b))
        window = self.model_checks[(nearest, drafted)]
        predicted = sum(p for p, _, _, _ in window) / sum(m for _, m, _, _ in window)
        realized = sum(e for _, _, e, _ in window) / sum(t for _, _, _, t in window)
        weight = len(window) / (len(window) + MODEL_PRIOR_STEPS)
        return math.exp(weight * math.log(max(realized, 1e-9) / predicted))

    def timings(self, rows: int, width: int) -> int:
        """How many verify timings stand behind ``verify_cost[(rows, width)]``: those seen, up to the median's
        ``VERIFY_WINDOW`` (1 for a price set without a count; 0 when there is none)."""
        if (rows, width) not in self.verify_cost:
            return 0
        return min(self.verify_count.get((rows, width), 1), VERIFY_WINDOW)

    # -- keys and files ------------------------------------------------------------------------------------------
    def bind(self, key: dict) -> None:
        """Adopt ``key`` when unkeyed; refuse measurements taken for another target / drafter / device / dtype /
        thread count."""
        if self.key is None:
            self.key = dict(key)
            return
        differing = sorted(k for k in set(self.key) | set(key)
                           if _comparable(k, self.key.get(k)) != _comparable(k, key.get(k)))
        if differing:
            details = ", ".join(f"{k}: {self.key.get(k)!r} vs now {key.get(k)!r}" for k in differing)
            raise ValueError(f"these engine measurements were taken under other conditions ({details}); "
                             "use a fresh EngineMeasurements (or another file) for this setup")

    def bind_gate_tokens(self, gate_tokens: str) -> None:
        """Record how the engine using these measurements counts a step's tokens in the realized windows; refuse
        windows counted another way (their rates are not comparable)."""
        if self.gate_tokens is None:
            self.gate_tokens = gate_tokens
        elif gate_tokens != self.gate_tokens:
            raise ValueError(f"these measurements' realized windows count {self.gate_tokens!r} tokens, the engine "
                             f"{gate_tokens!r}: use DSparkEngine(gate_tokens={self.gate_tokens!r}) or fresh "
                             "measurements")

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "gate_tokens": self.gate_tokens,
            "draft_cost": [[bucket, seconds] for bucket, seconds in sorted(self.draft_cost.items())],
            "verify_cost": [[rows, width, seconds, self.timings(rows, width)]
                            for (rows, width), seconds in sorted(self.verify_cost.items())],
            "realized": [[rows, drafted, [list(step) for step in window]]
                         for (rows, drafted), window in sorted(self.realized.items())],
            "confidence_prior": [self.confidence_count, self.confidence_sum],
            "catch_up": [list(entry) for entry in self.catch_up],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "EngineMeasurements":
        missing = [k for k in ("key", "draft_cost", "verify_cost", "realized") if k not in data]
        if missing:
            raise ValueError(f"not an engine measurements file: missing {missing}")
        out = cls(data["key"])
        out.draft_cost = {int(b): float(s) for b, s in data["draft_cost"]}
        for entry in data["verify_cost"]:  # [rows, width, seconds(, count)]: files before counts hold one timing each
            if len(entry) not in (3, 4):
                raise ValueError(f"not an engine measurements file: verify_cost entry {entry!r}")
            key = (int(entry[0]), int(entry[1]))
            out.verify_cost[key] = float(entry[2])
            out.verify_count[key] = int(entry[3]) if len(entry) == 4 else 1
            # the median's window is not saved: it restarts from the saved price, held by as many timings as stood
            # behind it
            out._verify_window[key] = deque([out.verify_cost[key]] * out.timings(*key), maxlen=VERIFY_WINDOW)
        out.realized = {(int(r), bool(d)): RoundWindow(steps, maxlen=realized_window(int(r)))
                        for r, d, steps in data["realized"]}
        if data.get("confidence_prior") is not None:  # files before it carry none
            count, sums = data["confidence_prior"]
            if sums is not None:
                out.record_confidences(sums, count)
        for entry in data.get("catch_up") or []:  # files before it carry none
            if len(entry) != 2:
                raise ValueError(f"not an engine measurements file: catch_up entry {entry!r}")
            out.record_catch_up(int(entry[0]), float(entry[1]))
        out.version = 1 if out.verify_cost else 0
        # files before it counted the tokens each step emitted (and those without realized windows, nothing)
        out.gate_tokens = data.get("gate_tokens", "emitted" if out.realized else None)
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "EngineMeasurements":
        return cls.from_dict(json.loads(Path(path).read_text()))


__all__ = ["CATCH_UP_WINDOW", "EMA_WEIGHT", "MODEL_PRIOR_STEPS", "MODEL_WINDOW", "VERIFY_WINDOW", "EngineMeasurements",
           "ema", "measurement_key"]
