"""The clock both routes time their rounds with: ``time_mark`` on a device, ``seconds_between`` two marks.

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


__all__ = ["seconds_between", "time_mark"]
