"""oneDNN weight prepacking for ``nn.Linear`` on CPU: the one module that calls torch's private mkldnn ops.

torch's stock CPU linear calls the BLAS GEMV for one input row and the BLAS GEMM for several; on CPUs the BLAS does
not tune for, a GEMM over 2-16 rows costs up to twice the GEMV although it streams the same weights. oneDNN reorders a
weight once into the blocked layout its kernels read ("prepacking"); a linear over the packed weight then costs about
the same at 1 and at 16 rows, and less than the stock path at every row count measured. torch inductor's weight
freezing emits exactly these two ops for a frozen CPU linear (``torch/_inductor/fx_passes/mkldnn_fusion.py``); torch
exposes no public function for them, so this module keeps them behind :func:`unavailable`, which checks that the ops
exist with the schemas this code calls and that they compute ``F.linear`` on a small example, per dtype. Everything
else in the package goes through :func:`pack` and :func:`linear`; when :func:`unavailable` gives a reason, callers
keep the stock linear.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The schemas this module calls, as torch 2.13 declares them. A torch that changes either is refused (stock linears
# are used) and tests/test_target_optimization.py fails naming the op.
REORDER_SCHEMA = "mkldnn::_reorder_linear_weight(Tensor self, int? batch_size=None) -> Tensor Y"
LINEAR_SCHEMA = ("mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, "
                 "str? algorithm) -> Tensor Y")
# The dtypes whose packed linear oneDNN runs on CPU; float16 needs AVX512-FP16 and is probed like the others.
CANDIDATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def schemas() -> dict[str, str | None]:
    """The declared schemas of the two ops (None where torch lacks the op)."""
    found = {}
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        op = getattr(torch.ops.mkldnn, name, None)
        try:
            found[name] = str(op.default._schema) if op is not None else None
        except (AttributeError, RuntimeError):
            found[name] = None
    return found


@functools.cache
def unavailable(dtype: torch.dtype) -> str | None:
    """Why prepacked linears cannot run in ``dtype`` here, or None when they can (cached per dtype)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    if dtype not in CANDIDATE_DTYPES:
        return f"oneDNN prepacking covers {', '.join(str(d) for d in CANDIDATE_DTYPES)}, not {dtype}"
    found = schemas()
    for name, expected in (("_reorder_linear_weight", REORDER_SCHEMA), ("_linear_pointwise", LINEAR_SCHEMA)):
        if found[name] is None:
            return f"this torch has no torch.ops.mkldnn.{name}"
        if found[name] != expected:
            return f"torch.ops.mkldnn.{name} changed its schema to {found[name]!r} (expected {expected!r})"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator).to(dtype)
    bias = torch.randn(24, generator=generator).to(dtype)
    rows = torch.randn(3, 40, generator=generator).to(dtype)
    try:
        got = linear(rows, pack(weight), bias)
    except RuntimeError as err:  # the op exists but refuses this dtype on this CPU
        return f"oneDNN refuses a {dtype} linear here: {str(err).splitlines()[0]}"
    want = F.linear(rows.float(), weight.float(), bias.float())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if got.shape != want.shape or not torch.allclose(got.float(), want, atol=tolerance, rtol=tolerance):
        return f"oneDNN's packed {dtype} linear does not match F.linear on a small example"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered once into oneDNN's layout (an opaque tensor only :func:`linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``rows`` [M, in] times the packed weight, plus ``bias``: [M, out], as ``F.linear`` computes it."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


__all__ = ["CANDIDATE_DTYPES", "linear", "pack", "schemas", "unavailable"]
