"""Triton scheduler kernel vs its torch twin, under the Triton interpreter on CPU."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from hf_dspark.kernels.scheduler import schedule_triton, width_schedule_triton
    from hf_dspark.scheduling import StepsPerSecond, prefix_schedule, topk_schedule, width_schedule
    g = torch.Generator().manual_seed(0)
    cases = 0
    for num, block in [(1, 1), (1, 7), (3, 4), (5, 7), (8, 3), (4, 15)]:
        for trial in range(6):
            c = torch.rand(num, block, generator=g)
            c[torch.rand(num, block, generator=g) < 0.15] = 0.0
            if trial == 0:
                c[:] = 1.0  # ties everywhere
            samples = [1, num + 1, num + block, num * block + num + 1]
            sps = StepsPerSecond(sorted(set(samples)), [100.0 / (1 + 0.02 * i * (trial + 1)) for i in range(len(set(samples)))])
            table = sps.table()
            expected = prefix_schedule(c, table)
            got = schedule_triton(c, table)
            assert torch.equal(got, expected), (c, got, expected)
            for capacity in (0, 1, 3, num * block):
                assert torch.equal(schedule_triton(c, table, capacity), topk_schedule(c, capacity)), capacity
            # Width layers (padded batches): SPS over B = R * (1 + L), also with a table too short for every layer.
            widths = [num * (1 + k) for k in range(block + 1)]
            for top in (len(widths), max(1, len(widths) // 2)):
                padded = StepsPerSecond(widths[:top], [100.0 / (1 + (0.3 - 0.04 * trial) * k) for k in range(top)])
                expected = width_schedule(c, padded.table())
                got = width_schedule_triton(c, padded.table())
                assert torch.equal(got, expected), (c, got, expected)
            cases += 1
    print("ok", cases)
    """
)


def test_triton_kernel_matches_torch_twin():
    # TRITON_INTERPRET must be set before the kernel is defined, so run in a fresh interpreter.
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().startswith("ok")


def test_kernel_warmup_compiles_in_the_background_and_reports_failures():
    """Until a variant is compiled, callers are told it is not ready (and take the torch twin); compiles run in one
    background thread, once per variant; a failed compile is kept with its error and never retried."""
    import threading

    import torch

    from hf_dspark.kernels import KernelWarmup, warm_scheduler_kernels
    from hf_dspark.kernels.scheduler import WARMUP, _variant

    started, release, compiled = threading.Event(), threading.Event(), []

    def compile_fn(variant, device):
        started.set()
        assert release.wait(10)
        if variant[0] == "width":
            raise RuntimeError("ptxas failed")
        compiled.append(variant)

    warm = KernelWarmup(compile_fn)
    good, bad = _variant("prefix", 5, 7), _variant("width", 33, 7)
    assert good == ("prefix", 8, 8) and bad == ("width", 64, 8) and _variant("topk", 1, 1) == ("topk", 2, 2)
    device = torch.device("cpu")
    warm.request([good, bad], device)
    assert started.wait(10)
    assert not warm.ready(good, device)  # compiling: not ready yet
    warm.request([good], device)  # already queued: not compiled twice
    release.set()
    assert warm.wait(10)
    assert warm.ready(good, device) and compiled == [good]
    assert not warm.ready(good, torch.device("meta"))  # compiled per device
    assert not warm.ready(bad, device) and "ptxas failed" in warm.failed[("cpu", bad)]
    warm.request([bad, good], device)
    assert warm.wait(10) and compiled == [good]  # neither compiled again
    # Off CUDA nothing is compiled
    assert warm_scheduler_kernels("cpu", 64, 7) is WARMUP and WARMUP._worker is None


def test_kernel_warmup_holds_compiles_back_while_something_is_timed():
    """``quiet()`` waits for the compile in progress, starts none while the block runs (a compile beside a timed
    host-bound forward makes it look slower), and lets the queue go on afterwards."""
    import threading
    import time

    import torch

    from hf_dspark.kernels import KernelWarmup

    events, release = [], threading.Event()

    def compile_fn(variant, device):
        events.append(("start", variant[1]))
        if variant[1] == 2:
            assert release.wait(10)
        time.sleep(0.01)
        events.append(("end", variant[1]))

    warm = KernelWarmup(compile_fn)
    device = torch.device("cpu")
    warm.request([("width", r, 8) for r in (2, 4, 8)], device)
    while not events:
        time.sleep(0.001)
    threading.Timer(0.2, release.set).start()
    with warm.quiet(timeout=10) as idle:
        assert idle and events == [("start", 2), ("end", 2)]  # entered once the running compile ended
        time.sleep(0.1)
        events.append(("timed", 0))
        assert events[-2:] == [("end", 2), ("timed", 0)]  # nothing started meanwhile
    assert warm.wait(10)
    assert events == [("start", 2), ("end", 2), ("timed", 0), ("start", 4), ("end", 4), ("start", 8), ("end", 8)]
    assert all(warm.ready(("width", r, 8), device) for r in (2, 4, 8))
    with warm.quiet(timeout=0) as idle:  # nothing compiling: enters at once
        assert idle
    running, blocked = threading.Event(), threading.Event()
    warm = KernelWarmup(lambda variant, device: (running.set(), blocked.wait(10)))
    warm.request([("width", 2, 8)], device)
    assert running.wait(10)
    with warm.quiet(timeout=0.05) as idle:
        assert not idle  # the compile outlasted the timeout: timed anyway, and said so
    blocked.set()
    assert warm.wait(10)


def test_schedule_lengths_counts_the_calls_the_twin_serves_while_a_kernel_compiles(monkeypatch):
    """Under ``backend="auto"`` a CUDA call whose variant is not compiled yet is served by the torch twin (the same
    lengths, no wait), queues the compile and is counted as a twin call: the device check reads the counts."""
    import torch

    import hf_dspark.kernels.scheduler as scheduler
    from hf_dspark.scheduling import StepsPerSecond, width_schedule

    class OnCuda(torch.Tensor):  # a CPU tensor that routes like a CUDA one
        @property
        def is_cuda(self):
            return True

    queued = []
    warm = scheduler.KernelWarmup(lambda variant, device: queued.append(variant))
    monkeypatch.setattr(scheduler, "WARMUP", warm)
    monkeypatch.setattr(scheduler, "_HAVE_TRITON", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    confidences = torch.rand(3, 7, generator=torch.Generator().manual_seed(0))
    table = StepsPerSecond([3 * (1 + k) for k in range(8)], [100.0 / (1 + 0.3 * k) for k in range(8)]).table()
    lengths = scheduler.schedule_lengths(confidences.as_subclass(OnCuda), table, padded=True)
    assert torch.equal(lengths.as_subclass(torch.Tensor), width_schedule(confidences, table))
    assert warm.calls == {"twin": 1, "kernel": 0}
    assert warm.wait(10) and queued == [scheduler._variant("width", 3, 7)]
