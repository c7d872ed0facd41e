"""Triton kernel for the prefix scheduler: cumprod -> global sort -> cumsum -> admission -> per-request lengths.

One program handles the whole batch (R requests x g positions, padded to powers of two), which is the size the
scheduler sees each step (R * g is at most a few thousand). Twin of ``scheduling.prefix_schedule`` (early stop,
the lossless default) and ``scheduling.topk_schedule`` (fixed capacity, no early stop). A second kernel is the twin
of ``scheduling.width_schedule`` (Algorithm 1 by width layers, for padded batches): cumprod -> column sums ->
cumsum -> admission.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import torch

from ..budget import prefix_schedule, topk_schedule, use_schedule_kernels, width_schedule

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is optional
    _HAVE_TRITON = False


def triton_available() -> bool:
    return _HAVE_TRITON


if _HAVE_TRITON:

    # The integer arguments are not specialised (Triton would compile separate variants for a value of 1 or a multiple
    # of 16): a kernel's compiled variants are then exactly its block sizes, which warm-up can cover.
    @triton.jit(do_not_specialize=["num_requests", "block_size", "max_batch", "capacity"])
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


    @triton.jit(do_not_specialize=["num_requests", "block_size", "layers"])
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
    _, r_block, g_block = _variant("", num_requests, g)
    blocks = dict(R_BLOCK=r_block, G_BLOCK=g_block)
    return conf, table, out, num_requests, g, max_batch, blocks


def schedule_triton(confidences: torch.Tensor, sps_table: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Triton twin: Algorithm 1 (``capacity=None``) or top-``capacity`` admission. Returns [R] lengths."""
    conf, table, out, num_requests, g, max_batch, blocks = _launch_inputs(confidences, sps_table)
    with _on_device(conf.device):
        _schedule_kernel[(1,)](conf, table, out, num_requests, g, max_batch, 0 if capacity is None else int(capacity),
                               EARLY_STOP=capacity is None, **blocks)
    return out


