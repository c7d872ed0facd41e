"""The engine's column-aligned ragged caches: the target's ``DynamicCache`` with masked rollback
(``RaggedBatchCache``, appending in place through ``_GrowingLayer``) and the drafter's lazily projected context
(``DeferredDrafterContext``). Rejected columns become holes that attention masks hide; ``compact`` squeezes them out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..modeling_dspark import DSparkContextCache
from ..tree_round import additive_mask


# ------------------------------------------------------------------------------------------------------------------
# Column-aligned ragged caches
# ------------------------------------------------------------------------------------------------------------------
class _ColumnAligned:
    """Per-request rows of cache tensors [R, heads, W, head_dim], column-aligned, with ``valid`` [R, W] marking the
    columns that hold verified positions; every other column is a hole that attention masks hide."""

    valid: torch.Tensor

    def _tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _assign(self, tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError

    @property
    def num_rows(self) -> int:
        return self.valid.shape[0]

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def check_aligned(self) -> None:
        widths = {t.shape[2] for t in self._tensors()}
        if widths != {self.width}:
            raise RuntimeError(f"ragged cache out of step: tensor widths {sorted(widths)}, mask width {self.width}")

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows``, in that order (requests leaving the batch drop out).

        When ``rows`` keeps every surviving row of the first ``n = len(rows)`` in place and fills the others with rows
        from the tail (``tail_filled_order``), only those rows are copied and the tensors are narrowed to ``n`` (a
        view): a request finishing in a batch of R does not cost a gather of all R rows of every cache tensor."""
        n = rows.numel()
        positions = torch.arange(n, device=rows.device)
        moved = rows != positions
        if bool((rows[moved] >= n).all()):
            dst, src = positions[moved], rows[moved]
            tensors = []
            for t in self._tensors():
                if dst.numel():
                    t[dst] = t.index_select(0, src)
                tensors.append(t[:n])
            self._assign(tensors)
            if dst.numel():
                self.valid[dst] = self.valid.index_select(0, src)
            self.valid = self.valid[:n]
            return
        self._assign([t.index_select(0, rows) for t in self._tensors()])
        self.valid = self.valid.index_select(0, rows)

    def append_rows(self, others: Sequence["_ColumnAligned"]) -> None:
        """Add the rows of ``others`` (requests joining); narrower parts are padded with holes on the right."""
        parts = [self, *others]
        width = max(part.width for part in parts)

        def pad(t: torch.Tensor, w: int) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, width - w)) if t.dim() == 4 else F.pad(t, (0, width - w))

        columns = zip(*(part._tensors() for part in parts), strict=True)
        self._assign([torch.cat([pad(t, part.width) for t, part in zip(ts, parts)], dim=0) for ts in columns])
        self.valid = torch.cat([pad(part.valid, part.width) for part in parts], dim=0)

    def compact(self) -> None:
        """Squeeze the holes out: each row's valid columns move to the front, in order."""
        lengths = self.valid.sum(dim=1)
        width = int(lengths.max()) if lengths.numel() else 0
        order = torch.argsort((~self.valid).to(torch.uint8), dim=1, stable=True)[:, :width]  # valid columns first
        gathered = []
        for t in self._tensors():
            index = order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
            gathered.append(t.gather(2, index))
        self._assign(gathered)
        self.valid = torch.arange(width, device=self.valid.device) < lengths[:, None]

    def holes_exceed(self, fraction: float = 0.25, slack: int = 16) -> bool:
        """Whether holes take more than ``fraction`` of the longest row (plus ``slack`` columns): time to compact."""
        if self.width <= slack:  # never (a drafter context that was never projected has no columns at all)
            return False
        longest = int(self.valid.sum(dim=1).max()) if self.num_rows else 0
        return self.width > longest + max(slack, int(longest * fraction))


