"""glibc malloc settings (``mallopt``) for processes whose large tensors would otherwise come back as fresh pages: the
trainer keeps freed memory (``keep_freed_memory``), the serving benches pin the thresholds (``fix_allocator``)."""

from __future__ import annotations

import ctypes
import sys

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4


def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc with ``mallopt`` (Linux), else None (nothing to set)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 (glibc has it; musl and others do not)
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and keep freed memory for reuse: what jemalloc or tcmalloc do for
    PyTorch on a CPU. A training step allocates activation buffers of tens of MB; by default glibc maps each one
    afresh and unmaps it when freed, so every step pays page faults and zeroing for all of them. Process-wide; the
    heap then stays at its peak size. Returns whether it applied (False off glibc)."""
    libc = glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


# Heap the benches pre-touch (``fix_allocator(pretouch=)``): room for three engines' caches at 64 requests
BENCH_PRETOUCH_MIB = 3072


def pretouch_setting(dynamic_allocator: bool, pretouch_mib: int | None) -> int | None:
    """Bytes of heap to pre-touch for the benches' ``--dynamic-allocator`` / ``--pretouch MIB`` options (None: the
    allocator is left as the C library sets it). ``--pretouch`` goes with the pinned allocator and is >= 0."""
    if dynamic_allocator and pretouch_mib is not None:
        raise ValueError("--pretouch goes with the pinned allocator; --dynamic-allocator leaves glibc as it is")
    if pretouch_mib is not None and pretouch_mib < 0:
        raise ValueError(f"--pretouch must be >= 0 MiB, got {pretouch_mib}")
    if dynamic_allocator:
        return None
    return (BENCH_PRETOUCH_MIB if pretouch_mib is None else pretouch_mib) << 20


def fix_allocator(mmap_threshold: int = 32 << 20, trim_threshold: int | None = None, top_pad: int = 256 << 20,
                  pretouch: int = 0) -> str | None:
    """Pin glibc malloc's thresholds for this process (``mallopt``): blocks up to ``mmap_threshold`` bytes come from
    the heap, freed heap memory is kept up to ``trim_threshold`` bytes (None: always kept), and the heap grows
    ``top_pad`` bytes at a time. Then grow the heap by ``pretouch`` bytes, write every page and free them again (kept),
    so that the engines find memory the kernel has already handed over.

    By default glibc moves its mmap threshold up as large blocks are freed, so one engine's allocations change where
    the next engine's come from, and whether they pay fresh page faults. Two engines stepped side by side in one
    process (``run_lockstep``) then read a few percent apart depending on which of them was created and stepped first
    (on SmolLM2 at 16 requests, 0.96-0.97 one way and 1.03-1.04 the other; pinned, within 1% either way). A server
    runs one engine, so neither order is its speed. Setting any of these turns glibc's adjustment off.

    Pinned, memory freed stays with the process, but each page is still first written (a page fault) by whichever
    engine first takes the process past its high-water mark, and engines stepped side by side hold their caches at
    once (the scheduled engine also keeps its prompts' target features for the drafter). ``pretouch`` takes those
    faults out of the engines' runs. It removes a confounder, not a measured bias; each run's count is in the bench
    report (``runs_counts``).

    Returns what was done, or None where the C library is not glibc (nothing to pin; the benches run as they are).
    Raises ``RuntimeError`` if glibc refuses a value, ``ValueError`` for a ``pretouch`` glibc would trim again."""
    if pretouch < 0 or (trim_threshold is not None and pretouch + top_pad >= trim_threshold):
        raise ValueError(f"pretouch must be >= 0 and, with the top pad ({top_pad} bytes), below the trim threshold "
                         f"({trim_threshold} bytes), got {pretouch}")
    libc = glibc()
    if libc is None:
        return None
    for name, param, value in (("mmap threshold", M_MMAP_THRESHOLD, mmap_threshold),
                               ("trim threshold", M_TRIM_THRESHOLD, -1 if trim_threshold is None else trim_threshold),
                               ("top pad", M_TOP_PAD, top_pad)):
        if libc.mallopt(param, value) != 1:
            raise RuntimeError(f"glibc refused malloc {name} {value}")
    trim = "never trims" if trim_threshold is None else f"trim threshold {trim_threshold >> 20} MiB"
    done = f"glibc malloc pinned: mmap threshold {mmap_threshold >> 20} MiB, {trim}, top pad {top_pad >> 20} MiB"
    if pretouch:
        _pretouch_heap(libc, pretouch, max(1, mmap_threshold // 2))
        done += f", {pretouch >> 20} MiB of heap pre-touched"
    return done


def _pretouch_heap(libc, size: int, chunk: int) -> None:
    """Allocate ``size`` bytes of heap in blocks of ``chunk`` (below the mmap threshold: from the heap), write them
    and free them, last first, so that they merge back into the heap's top."""
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = []
    try:
        for offset in range(0, size, chunk):
            n = min(chunk, size - offset)
            block = libc.malloc(n)
            if not block:
                raise MemoryError(f"could not pre-touch {size} bytes of heap")
            blocks.append(block)
            ctypes.memset(block, 0, n)
    finally:
        for block in reversed(blocks):
            libc.free(block)
