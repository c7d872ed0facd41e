"""Which dtypes this machine's CPU multiplies natively, read from its feature flags (``/proc/cpuinfo``).

Where a CPU lacks the instructions, torch emulates bfloat16 / float16 matrix products, and a model in that dtype runs
slower than in float32 (float16 on an AVX-512 CPU without AVX512-FP16: a half to a third of float32's speed). The
trainer's ``mixed_precision="auto"`` and the command line's ``--dtype`` warning both read it here. Standard library
only.
"""

from __future__ import annotations

from collections.abc import Collection

# dtype -> the CPU flags of the instructions that multiply it natively (any one of them will do)
NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def multiplies_natively(dtype: str, flags: Collection[str]) -> bool:
    """Whether a CPU with ``flags`` multiplies ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``) natively."""
    return dtype == "float32" or any(flag in flags for flag in NATIVE_FLAGS.get(dtype, ()))


def slow_dtype_warning(dtype: str, device_type: str, flags: Collection[str]) -> str | None:
    """Why a model in ``dtype`` runs slowly on a ``device_type`` device (``"cpu"``, ``"cuda"``) whose CPU has
    ``flags``, and which dtype is faster; None where it does not (float32, off the CPU, or native instructions)."""
    if device_type != "cpu" or dtype not in NATIVE_FLAGS or multiplies_natively(dtype, flags):
        return None
    faster = "bfloat16" if dtype == "float16" and multiplies_natively("bfloat16", flags) else "float32"
    return (f"{dtype} is slow on this CPU: it has no {' or '.join(NATIVE_FLAGS[dtype])} instructions, so torch "
            f"emulates {dtype} matrix products; {faster} is faster here")


__all__ = ["NATIVE_FLAGS", "cpu_flags", "multiplies_natively", "slow_dtype_warning"]
