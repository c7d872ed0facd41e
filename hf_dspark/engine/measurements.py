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
import os
from collections import deque
from pathlib import Path

EMA_WEIGHT = 0.3  # weight of the newest timing in the drafter and verify moving averages
REALIZED_WINDOW = 32  # whole steps per (batch size, drafted) behind the realized gate's tokens per second


def ema(previous: float | None, value: float) -> float:
    """Exponential moving average with ``EMA_WEIGHT`` on the newest value (the value itself when there is none)."""
    return value if previous is None else (1.0 - EMA_WEIGHT) * previous + EMA_WEIGHT * value


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


class EngineMeasurements:
    """Moving averages of an engine's step timings, shareable across engines and savable as JSON.

    - ``draft_cost[bucket]``: seconds of one drafter forward for a number of drafting rows (power-of-2 bucket);
    - ``verify_cost[(rows, width)]``: seconds of one verify forward of ``rows`` requests ``width`` tokens wide;
    - ``realized[(rows, drafted)]``: ``(tokens emitted, seconds)`` of the last ``REALIZED_WINDOW`` whole steps
      (drafter, context catch-up, verification and bookkeeping) at ``rows`` active requests, with some request
      drafting or none; their rate is total tokens over total seconds, so one slow step (a hiccup of a shared
      machine) moves it by a thirty-second, not by the 30% a moving average would.

    ``version`` increases with every verify timing (the engine rebuilds its repriced SPS tables on a change).
    """

    def __init__(self, key: dict | None = None):
        self.key = key
        self.draft_cost: dict[int, float] = {}
        self.verify_cost: dict[tuple[int, int], float] = {}
        self.realized: dict[tuple[int, bool], deque[tuple[float, float]]] = {}
        self.version = 0
        # Exploration state of the realized gate (not saved: a loaded file starts a fresh schedule of re-measurements)
        self.steps_since: dict[tuple[int, bool], int] = {}  # steps at R since the last (drafting, plain) step
        self.explore_wait: dict[int, int] = {}  # R -> steps before drafting is re-measured while it loses

    # -- recording -----------------------------------------------------------------------------------------------
    def record_draft(self, bucket: int, seconds: float) -> None:
        self.draft_cost[bucket] = ema(self.draft_cost.get(bucket), seconds)

    def record_verify(self, rows: int, width: int, seconds: float) -> None:
        self.verify_cost[(rows, width)] = ema(self.verify_cost.get((rows, width)), seconds)
        self.version += 1

    def record_step(self, rows: int, drafted: bool, emitted: int, seconds: float) -> None:
        key = (rows, drafted)
        self.realized.setdefault(key, deque(maxlen=REALIZED_WINDOW)).append((float(emitted), float(seconds)))
        self.steps_since[key] = 0
        other = (rows, not drafted)
        self.steps_since[other] = self.steps_since.get(other, 0) + 1

    def realized_rate(self, rows: int, drafted: bool) -> float | None:
        """Tokens per second of the recent whole steps at ``rows`` requests (with drafting or without), or None."""
        window = self.realized.get((rows, drafted))
        if not window:
            return None
        seconds = sum(s for _, s in window)
        return sum(e for e, _ in window) / seconds if seconds > 0 else float("inf")

    # -- the realized gate ---------------------------------------------------------------------------------------
    def drafting_allowed(self, rows: int, explore_interval: int, max_explore_interval: int) -> bool:
        """Whether a step at ``rows`` requests may draft, judged by the tokens per second recent whole steps
        delivered there: free until drafting has been measured twice; while only drafting is measured (or the plain
        side has not been refreshed for ``explore_interval`` steps), a plain step every ``explore_interval`` steps;
        otherwise the faster side, re-measuring a losing drafting side after a wait that starts at
        ``explore_interval`` and doubles (up to ``max_explore_interval``) while drafting keeps losing.

        A batch size where drafting has not been measured twice yet takes the verdict of the nearest smaller one
        where both sides were: when drafting loses there, it is presumed to lose here too (each verified draft
        widens a larger batch, and the budget shrinks with load), so a rising load does not pay a full-width
        drafting step at every new batch size to learn what the smaller ones already showed. Those smaller batch
        sizes keep re-measuring drafting; once it wins there, the larger ones are free to try again."""
        drafting = self.realized.get((rows, True))
        if drafting is None or len(drafting) < 2:
            return not self.drafting_lost_below(rows)  # not measured here: free, unless a smaller size lost
        plain_rate = self.realized_rate(rows, False)
        fresh_plain = self.steps_since.get((rows, False), 0) < explore_interval
        if plain_rate is None:
            return fresh_plain
        wait = self.explore_wait.get(rows, explore_interval)
        if self.realized_rate(rows, True) >= plain_rate:
            self.explore_wait[rows] = explore_interval
            return fresh_plain  # a stale plain side is re-measured too: a slow step there must not stick
        if self.steps_since.get((rows, True), 0) < wait:
            return False
        self.explore_wait[rows] = min(2 * wait, max_explore_interval)  # re-measure drafting now
        return True

    def drafting_lost_below(self, rows: int) -> bool:
        """Whether drafting delivered fewer tokens per second than plain steps at the largest batch size below
        ``rows`` where both were measured (drafting at least twice); False when there is none."""
        measured = [r for (r, drafted), window in self.realized.items()
                    if drafted and r < rows and len(window) >= 2 and self.realized.get((r, False))]
        if not measured:
            return False
        nearest = max(measured)
        return self.realized_rate(nearest, True) < self.realized_rate(nearest, False)

    # -- keys and files ------------------------------------------------------------------------------------------
    def bind(self, key: dict) -> None:
        """Adopt ``key`` when unkeyed; refuse measurements taken for another target / drafter / device / dtype /
        thread count."""
        if self.key is None:
            self.key = dict(key)
            return
        differing = sorted(k for k in set(self.key) | set(key) if self.key.get(k) != key.get(k))
        if differing:
            details = ", ".join(f"{k}: {self.key.get(k)!r} vs now {key.get(k)!r}" for k in differing)
            raise ValueError(f"these engine measurements were taken under other conditions ({details}); "
                             "use a fresh EngineMeasurements (or another file) for this setup")

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "draft_cost": [[bucket, seconds] for bucket, seconds in sorted(self.draft_cost.items())],
            "verify_cost": [[rows, width, seconds] for (rows, width), seconds in sorted(self.verify_cost.items())],
            "realized": [[rows, drafted, [list(step) for step in window]]
                         for (rows, drafted), window in sorted(self.realized.items())],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "EngineMeasurements":
        missing = [k for k in ("key", "draft_cost", "verify_cost", "realized") if k not in data]
        if missing:
            raise ValueError(f"not an engine measurements file: missing {missing}")
        out = cls(data["key"])
        out.draft_cost = {int(b): float(s) for b, s in data["draft_cost"]}
        out.verify_cost = {(int(r), int(w)): float(s) for r, w, s in data["verify_cost"]}
        out.realized = {(int(r), bool(d)): deque(((float(e), float(s)) for e, s in steps), maxlen=REALIZED_WINDOW)
                        for r, d, steps in data["realized"]}
        out.version = 1 if out.verify_cost else 0
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


__all__ = ["EMA_WEIGHT", "REALIZED_WINDOW", "EngineMeasurements", "ema", "measurement_key"]
