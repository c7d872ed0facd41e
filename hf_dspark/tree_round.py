"""Token-tree rounds inside transformers' assisted decoding (``generate()``, one sequence, greedy).

transformers' loop verifies a chain: it runs the target over ``[anchor, candidates...]``, keeps the candidates up to
the first mismatch and crops the cache behind them. A tree round is verified before the loop sees it: the generator
grows the tree from its block (``token_tree.grow_tree``), the planner sizes it, and ``verify_tree`` runs the target
once over ``[anchor, nodes...]`` with the tree's attention mask and positions by depth, walks the target's greedy
choices down the tree, and moves the accepted path's keys and values in the cache to where a chain of those tokens
would have put them (the rest is cropped). The loop then receives the accepted path as the round's candidates, and
its forward over ``[anchor, path...]`` is answered from the tree forward (``PathForward``): the same logits and hidden
states, rows along the path, and the cache already holding them. Everything after that is the loop's own: the
processors, the greedy match (every candidate matches, since each is the target's choice), EOS and length crops,
the streamer, scores, ``return_dict_in_generate``.

This file is self-contained (torch + its sibling ``token_tree``), so exported drafter folders can carry it.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

try:  # inside the hf_dspark package, or a custom_generate/ folder carrying its siblings next to this file
    from .token_tree import TokenTree, grow_tree, tree_obstacle
except ImportError:  # pragma: no cover - loaded as a top-level module
    from token_tree import TokenTree, grow_tree, tree_obstacle  # type: ignore[no-redef]


class VerifiedPath(NamedTuple):
    """A tree round's outcome: the accepted ``path`` (node indices), the target's ``next_token`` after it, the
    ``tokens`` [1 + len(path)] the loop's next forward runs over (anchor, then the path), and ``outputs``, the tree
    forward's outputs along those rows."""

    path: list[int]
    next_token: int
    tokens: torch.Tensor
    outputs: Any


class PathForward:
    """The target's ``forward`` while DSpark assisted decodings run on it: a plain forward, except the call right
    after a tree round in the same thread, which gets the round's outputs along its path (checked against the tokens
    it is asked to run). One per target, shared by the calls running on it (``path_forward``)."""

    def __init__(self, forward, own=None, had_own: bool = False):
        self.forward, self.own, self.had_own = forward, own, had_own
        self.users = 0
        self._local = threading.local()

    @property
    def pending(self) -> VerifiedPath | None:
        return getattr(self._local, "pending", None)

    @pending.setter
    def pending(self, value: VerifiedPath | None) -> None:
        self._local.pending = value

    def __call__(self, *args, **kwargs):
        pending, self.pending = self.pending, None
        if pending is None:
            return self.forward(*args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or not torch.equal(ids.reshape(-1).to(pending.tokens.device), pending.tokens):
            raise RuntimeError("the forward after a token-tree round does not run over the round's accepted path; "
                               "the assisted-decoding loop changed under DSpark's tree rounds")
        return pending.outputs


_PATH_FORWARD: contextvars.ContextVar[PathForward | None] = contextvars.ContextVar("dspark_path_forward", default=None)
_INSTALL = threading.Lock()


@contextlib.contextmanager
def path_forward(target) -> Iterator[PathForward]:
    """Make ``target.forward`` a ``PathForward`` for the block (and ``current_path_forward()`` in this context).
    Calls running at once on one target share it; the last one out restores the previous ``forward`` (the class's,
    or an instance attribute such as accelerate's hook)."""
    with _INSTALL:
        hook = target.__dict__.get("forward")
        if not isinstance(hook, PathForward):
            hook = PathForward(target.forward, target.__dict__.get("forward"), "forward" in target.__dict__)
            target.forward = hook
        hook.users += 1
    token = _PATH_FORWARD.set(hook)
    try:
        yield hook
    finally:
        _PATH_FORWARD.reset(token)
        hook.pending = None
        with _INSTALL:
            hook.users -= 1
            if hook.users == 0:
                if hook.had_own:
                    target.forward = hook.own
                else:
                    del target.forward


def current_path_forward() -> PathForward | None:
    """The ``PathForward`` of the assisted decoding running in this context (None: tree rounds are unavailable)."""
    return _PATH_FORWARD.get()


def tree_cache_obstacle(cache) -> str | None:
    """Why the target's ``cache`` cannot keep a tree round's path (None: it can): every layer must be a plain
    full-attention ``DynamicLayer``, whose columns a round may move (sliding, static, quantized or recurrent layers
    keep other state)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return "the target's cache has no layers to move a path in"
    kinds = sorted({type(layer).__name__ for layer in layers} - {"DynamicLayer"})
    if kinds:
        return f"the target's cache holds {', '.join(kinds)} layers (a tree round needs DynamicLayer ones)"
    return None


def tree_mask(tree: TokenTree, past: int, dtype: torch.dtype | None, device) -> torch.Tensor:
    """[1, 1, 1 + n, past + 1 + n]: every row sees the ``past`` cached positions, the anchor, its ancestors and
    itself; boolean, or additive floats of ``dtype`` (eager attention)."""
    n = tree.size
    seen = torch.ones(1, 1, n + 1, past + n + 1, dtype=torch.bool, device=device)
    seen[0, 0, :, past:] = tree.visibility().to(device)
    return seen if dtype is None else additive_mask(seen, dtype)


def additive_mask(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as eager attention takes it: 0 where ``seen``, the lowest ``dtype`` value
    elsewhere."""
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


@torch.no_grad()
def verify_tree(target, cache, input_ids: torch.LongTensor, tree: TokenTree, hidden_layers: Sequence[int],
                logits_processor=None) -> VerifiedPath:
    """One target forward over ``[anchor, tree nodes]`` after ``cache`` (which holds every position of
    ``input_ids`` [1, L] but the anchor, its last), the target's greedy walk down the tree (its choice at a row
    is the argmax of ``logits_processor`` over that row, given the sequence up to it, as the loop picks it), and
    the cache left holding the anchor and the accepted path in order."""
    device = input_ids.device
    past = input_ids.shape[1] - 1
    if cache.get_seq_length() != past:
        raise ValueError(f"a tree round needs the cache at {past} positions, it holds {cache.get_seq_length()}")
    ids = torch.cat([input_ids[0, -1:], tree.tokens.to(device)])[None]
    positions = (past + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths]).to(device))[None]
    eager = target.config.get_text_config()._attn_implementation == "eager"
    mask = tree_mask(tree, past, next(target.parameters()).dtype if eager else None, device)
    out = target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                 output_hidden_states=list(hidden_layers))
    logits = out.logits[0]
    tokens = tree.tokens.tolist()

    def choose(row: int, path: list[int]) -> int:
        scores = logits[row : row + 1].float()
        if logits_processor:
            prefix = torch.tensor([tokens[i] for i in path], dtype=torch.long, device=device)
            scores = logits_processor(torch.cat([input_ids[0], prefix])[None], scores)
        return int(scores.argmax(dim=-1))

    path, next_token = tree.accepted_path(choose)
    rows = torch.tensor([0] + [1 + i for i in path], device=device)
    _keep_path(cache, past, rows)
    hidden = out.hidden_states
    along = {"logits": out.logits.index_select(1, rows),
             "hidden_states": None if hidden is None else tuple(
                 None if h is None else h.index_select(1, rows) for h in hidden)}
    outputs = type(out)(**{**dict(out.items()), **along})
    return VerifiedPath(path, next_token, ids[0].index_select(0, rows), outputs)


