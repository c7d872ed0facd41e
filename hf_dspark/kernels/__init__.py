"""Triton kernels with torch reference twins (``hf_dspark.scheduling``). On CUDA the Triton path is the default, each
kernel variant once it is compiled (in the background: ``warm_scheduler_kernels``); on CPU the torch twins run (Triton
has no CPU backend; tests run the kernels under ``TRITON_INTERPRET=1``)."""

from .scheduler import KernelWarmup, schedule_lengths, triton_available, warm_scheduler_kernels

__all__ = ["KernelWarmup", "schedule_lengths", "triton_available", "warm_scheduler_kernels"]
