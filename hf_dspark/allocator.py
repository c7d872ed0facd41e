"""glibc malloc settings (``mallopt``) for processes whose large tensors would otherwise come back as fresh pages."""

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
