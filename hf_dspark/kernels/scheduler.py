"""Triton kernel for the prefix scheduler: cumprod -> global sort -> cumsum -> admission -> per-request lengths.

One program handles the whole batch (R requests x g positions, padded to powers of two), which is the size the
scheduler sees each step (R * g is at most a few thousand). Twin of ``scheduling.prefix_schedule`` (early stop,
the lossless default) and ``scheduling.topk_schedule`` (fixed capacity, no early stop). A second kernel is the twin
of ``scheduling.width_schedule`` (Algorithm 1 by width layers, for padded batches): cumprod -> column sums ->
cumsum -> admission.
"""

from __future__ import annotations

import torch

from ..scheduling import prefix_schedule, topk_schedule, width_schedule

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is optional
    _HAVE_TRITON = False


def triton_available() -> bool:
    return _HAVE_TRITON


if _HAVE_TRITON:

    @triton.jit
    def _schedule_kernel(
        conf_ptr, sps_ptr, out_ptr, num_requests, block_size, max_batch, capacity,
        R_BLOCK: tl.constexpr, G_BLOCK: tl.constexpr, EARLY_STOP: tl.constexpr,
    ):
        rows = tl.arange(0, R_BLOCK)
        cols = tl.arange(0, G_BLOCK)
        valid = (rows[:, None] < num_requests) & (cols[None, :] < block_size)
        conf = tl.load(conf_ptr + rows[:, None] * block_size + cols[None, :], mask=valid, other=0.0)
        conf = tl.minimum(tl.maximum(conf, 0.0), 1.0)
        survival = tl.cumprod(conf, axis=1)  # prefix survival a_{r,j}
        survival = tl.where(valid, survival, 0.0)
        # Sort key: float bits (monotonic for a >= 0) above a priority that prefers smaller j, then smaller r.
        priority = (G_BLOCK - 1 - cols[None, :]) * R_BLOCK + (R_BLOCK - 1 - rows[:, None])
        key = (survival.to(tl.int32, bitcast=True).to(tl.int64) << 32) | priority.to(tl.int64)
        key = tl.reshape(key, [R_BLOCK * G_BLOCK])
        key = tl.sort(key, descending=True)
        value = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        prio = (key & 0xFFFFFFFF).to(tl.int32)
        pos = G_BLOCK - 1 - prio // R_BLOCK + 1  # 1-based draft position j
        req = R_BLOCK - 1 - prio % R_BLOCK
        index = tl.arange(0, R_BLOCK * G_BLOCK)
        batch = num_requests + 1 + index
        in_budget = batch <= max_batch
        if EARLY_STOP:
            tau = num_requests + tl.cumsum(value, axis=0)
            sps = tl.load(sps_ptr + batch, mask=in_budget, other=0.0)
            sps_prev = tl.load(sps_ptr + batch - 1, mask=in_budget, other=0.0)
            theta = tau * sps
            theta_prev = (tau - value) * sps_prev
            improving = (theta > theta_prev) & (value > 0) & in_budget
            failures = tl.cumsum((1 - improving.to(tl.int32)), axis=0)
            admitted = failures == 0
        else:
            admitted = (index < capacity) & (value > 0) & in_budget
        lengths = tl.where(admitted[None, :] & (req[None, :] == rows[:, None]), pos[None, :], 0)
        lengths = tl.max(lengths, axis=1)
        tl.store(out_ptr + rows, lengths.to(tl.int64), mask=rows < num_requests)


    @triton.jit
    def _width_schedule_kernel(
        conf_ptr, sps_ptr, out_ptr, num_requests, block_size, layers,
        R_BLOCK: tl.constexpr, G_BLOCK: tl.constexpr,
    ):
        rows = tl.arange(0, R_BLOCK)
        cols = tl.arange(0, G_BLOCK)
        valid = (rows[:, None] < num_requests) & (cols[None, :] < block_size)
        conf = tl.load(conf_ptr + rows[:, None] * block_size + cols[None, :], mask=valid, other=0.0)
        conf = tl.minimum(tl.maximum(conf, 0.0), 1.0)
        survival = tl.where(valid, tl.cumprod(conf, axis=1), 0.0)  # prefix survival a_{r,j}
        gain = tl.sum(survival, axis=0)  # [G] survival mass of each width layer
        tau = num_requests + tl.cumsum(gain, axis=0)
        in_budget = cols < layers
        width = (cols + 2) * num_requests
        sps = tl.load(sps_ptr + width, mask=in_budget, other=0.0)
        sps_prev = tl.load(sps_ptr + width - num_requests, mask=in_budget, other=0.0)
        theta = tau * sps
        theta_prev = (tau - gain) * sps_prev
        improving = (theta > theta_prev) & (gain > 0) & in_budget
        failures = tl.cumsum(1 - improving.to(tl.int32), axis=0)
        admitted = tl.sum((failures == 0).to(tl.int32), axis=0)
        lengths = tl.sum(((survival > 0) & (cols[None, :] < admitted)).to(tl.int32), axis=1)
        tl.store(out_ptr + rows, lengths.to(tl.int64), mask=rows < num_requests)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _launch_inputs(confidences: torch.Tensor, sps_table: torch.Tensor):
    """Shared set-up of both kernels: contiguous float inputs on one device, the output, and the block sizes."""
    if not _HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    conf = confidences.contiguous().float()
    num_requests, g = conf.shape
    max_batch = sps_table.shape[0] - 1
    if num_requests > max_batch:
        raise ValueError(f"{num_requests} requests exceed the profiled max_batch_tokens={max_batch}")
    out = torch.zeros(num_requests, dtype=torch.long, device=conf.device)
    table = sps_table.contiguous().float().to(conf.device)
    blocks = dict(R_BLOCK=max(2, _next_pow2(num_requests)), G_BLOCK=max(2, _next_pow2(g)))
    return conf, table, out, num_requests, g, max_batch, blocks


