"""Triton kernels with torch reference twins (``hf_dspark.scheduling``). On CUDA the Triton path is the default;
on CPU the torch twins run (Triton has no CPU backend; tests run the kernels under ``TRITON_INTERPRET=1``)."""

from .scheduler import schedule_lengths, triton_available

__all__ = ["schedule_lengths", "triton_available"]
