"""A target whose multi-token forward costs what a one-token forward costs: ``optimize_target(model)``.

Speculative decoding gains the accepted length divided by what a verification forward of width k costs against a
one-token forward. With torch's stock CPU linears that ratio is far above its physical limit (both forwards stream
the same weights): the BLAS GEMM that serves several rows costs up to twice the GEMV that serves one. Prepacking the
weights for oneDNN (:mod:`hf_dspark.onednn`) brings a 2-16 token forward within 1.1-1.4x of one token and makes the
one-token forward itself faster; ``docs/design.md`` ("Where a verification forward's time goes") has the breakdown
and ``scripts/forward_cost.py`` measures it on the machine at hand.

``optimize_target`` changes the model in place and keeps it a normal transformers model: every ``nn.Linear`` stays
an ``nn.Linear`` with the same ``weight`` Parameter (state dicts, tied embeddings, ``save_pretrained`` and PEFT see
nothing new); its class becomes :class:`PrepackedLinear`, which holds a packed copy of the weight beside it and uses
it for forwards without autograd on CPU. Projections that read the same input (q/k/v, gate/up) are multiplied in
one call over their concatenated packed weights (:class:`SharedInputGroup`). A weight changed in place or replaced
is repacked at its next forward; a write through ``weight.data`` (PEFT's ``merge()``) bypasses the version counter
that tells, so call :func:`repack_target` after one (or optimise after merging).
``"auto"`` (what ``load_default`` and the CLI use) measures stock against prepacked forwards of the model at widths 1
and 8 once per machine, dtype, thread count and model, caches the verdict, and applies the packing only where it is
faster at both widths. :func:`stock_linears` runs a block on the stock linears (the baseline a user has without this
library), :func:`restore_target` undoes the change.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from . import onednn
from .cpu_features import cpu_flags
from .target import cache_root, write_json_atomically

logger = logging.getLogger(__name__)

Mode = Literal["auto", "on", "off"]
MODES = ("auto", "on", "off")
# The widths whose forwards decide "auto": decoding's one token and a typical verification block.
DECIDING_WIDTHS = (1, 8)
DECIDING_CONTEXT = 64
# Bump when the deciding measurement changes; older cached verdicts are then ignored.
DECISION_METHOD = 2


# Sibling projections that read the same input, by the names transformers' model files give them: multiplied in
# one oneDNN call over their concatenated weights (one call's fixed cost instead of three, and one longer stream).
SHARED_INPUT_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PrepackedLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies by a oneDNN-prepacked copy of its weight when no gradient is needed on CPU.

    The class is swapped onto existing ``nn.Linear`` modules by :func:`optimize_target` (never constructed
    directly); ``weight`` and ``bias`` stay the module's Parameters. The packed copy is made at the first forward
    that needs it and remade when the weight's storage, version counter or dtype no longer match the ones it was
    packed from. A member of a :class:`SharedInputGroup` takes its output from the group's one multiplication."""

    _packed: torch.Tensor | None
    _packed_from: tuple | None
    _shared: "SharedInputGroup | None"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.device.type != "cpu" or x.dtype != weight.dtype or x.numel() == 0 or weight.device.type != "cpu"
                or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
                or torch.is_autocast_enabled("cpu")):
            return F.linear(x, weight, self.bias)
        if self._shared is not None:
            return self._shared.output_for(self, x)
        if self._packed_from != _stamp(weight):
            if onednn.unavailable(weight.dtype) is not None:  # converted to a dtype oneDNN cannot pack here
                return F.linear(x, weight, self.bias)
            self._packed, self._packed_from = onednn.pack(weight), _stamp(weight)
        out = onednn.linear(x.reshape(-1, x.shape[-1]), self._packed, self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickling) packs again at its first forward instead of carrying oneDNN's opaque layout.
        return {**super().__getstate__(), "_packed": None, "_packed_from": None}


