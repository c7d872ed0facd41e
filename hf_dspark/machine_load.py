"""How busy the rest of the machine was while something was timed.

A speed profile measured while other processes share the CPUs prices every forward too high, wide ones most, and a
cached profile outlives the load that distorted it. ``OthersLoad`` reads the CPUs' busy time from ``/proc/stat`` and
this process's own CPU time around a block; the difference is what other processes (and, in a VM, the hypervisor's
steal) took, as a fraction of all the machine's cores. Where ``/proc/stat`` is missing (not Linux) it reports None.
"""

from __future__ import annotations

import os
import time

# Above this share of the machine's cores used by others, a timing is called busy.
BUSY_SHARE = 0.25


def _busy_and_total_seconds() -> tuple[float, float] | None:
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user and nice]
    ticks = [int(v) for v in fields[1:9]]
    per_second = os.sysconf("SC_CLK_TCK")
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
    return busy / per_second, sum(ticks) / per_second


class OthersLoad:
    """``with OthersLoad() as load: ...``; then ``load.share``: the fraction of the machine's CPU time that other
    processes used during the block (0 = this process alone, 1 = every core busy with others), or None."""

    def __init__(self):
        self.share: float | None = None

    def __enter__(self) -> "OthersLoad":
        self._start = _busy_and_total_seconds()
        self._own = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        end = _busy_and_total_seconds()
        if self._start is None or end is None:
            return
        busy, total = end[0] - self._start[0], end[1] - self._start[1]
        own = time.process_time() - self._own
        self.share = min(1.0, max(0.0, (busy - own) / total)) if total > 0 else None

    @property
    def busy(self) -> bool:
        return self.share is not None and self.share > BUSY_SHARE


def others_load_now(seconds: float = 0.3) -> float | None:
    """The share of the CPUs other processes use over the next ``seconds`` (this process sleeping meanwhile)."""
    with OthersLoad() as load:
        time.sleep(seconds)
    return load.share


__all__ = ["BUSY_SHARE", "OthersLoad", "others_load_now"]
