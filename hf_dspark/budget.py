"""How one round's verification budget is shared: the target's measured cost curve ``StepsPerSecond`` (SPS(B)) and
DSpark's Algorithm 1 over it (``prefix_schedule``), its padded-batch form (``width_schedule``), the dynamic top-K
variant (``dynamic_topk_capacity``, ``topk_schedule``), and ``schedule_batch``, which runs one of them for R rows (the
Triton kernels of ``hf_dspark.kernels`` where that package registered them, these torch twins otherwise).

This file is self-contained (torch only): exported drafter folders carry it in ``custom_generate/``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class StepsPerSecond:
    """A profiled SPS(B) curve: target forward steps per second with B tokens in the verification batch.

    Built from samples ``(B_i, sps_i)``; values between samples are linearly interpolated and B beyond
    ``max_batch_tokens`` is not allowed (the scheduler never admits past it).

    A forward's cost grows with the context it attends over (the cache it reads, and on CPU the attention itself), and
    faster for wide forwards than for one token. A profile measured at several contexts carries that growth:
    ``context_length`` is the context the samples stand for and ``seconds_per_context_token[i]`` what a forward of
    ``B_i`` tokens gains per extra cached token (a least-squares line through its measured seconds per context).
    ``at_context(n)`` is the curve at ``n`` cached tokens; a profile without them reads the same at every context.
    """

    def __init__(self, batch_tokens: list[int], steps_per_sec: list[float], max_batch_tokens: int | None = None,
                 context_length: int | None = None, seconds_per_context_token: list[float] | None = None):
        if len(batch_tokens) != len(steps_per_sec) or not batch_tokens:
            raise ValueError("SPS profile needs equally long, non-empty sample_batch_tokens and sample_steps_per_sec")
        if (context_length is None) != (seconds_per_context_token is None):
            raise ValueError("an SPS profile's context model needs both context_length and seconds_per_context_token")
        if seconds_per_context_token is not None and len(seconds_per_context_token) != len(batch_tokens):
            raise ValueError("seconds_per_context_token needs one value per sample_batch_tokens")
        order = sorted(range(len(batch_tokens)), key=lambda i: batch_tokens[i])
        self.batch_tokens = [int(batch_tokens[i]) for i in order]
        self.steps_per_sec = [float(steps_per_sec[i]) for i in order]
        if self.batch_tokens[0] < 1 or min(self.steps_per_sec) <= 0:
            raise ValueError("SPS samples need B >= 1 and positive steps per second")
        self.max_batch_tokens = int(max_batch_tokens or self.batch_tokens[-1])
        self.context_length = None if context_length is None else int(context_length)
        self.seconds_per_context_token = (None if seconds_per_context_token is None else
                                          [max(0.0, float(seconds_per_context_token[i])) for i in order])

    @property
    def models_context(self) -> bool:
        return self.seconds_per_context_token is not None

    def at_context(self, context_length: int) -> "StepsPerSecond":
        """The curve at ``context_length`` cached tokens (this curve itself when the profile has no context model).
        Seconds per forward move along each B's line, never below half their value at the profiled context (a
        line fitted far away must not predict a free forward), and stay non-increasing in B."""
        if not self.models_context:
            return self
        shift = int(context_length) - self.context_length
        rates, slowest = [], float("inf")
        for sps, slope in zip(self.steps_per_sec, self.seconds_per_context_token):
            slowest = min(slowest, 1.0 / max(0.5 / sps, 1.0 / sps + slope * shift))  # a wider forward is never faster
            rates.append(slowest)
        return StepsPerSecond(self.batch_tokens, rates, self.max_batch_tokens)

    @classmethod
    def from_dict(cls, data: dict) -> "StepsPerSecond":
        try:
            return cls(data["sample_batch_tokens"], data["sample_steps_per_sec"], data.get("max_batch_tokens"),
                       data.get("context_length"), data.get("sample_seconds_per_context_token"))
        except KeyError as err:
            raise ValueError(f"SPS profile lacks {err.args[0]!r}") from None

    def to_dict(self) -> dict:
        data = {"sample_batch_tokens": list(self.batch_tokens), "sample_steps_per_sec": list(self.steps_per_sec),
                "max_batch_tokens": self.max_batch_tokens}
        if self.models_context:
            data["context_length"] = self.context_length
            data["sample_seconds_per_context_token"] = list(self.seconds_per_context_token)
        return data

    def table(self, device=None) -> torch.Tensor:
        """SPS for B = 0..max_batch_tokens as a dense tensor (index 0 unused: 0)."""
        b = torch.arange(self.max_batch_tokens + 1, dtype=torch.float64)
        xs = torch.tensor(self.batch_tokens, dtype=torch.float64)
        ys = torch.tensor(self.steps_per_sec, dtype=torch.float64)
        idx = torch.searchsorted(xs, b).clamp(1, len(xs) - 1) if len(xs) > 1 else torch.zeros_like(b, dtype=torch.long)
        if len(xs) == 1:
            values = ys[0].expand_as(b).clone()
        else:
            x0, x1, y0, y1 = xs[idx - 1], xs[idx], ys[idx - 1], ys[idx]
            values = y0 + (y1 - y0) * (b - x0) / (x1 - x0)
            values = torch.where(b <= xs[0], ys[0], torch.where(b >= xs[-1], ys[-1], values))
        values[0] = 0.0
        return values.to(device=device, dtype=torch.float32)

    def __call__(self, batch_tokens: int) -> float:
        return float(self.table()[batch_tokens])


def _sorted_entries(confidences: torch.Tensor):
    """Prefix survival a = cumprod(c) [R, g] and all (r, j) sorted by a descending, ties toward smaller j
    (then smaller r). Returns (survival, sorted values [R*g], request index, position index (1-based))."""
    survival = torch.cumprod(confidences.float().clamp(0, 1), dim=-1)
    num_requests, g = survival.shape
    positions = torch.arange(1, g + 1, device=survival.device).expand(num_requests, g).reshape(-1)
    requests = torch.arange(num_requests, device=survival.device).repeat_interleave(g)
    values = survival.reshape(-1)
    # Stable sorts: by request, then position, then value descending -> ties resolved toward smaller j, then r.
    order = torch.argsort(requests, stable=True)
    order = order[torch.argsort(positions[order], stable=True)]
    order = order[torch.argsort(values[order], descending=True, stable=True)]
    return survival, values[order], requests[order], positions[order]


def prefix_schedule(confidences: torch.Tensor, sps_table: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 (lossless): verification lengths for R requests.

    Args:
        confidences: [R, g] conditional confidences c_{r,k}.
        sps_table: [Bmax + 1] SPS(B) (``StepsPerSecond.table()``).
    Returns:
        [R] long: number of draft tokens to verify per request (plus its anchor).

    Entries are admitted in global order of prefix survival while the expected throughput
    ``(R + sum admitted a) * SPS(R + admitted)`` strictly improves; the first non-improvement stops the search
    (the early stop that keeps the output distribution exact). Zero-survival entries are never admitted.
    """
    num_requests = confidences.shape[0]
    _, values, requests, positions = _sorted_entries(confidences)
    max_b = sps_table.shape[0] - 1
    if num_requests > max_b:
        raise ValueError(f"{num_requests} requests exceed the profiled max_batch_tokens={max_b}")
    count = min(values.shape[0], max_b - num_requests)
    values, requests, positions = values[:count], requests[:count], positions[:count]
    table = sps_table.to(device=values.device, dtype=torch.float32)
    # float32 throughout, with theta_prev = (tau - a) * SPS(B - 1): the same arithmetic as the Triton twin.
    tau = num_requests + torch.cumsum(values, dim=0)
    batch = torch.arange(num_requests + 1, num_requests + 1 + count, device=values.device)
    theta = tau * table[batch]
    previous = (tau - values) * table[batch - 1]
    improving = (theta > previous) & (values > 0)
    admitted = int(torch.cumprod(improving.long(), dim=0).sum()) if count else 0
    lengths = torch.zeros(num_requests, dtype=torch.long, device=confidences.device)
    if admitted:
        lengths.scatter_reduce_(0, requests[:admitted].to(lengths.device), positions[:admitted].to(lengths.device),
                                reduce="amax")
    return lengths