class SharedInputGroup:
    """Linears that a block calls on the same input tensor (an attention's q/k/v projections, an MLP's gate and up
    projections), computed together: the first member called with an input multiplies it by all the members'
    concatenated packed weights and keeps each member's columns until that member asks for them (then drops them,
    so no activation outlives its forward). A member called with another tensor, or twice with one, starts a new
    product: the output is always the member's own ``x @ W.T + b``, column for column what its own linear gives."""

    def __init__(self, members: list[PrepackedLinear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.packed: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.packed_from: tuple | None = None
        self._lock = threading.Lock()  # packing, once, for every thread
        self._pending = threading.local()  # per thread (the demo runs two generate() calls on one target at once)

    def __getstate__(self) -> dict:
        # Copies carry neither the lock, another thread's pending products nor the opaque packed weight.
        return {"members": self.members, "sizes": self.sizes}

    def __setstate__(self, state: dict) -> None:
        # The members may still be half rebuilt here (they refer back to the group): only their references are kept.
        self.members, self.sizes = state["members"], state["sizes"]
        self.packed = self.bias = self.packed_from = None
        self._lock, self._pending = threading.Lock(), threading.local()

    def _stamp(self) -> tuple:
        return tuple(_stamp(p) for m in self.members for p in (m.weight, m.bias) if p is not None)

    def output_for(self, member: PrepackedLinear, x: torch.Tensor) -> torch.Tensor:
        index = self.members.index(member)
        pending = self._pending
        outputs = getattr(pending, "outputs", None)
        if outputs is None or pending.input is not x or index not in outputs or pending.version != _version(x):
            with self._lock:
                if self.packed_from != self._stamp():
                    if onednn.unavailable(member.weight.dtype) is not None:
                        return F.linear(x, member.weight, member.bias)
                    self.packed = onednn.pack(torch.cat([m.weight.detach() for m in self.members]))
                    has_bias = self.members[0].bias is not None
                    self.bias = torch.cat([m.bias.detach() for m in self.members]) if has_bias else None
                    self.packed_from = self._stamp()
                packed, bias = self.packed, self.bias
            out = onednn.linear(x.reshape(-1, x.shape[-1]), packed, bias)
            columns = out.split(self.sizes, dim=-1)
            outputs = {i: c.reshape(*x.shape[:-1], c.shape[-1]) for i, c in enumerate(columns)}
            pending.input, pending.version, pending.outputs = x, _version(x), outputs
        output = outputs.pop(index)
        if not outputs:
            pending.input = pending.outputs = None
        return output

    def packed_bytes(self) -> int:
        return 0 if self.packed is None else self.packed.numel() * self.packed.element_size()


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; inference tensors keep none (0)."""
    return 0 if tensor.is_inference() else tensor._version


def _stamp(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), _version(weight), weight.dtype


def _shared_input_groups(model: nn.Module) -> list[list[PrepackedLinear]]:
    groups = []
    for parent in model.modules():
        for names in SHARED_INPUT_NAMES:
            members = [getattr(parent, name, None) for name in names]
            if (all(type(m) is PrepackedLinear for m in members)
                    and len({(m.in_features, m.weight.dtype, m.bias is None) for m in members}) == 1):
                groups.append(members)
    return groups


@dataclass
class TargetOptimization:
    """What :func:`optimize_target` did, for logs, ``--json`` and benchmark reports."""

    mode: str
    applied: bool
    reason: str
    linears: int = 0
    packed_bytes: int = 0
    # Fastest forward seconds per width, stock and prepacked, where "auto" measured (or read its cached verdict).
    measured: dict = field(default_factory=dict)
    cached_verdict: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        if not self.applied:
            return f"stock linears ({self.reason})"
        ratios = ""
        if self.measured:
            ratios = " (" + ", ".join(
                f"width {w}: {self.measured['prepacked'][w] / self.measured['stock'][w]:.2f}x stock"
                for w in self.measured["stock"]) + ")"
        return f"oneDNN-prepacked weights for {self.linears} linears{ratios}"


def linears_state(model: nn.Module) -> str:
    """``"onednn-prepacked"`` when ``model``'s linears run on packed weights, else ``"stock"`` (part of the SPS
    profile's cache key: a profile measured on one does not price the other)."""
    return "onednn-prepacked" if any(type(m) is PrepackedLinear for m in model.modules()) else "stock"


def _plain_linears(model: nn.Module) -> list[nn.Linear]:
    # Only exact nn.Linear: subclasses (quantized, LoRA-wrapped, sharded) carry forwards of their own.
    return [m for m in model.modules() if type(m) is nn.Linear]


def prepack_linears(model: nn.Module) -> int:
    """Swap every plain CPU ``nn.Linear`` of ``model`` to :class:`PrepackedLinear`; returns how many. Raises
    ``RuntimeError`` naming the reason when oneDNN cannot run the model's dtype here."""
    dtype = next(model.parameters()).dtype
    reason = onednn.unavailable(dtype)
    if reason is not None:
        raise RuntimeError(f"cannot prepack the target's linears: {reason}")
    count = 0
    for module in _plain_linears(model):
        if module.weight.device.type != "cpu" or module.weight.dtype != dtype:
            continue
        module.__class__ = PrepackedLinear
        module._packed, module._packed_from, module._shared = None, None, None
        count += 1
    for members in _shared_input_groups(model):
        group = SharedInputGroup(members)
        for member in members:
            member._shared = group
    # Pack now (a forward over one token does) rather than inside the first timed forward; a failure (out of memory)
    # leaves the model as it was.
    try:
        with torch.inference_mode():
            for module in model.modules():
                if type(module) is PrepackedLinear:
                    module(torch.zeros(1, module.in_features, dtype=dtype))
    except BaseException:
        restore_target(model)
        raise
    return count


def repack_target(model: nn.Module) -> int:
    """Drop every packed copy so that the next forward packs the current weights; returns how many linears. Needed
    after a change the version counter does not see: writing through ``weight.data`` (PEFT's ``merge()`` does),
    or replacing storage at an address the allocator reused."""
    modules = [m for m in model.modules() if type(m) is PrepackedLinear]
    for module in modules:
        module._packed = module._packed_from = None
        if module._shared is not None:
            module._shared.packed_from = None
    return len(modules)


def restore_target(model: nn.Module) -> int:
    """Undo :func:`optimize_target`: every :class:`PrepackedLinear` becomes a plain ``nn.Linear`` again and drops
    its packed copy; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is PrepackedLinear:
            module.__class__ = nn.Linear
            del module._packed, module._packed_from, module._shared
            count += 1
    return count


@contextlib.contextmanager
def stock_linears(model: nn.Module) -> Iterator[None]:
    """Run the block with ``model``'s linears on torch's stock path (the packed copies are kept and reused after)."""
    swapped = [m for m in model.modules() if type(m) is PrepackedLinear]
    for module in swapped:
        module.__class__ = nn.Linear
    try:
        yield
    finally:
        for module in swapped:
            module.__class__ = PrepackedLinear


def _packed_bytes(model: nn.Module) -> int:
    modules = [m for m in model.modules() if type(m) is PrepackedLinear]
    groups = {id(m._shared): m._shared for m in modules if m._shared is not None}
    return (sum(m._packed.numel() * m._packed.element_size() for m in modules if m._packed is not None)
            + sum(g.packed_bytes() for g in groups.values()))


def optimize_target(model: nn.Module, mode: Mode = "auto", cache_folder=None) -> TargetOptimization:
    """Make ``model``'s multi-token CPU forward cheap, in place, and say what was done.

    ``mode``: ``"on"`` prepacks wherever oneDNN can run the model's dtype (raises ``RuntimeError`` with the reason
    where it cannot); ``"off"`` leaves (or puts back) the stock linears; ``"auto"`` prepacks where a measurement of
    this model on this machine, dtype and thread count found the prepacked forward faster at widths 1 and 8 (the
    verdict is cached under ``hf_dspark.target.cache_root()/optimization``, so the measurement, a few seconds, runs
    once). Models on an accelerator are left as they are under ``"auto"``.

    The packed copies cost as much memory as the linear weights (``packed_bytes``); ``restore_target`` frees them.
    The report is also kept as ``model.hf_dspark_optimization`` (see :func:`optimization_report`).
    """
    if mode not in MODES:
        raise ValueError(f"target optimization mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode != "off" and linears_state(model) != "stock":
        return optimization_report(model)  # already optimised: repacking would only cost time
    restore_target(model)
    report = _optimize(model, mode, cache_folder)
    model.hf_dspark_optimization = report
    return report


def optimization_report(model: nn.Module) -> TargetOptimization:
    """What :func:`optimize_target` last did to ``model``; for a model it never saw, its linears' current state."""
    report = getattr(model, "hf_dspark_optimization", None)
    if isinstance(report, TargetOptimization) and report.applied == (linears_state(model) != "stock"):
        return report
    applied = linears_state(model) != "stock"
    return TargetOptimization("on" if applied else "off", applied, "set outside optimize_target" if applied
                              else "optimize_target was not applied")


def _optimize(model: nn.Module, mode: str, cache_folder) -> TargetOptimization:
    if mode == "off":
        return TargetOptimization(mode, False, "turned off")
    parameter = next(model.parameters(), None)
    if parameter is None:
        return TargetOptimization(mode, False, "the model has no parameters")
    if parameter.device.type != "cpu":
        if mode == "on":
            raise RuntimeError(f"cannot prepack the target's linears: it is on {parameter.device}, not the CPU")
        return TargetOptimization(mode, False, f"the target is on {parameter.device.type}")
    reason = onednn.unavailable(parameter.dtype)
    if reason is not None:
        if mode == "on":
            raise RuntimeError(f"cannot prepack the target's linears: {reason}")
        return TargetOptimization(mode, False, reason)
    if not _plain_linears(model):
        return TargetOptimization(mode, False, "the target has no plain nn.Linear layers")
    measured, cached = {}, False
    if mode == "auto":
        try:
            measured, cached = _verdict(model, cache_folder)
        except Exception as err:  # a model whose forward this measurement cannot drive keeps its stock linears
            logger.warning("could not time the target's forwards (%s): keeping its stock linears", err)
            return TargetOptimization(mode, False, f"could not time its forwards: {err}")
        slower = [w for w in measured["stock"] if measured["prepacked"][w] >= measured["stock"][w]]
        if slower:
            return TargetOptimization(mode, False, "prepacked forwards measured slower here at width "
                                      + ", ".join(map(str, slower)), measured=measured, cached_verdict=cached)
    try:
        count = prepack_linears(model)
    except RuntimeError as err:  # e.g. out of memory for the packed copies: the model is left as it was
        if mode == "on":
            raise
        return TargetOptimization(mode, False, f"packing failed: {err}", measured=measured, cached_verdict=cached)
    return TargetOptimization(mode, True, "measured faster" if mode == "auto" else "asked for", count,
                              _packed_bytes(model), measured, cached)


# ----------------------------------------------------------------------------------------------------------------
# The "auto" verdict: measured once per machine, dtype, thread count and model, then cached
# ----------------------------------------------------------------------------------------------------------------
def cpu_description() -> dict:
    """The CPU's model name and a digest of its feature flags (from /proc/cpuinfo where there is one)."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name in ("", platform.machine(), platform.processor()):
                    name = value.strip()
                    break
    except OSError:
        pass
    flags = " ".join(sorted(cpu_flags()))
    return {"cpu": name, "cpu_flags": hashlib.sha1(flags.encode()).hexdigest()[:12]}


def verdict_key(model: nn.Module) -> dict:
    shapes = sorted({tuple(m.weight.shape) for m in _plain_linears(model)})
    return {
        **cpu_description(),
        "model": str(getattr(model.config, "_name_or_path", "") or model.config.model_type),
        "architecture": type(model).__name__,
        "linear_shapes": hashlib.sha1(repr(shapes).encode()).hexdigest()[:12],
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "method": DECISION_METHOD,
    }


def verdict_path(model: nn.Module, folder=None) -> Path:
    digest = hashlib.sha1(json.dumps(verdict_key(model), sort_keys=True).encode()).hexdigest()[:16]
    return Path(folder or cache_root() / "optimization") / f"verdict-{digest}.json"


def _verdict(model: nn.Module, folder=None) -> tuple[dict, bool]:
    path = verdict_path(model, folder)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            measured = {k: {int(w): float(s) for w, s in data["measured"][k].items()} for k in ("stock", "prepacked")}
            if set(measured["stock"]) == set(measured["prepacked"]) and measured["stock"]:
                return measured, True
            raise ValueError("stock and prepacked widths differ")
        except (ValueError, KeyError, AttributeError, TypeError) as err:  # a damaged file is measured again
            logger.warning("ignoring the unreadable cached verdict %s (%s)", path, err)
    logger.info("timing the target's stock and prepacked forwards once (a few seconds; cached)")
    measured = measure_forwards(model)
    payload = {"key": verdict_key(model), "measured": measured, "created": time.time(),
               "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    write_json_atomically(path, payload)
    return measured, False


def measure_forwards(model: nn.Module, widths=DECIDING_WIDTHS, context: int = DECIDING_CONTEXT,
                     repeats: int = 5) -> dict[str, dict[int, float]]:
    """Fastest seconds of ``model``'s forward at each width over a ``context``-token cache, on stock and on
    prepacked linears, alternating the two (and the widths) every repeat so that drift in the machine's load hits
    both alike; one warm-up round first. The model is left on stock linears."""
    from transformers import DynamicCache

    from .attention import packed_attention

    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context), generator=generator)
    steps = {w: torch.randint(0, vocab, (1, w), generator=generator) for w in widths}
    times: dict[str, dict[int, list[float]]] = {"stock": {w: [] for w in widths}, "prepacked": {w: [] for w in widths}}
    prepack_linears(model)
    try:
        with torch.inference_mode(), packed_attention(model):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            cache.activate_past_recording()  # sliding-window layers keep what each timed forward adds, so it crops back
            for r in range(repeats + 1):
                for variant in ("stock", "prepacked"):
                    context_manager = stock_linears(model) if variant == "stock" else contextlib.nullcontext()
                    with context_manager:
                        for w in widths:
                            positions = torch.arange(context, context + w).unsqueeze(0)
                            started = time.perf_counter()
                            model(input_ids=steps[w], cache=cache, position_ids=positions, use_cache=True)
                            elapsed = time.perf_counter() - started
                            cache.crop(-w)
                            if r:
                                times[variant][w].append(elapsed)
    finally:
        restore_target(model)
    return {variant: {w: min(t) for w, t in per_width.items()} for variant, per_width in times.items()}


__all__ = [
    "MODES",
    "PrepackedLinear",
    "TargetOptimization",
    "linears_state",
    "measure_forwards",
    "optimization_report",
    "optimize_target",
    "prepack_linears",
    "repack_target",
    "restore_target",
    "stock_linears",
]