class _GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views into buffers with spare columns: a step's new columns are
    written in place, where ``DynamicLayer.update`` concatenates (a fresh copy of the whole layer every step: for
    SmolLM2, bf16, 2 threads, about a tenth of a decode step at 16 or 64 rows). When the engine replaces the tensors
    (rows leaving or joining, compaction) the next update copies them once into a new buffer."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys.dim() != 4:
            return super().update(key_states, value_states, *args, **kwargs)
        rows, width, new = self.keys.shape[0], self.keys.shape[-2], key_states.shape[-2]
        buffers = getattr(self, "_spare", None)
        if not (buffers is not None and buffers[0].shape[-2] >= width + new and buffers[0].shape[0] >= rows
                and all(b.data_ptr() == t.data_ptr() and b.stride() == t.stride()
                        for b, t in zip(buffers, (self.keys, self.values)))):
            capacity = width + new + max(64, (width + new) // 4)
            buffers = []
            for t in (self.keys, self.values):
                buffer = t.new_empty(t.shape[0], t.shape[1], capacity, t.shape[3])
                buffer[:, :, :width] = t
                buffers.append(buffer)
            self._spare = tuple(buffers)
        keys, values = (b[:rows] for b in self._spare)
        keys[:, :, width:width + new] = key_states
        values[:, :, width:width + new] = value_states
        self.keys, self.values = keys[:, :, :width + new], values[:, :, :width + new]
        return self.keys, self.values


class AttentionLayout(NamedTuple):
    """Which attention the target's layers use: ``kinds`` (a set of ``"full_attention"`` / ``"sliding_attention"``)
    and the ``window`` of the sliding ones (None without)."""

    kinds: frozenset
    window: int | None

    @classmethod
    def of(cls, config) -> "AttentionLayout":
        """From the target's (text) config: its ``layer_types`` when given, else every layer sliding when it has a
        ``sliding_window`` (Mistral), else full."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        window = getattr(text, "sliding_window", None)
        kinds = frozenset(getattr(text, "layer_types", None) or
                          (["sliding_attention"] if window else ["full_attention"]))
        return cls(kinds, int(window) if window and "sliding_attention" in kinds else None)

    @property
    def windowed(self) -> bool:
        return self.window is not None

    @staticmethod
    def new_cache() -> DynamicCache:
        """The engine's target cache: one full-length layer per decoder layer, also for sliding-window layers (their
        window is applied by the masks, ``masks``, so a rollback never needs keys a window already dropped; the
        engine refuses other layer kinds up front)."""
        return DynamicCache()

    def masks(self, key_valid: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor,
              eager_dtype: torch.dtype | None = None):
        """The attention masks of a windowed target's forward, from positions: key column c of row r is seen by
        query i when it is valid and ``key_positions[r, c] <= query_positions[r, i]`` (full attention), and also
        ``query_positions[r, i] - key_positions[r, c] < window`` (sliding). Holes never shift a position, so the
        window counts tokens of the sequence, not cache columns. Returns the sliding [R, 1, Q, K] mask for a target
        whose layers all slide, else ``{"full_attention": ..., "sliding_attention": ...}``; boolean, or additive
        floats of ``eager_dtype`` for eager attention."""
        seen = key_valid[:, None, None, :] & (key_positions[:, None, None, :] <= query_positions[:, None, :, None])
        near = seen & (query_positions[:, None, :, None] - key_positions[:, None, None, :] < self.window)
        if eager_dtype is not None:
            seen, near = additive_mask(seen, eager_dtype), additive_mask(near, eager_dtype)
        if self.kinds == {"sliding_attention"}:
            return near
        return {"full_attention": seen, "sliding_attention": near}


class RaggedBatchCache(_ColumnAligned):
    """The target's ``DynamicCache`` for all active requests, one row per request, column-aligned, with ``valid``
    [R, W] marking the columns that hold verified positions.

    Invariant: the valid columns of row r hold the K/V of positions 0..n_r-1 of request r, in order. Every other
    column is a hole (a rejected draft, block padding, or width padding from joining) that attention masks hide.
    """

    def __init__(self, target_cache: DynamicCache, valid: torch.Tensor):
        for i, layer in enumerate(target_cache.layers):
            if type(layer) is DynamicLayer:  # same state, appended in place
                growing = _GrowingLayer.__new__(_GrowingLayer)
                growing.__dict__.update(layer.__dict__)
                target_cache.layers[i] = growing
            elif type(layer) is not _GrowingLayer:
                raise ValueError(
                    f"the batched engine serves full-attention targets with a plain DynamicCache; this target's "
                    f"cache has a {type(layer).__name__} layer (sliding-window or hybrid attention)"
                )
        self.target_cache = target_cache
        self.valid = valid  # bool [R, W]

    def _tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.target_cache.layers for t in (layer.keys, layer.values)]

    def _assign(self, tensors: list[torch.Tensor]) -> None:
        it = iter(tensors)
        for layer in self.target_cache.layers:
            layer.keys, layer.values = next(it), next(it)

    def attention_mask(self, block_valid: torch.Tensor) -> torch.Tensor:
        """2D mask [R, W + Q] for a forward that appends Q block columns (``block_valid`` [R, Q])."""
        return torch.cat([self.valid, block_valid], dim=1)

    def key_positions(self) -> torch.Tensor:
        """[R, W]: the sequence position each valid column holds (its rank among the row's valid columns; holes
        carry the position of the valid column before them and are masked anyway)."""
        return self.valid.long().cumsum(dim=1) - 1

    def commit(self, kept: torch.Tensor) -> None:
        """After the cache appended Q block columns: keep the columns marked in ``kept`` [R, Q] (anchor and accepted
        drafts), and turn the rest into holes."""
        self.valid = torch.cat([self.valid, kept], dim=1)
        self.check_aligned()


class PendingFeatures(NamedTuple):
    """Target features a row verified and has not projected yet: the first ``count`` positions of row ``row`` of a
    step's ``taps`` (hidden states [R, Q, D] each) at ``positions`` [R, Q], shared with the step's other rows."""

    taps: tuple[torch.Tensor, ...]
    positions: torch.Tensor
    row: int
    count: int


class DeferredDrafterContext(_ColumnAligned):
    """The drafter's context K/V for all active requests, built lazily.

    The target's features of each request's verified positions are kept pending (views of the verify forward's
    hidden states, nothing is copied) and projected into context K/V only when the request next drafts, in one
    batched projection for all the rows drafting that step. Requests that skip drafting (a zero predicted budget,
    or a batch too large for drafts to pay) never pay for the drafter's context. The valid columns of row r hold
    the K/V of r's positions 0..m_r-1 in order (m_r <= n_r: the rest is pending); holes are masked as in
    ``RaggedBatchCache``, with their own compaction.
    """

    def __init__(self, drafter, num_rows: int, device, pending: list[list["PendingFeatures"]] | None = None):
        config = drafter.config
        dtype = next(drafter.parameters()).dtype
        empty = torch.zeros(num_rows, config.num_key_value_heads, 0, config.head_dim, dtype=dtype, device=device)
        self.cache = drafter.new_context_cache()
        self.cache.keys = [empty] * config.num_hidden_layers
        self.cache.values = [empty] * config.num_hidden_layers
        self.valid = torch.zeros(num_rows, 0, dtype=torch.bool, device=device)
        self.pending = pending if pending is not None else [[] for _ in range(num_rows)]
        if len(self.pending) != num_rows:
            raise ValueError(f"{len(self.pending)} pending lists for {num_rows} rows")
        # pending positions per row, kept as rows come and go (the realized gate prices a catch-up every step)
        self.pending_counts = [sum(entry.count for entry in row) for row in self.pending]

    def _tensors(self) -> list[torch.Tensor]:
        return self.cache.keys + self.cache.values

    def _assign(self, tensors: list[torch.Tensor]) -> None:
        n = len(self.cache.keys)
        self.cache.keys, self.cache.values = list(tensors[:n]), list(tensors[n:])

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        rows = rows.tolist()
        self.pending = [self.pending[i] for i in rows]
        self.pending_counts = [self.pending_counts[i] for i in rows]

    def append_rows(self, others: Sequence["DeferredDrafterContext"]) -> None:
        super().append_rows(others)
        self.pending = [p for part in (self, *others) for p in part.pending]
        self.pending_counts = [n for part in (self, *others) for n in part.pending_counts]

    def defer(self, features: torch.Tensor | Sequence[torch.Tensor], positions: torch.Tensor,
              counts: Sequence[int]) -> None:
        """Queue the first ``counts[r]`` of row r's features at positions [R, Q]. ``features``: [R, Q, taps * D], or
        the taps' hidden states [R, Q, D] each. The whole tensors are kept, shared by the rows (no copy, not even a
        view per row: a step at 16 requests would spend 0.2 ms slicing them); each row's slice is taken only when
        the row drafts and they are projected."""
        taps = (features,) if isinstance(features, torch.Tensor) else tuple(features)
        for r, n in enumerate(counts):
            if n:
                self.pending[r].append(PendingFeatures(taps, positions, r, int(n)))
                self.pending_counts[r] += int(n)

    def num_pending(self, row: int) -> int:
        return self.pending_counts[row]

    def pending_positions(self, rows: Sequence[int]) -> int:
        """Pending positions over ``rows``: what projecting them (``flush``) has to go through."""
        return sum(self.pending_counts[r] for r in rows)

    def flush(self, drafter, rows: Sequence[int]) -> None:
        """Project the pending features of ``rows`` into context K/V (one batched forward of the drafter's context
        path) and append them as new columns; the other rows get holes there."""
        todo = [r for r in rows if self.pending[r]]
        if not todo:
            return
        device = self.valid.device
        features = [torch.cat([torch.cat([t[e.row, : e.count] for t in e.taps], dim=-1) for e in self.pending[r]])
                    for r in todo]
        positions = [torch.cat([e.positions[e.row, : e.count] for e in self.pending[r]]) for r in todo]
        counts = torch.tensor([f.shape[0] for f in features], device=device)
        features = torch.nn.utils.rnn.pad_sequence(features, batch_first=True)
        positions = torch.nn.utils.rnn.pad_sequence(positions, batch_first=True)
        columns = torch.arange(features.shape[1], device=device) < counts[:, None]  # [k, n]
        context = drafter.project_context(features)
        rope = drafter.rotary_emb(context, positions)
        every_row = len(todo) == self.num_rows
        index = None if every_row else torch.tensor(todo, device=device)
        for layer in drafter.layers:
            keys, values = layer.self_attn.key_values(context, *rope)  # [k, heads, n, head_dim]
            i = layer.self_attn.layer_idx
            if not every_row:
                keys = keys.new_zeros(self.num_rows, *keys.shape[1:]).index_copy_(0, index, keys)
                values = values.new_zeros(self.num_rows, *values.shape[1:]).index_copy_(0, index, values)
            self.cache.keys[i] = torch.cat([self.cache.keys[i], keys], dim=2)
            self.cache.values[i] = torch.cat([self.cache.values[i], values], dim=2)
        if not every_row:
            columns = columns.new_zeros(self.num_rows, columns.shape[1]).index_copy_(0, index, columns)
        self.valid = torch.cat([self.valid, columns], dim=1)
        for r in todo:
            self.pending[r] = []
            self.pending_counts[r] = 0
        self.check_aligned()

    def rows_view(self, rows: Sequence[int]) -> tuple[DSparkContextCache, torch.Tensor]:
        """The context cache and valid mask of ``rows`` (all rows: no copy)."""
        if len(rows) == self.num_rows and list(rows) == list(range(self.num_rows)):
            return self.cache, self.valid
        index = torch.tensor(list(rows), device=self.valid.device)
        view = DSparkContextCache(len(self.cache.keys))
        view.keys = [k.index_select(0, index) for k in self.cache.keys]
        view.values = [v.index_select(0, index) for v in self.cache.values]
        return view, self.valid.index_select(0, index)