def schedule_triton(confidences: torch.Tensor, sps_table: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Triton twin: Algorithm 1 (``capacity=None``) or top-``capacity`` admission. Returns [R] lengths."""
    conf, table, out, num_requests, g, max_batch, blocks = _launch_inputs(confidences, sps_table)
    _schedule_kernel[(1,)](conf, table, out, num_requests, g, max_batch, 0 if capacity is None else int(capacity),
                           EARLY_STOP=capacity is None, **blocks)
    return out


def width_schedule_triton(confidences: torch.Tensor, sps_table: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``scheduling.width_schedule``. Returns [R] lengths."""
    conf, table, out, num_requests, g, max_batch, blocks = _launch_inputs(confidences, sps_table)
    layers = max(0, min(g, max_batch // num_requests - 1))
    _width_schedule_kernel[(1,)](conf, table, out, num_requests, g, layers, **blocks)
    return out


def schedule_lengths(confidences: torch.Tensor, sps_table: torch.Tensor | None = None, capacity: int | None = None,
                     backend: str = "auto", padded: bool = False) -> torch.Tensor:
    """Verification lengths for R requests: Triton on CUDA (``backend="auto"``), torch elsewhere.

    ``capacity``: top-K admission; else Algorithm 1 over single entries, or by width layers with ``padded=True``
    (``scheduling.width_schedule``: the cost of a padded batch).
    """
    if capacity is None and sps_table is None:
        raise ValueError("Algorithm 1 needs an SPS table")
    if capacity is not None and padded:
        raise ValueError("padded (width-layer) scheduling takes an SPS table, not a capacity")
    use_triton = backend == "triton" or (backend == "auto" and _HAVE_TRITON and confidences.is_cuda)
    if use_triton:
        if padded:
            return width_schedule_triton(confidences, sps_table)
        table = sps_table if sps_table is not None else torch.zeros(confidences.numel() + confidences.shape[0] + 1)
        return schedule_triton(confidences, table, capacity)
    if capacity is not None:
        return topk_schedule(confidences, capacity)
    if padded:
        return width_schedule(confidences, sps_table)
    return prefix_schedule(confidences, sps_table)
