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