def width_schedule_triton(confidences: torch.Tensor, sps_table: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``scheduling.width_schedule``. Returns [R] lengths."""
    conf, table, out, num_requests, g, max_batch, blocks = _launch_inputs(confidences, sps_table)
    layers = max(0, min(g, max_batch // num_requests - 1))
    with _on_device(conf.device):
        _width_schedule_kernel[(1,)](conf, table, out, num_requests, g, layers, **blocks)
    return out


def _on_device(device: torch.device):
    """A launch's CUDA device made current: Triton launches on the current device, whatever its tensors' device is
    (the interpreter runs CPU tensors: nothing to switch)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------------------------
# Compiling ahead of the requests
# ------------------------------------------------------------------------------------------------------------------
class KernelWarmup:
    """Which kernel variants are compiled, and a background thread that compiles the others.

    A variant is ``(kind, R_BLOCK, G_BLOCK)`` with kind ``"prefix"``, ``"topk"`` or ``"width"``, compiled per device.
    Compiling one takes seconds; ``schedule_lengths`` (``backend="auto"``) launches a variant only once it is ready and meanwhile uses the
    torch twin, which returns the same lengths, so no step waits on a compile. ``compile_fn(variant, device)``
    compiles one variant (by default ``JITFunction.warmup``: compiled and cached, nothing launched).
    """

    def __init__(self, compile_fn: Callable[[tuple, torch.device], None] | None = None):
        self.compile_fn = compile_fn or _compile_variant
        self._ready: set[tuple] = set()
        self._queued: set[tuple] = set()
        self._failed: dict[tuple, str] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a compile started or ended, or a hold was taken or let go
        self._pending: list[tuple[tuple, torch.device]] = []
        self._worker: threading.Thread | None = None
        self._holds = 0  # ``quiet()`` blocks open: no compile starts while any is
        self._compiling = False
        # ``schedule_lengths(backend="auto")`` calls on CUDA, by what served them: the torch twin while the variant
        # compiled ("twin") or the compiled kernel ("kernel")
        self.calls = {"twin": 0, "kernel": 0}

    def ready(self, variant: tuple, device: torch.device) -> bool:
        return (_device_key(device), variant) in self._ready

    @property
    def failed(self) -> dict[tuple, str]:
        """``(device, variant)`` pairs whose compile raised, with the error (they keep the torch twin)."""
        return dict(self._failed)

    def request(self, variants, device: torch.device) -> None:
        """Compile ``variants`` on ``device`` in the background (those not ready, queued or failed already)."""
        with self._lock:
            for variant in variants:
                key = (_device_key(device), variant)
                if key not in self._ready and key not in self._queued and key not in self._failed:
                    self._queued.add(key)
                    self._pending.append((variant, device))
            if self._pending and (self._worker is None or not self._worker.is_alive()):
                self._worker = threading.Thread(target=self._run, name="hf-dspark-kernel-warmup", daemon=True)
                self._worker.start()

    @contextlib.contextmanager
    def quiet(self, timeout: float | None = None) -> Iterator[bool]:
        """Hold compiles back while something is timed: no variant starts compiling inside the block, and entering
        waits (up to ``timeout`` seconds) for the one compiling now. A compile holds Python's GIL for much of its
        seconds (Triton's front end is Python), so a host-bound forward timed beside it runs, and is priced, slower:
        the batched SPS profile of an engine start would price every width too dear. Yields whether no compile was
        running when the block began (False: ``timeout`` ran out first). Do not ``wait()`` inside the block."""
        with self._changed:
            self._holds += 1
            idle = self._changed.wait_for(lambda: not self._compiling, timeout)
        try:
            yield idle
        finally:
            with self._changed:
                self._holds -= 1
                self._changed.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every requested variant is compiled (or failed); False on timeout."""
        worker = self._worker
        if worker is not None:
            worker.join(timeout)
            return not worker.is_alive()
        return True

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: not self._holds or not self._pending)
                if not self._pending:
                    return
                variant, device = self._pending.pop(0)
                self._compiling = True
            key = (_device_key(device), variant)
            error = None
            try:
                self.compile_fn(variant, device)
            except Exception as raised:  # the torch twin keeps serving this variant
                error = f"{type(raised).__name__}: {raised}"
            with self._changed:
                if error is None:
                    self._ready.add(key)
                else:
                    self._failed[key] = error
                self._queued.discard(key)
                self._compiling = False
                self._changed.notify_all()


def _device_key(device: torch.device | str) -> str:
    """``cuda`` and ``cuda:0`` name one device (the current one): one key for both."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _variant(kind: str, num_requests: int, block_size: int) -> tuple:
    """``(kind, R_BLOCK, G_BLOCK)``: the compiled variant a launch for this many requests and drafts uses."""
    return (kind, max(2, _next_pow2(num_requests)), max(2, _next_pow2(block_size)))


def _compile_variant(variant: tuple, device: torch.device) -> None:
    kind, r_block, g_block = variant
    with torch.cuda.device(device):
        conf = torch.zeros(r_block, g_block, device=device)
        table = torch.zeros(r_block * g_block + r_block + 1, device=device)
        out = torch.zeros(r_block, dtype=torch.long, device=device)
        if kind == "width":
            _width_schedule_kernel.warmup(conf, table, out, r_block, g_block, g_block,
                                          R_BLOCK=r_block, G_BLOCK=g_block, grid=(1,))
        else:
            _schedule_kernel.warmup(conf, table, out, r_block, g_block, table.numel() - 1, 0,
                                    R_BLOCK=r_block, G_BLOCK=g_block, EARLY_STOP=kind == "prefix", grid=(1,))


WARMUP = KernelWarmup()


def warm_scheduler_kernels(device: torch.device | str, max_requests: int, block_size: int,
                           kinds: tuple[str, ...] = ("prefix", "topk", "width")) -> KernelWarmup:
    """Start compiling, in the background, every variant a batch of up to ``max_requests`` requests drafting
    ``block_size`` tokens can launch (power-of-two request blocks 2 .. ``max_requests``). No-op off CUDA, without
    Triton, or under ``TRITON_INTERPRET`` (nothing is compiled there). Returns the shared ``KernelWarmup``."""
    device = torch.device(device)
    if device.type != "cuda" or not _HAVE_TRITON or os.environ.get("TRITON_INTERPRET"):
        return WARMUP
    top = max(2, _next_pow2(max_requests))
    blocks = [1 << k for k in range(1, top.bit_length())]
    WARMUP.request([_variant(kind, r, block_size) for r in blocks for kind in kinds], device)
    return WARMUP


def schedule_lengths(confidences: torch.Tensor, sps_table: torch.Tensor | None = None, capacity: int | None = None,
                     backend: str = "auto", padded: bool = False) -> torch.Tensor:
    """Verification lengths for R requests: Triton on CUDA (``backend="auto"``), torch elsewhere.

    ``capacity``: top-K admission; else Algorithm 1 over single entries, or by width layers with ``padded=True``
    (``scheduling.width_schedule``: the cost of a padded batch). Under ``"auto"`` a kernel variant that is not compiled
    yet is queued for a background compile and this call uses the torch twin (the same lengths); ``"triton"``
    launches the kernel whatever it costs.
    """
    if capacity is None and sps_table is None:
        raise ValueError("Algorithm 1 needs an SPS table")
    if capacity is not None and padded:
        raise ValueError("padded (width-layer) scheduling takes an SPS table, not a capacity")
    use_triton = backend == "triton"
    if backend == "auto" and _HAVE_TRITON and confidences.is_cuda:
        kind = "width" if padded else ("topk" if capacity is not None else "prefix")
        variant = _variant(kind, *confidences.shape)
        use_triton = WARMUP.ready(variant, confidences.device) or bool(os.environ.get("TRITON_INTERPRET"))
        WARMUP.calls["kernel" if use_triton else "twin"] += 1
        if not use_triton:
            WARMUP.request([variant], confidences.device)
    if use_triton:
        if padded:
            return width_schedule_triton(confidences, sps_table)
        table = (sps_table if sps_table is not None  # top-K reads no table: a placeholder on the launch's device
                 else torch.zeros(confidences.numel() + confidences.shape[0] + 1, device=confidences.device))
        return schedule_triton(confidences, table, capacity)
    if capacity is not None:
        return topk_schedule(confidences, capacity)
    if padded:
        return width_schedule(confidences, sps_table)
    return prefix_schedule(confidences, sps_table)


use_schedule_kernels(schedule_lengths)  # schedule_batch (hf_dspark.scheduling) launches through it from now on