def _keep_path(cache, past: int, rows: torch.Tensor) -> None:
    """Move the columns ``past + rows`` of every layer to ``past .. past + len(rows) - 1`` and crop the rest."""
    kept = rows.numel()
    columns = past + rows
    for layer in cache.layers:
        layer.keys[:, :, past : past + kept] = layer.keys.index_select(2, columns)
        layer.values[:, :, past : past + kept] = layer.values.index_select(2, columns)
    dropped = cache.get_seq_length() - (past + kept)
    if dropped:
        cache.crop(-dropped)


class SequenceTrees:
    """``generate()``'s token-tree rounds for one sequence: whether this call can take them (``off``: why not),
    growing a tree from a block, the planner's choice between it and the chain, and its verification.

    ``mode`` is ``token_tree.DRAFT_TREES``' setting; ``hidden_layers`` the target layers the drafter reads (the tree
    forward returns them for the accepted path, as a chain's forward would)."""

    def __init__(self, drafter, target, mode: str, do_sample: bool, hidden_layers: Sequence[int], logits_processor,
                 max_nodes: int):
        self.drafter, self.target, self.mode = drafter, target, mode
        self.hidden_layers, self.logits_processor, self.max_nodes = list(hidden_layers), logits_processor, max_nodes
        self.forward = current_path_forward()
        self.cache = None
        self.off = self._obstacle(do_sample)

    def _obstacle(self, do_sample: bool) -> str | None:
        if self.mode == "chain":
            return "draft_tree='chain'"
        if do_sample:
            return "sampling verifies the chain (no multi-draft rejection sampling)"
        if self.forward is None:
            return "the assisted-decoding loop runs without DSpark's path forward"
        return tree_obstacle(self.drafter)

    def start(self, cache, scheduled: bool, fixed_width: bool) -> None:
        """At the prefill round: the call's cache and how its rounds are priced rule tree rounds in or out."""
        if self.off is None:
            if not scheduled:
                self.off = "the verification policy is not priced by an SPS profile"
            elif fixed_width:
                self.off = "every round verifies a fixed width (verification_width)"
            else:
                self.off = tree_cache_obstacle(cache)
        if self.off is not None and self.mode == "always":
            raise ValueError(f"draft_tree='always' cannot grow token trees here: {self.off}")
        self.cache = cache

    def grow(self, draft, anchor: torch.Tensor, room: int, table_width: int) -> TokenTree | None:
        """The tree below ``anchor`` (a 0-d token tensor) of the block ``draft`` (None when tree rounds are off or the
        draft has no backbone outputs), at most ``room`` deep and no wider than the SPS table prices."""
        if self.off is not None or draft.base_logits is None or draft.hidden is None:
            return None
        nodes = min(self.max_nodes, table_width - 2)
        if nodes < 1 or room < 1:
            return None
        return grow_tree(self.drafter, draft.base_logits[0], draft.hidden[0], int(anchor), nodes, max_depth=room)

    def verify(self, input_ids: torch.LongTensor, tree: TokenTree) -> VerifiedPath:
        """The tree verified by the target, its path kept in the cache and handed to the loop's next forward."""
        verified = verify_tree(self.target, self.cache, input_ids, tree, self.hidden_layers, self.logits_processor)
        self.forward.pending = verified
        return verified


__all__ = ["PathForward", "SequenceTrees", "VerifiedPath", "additive_mask", "current_path_forward", "path_forward",
           "tree_cache_obstacle", "tree_mask", "verify_tree"]
