"""The clock both routes time their rounds with: ``time_mark`` on a device, ``seconds_between`` two marks; and
``RoundClock``, everything one ``generate()`` call times.

This file is self-contained (torch only): exported drafter folders carry it in ``custom_generate/``.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def time_mark(device: torch.device) -> Any:
    """A point in time on ``device``: on CUDA a recorded timing event on its current stream (no sync: it marks when
    the work launched before it has run), elsewhere ``time.perf_counter()``."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))  # the device's own stream, whichever device is current
    return event


def seconds_between(start: Any, end: Any) -> float:
    """Seconds between two ``time_mark`` points (CUDA events: once ``end`` has been reached)."""
    return end - start if isinstance(start, float) else start.elapsed_time(end) / 1000.0


# Weight of the newest timing in a moving average of the drafter's seconds (``ema``): generate()'s ``RoundClock`` and
# the engine's ``EngineMeasurements`` smooth the drafter's measured time the same way.
EMA_WEIGHT = 0.3


def ema(previous: float | None, value: float) -> float:
    """Exponential moving average with ``EMA_WEIGHT`` on the newest value (the value itself when there is none)."""
    return value if previous is None else (1.0 - EMA_WEIGHT) * previous + EMA_WEIGHT * value


class RoundClock:
    """What one ``generate()`` call times, on ``device``'s clock:

    - ``draft_seconds``: the drafter's time per block, a moving average (``ema``), for the planner's pay-off rule. On
      CUDA a drafter call returns before its kernels finish, so its events are read at the next round, once
      verification has synchronised; an event not yet reached then is skipped rather than waited for.
    - whole rounds for the realized gate: a round runs from one proposal to the next (drafter, target forward,
      acceptance and the assisted loop's bookkeeping); ``next_round`` returns the one that just ended.
    - each round's (drafting start, drafting end) marks, for ``DSparkStats.time_split``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.draft_seconds: float | None = None
        self._draft_events: tuple[Any, Any] | None = None
        self._round_started: float | None = None
        self._finished: tuple[bool, int] | None = None  # (speculated, tokens emitted) of the round just verified
        self.marks: tuple[Any, Any] | None = None  # this round's drafting start and end

    def mark(self) -> Any:
        return time_mark(self.device)

    def drafted(self, started: Any, ended: Any) -> None:
        """One drafter call between two marks: folded into ``draft_seconds`` (on CUDA at the next round)."""
        if self.device.type == "cuda":
            self._draft_events = (started, ended)
        else:
            self.draft_seconds = ema(self.draft_seconds, seconds_between(started, ended))

    def next_round(self) -> tuple[bool, int, float] | None:
        """A new round starts: the drafter's pending CUDA time is folded in, and the round that just ended is
        returned as ``(speculated, emitted, seconds)`` (None for the first, or one without a verdict)."""
        if self._draft_events is not None:
            started, ended = self._draft_events
            self._draft_events = None
            if ended.query():
                self.draft_seconds = ema(self.draft_seconds, seconds_between(started, ended))
        now = time.perf_counter()
        ended_round = None
        if self._round_started is not None and self._finished is not None:
            ended_round = (*self._finished, now - self._round_started)
        self._round_started, self._finished = now, None
        return ended_round

    def verdict(self, speculated: bool, emitted: int) -> None:
        """The round's verdict: whether it verified speculative tokens, and the tokens it emitted."""
        self._finished = (speculated, emitted)


__all__ = ["EMA_WEIGHT", "RoundClock", "ema", "seconds_between", "time_mark"]
