"""The static drafting round: one sequence's drafting rounds over fixed-shape buffers, the form a CUDA graph captures
and replays (docs/design.md, "A drafting round is replayed, not launched").

Self-contained (torch + transformers + ``draft_sampling``): drafter folders carry it beside ``modeling_dspark.py``
for ``trust_remote_code``. It reads the drafter through its public methods, so it needs no import of the model.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process

from .draft_sampling import VALUE_ONLY_WARPERS, CandidateWarpers, DSparkDraft, exponential_race


class _KeptRounds(dict):
    """A drafter's static rounds by thread id. Not copied with the drafter (a CUDA graph cannot be, and a copy's
    weights live elsewhere): a deep copy or an unpickled drafter starts with none and builds its own."""

    def __deepcopy__(self, memo):
        return _KeptRounds()

    def __reduce__(self):
        return (_KeptRounds, ())


# Value-only warpers that read a value back to the host (``torch.distributions.Categorical`` validates its logits):
# a static round runs them eagerly, a CUDA graph cannot capture them.
HOST_READING_WARPERS = tuple(getattr(logits_process, name) for name in (
    "EtaLogitsWarper", "TopHLogitsWarper") if hasattr(logits_process, name))


def static_round_obstacle(drafter: "DSparkDrafter", processors: LogitsProcessorList | None,
                          graph: bool = False) -> str | None:
    """Why a drafting round cannot run as a ``DSparkStaticRound`` with these logits processors, or with ``graph``
    also be captured as a CUDA graph (None: it can).

    The static round feeds the sequential head its own previous draft and gives processors no token history, so
    it takes only value-only warpers (temperature, top-k/p, ...); a processor that reads token ids (repetition
    penalty, bad words, ...) needs the eager round's growing sequence. A graph also admits nothing that reads a
    value back to the host during the round: the eta and top-h warpers, or a dynamic / LongRoPE rotary embedding
    (it compares the largest position with its cached length on every call)."""
    readers = [type(p).__name__ for p in processors or [] if type(p) not in VALUE_ONLY_WARPERS]
    if readers:
        return f"logits processors that read token ids ({', '.join(readers)})"
    if graph:
        syncing = [type(p).__name__ for p in processors or [] if type(p) in HOST_READING_WARPERS]
        if syncing:
            return f"logits processors that read values back to the host ({', '.join(syncing)})"
        rope_type = getattr(drafter.rotary_emb, "rope_type", "default")
        if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
            return f"a rotary embedding that resizes itself while running (rope_type {rope_type!r})"
    return None


class DSparkStaticRound:
    """Drafting rounds of one sequence over fixed-shape buffers: the form a CUDA graph captures and replays.

    The context keys/values live in preallocated ``[1, kv_heads, capacity, head_dim]`` buffers per layer, appended
    in place. A round's varying inputs (the anchor, a window of ``block_size + 1`` rows of new context features,
    where that window starts and how many of its rows are real) are copied into static tensors; the round reads
    only those, writes the window's keys/values at its positions, attends over the whole buffer with the positions
    at or past the anchor masked out, and samples the block with the sequential head. Every round therefore runs
    the same kernels on the same addresses, with no host synchronisation: on CUDA (``graph=True``) the round is
    captured once and each draft is one graph replay instead of hundreds of kernel launches from Python.

    Rows past the real ones in the window are written too (positions at or past the anchor, masked, and
    overwritten by the next round's window), so a round's shapes never depend on how many tokens were accepted.
    More new positions than the window holds (the prompt, or features kept back by rounds that did not draft)
    are appended eagerly first.
    """

    def __init__(self, drafter: "DSparkDrafter", capacity: int, *, processors: LogitsProcessorList | None = None,
                 do_sample: bool = False, graph: bool = False, fallback: bool = False):
        obstacle = static_round_obstacle(drafter, processors, graph)
        if obstacle is not None:
            kind = "a CUDA graph of the drafting round" if graph else "a static drafting round"
            raise ValueError(f"{kind} cannot run {obstacle}; use draft_round='eager'")
        config = drafter.config
        weight = drafter.fc.weight
        self.device, self.dtype = weight.device, weight.dtype
        if graph and self.device.type != "cuda":
            raise ValueError(f"draft_round='graph' captures a CUDA graph; the drafter is on {self.device}")
        self.drafter = drafter
        self.block_size = g = config.block_size
        self.window = g + 1  # a block round verifies at most g drafts and adds the target's own token
        if capacity < self.window:
            raise ValueError(f"capacity {capacity} is smaller than one round's window ({self.window})")
        self.capacity = capacity
        self.processors = LogitsProcessorList(processors or [])
        self.do_sample = do_sample
        draft_size = config.vocab_size if drafter.draft_vocab is None else drafter.draft_vocab.numel()
        self.candidate = CandidateWarpers.build(self.processors, draft_size) if do_sample else None
        self.graph = graph
        self.fallback = fallback  # a failed capture warns and drafts eagerly instead of raising
        shape = (1, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in drafter.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in drafter.layers]
        taps = len(config.target_layer_ids) * config.target_hidden_size
        self.features = torch.zeros(1, self.window, taps, dtype=self.dtype, device=self.device)
        self.start = torch.zeros((), dtype=torch.long, device=self.device)  # the window's first position
        self.valid = torch.zeros((), dtype=torch.long, device=self.device)  # its real rows; the anchor follows them
        self.anchor = torch.zeros(1, dtype=torch.long, device=self.device)
        self.masks = torch.full((1, g - 1), config.mask_token_id, dtype=torch.long, device=self.device)
        self.history = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # value-only processors ignore it
        self.length = 0  # context positions in the buffers (host-side: the caller knows every count)
        # The round's own references to the draft-head rows and STS temperatures: a graph reads them by address, and
        # the drafter's shared cached copies can be replaced by other calls (another block size, another thread).
        # ``kept_static_round`` builds a new round whenever what they derive from changes.
        self.head_rows = drafter.draft_head_rows()
        self.temperatures = drafter.confidence_temperature_tensor(g, self.dtype, self.device)
        self._graph = None
        self._outputs: tuple[torch.Tensor, ...] | None = None

    def reset(self) -> None:
        """Start a new sequence (the buffers are reused; stale rows sit past the length, masked)."""
        self.length = 0

    # The round ----------------------------------------------------------------------------------------------------
    def _round(self) -> tuple[torch.Tensor, ...]:
        drafter, g = self.drafter, self.block_size
        window_positions = (self.start + torch.arange(self.window, device=self.device)).unsqueeze(0)
        anchor_position = self.start + self.valid
        block_positions = (anchor_position + torch.arange(g, device=self.device)).unsqueeze(0)
        window_key_values = drafter.context_key_values(self.features, window_positions)
        block_ids = torch.cat([self.anchor.view(1, 1), self.masks], dim=1)
        hidden = drafter._require_shared()[0](block_ids).to(self.dtype)
        block_rope = drafter.rotary_emb(hidden, block_positions)
        visible = torch.arange(self.capacity, device=self.device) < anchor_position
        mask = torch.cat([visible.expand(g, -1), visible.new_ones(g, g)], dim=-1).view(1, 1, g, -1)
        for layer, keys, values, (new_keys, new_values) in zip(drafter.layers, self.keys, self.values,
                                                                window_key_values):
            keys.index_copy_(2, window_positions[0], new_keys)
            values.index_copy_(2, window_positions[0], new_values)
            hidden = layer(hidden, block_rope, (keys, values), mask)
        hidden = drafter.norm(hidden)
        base_logits = drafter.output_logits(hidden, self.head_rows)
        base = base_logits.float()
        head = drafter.markov_head
        state = None if head is None else head.initial_state(hidden)
        previous, steps, tokens = self.anchor, [], []
        for k in range(g):
            scores = base[:, k]
            if head is not None:
                bias, state = head.step(previous, hidden[:, k], state)
                scores = scores + bias.to(scores.dtype)
            if self.candidate is not None:  # the same warpers on the top candidates (see CandidateWarpers)
                values, indices = self.candidate(scores)
                steps.append(self.candidate.full(values, indices, scores.shape[-1]))
                index = indices.gather(-1, exponential_race(values))
            else:
                if self.processors:
                    scores = self.processors(self.history, scores)
                steps.append(scores)
                index = exponential_race(scores) if self.do_sample else scores.argmax(dim=-1, keepdim=True)
            token = index if drafter.draft_vocab is None else drafter.draft_vocab[index]
            tokens.append(token)
            previous = token.view(1)
        draft_ids = torch.cat(tokens, dim=1)
        prev_ids = torch.cat([self.anchor.view(1, 1), draft_ids[:, :-1]], dim=1)
        confidence_logits = drafter.confidence_logits(hidden, prev_ids)
        outputs = [base_logits, draft_ids, torch.stack(steps, dim=1), hidden]
        if confidence_logits is not None:
            outputs += [confidence_logits, drafter.confidences(confidence_logits, self.temperatures)]
        return tuple(outputs)

    def _on_device(self):
        """The round's CUDA device made current (graphs and streams belong to one device); elsewhere nothing."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _capture(self) -> None:
        # Warm up on a side stream (lazy initialisation), then capture. The warm-up rounds rewrite the window's rows
        # with the same values the first replay writes. Everything runs on the round's device, whichever is current.
        with self._on_device():
            caller = torch.cuda.current_stream()
            stream = torch.cuda.Stream()
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._round()
            caller.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: CUDA work that other threads launch meanwhile (another generate()) neither breaks the
                # capture nor is refused.
                with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
                    outputs = self._round()
            finally:
                # A capture that fails to end leaves torch.cuda.graph's stream current: the caller's comes back.
                torch.cuda.set_stream(caller)
        self._graph, self._outputs = graph, outputs  # only a finished capture is kept and replayed

    def _replay(self) -> tuple[torch.Tensor, ...]:
        if self._graph is None:
            try:
                self._capture()
            except Exception as error:
                if not self.fallback:
                    raise
                warnings.warn(f"capturing the drafting round as a CUDA graph failed ({type(error).__name__}: {error}); "
                              "this drafter drafts with the static round run eagerly", RuntimeWarning, stacklevel=4)
                self.graph = False
                return self._round()
        with self._on_device():
            self._graph.replay()
        return tuple(t.clone() for t in self._outputs)  # the next replay overwrites the graph's outputs

    # Appending and drafting ------------------------------------------------------------------------------------------
    def extend(self, target_hidden: torch.Tensor) -> None:
        """Append the keys/values of ``target_hidden`` [1, n, taps * D] at positions ``length ..`` (eagerly)."""
        n = target_hidden.shape[1]
        if self.length + n > self.capacity:
            raise ValueError(f"the drafter context would hold {self.length + n} positions; capacity is {self.capacity}")
        positions = torch.arange(self.length, self.length + n, device=target_hidden.device).unsqueeze(0)
        for keys, values, (new_keys, new_values) in zip(self.keys, self.values,
                                                        self.drafter.context_key_values(target_hidden, positions)):
            keys[:, :, self.length:self.length + n] = new_keys
            values[:, :, self.length:self.length + n] = new_values
        self.length += n

    @torch.no_grad()
    def draft(self, anchor_ids: torch.LongTensor, anchor_position: int, target_hidden: torch.Tensor) -> DSparkDraft:
        """One round: append ``target_hidden`` [1, n, taps * D] (the features of every position the context lacks,
        so that it covers ``0 .. anchor_position - 1``) and draft a block from ``anchor_ids`` [1]."""
        n = target_hidden.shape[1]
        if anchor_ids.numel() != 1 or target_hidden.shape[0] != 1:
            raise ValueError("a static drafting round drafts for one sequence")
        if self.length + n != anchor_position:
            raise ValueError(
                f"the drafter context would cover positions 0..{self.length + n - 1} but the anchor is at "
                f"{anchor_position}: pass the features of every position the context lacks"
            )
        if anchor_position - min(n, self.window) + self.window > self.capacity:
            raise ValueError(f"anchor position {anchor_position} is past this round's capacity ({self.capacity})")
        if n > self.window:
            self.extend(target_hidden[:, : n - self.window])
            target_hidden, n = target_hidden[:, n - self.window:], self.window
        self.features[:, :n].copy_(target_hidden)
        self.start.fill_(self.length)
        self.valid.fill_(n)
        self.anchor.copy_(anchor_ids.reshape(1))
        if not self.graph:
            outputs = self._round()
        else:
            outputs = self._replay()
        self.length += n
        base_logits, draft_ids, sampled, hidden, *confidence = outputs
        return DSparkDraft(
            base_logits=base_logits,
            draft_ids=draft_ids,
            sampled_logits=sampled,
            hidden_states=hidden,
            confidence_logits=confidence[0] if confidence else None,
            confidences=confidence[1] if confidence else None,
            to_full_vocab=self.drafter.to_full_vocab if self.drafter.draft_vocab is not None else None,
        )


def kept_static_round(drafter: "DSparkDrafter", capacity: int, *, processors: LogitsProcessorList | None = None,
                      do_sample: bool = False, graph: bool = False, fallback: bool = False) -> "DSparkStaticRound":
    """``drafter``'s ``DSparkStaticRound`` (reset, ready for a new sequence) for contexts up to ``capacity`` positions.

    The last one built in the calling thread is kept and reused while its key matches: the capacity, the sampling
    mode, the processors' settings (a CUDA graph bakes them in), and the identity of every tensor the round reads
    or derives a cached copy from. A CUDA graph is then captured once, not per ``generate()`` call, and
    ``generate()`` calls running at the same time in different threads never share buffers."""
    embed, lm_head = drafter._require_shared()
    tensors = [*drafter.parameters(), *drafter.buffers(), embed.weight, lm_head.weight]
    key = (
        capacity, graph, fallback, do_sample,
        repr([(type(p).__name__, sorted(vars(p).items())) for p in processors or []]),
        tuple((t.data_ptr(), t.dtype, t.device) for t in tensors),
        lm_head.weight._version, None if drafter.draft_vocab is None else drafter.draft_vocab._version,
        None if drafter.config.confidence_temperatures is None else tuple(drafter.config.confidence_temperatures),
    )
    kept = drafter.__dict__.get("_static_rounds")
    if kept is None:
        kept = drafter.__dict__["_static_rounds"] = _KeptRounds()
    thread = threading.get_ident()
    cached = kept.get(thread)
    if cached is None or cached[0] != key:
        kept.pop(thread, None)  # free the old buffers (and graph) before allocating new ones
        cached = kept[thread] = (key, DSparkStaticRound(drafter, capacity, processors=processors, do_sample=do_sample,
                                                        graph=graph, fallback=fallback))
    cached[1].reset()
    return cached[1]
