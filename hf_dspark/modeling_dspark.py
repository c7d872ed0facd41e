"""DSpark drafter: a DFlash-style parallel backbone fed with target hidden states, a lightweight sequential head
(Markov / gated / RNN) and a confidence head.

Reads top to bottom like a transformers model file: context cache, attention, decoder layer, the drafter, then the
low-level drafting API (``DSparkDrafter.draft``); the sequential and confidence heads are in ``heads``.

This file is self-contained (torch + transformers + the sibling modules it imports: ``configuration_dspark``,
``draft_sampling``, ``heads``, ``static_round``, ``drafter_files``): ``save_pretrained`` copies it with them into every drafter
folder so that ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` works without ``hf_dspark``.

Conventions (DSpark, not original DFlash): the block is ``[anchor, mask * (g - 1)]`` at positions
``anchor_pos .. anchor_pos + g - 1`` and block position ``k`` (0-based) predicts the token at ``anchor_pos + k + 1``.
The context is always exactly the target features of positions ``< anchor_pos``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.utils import ModelOutput

from .configuration_dspark import DSparkConfig
from .draft_sampling import CandidateWarpers, DSparkDraft, SequentialHeadLogitsProcessor, value_only
from .drafter_files import load_reference_shared, read_json, write_custom_generate
from .heads import SEQUENTIAL_HEADS, DSparkConfidenceHead, DSparkGatedHead, DSparkMarkovHead, DSparkRNNHead
from .static_round import DSparkStaticRound, kept_static_round, static_round_obstacle

DEFAULT_GENERATION_SETTINGS = {"verification_policy": "fixed", "num_verify_tokens": None, "confidence_threshold": 0.5}


# --------------------------------------------------------------------------------------------------------------
# Context K/V cache
# --------------------------------------------------------------------------------------------------------------
class DSparkContextCache:
    """Per-layer keys/values of the context (verified target positions) only.

    Block keys/values are never stored: each round attends over ``[cached context ; block]`` and the next round
    appends just the newly verified positions, so nothing has to be cropped.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # [batch, kv_heads, length, head_dim]
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def update(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer_idx] is None:
            self.keys[layer_idx], self.values[layer_idx] = keys, values
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` context positions (e.g. to roll back a speculative context extension)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]


# --------------------------------------------------------------------------------------------------------------
# Backbone
# --------------------------------------------------------------------------------------------------------------
@dataclass
class BlockLayout:
    """Many blocks per sequence, as training lays them out: the block tokens are ``A`` consecutive blocks of
    ``block_size``, and block ``a`` of sequence ``b`` attends to context positions ``< context_lengths[b, a]`` and
    to its own block (bidirectionally). Passed as ``attention_mask`` in place of the equivalent dense boolean mask."""

    context_lengths: torch.Tensor  # [batch, A] long
    block_size: int


class DSparkAttention(nn.Module):
    """Qwen3 attention (GQA, per-head q/k RMSNorm, RoPE) whose keys/values are ``[context ; block]``.

    Context keys go through the same ``k_proj``/``k_norm``/RoPE as the block's; queries come from the block only.
    Without a mask the block attends to all context and bidirectionally within itself.
    """

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*x.shape[:-1], -1, self.head_dim)
        keys = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)  # [batch, kv_heads, length, head_dim]
        values = self.v_proj(x).view(shape).transpose(1, 2)
        keys = keys * cos.unsqueeze(1) + _rotate_half(keys) * sin.unsqueeze(1)
        return keys, values

    def forward(
        self,
        block: torch.Tensor,  # [batch, block_len, hidden], already input-normed
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_kv: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,  # bool [batch|1, 1, block_len, ctx_len + block_len]
    ) -> torch.Tensor:
        cos, sin = block_rope
        shape = (*block.shape[:-1], -1, self.head_dim)
        queries = self.q_norm(self.q_proj(block).view(shape)).transpose(1, 2)
        queries, _ = apply_rotary_pos_emb(queries, queries, cos, sin)
        keys, values = self.key_values(block, cos, sin)
        if isinstance(attention_mask, BlockLayout):
            out = self._blockwise(queries, keys, values, context_kv, attention_mask)
            return self.o_proj(out.transpose(1, 2).reshape(*block.shape[:-1], -1))
        if context_kv is not None:
            keys = torch.cat([context_kv[0], keys], dim=-2)
            values = torch.cat([context_kv[1], values], dim=-2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attention_mask, scale=self.scaling, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(*block.shape[:-1], -1))

    def _blockwise(self, queries, keys, values, context_kv, layout: "BlockLayout") -> torch.Tensor:
        """Attention of many blocks per sequence, each over its context prefix and itself (``BlockLayout``), without
        the dense ``[q, n + q]`` mask: scores against the shared context keys (masked per block), scores within each
        block, one softmax over both. The same result as the dense mask for every block with context; about half
        the work, since a block never looks at the other blocks' keys."""
        b, heads, q, d = queries.shape
        kv_heads, g = keys.shape[1], layout.block_size
        groups, num = heads // kv_heads, q // g
        grouped = queries.reshape(b, kv_heads, groups, num, g, d)  # head h reads kv head h // groups (GQA)
        own = torch.matmul(grouped, keys.reshape(b, kv_heads, 1, num, g, d).transpose(-1, -2)) * self.scaling
        if context_kv is None:
            probs = torch.softmax(own.float(), dim=-1).to(values.dtype)
            out = torch.matmul(probs, values.reshape(b, kv_heads, 1, num, g, d))
            return out.reshape(b, heads, q, d)
        context_keys, context_values = context_kv
        n = context_keys.shape[-2]
        scores = torch.matmul(grouped.reshape(b, kv_heads, groups * q, d), context_keys.transpose(-1, -2))
        scores = (scores * self.scaling).reshape(b, kv_heads, groups, num, g, n)
        visible = torch.arange(n, device=scores.device) < layout.context_lengths.reshape(b, 1, 1, num, 1, 1)
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(torch.cat([scores, own], dim=-1).float(), dim=-1).to(values.dtype)
        to_context, to_block = probs.split([n, g], dim=-1)
        out = torch.matmul(to_context.reshape(b, kv_heads, groups * q, n), context_values)
        out = out.reshape(b, kv_heads, groups, num, g, d) + torch.matmul(
            to_block, values.reshape(b, kv_heads, 1, num, g, d))
        return out.reshape(b, heads, q, d)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DSparkDecoderLayer(nn.Module):
    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DSparkAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, block, block_rope, context_kv, attention_mask=None):
        block = block + self.self_attn(self.input_layernorm(block), block_rope, context_kv, attention_mask)
        return block + self.mlp(self.post_attention_layernorm(block))


# --------------------------------------------------------------------------------------------------------------
# Outputs
# --------------------------------------------------------------------------------------------------------------
@dataclass
class DSparkOutput(ModelOutput):
    """Backbone output for a block: ``hidden_states`` after the final norm ``[batch, g, d]`` and, when an LM head
    is available, the base logits ``U`` (before the sequential head) ``[batch, g, V]``."""

    hidden_states: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None



# --------------------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------------------
class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    base_model_prefix = "dspark"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True
    # Reference-format folders carry copies of the target's embedding and LM head; they are loaded separately.
    _keys_to_ignore_on_load_unexpected = [r"^embed_tokens\.weight$", r"^lm_head\.weight$", r"^d2t$"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, Qwen3RMSNorm):
            nn.init.ones_(module.weight)
        else:
            super()._init_weights(module)  # RoPE tables and other buffers


class DSparkDrafter(DSparkPreTrainedModel):
    """The DSpark drafter. Attach it to its target (``attach_target``, done automatically by ``generate``) to use
    the target's input embedding and LM head in place (no copy is made, and checkpoints never store them)."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        num_taps = len(config.target_layer_ids)
        self.fc = nn.Linear(num_taps * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DSparkDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.markov_head = SEQUENTIAL_HEADS[config.sequential_head](config) if config.uses_markov_embedding else None
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None
        if config.draft_vocab_size:
            # Target token id of each draft-vocabulary entry (set from data by the trainer; saved with the weights).
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_vocab = None
        self.__dict__["_draft_head_cache"] = None
        # Target-owned modules live outside the module tree: no parameters, no state-dict entries, no copies.
        self.__dict__["_shared"] = {"embed_tokens": None, "lm_head": None}
        self.generation_config = GenerationConfig(**DEFAULT_GENERATION_SETTINGS)
        self.last_stats = None
        self.post_init()

    # ----------------------------------------------------------------------------------------------------------
    # Target coupling
    # ----------------------------------------------------------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Module | None:
        return self._shared["embed_tokens"]

    @property
    def lm_head(self) -> nn.Module | None:
        return self._shared["lm_head"]

    def set_shared_modules(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        self._shared["embed_tokens"], self._shared["lm_head"] = embed_tokens, lm_head

    def check_target(self, target: PreTrainedModel) -> None:
        """Raise ``ValueError`` naming the mismatch if this drafter cannot serve ``target``."""
        check_target_compatibility(self.config, target.config)

    def attach_target(self, target: PreTrainedModel) -> "DSparkDrafter":
        """Use ``target``'s input embedding and LM head (shared, not copied) after checking compatibility."""
        self.check_target(target)
        self.set_shared_modules(target.get_input_embeddings(), target.get_output_embeddings())
        return self

    def _require_shared(self) -> tuple[nn.Module, nn.Module]:
        if self.embed_tokens is None or self.lm_head is None:
            raise RuntimeError(
                "This DSpark drafter has no embedding / LM head: call `drafter.attach_target(target)` first "
                "(generate() does it for you)."
            )
        return self.embed_tokens, self.lm_head

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return None  # the LM head is the target's; nothing to tie or resize here

    def new_context_cache(self) -> DSparkContextCache:
        return DSparkContextCache(self.config.num_hidden_layers)

    @staticmethod
    def gather_target_hidden(hidden_states, target_layer_ids) -> torch.Tensor:
        """Concatenate target ``hidden_states[i + 1]`` for ``i`` in ``target_layer_ids`` (``-1`` = embeddings)."""
        return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)

    def target_hidden_states_indices(self) -> list[int]:
        """Indices into transformers' ``hidden_states`` the drafter needs (``output_hidden_states=`` accepts it)."""
        return [i + 1 for i in self.config.target_layer_ids]

    # ----------------------------------------------------------------------------------------------------------
    # Backbone forward
    # ----------------------------------------------------------------------------------------------------------
    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(concat target features))``: [batch, n, taps * D] -> [batch, n, d]."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        target_hidden: torch.Tensor | None = None,
        context_position_ids: torch.LongTensor | None = None,
        cache: DSparkContextCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        compute_logits: bool = True,
        **kwargs,
    ) -> DSparkOutput:
        """Run the backbone over block(s).

        Args:
            input_ids: block tokens [batch, q] (anchor + masks per block); or ``inputs_embeds`` [batch, q, d].
            position_ids: absolute positions of the block tokens [batch, q].
            target_hidden: NEW context features, concatenated target hidden states [batch, n, taps * D].
            context_position_ids: their absolute positions [batch, n].
            cache: context K/V of earlier positions; ``target_hidden`` is appended to it.
            attention_mask: optional bool mask [batch|1, 1, q, cached + n + q] (True = attend), or a ``BlockLayout``
                (the same structure without the dense mask), for training with many blocks per sequence; none means
                every block token sees all context and the whole block.
        """
        if kwargs:
            raise TypeError(f"DSparkDrafter.forward got unexpected arguments: {sorted(kwargs)}")
        if inputs_embeds is None:
            if input_ids is None:
                raise ValueError("pass the block as `input_ids` or `inputs_embeds`")
            inputs_embeds = self._require_shared()[0](input_ids)
        hidden = inputs_embeds.to(self.fc.weight.dtype)
        block_rope = self.rotary_emb(hidden, position_ids)
        context = context_rope = None
        if target_hidden is not None:
            if context_position_ids is None:
                raise ValueError("`target_hidden` needs `context_position_ids`")
            context = self.project_context(target_hidden)
            context_rope = self.rotary_emb(context, context_position_ids)
        for layer in self.layers:
            context_kv = None
            if context is not None:
                context_kv = layer.self_attn.key_values(context, *context_rope)
            if cache is not None:
                if context_kv is not None:
                    context_kv = cache.update(layer.self_attn.layer_idx, *context_kv)
                elif cache.keys[layer.self_attn.layer_idx] is not None:
                    context_kv = (cache.keys[layer.self_attn.layer_idx], cache.values[layer.self_attn.layer_idx])
            hidden = layer(hidden, block_rope, context_kv, attention_mask)
        hidden = self.norm(hidden)
        logits = self.output_logits(hidden) if compute_logits else None
        return DSparkOutput(hidden_states=hidden, logits=logits)

    def output_logits(self, hidden: torch.Tensor, head_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target's LM head on drafter hidden states: [..., d] -> [..., output_vocab_size]. ``head_rows``: the
        draft-vocabulary rows to use (``draft_head_rows()``) instead of the drafter's shared cached copy."""
        lm_head = self._require_shared()[1]
        if self.draft_vocab is None:
            return lm_head(hidden.to(lm_head.weight.dtype))
        rows = self._draft_head_weight(lm_head) if head_rows is None else head_rows
        return F.linear(hidden.to(lm_head.weight.dtype), rows)

    def draft_head_rows(self) -> torch.Tensor | None:
        """The draft-vocabulary rows of the target's LM head (None without a draft vocabulary)."""
        return None if self.draft_vocab is None else self._draft_head_weight(self._require_shared()[1])

    def _draft_head_weight(self, lm_head: nn.Module) -> torch.Tensor:
        # The draft-vocabulary rows of the (frozen) target LM head, gathered once and reused while unchanged.
        weight = lm_head.weight
        key = (weight.data_ptr(), weight._version, self.draft_vocab.data_ptr(), self.draft_vocab._version,
               weight.device, weight.dtype)
        cached = self._draft_head_cache
        if cached is None or cached[0] != key:
            rows = weight.detach().index_select(0, self.draft_vocab.to(weight.device))
            self.__dict__["_draft_head_cache"] = cached = (key, rows)
        return cached[1]

    def to_full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocabulary logits into the full vocabulary (-inf elsewhere: q = 0 there)."""
        if self.draft_vocab is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab.to(logits.device), logits)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Set the draft vocabulary (target token ids, distinct, length ``draft_vocab_size``)."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        if self.draft_vocab is None or token_ids.shape != self.draft_vocab.shape:
            raise ValueError(f"expected {self.config.draft_vocab_size} draft-vocabulary ids, got {tuple(token_ids.shape)}")
        if token_ids.unique().numel() != token_ids.numel() or not 0 <= int(token_ids.min()) <= int(token_ids.max()) < self.config.vocab_size:
            raise ValueError("draft vocabulary ids must be distinct target token ids")
        self.draft_vocab.copy_(token_ids.to(self.draft_vocab.device))

    def context_key_values(self, target_hidden: torch.Tensor,
                           positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys/values [batch, kv_heads, n, head_dim] of context features [batch, n, taps * D] at
        absolute ``positions`` [batch|1, n]."""
        context = self.project_context(target_hidden)
        rope = self.rotary_emb(context, positions)
        return [layer.self_attn.key_values(context, *rope) for layer in self.layers]

    def extend_context(self, cache: DSparkContextCache, target_hidden: torch.Tensor, start_position: int) -> None:
        """Append the K/V of newly verified positions ``start_position ..`` to ``cache`` without drafting."""
        positions = _positions(start_position, target_hidden.shape[1], target_hidden)
        for layer, key_values in zip(self.layers, self.context_key_values(target_hidden, positions)):
            cache.update(layer.self_attn.layer_idx, *key_values)

    # ----------------------------------------------------------------------------------------------------------
    # Heads
    # ----------------------------------------------------------------------------------------------------------
    def sequential_logits(self, base_logits: torch.Tensor, hidden: torch.Tensor, prev_ids: torch.Tensor):
        """Teacher forcing: ``U_k + B_k`` with KNOWN previous tokens ``prev_ids`` [..., g] (training, parity)."""
        bias = self.sequential_bias(hidden, prev_ids)
        return base_logits if bias is None else base_logits + bias.to(base_logits.dtype)

    def sequential_bias(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Teacher forcing: the sequential head's bias ``B_k`` [..., g, V_out] (None without a head)."""
        return None if self.markov_head is None else self.markov_head.teacher_forced(prev_ids, hidden)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Uncalibrated confidence logits [..., g] for block hidden states and their previous tokens."""
        if self.confidence_head is None:
            return None
        prev_embedding = None
        if self.config.confidence_head_with_markov and self.markov_head is not None:
            prev_embedding = self.markov_head.markov_w1(prev_ids)
        return self.confidence_head(hidden, prev_embedding)

    def confidences(self, confidence_logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
        """c_k = sigmoid(z_k / T_k), with the Sequential Temperature Scaling temperatures when calibrated.
        ``temperatures``: the [g] tensor to divide by (``confidence_temperature_tensor``) instead of the drafter's
        shared cached one."""
        if temperatures is not None:
            confidence_logits = confidence_logits / temperatures
        elif self.config.confidence_temperatures is not None:
            confidence_logits = confidence_logits / self.confidence_temperature_tensor(
                confidence_logits.shape[-1], confidence_logits.dtype, confidence_logits.device)
        return torch.sigmoid(confidence_logits.float())

    def confidence_temperature_tensor(self, block_size: int, dtype: torch.dtype,
                                      device: torch.device) -> torch.Tensor | None:
        """The first ``block_size`` STS temperatures as a tensor (None when uncalibrated)."""
        temperatures = self.config.confidence_temperatures
        if temperatures is None:
            return None
        return self._temperature_tensor(tuple(temperatures[:block_size]), dtype, device)

    def _temperature_tensor(self, temperatures: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # The STS temperatures on the device, made once per (values, dtype, device): a host-to-device copy per round
        # would be a transfer on every draft, and one a CUDA graph cannot capture.
        key = (temperatures, dtype, device)
        cached = self.__dict__.get("_temperature_cache")
        if cached is None or cached[0] != key:
            self.__dict__["_temperature_cache"] = cached = (key, torch.tensor(temperatures, dtype=dtype, device=device))
        return cached[1]

    # ----------------------------------------------------------------------------------------------------------
    # Low-level drafting API
    # ----------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(
        self,
        anchor_ids: torch.LongTensor,
        anchor_position: int,
        target_hidden: torch.Tensor | None = None,
        cache: DSparkContextCache | None = None,
        *,
        prefix_ids: torch.LongTensor | None = None,
        logits_processor: LogitsProcessorList | None = None,
        do_sample: bool = False,
        generator: torch.Generator | None = None,
        block_size: int | None = None,
    ) -> DSparkDraft:
        """One DSpark drafting round.

        Args:
            anchor_ids: [batch] the anchor (last token the target produced, not yet run through the target).
            anchor_position: its absolute position; the block occupies ``anchor_position .. + g - 1``.
            target_hidden: concatenated target features [batch, n, taps * D] of context positions not yet in
                ``cache``; together they must cover exactly positions ``0 .. anchor_position - 1``.
            cache: context K/V cache, extended in place (None: ``target_hidden`` is the whole context).
            prefix_ids: the sequence before the anchor [batch, anchor_position], for logits processors that look
                at history (repetition penalty...). Defaults to just the anchor.
            logits_processor: the user's processors (temperature, top-k/p, penalties), applied after the
                sequential head; the returned ``draft_logits`` are exactly what each token was sampled from.
            do_sample: sample (``torch.multinomial``) instead of taking the argmax.
            block_size: draft fewer than ``config.block_size`` tokens.
        """
        g = block_size or self.config.block_size
        anchor_ids = anchor_ids.reshape(-1)
        batch = anchor_ids.shape[0]
        cached = 0 if cache is None else cache.length
        context_position_ids = None
        if target_hidden is not None:
            context_position_ids = _positions(cached, target_hidden.shape[1], anchor_ids)
            cached += target_hidden.shape[1]
        if cached != anchor_position:
            raise ValueError(
                f"the drafter context covers positions 0..{cached - 1} but the anchor is at {anchor_position}: "
                "the context must be exactly the target features of every position before the anchor"
            )
        block_ids = torch.full((batch, g), self.config.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        block_ids[:, 0] = anchor_ids
        out = self(
            input_ids=block_ids,
            position_ids=_positions(anchor_position, g, anchor_ids).expand(batch, -1),
            target_hidden=target_hidden,
            context_position_ids=None if context_position_ids is None else context_position_ids.expand(batch, -1),
            cache=cache,
        )
        return self.sample_block(
            out.logits,
            out.hidden_states,
            anchor_ids,
            prefix_ids=prefix_ids,
            logits_processor=logits_processor,
            do_sample=do_sample,
            generator=generator,
        )

    def static_round_obstacle(self, processors: LogitsProcessorList | None, graph: bool = False) -> str | None:
        """Why drafting with ``processors`` cannot use a static round, or with ``graph`` a captured one (None: it
        can); see ``static_round_obstacle``."""
        return static_round_obstacle(self, processors, graph)

    def static_round(self, capacity: int, *, processors: LogitsProcessorList | None = None, do_sample: bool = False,
                     graph: bool = False, fallback: bool = False) -> DSparkStaticRound:
        """A ``DSparkStaticRound`` (reset, ready for a new sequence) for contexts up to ``capacity`` positions, kept
        per thread and reused while nothing it bakes in changed; see ``kept_static_round``."""
        return kept_static_round(self, capacity, processors=processors, do_sample=do_sample, graph=graph,
                                 fallback=fallback)

    @torch.no_grad()
    def sample_block(
        self,
        base_logits: torch.Tensor,
        hidden: torch.Tensor,
        anchor_ids: torch.LongTensor,
        *,
        prefix_ids: torch.LongTensor | None = None,
        logits_processor: LogitsProcessorList | None = None,
        do_sample: bool = False,
        generator: torch.Generator | None = None,
    ) -> DSparkDraft:
        """Sample a block left to right from base logits [batch, g, V] and hidden states [batch, g, d]."""
        anchor_ids = anchor_ids.reshape(-1, 1)
        sequence = anchor_ids if prefix_ids is None else torch.cat([prefix_ids, anchor_ids], dim=-1)
        processors = LogitsProcessorList()
        head = None
        if self.markov_head is not None:
            head = SequentialHeadLogitsProcessor(self.markov_head, hidden, sequence.shape[1])
        if logits_processor:
            processors.extend(logits_processor)
        base = base_logits.float()
        g = base.shape[1]
        draft_vocab = None if self.draft_vocab is None else self.draft_vocab.to(base.device)
        # Sample directly in the draft vocabulary (a fraction of the full vocabulary's cost per step) when no
        # processor reads token ids: without processors that is the same distribution as the full vocabulary with
        # -inf outside it; with value-only warpers (temperature, top-k/p, ...) it is those warpers over the draft
        # vocabulary, still the exact q each draft was drawn from, which is all lossless verification needs.
        in_draft_space = self.draft_vocab is not None and value_only(processors)
        candidate = CandidateWarpers.build(logits_processor, base.shape[-1]) if do_sample else None
        steps = []
        for k in range(g):
            # q_k: the exact distribution x_k is drawn from (sequential head, then every processor, over the draft
            # or the full vocabulary as chosen above, with the actually sampled prefix).
            scores = base[:, k] if head is None else head(sequence, base[:, k])
            step_logits, index = self._block_step(scores, sequence, processors, candidate, in_draft_space,
                                                  do_sample, generator)
            steps.append(step_logits)
            token = draft_vocab[index] if in_draft_space else index
            sequence = torch.cat([sequence, token], dim=-1)
        draft_logits = torch.stack(steps, dim=1)
        draft_ids = sequence[:, -base_logits.shape[1] :]
        prev_ids = torch.cat([anchor_ids, draft_ids[:, :-1]], dim=-1)
        confidence_logits = self.confidence_logits(hidden, prev_ids)
        confidences = None if confidence_logits is None else self.confidences(confidence_logits)
        return DSparkDraft(
            base_logits=base_logits,
            draft_ids=draft_ids,
            sampled_logits=draft_logits,
            hidden_states=hidden,
            confidence_logits=confidence_logits,
            confidences=confidences,
            to_full_vocab=self.to_full_vocab if in_draft_space else None,
        )

    def _block_step(self, scores, sequence, processors, candidate, in_draft_space, do_sample, generator):
        """One position of ``sample_block``: the logits of the distribution the draft is drawn from and the drawn
        index (in the draft vocabulary when ``in_draft_space``)."""
        if candidate is not None:  # the same warpers on the top candidates (see CandidateWarpers)
            values, indices = candidate(scores)
            pick = torch.multinomial(torch.softmax(values, dim=-1), num_samples=1, generator=generator)
            return candidate.full(values, indices, scores.shape[-1]), indices.gather(-1, pick)
        if processors:
            scores = processors(sequence, scores if in_draft_space else self.to_full_vocab(scores))
        if do_sample:
            return scores, torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=generator)
        return scores, scores.argmax(dim=-1, keepdim=True)

    # ----------------------------------------------------------------------------------------------------------
    # Loading and saving
    # ----------------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load an hf-dspark drafter folder or a reference-format (``Qwen3DSparkModel``) folder / Hub repo."""
        config_dict = read_json(pretrained_model_name_or_path, "config.json", kwargs)
        reference = config_dict is not None and DSparkConfig.is_reference_dict(config_dict)
        if reference and "config" not in kwargs:
            kwargs["config"] = DSparkConfig.from_reference_dict(config_dict)
        loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True
        if reference:
            embed, lm_head = load_reference_shared(pretrained_model_name_or_path, model.config, kwargs)
            model.set_shared_modules(embed.to(model.device, model.dtype), lm_head.to(model.device, model.dtype))
        generation_dict = read_json(pretrained_model_name_or_path, "generation_config.json", kwargs)
        if generation_dict is not None:
            settings = dict(DEFAULT_GENERATION_SETTINGS)
            settings.update({k: v for k, v in generation_dict.items() if k != "transformers_version"})
            model.generation_config = GenerationConfig(**settings)
        return loaded

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save weights (without the target's embedding / LM head), config, generation settings, and, for a
        drafter class registered for the auto classes, the code files plus ``custom_generate/``."""
        super().save_pretrained(save_directory, *args, **kwargs)
        self.generation_config.save_pretrained(save_directory)
        if self.is_remote_code():
            write_custom_generate(save_directory, getattr(self.config, "_name_or_path", None))


def check_target_compatibility(config: DSparkConfig, target_config) -> None:
    """Raise ``ValueError`` naming the mismatch if a drafter cannot serve ``target_config``."""
    text = target_config.get_text_config()
    if text.vocab_size != config.vocab_size:
        raise ValueError(
            f"vocabulary mismatch: the drafter was built for vocab_size={config.vocab_size}, the target has "
            f"{text.vocab_size}"
        )
    if text.hidden_size != config.target_hidden_size:
        raise ValueError(
            f"hidden-size mismatch: the drafter reads target features of size {config.target_hidden_size}, the "
            f"target's hidden_size is {text.hidden_size}"
        )
    if text.hidden_size != config.hidden_size:
        raise ValueError(
            f"hidden-size mismatch: the drafter's hidden_size={config.hidden_size} must equal the target's "
            f"{text.hidden_size} to share its embedding and LM head"
        )
    layers = text.num_hidden_layers
    bad = [i for i in config.target_layer_ids if not -1 <= i < layers - 1]
    if bad:
        raise ValueError(
            f"target_layer_ids {bad} are out of range for this target ({layers} layers; usable: -1..{layers - 2}, "
            "the last layer excluded)"
        )


def _positions(start: int, length: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(start, start + length, device=like.device, dtype=torch.long).unsqueeze(0)


__all__ = [
    "DSparkContextCache",
    "DSparkDrafter",
    "DSparkOutput",
    "DSparkPreTrainedModel",
    "check_target_compatibility",
]
