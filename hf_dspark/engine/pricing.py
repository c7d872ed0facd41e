"""What a verification forward costs the engine: the SPS profile of the target's padded batches, repriced by the
verify times the engine measures (``VerifyPricing``)."""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from ..profiling import monotone_fit
from ..scheduling import StepsPerSecond
from .measurements import EngineMeasurements

logger = logging.getLogger(__name__)

# Weight of the profile's shape (at the engine's measured level) against a width's own verify timings when pricing
# it (``VerifyPricing.sps_table``): a width with a full window of 16 timings moves a third of the way from the shape
# to its own median. Each width's timings come from other stretches of the run: at 16 requests the width-2 steps
# were the early, short-context ones and the plain steps the late ones, so their medians came out equal where the
# profile (and each measured alone) has width 2 at 1.25x width 1, and the cost model took width 2 for free.
PRICE_PRIOR_TIMINGS = 32.0
# How long an engine's first SPS profile waits for a scheduler kernel compiling in the background to finish (one
# variant takes seconds) before timing anyway.
KERNEL_QUIET_TIMEOUT_S = 30.0


class VerifyPricing:
    """SPS tables per batch size for the scheduler: the profile (``sps``; None profiles the target once, cached, at
    batch sizes 1, 2, 4, .. up to ``max_concurrency``), repriced by ``measurements``' verify timings when
    ``adapt_sps``. ``tokens_per_request``: the widest block a row verifies (default ``block_size + 1``; wider where
    rows verify token trees)."""

    def __init__(self, target, block_size: int, taps: list[int], measurements: EngineMeasurements, sps=None,
                 adapt_sps: bool = False, max_concurrency: int | None = None, tokens_per_request: int | None = None):
        self.target = target
        self.device = next(target.parameters()).device
        self.block_size = block_size
        self.tokens_per_request = tokens_per_request or block_size + 1
        self.taps = taps
        self.measurements = measurements
        self.sps = sps
        self.adapt_sps = adapt_sps
        self.max_concurrency = max_concurrency
        self._tables: dict[int, torch.Tensor] = {}
        self._profiled_lists: dict[int, list[float]] = {}
        self._priced_tables: dict[int, tuple[int, torch.Tensor]] = {}

    def sps_table(self, num_requests: int) -> torch.Tensor:
        """SPS over the batch's total verification tokens B = 0..R * (g + 1), for R requests: the profile, repriced by
        what this engine has measured (medians of recent verify forwards), kept non-increasing. The profile is
        timed on a clean cache at one context length; measured steps price what the budget really buys. Each
        measured verify time is read as a ratio to the profile's price of the same (rows, width), and combined in log
        scale:

        - the level: this R's ratios, averaged with their numbers of timings as weights (or the level of the nearest
          batch size measured, when nothing was run at this R yet): the profile's shape at the engine's level;
        - a width run at this R: its own ratio, weighted by its number of timings against ``PRICE_PRIOR_TIMINGS``
          for the level. A width timed many times costs what it measured; one timed once or twice (a probe, a rare
          width, possibly in a hiccup of a shared machine) moves its price only part of the way, so one noisy
          timing does not make every wider width look dear;
        - a width not yet run at this R: the level, times how much dearer than the level that width (or a narrower
          one not run here) was at the nearest batch size that ran it (never cheaper: one slow wide step at R = 8
          stops the first wide step at R = 16 from being taken at the profile's word).

        A width is never priced cheaper than a narrower one: the log costs get their weighted non-decreasing fit
        (``profiling.monotone_fit``; weights: the width's timings plus ``PRICE_PRIOR_TIMINGS``), so a narrow width that
        measured dear is pooled with the cheaper wider ones after it instead of lifting all of them to its price.
        Only past steps are used. Tables are cached until a new measurement arrives."""
        table = self.profiled_table(num_requests)
        if not self.adapt_sps or not self.measurements.verify_cost:  # without adapt_sps the given SPS is used as is
            return table
        cached = self._priced_tables.get(num_requests)
        if cached is not None and cached[0] == self.measurements.version:
            return cached[1]
        profiled = self._profiled_list(num_requests)
        ratios = self._log_cost_ratios()
        level = self._log_level(num_requests, ratios)
        widths = [w for w in range(1, self.tokens_per_request + 1) if num_requests * w < table.shape[0]]
        log_costs, weights = [], []
        excess = 0.0  # carried to wider widths not run here: they are at least as much dearer than the level
        for w in widths:
            own = ratios.get(num_requests, {}).get(w)
            weight = PRICE_PRIOR_TIMINGS
            if own is not None:
                timings = float(self.measurements.timings(num_requests, w))
                log_ratio = (timings * own + PRICE_PRIOR_TIMINGS * level) / (timings + PRICE_PRIOR_TIMINGS)
                weight += timings
            else:
                excess = max(excess, self._log_width_excess(num_requests, w, ratios))
                log_ratio = level + excess
            log_costs.append(log_ratio - math.log(profiled[num_requests * w]))
            weights.append(weight)
        priced = list(profiled)
        for w, log_cost in zip(widths, monotone_fit(log_costs, weights)):
            priced[num_requests * w] = math.exp(-log_cost)
        priced = torch.tensor(priced, dtype=table.dtype, device=table.device)
        self._priced_tables[num_requests] = (self.measurements.version, priced)
        return priced

    def _log_cost_ratios(self) -> dict[int, dict[int, float]]:
        """``{R: {width: log(measured verify seconds / profiled seconds)}}`` over every measured (R, width)."""
        out: dict[int, dict[int, float]] = {}
        for (rows, width), seconds in self.measurements.verify_cost.items():
            try:
                table = self._profiled_list(rows)
            except ValueError:  # shared measurements from a batch size this engine's profile does not cover
                continue
            if rows * width < len(table) and seconds > 0:
                out.setdefault(rows, {})[width] = math.log(seconds * table[rows * width])
        return out

    def _profiled_list(self, num_requests: int) -> list[float]:
        """``profiled_table`` as Python floats (the repricing reads it entry by entry, every step)."""
        table = self._profiled_lists.get(num_requests)
        if table is None:
            table = self._profiled_lists[num_requests] = self.profiled_table(num_requests).tolist()
        return table

    def _log_level(self, num_requests: int, ratios: dict[int, dict[int, float]]) -> float:
        """The timing-weighted mean log ratio at ``num_requests``, or at the nearest batch size measured (in log scale,
        ties toward the larger); 0 (the profile) when nothing is measured."""
        if not ratios:
            return 0.0
        rows = min(ratios, key=lambda r: (abs(math.log(r / num_requests)), -r))
        weights = {w: float(self.measurements.timings(rows, w)) for w in ratios[rows]}
        return sum(weights[w] * value for w, value in ratios[rows].items()) / sum(weights.values())

    def _log_width_excess(self, num_requests: int, width: int, ratios: dict[int, dict[int, float]]) -> float:
        """How much dearer (log ratio, >= 0) than its batch size's level ``width`` measured at the nearest other batch
        size that ran it (in log scale, ties toward the larger); 0 when none did."""
        sizes = [r for r in ratios if r != num_requests and width in ratios[r]]
        if not sizes:
            return 0.0
        nearest = min(sizes, key=lambda r: (abs(math.log(r / num_requests)), -r))
        return max(0.0, ratios[nearest][width] - self._log_level(nearest, ratios))

    def profile(self, progress=None) -> None:
        """Load or measure the batched profile now (cached per machine), instead of at the first scheduled step:
        ``progress`` is ``load_or_profile_batched``'s. Nothing to do when a profile was given or is loaded."""
        if self.sps is not None:
            return
        from ..profiling import load_or_profile_batched, powers_of_two_with

        sizes = powers_of_two_with([self.max_concurrency or 64])
        # The scheduler kernels this engine started compiling in the background wait meanwhile: a compile beside the
        # timed forwards would price them slower than they run (``KernelWarmup.quiet``).
        with self._quiet_kernels():
            self.sps = load_or_profile_batched(self.target, sizes, self.tokens_per_request,
                                                hidden_state_indices=self.taps, progress=progress)

    def profiled_table(self, num_requests: int) -> torch.Tensor:
        table = self._tables.get(num_requests)
        if table is None:
            self.profile(_announce_in_step)
            if isinstance(self.sps, StepsPerSecond):
                table = self.sps.table()
            else:
                table = self.sps.table(num_requests, num_requests * self.tokens_per_request)
            if table.shape[0] <= num_requests:
                raise ValueError(f"the SPS profile covers {table.shape[0] - 1} batch tokens, fewer than the "
                                 f"{num_requests} active requests' anchors; profile larger batches")
            self._tables[num_requests] = table.to(self.device)
        return self._tables[num_requests]

    def _quiet_kernels(self):
        """``KernelWarmup.quiet`` on CUDA, where this engine compiles scheduler kernels; elsewhere nothing."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from ..kernels.scheduler import WARMUP

        return WARMUP.quiet(timeout=KERNEL_QUIET_TIMEOUT_S)


def _announce_in_step(done: list[int], sizes: list[int], seconds: float) -> None:
    """Where a step has to measure the profile (nobody called ``DSparkEngine.prepare``), the wait is said, not
    silent."""
    if not done:
        logger.warning("measuring the target's verification cost at batch sizes %s before the first scheduled step "
                       "(once per machine, dtype and thread count, then cached; DSparkEngine.prepare() does it up "
                       "front)", ", ".join(map(str, sizes)))