def width_schedule(confidences: torch.Tensor, sps_table: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 for a PADDED batch (lossless): verification lengths for R requests.

    The engine verifies R requests as one [R, 1 + L] block, so a step's cost depends on the longest verification
    length L, not on the sum of the lengths: every request may verify its drafts up to position L for free once
    one request does. Admission therefore goes by draft position ("width layers") instead of by single entries:
    layer L (every request's entry at position L) is admitted while
    ``(R + sum_{r, j <= L} a_{r,j}) * SPS(R * (1 + L))`` strictly improves, and the first non-improvement stops the
    search. The decision to verify position L of a request depends only on survivals ``a_{., <= L}``, which do not
    depend on the draft token at position L, so the early stop keeps the output distribution exact as in
    Algorithm 1. Entries of zero survival are never admitted; with R = 1 this is Algorithm 1 exactly.

    Args:
        confidences: [R, g] conditional confidences c_{r,k} (zeros for requests that did not draft).
        sps_table: [Bmax + 1] SPS over the batch's padded tokens B = R * (1 + L).
    Returns:
        [R] long: number of draft tokens to verify per request.
    """
    survival = torch.cumprod(confidences.float().clamp(0, 1), dim=-1)
    num_requests, g = survival.shape
    max_b = sps_table.shape[0] - 1
    if num_requests > max_b:
        raise ValueError(f"{num_requests} requests exceed the profiled max_batch_tokens={max_b}")
    layers = min(g, max_b // num_requests - 1)
    lengths = torch.zeros(num_requests, dtype=torch.long, device=confidences.device)
    if layers <= 0:
        return lengths
    table = sps_table.to(device=survival.device, dtype=torch.float32)
    gain = survival[:, :layers].sum(dim=0)  # [L] survival mass each layer adds
    # float32 with theta_prev = (tau - gain) * SPS(previous width): the same arithmetic as the Triton twin.
    tau = num_requests + torch.cumsum(gain, dim=0)
    width = torch.arange(2, layers + 2, device=survival.device) * num_requests
    theta = tau * table[width]
    previous = (tau - gain) * table[width - num_requests]
    improving = (theta > previous) & (gain > 0)
    admitted = int(torch.cumprod(improving.long(), dim=0).sum())
    if admitted:
        lengths = (survival[:, :admitted] > 0).sum(dim=1).to(lengths.device)
    return lengths


def dynamic_topk_capacity(stale_confidences: torch.Tensor, sps_table: torch.Tensor) -> int:
    """Capacity K for the dynamic top-K variant, from confidences two steps old: the K maximising
    ``(R + top-K survival sum) * SPS(R + K)`` over all K (a full search is fine: the stale confidences
    cannot depend on the tokens being verified now)."""
    num_requests = stale_confidences.shape[0]
    _, values, _, _ = _sorted_entries(stale_confidences)
    max_b = sps_table.shape[0] - 1
    count = max(0, min(values.shape[0], max_b - num_requests))
    tau = num_requests + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(values[:count].double(), 0)])
    theta = tau * sps_table.double()[num_requests : num_requests + count + 1]
    return int(torch.argmax(theta))  # first maximum: ties toward the smaller batch


def topk_schedule(confidences: torch.Tensor, capacity: int) -> torch.Tensor:
    """Admit the ``capacity`` entries of highest CURRENT prefix survival (no early stop); zero-survival entries
    are never admitted. Returns [R] verification lengths."""
    num_requests = confidences.shape[0]
    _, values, requests, positions = _sorted_entries(confidences)
    keep = min(int(capacity), int((values > 0).sum()))
    lengths = torch.zeros(num_requests, dtype=torch.long, device=confidences.device)
    if keep:
        lengths.scatter_reduce_(0, requests[:keep], positions[:keep], reduce="amax")
    return lengths


# The ways a round's verification budget is shared among its rows (``schedule_batch``).
SCHEDULES = ("padded", "prefix", "topk")


class BatchShare(NamedTuple):
    """The rest of a batch one row's tree is priced within: the tokens the other rows are expected to deliver
    (``expected``), and what they verify: ``tokens`` in all, as wide as ``width`` (anchor included), in ``rows`` rows
    with this one. A padded batch (``padded``) runs every row as wide as its widest, so it costs SPS(rows * width);
    otherwise SPS(tokens + this row's width). The default is a batch of one row."""

    expected: float = 0.0
    tokens: int = 0
    width: int = 0
    rows: int = 1
    padded: bool = False

    def batch_tokens(self, width: torch.Tensor) -> torch.Tensor:
        """The batch's verification tokens B when this row verifies ``width`` tokens (anchor included)."""
        if self.padded:
            return self.rows * width.clamp(min=self.width)
        return self.tokens + width


def tree_schedule(survival: torch.Tensor, sps_table: torch.Tensor,
                  share: BatchShare = BatchShare()) -> tuple[int, float]:
    """Algorithm 1 for one sequence's token tree: how many of its nodes to verify, and the expected rate.

    ``survival`` [n]: each node's predicted probability of lying on the target's path, in the tree's order
    (decreasing, parents first: every prefix is a tree). Nodes are admitted in that order while the expected throughput
    ``(share.expected + 1 + sum admitted survival) * SPS(B)``, B the batch's tokens with this row verifying its anchor
    and the admitted nodes (``share``; alone: 1 + admitted), strictly improves, as ``prefix_schedule`` admits a
    chain's positions. Returns ``(nodes, expected tokens per second)``; zero nodes is the row decoding plainly."""
    table = sps_table.to(dtype=torch.float32, device="cpu")
    widths = torch.arange(1, 2 + int(survival.shape[0]))
    tokens = share.batch_tokens(widths)
    count = int((tokens <= table.shape[0] - 1).sum()) - 1  # nodes whose batch the table prices
    if count < 0:
        raise ValueError(f"the SPS table prices batches of at most {table.shape[0] - 1} tokens; this row's batch "
                         f"already takes {int(tokens[0])}")
    values = survival[:count].to(dtype=torch.float32, device="cpu")
    expected = share.expected + 1.0 + torch.cat([torch.zeros(1), torch.cumsum(values, dim=0)])
    theta = expected * table[tokens[: count + 1]]  # [count + 1]: 0..count nodes
    improving = (theta[1:] > theta[:-1]) & (values > 0)
    admitted = int(torch.cumprod(improving.long(), dim=0).sum()) if count else 0
    return admitted, float(theta[admitted])


def chain_rate(confidences: torch.Tensor, length: int, sps_table: torch.Tensor,
               share: BatchShare = BatchShare()) -> float:
    """The expected tokens per second of verifying the first ``length`` drafts of a chain with conditional
    confidences ``confidences`` [g]: ``(share.expected + 1 + sum of their survival) * SPS(B)``, B the batch's tokens
    with this row verifying ``1 + length`` (``share``; alone: ``1 + length``)."""
    tokens = int(share.batch_tokens(torch.tensor([1 + length]))[0])
    return float((share.expected + chain_expected(confidences, length)) * sps_table.float().cpu()[tokens])


def chain_expected(confidences: torch.Tensor, length: int) -> torch.Tensor:
    """The tokens a round verifying the first ``length`` drafts of a chain with conditional confidences
    ``confidences`` [g] is expected to deliver (0-d float32): 1 (the target's own) plus the drafts' survival."""
    return 1.0 + torch.cumprod(confidences.float().cpu().clamp(0, 1), dim=0)[:length].sum()


def use_schedule_kernels(schedule_lengths) -> None:
    """Run ``schedule_batch`` through ``schedule_lengths`` (``hf_dspark.kernels``: Triton on CUDA, these torch twins
    elsewhere), registered by that package when it is imported (the engine imports it). Without it, as in an exported
    folder, the torch twins here run; on a CPU both give the same lengths."""
    global _SCHEDULE_LENGTHS
    _SCHEDULE_LENGTHS = schedule_lengths


_SCHEDULE_LENGTHS = None


def capped_confidences(confidences: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Zero the confidences of positions past each row's cap ([R, g], [R]): the schedulers never admit zero-survival
    entries, so no row is given more drafts than it may verify."""
    positions = torch.arange(confidences.shape[1], device=confidences.device)
    return torch.where(positions < caps[:, None].to(confidences.device), confidences.float(), 0.0)


def schedule_batch(confidences: torch.Tensor, caps: torch.Tensor, sps_table: torch.Tensor, schedule: str = "prefix",
                   capacity: int | None = None) -> torch.Tensor:
    """Verification lengths [R] for one round from the shared budget.

    ``padded``: Algorithm 1 by width layers (``width_schedule``), the cost of a padded batch B = R * (1 + max
    length). ``prefix``: Algorithm 1 over all R rows at once (greedy admission by prefix survival with early stop,
    SPS of the batch's total tokens B = R + admitted). ``topk``: admit the ``capacity`` entries of highest survival
    (the capacity must come from earlier rounds' confidences). Rows that did not draft carry zeros. On CUDA the
    Triton kernels of ``hf_dspark.kernels`` run them; elsewhere, and in an exported folder, the torch twins here.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    if schedule == "topk" and capacity is None:
        raise ValueError("the top-K schedule needs a capacity")
    capped = capped_confidences(confidences, caps)
    table = None if sps_table is None else sps_table.to(capped.device)
    schedule_lengths = _SCHEDULE_LENGTHS
    if schedule_lengths is None:  # the kernels not imported (an exported folder): the torch twins
        if schedule == "topk":
            return topk_schedule(capped, int(capacity))
        return (width_schedule if schedule == "padded" else prefix_schedule)(capped, table)
    if schedule == "topk":
        return schedule_lengths(capped, capacity=int(capacity))
    return schedule_lengths(capped, table, padded=schedule == "padded")


__all__ = [
    "SCHEDULES",
    "BatchShare",
    "chain_expected",
    "chain_rate",
    "tree_schedule",
    "StepsPerSecond",
    "capped_confidences",
    "dynamic_topk_capacity",
    "prefix_schedule",
    "schedule_batch",
    "topk_schedule",
    "use_schedule_kernels",
    "width_schedule",
]
