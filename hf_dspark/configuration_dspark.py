"""DSpark drafter configuration, and conversion from/to the reference (DeepSpec ``Qwen3DSparkModel``) format.

This file is self-contained (torch + transformers only): it is copied into every exported drafter folder so that
``AutoConfig.from_pretrained(folder, trust_remote_code=True)`` works without ``hf_dspark`` installed.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

SEQUENTIAL_HEAD_TYPES = ("none", "markov", "gated", "rnn")
# The reference code names its sequential heads differently; "none" is written there as a zero Markov rank.
REFERENCE_HEAD_NAMES = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}
REFERENCE_ARCHITECTURE = "Qwen3DSparkModel"


class DSparkConfig(PreTrainedConfig):
    r"""
    Configuration of a [`DSparkDrafter`]: a DFlash-style parallel drafter fed with target hidden states, plus a
    lightweight sequential head and a confidence head (DSpark, DeepSeek-AI and Peking University, 2026).

    Backbone (Qwen3-style draft layers):
        vocab_size (`int`): vocabulary of the target (the drafter reuses its embedding and LM head).
        hidden_size (`int`): width of the draft layers; equal to the target's hidden size, since the drafter reads
            the target's input embedding and feeds the target's LM head.
        intermediate_size (`int`): SwiGLU width of the draft layers.
        num_hidden_layers (`int`): number of draft layers.
        num_attention_heads, num_key_value_heads, head_dim (`int`): grouped-query attention shape.
        hidden_act (`str`): MLP activation (``"silu"``).
        rms_norm_eps (`float`): epsilon of every RMSNorm.
        rope_parameters (`dict`): RoPE settings (transformers' ``rope_parameters`` convention); positions are the
            absolute token positions of the target sequence.
        max_position_embeddings (`int`): longest position the RoPE tables are built for.
        attention_bias (`bool`): bias on the q/k/v/o projections.
        initializer_range (`float`): std of the normal init of fresh weights.

    Target coupling:
        target_hidden_size (`int`): hidden size of the target (input width of ``fc`` per layer).
        num_target_layers (`int`): number of decoder layers of the target.
        target_layer_ids (`list[int]`): target layers whose outputs feed the drafter, reference numbering: layer
            ``i`` is transformers' ``hidden_states[i + 1]`` (``-1`` is the embedding output). The target's last
            layer may not be among them.
        mask_token_id (`int`): token id filling the block after the anchor.
        block_size (`int`): tokens drafted per forward (g). The anchor is the first prediction position.

    Heads:
        sequential_head (`str`): ``"none"`` (DFlash ablation), ``"markov"`` (default), ``"gated"`` or ``"rnn"``.
        markov_rank (`int`): rank r of the sequential head's token embedding ``W1`` and output ``W2``.
        enable_confidence_head (`bool`): whether the drafter predicts per-position acceptance confidences.
        confidence_head_with_markov (`bool`): whether the confidence head also reads ``W1[previous token]``.
        confidence_temperatures (`list[float]`, *optional*): Sequential Temperature Scaling, one temperature per
            block position for the confidence logit (set by calibration).
        confidence_target (`str`): what the confidence head was trained to predict: ``"sampling"`` (the paper's
            soft label, the acceptance rate of speculative sampling) or ``"greedy"`` (whether greedy verification
            accepts the draft's argmax).
        num_anchors (`int`): anchors sampled per training sequence.
        draft_vocab_size (`int`, *optional*): draft over a subset of the vocabulary (the most frequent target
            tokens, stored in the checkpoint as ``draft_vocab``): the LM-head and sequential-head outputs shrink
            from V to this size, which is what makes drafting cheap on a CPU. Tokens outside it get q = 0, so
            drafting stays lossless; None drafts over the full vocabulary.
    """

    model_type = "dspark"

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    target_hidden_size: int | None = None
    num_target_layers: int = 30
    target_layer_ids: list[int] | None = None
    mask_token_id: int = 0
    block_size: int = 7

    sequential_head: str = "markov"
    markov_rank: int = 256
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None
    confidence_target: str = "sampling"
    num_anchors: int = 512
    draft_vocab_size: int | None = None

    def __post_init__(self, **kwargs):
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, 5)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        self.validate_dspark()

    def validate_dspark(self) -> None:
        """Raise a clear ``ValueError`` for settings the drafter cannot run with."""
        if self.sequential_head not in SEQUENTIAL_HEAD_TYPES:
            raise ValueError(
                f"sequential_head={self.sequential_head!r} is not supported; choose one of {SEQUENTIAL_HEAD_TYPES}"
            )
        if self.sequential_head != "none" and self.markov_rank < 1:
            raise ValueError(f"sequential_head={self.sequential_head!r} needs markov_rank >= 1, got {self.markov_rank}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not -1 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are out of range for a target with {self.num_target_layers} layers "
                f"(valid: -1 for the embedding output, 0..{self.num_target_layers - 1})"
            )
        if self.num_target_layers - 1 in self.target_layer_ids:
            raise ValueError(
                f"target_layer_ids may not contain the target's last layer ({self.num_target_layers - 1}): its "
                "output is what the drafter tries to predict"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.confidence_temperatures is not None and len(self.confidence_temperatures) != self.block_size:
            raise ValueError(
                f"confidence_temperatures has {len(self.confidence_temperatures)} entries, expected block_size="
                f"{self.block_size}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be a token id in [0, vocab_size={self.vocab_size}), got "
                             f"{self.mask_token_id}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        if self.confidence_temperatures is not None and min(self.confidence_temperatures) <= 0:
            raise ValueError("confidence_temperatures must be positive")
        if self.confidence_target not in ("sampling", "greedy"):
            raise ValueError(f"confidence_target must be 'sampling' or 'greedy', got {self.confidence_target!r}")

    @property
    def uses_markov_embedding(self) -> bool:
        """Whether the drafter owns the token embedding ``W1`` of the sequential head."""
        return self.sequential_head != "none"

    @property
    def output_vocab_size(self) -> int:
        """Width of the draft logits: the draft vocabulary, or the full vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def confidence_input_size(self) -> int:
        extra = self.markov_rank if (self.confidence_head_with_markov and self.uses_markov_embedding) else 0
        return self.hidden_size + extra

    @classmethod
    def for_target(cls, target_config: PreTrainedConfig, **overrides: Any) -> "DSparkConfig":
        """A drafter config matched to a decoder-only target: same width, vocabulary, RoPE and attention shape.

        ``overrides`` set any field (``num_hidden_layers``, ``block_size``, ``sequential_head``...).
        """
        text = target_config.get_text_config()
        num_target_layers = _required(text, "num_hidden_layers")
        heads = _required(text, "num_attention_heads")
        hidden = _required(text, "hidden_size")
        fields: dict[str, Any] = {
            "vocab_size": _required(text, "vocab_size"),
            "hidden_size": hidden,
            "target_hidden_size": hidden,
            # the drafter's own MLP width: the target's where it names one (under any of its families' names)
            "intermediate_size": _first(text, "intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim")
            or 4 * hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": _key_value_heads(text, heads),
            "head_dim": getattr(text, "head_dim", None) or hidden // heads,
            "hidden_act": _first(text, "hidden_act", "hidden_activation", "activation_function") or "silu",
            "rms_norm_eps": _first(text, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon") or 1e-6,
            "rope_parameters": dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}),
            "max_position_embeddings": getattr(text, "max_position_embeddings", 8192),
            "num_target_layers": num_target_layers,
            "mask_token_id": _default_mask_token_id(text),
        }
        fields.update(overrides)
        if "target_layer_ids" not in overrides:
            fields["target_layer_ids"] = default_target_layer_ids(num_target_layers, min(5, num_target_layers - 1))
        return cls(**fields)

    # ----------------------------------------------------------------------------------------------------------
    # Reference (DeepSpec) format
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def is_reference_dict(config_dict: dict[str, Any]) -> bool:
        return REFERENCE_ARCHITECTURE in (config_dict.get("architectures") or [])

    @classmethod
    def from_reference_dict(cls, config_dict: dict[str, Any]) -> "DSparkConfig":
        """Build a config from a reference ``Qwen3DSparkModel`` ``config.json`` dictionary."""
        head_type = config_dict.get("markov_head_type", "vanilla")
        rank = int(config_dict.get("markov_rank", 0) or 0)
        by_reference_name = {v: k for k, v in REFERENCE_HEAD_NAMES.items()}
        if head_type not in by_reference_name:
            raise ValueError(
                f"reference checkpoint has markov_head_type={head_type!r}; hf-dspark supports "
                f"{sorted(by_reference_name)} (and markov_rank=0 for no sequential head)"
            )
        sequential_head = by_reference_name[head_type] if rank > 0 else "none"
        dflash = config_dict.get("dflash_config") or {}
        pick = lambda key, default=None: config_dict.get(key, dflash.get(key, default))  # noqa: E731
        heads = config_dict["num_attention_heads"]
        rope = config_dict.get("rope_parameters") or {
            "rope_type": "default",
            "rope_theta": config_dict.get("rope_theta", 10000.0),
        }
        return cls(
            vocab_size=config_dict["vocab_size"],
            hidden_size=config_dict["hidden_size"],
            intermediate_size=config_dict["intermediate_size"],
            num_hidden_layers=config_dict["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config_dict.get("num_key_value_heads") or heads,
            head_dim=config_dict.get("head_dim") or config_dict["hidden_size"] // heads,
            hidden_act=config_dict.get("hidden_act", "silu"),
            rms_norm_eps=config_dict.get("rms_norm_eps", 1e-6),
            rope_parameters=rope,
            max_position_embeddings=config_dict.get("max_position_embeddings", 8192),
            attention_bias=config_dict.get("attention_bias", False),
            target_hidden_size=config_dict.get("target_hidden_size", config_dict["hidden_size"]),
            num_target_layers=config_dict["num_target_layers"],
            target_layer_ids=pick("target_layer_ids"),
            mask_token_id=pick("mask_token_id"),
            block_size=pick("block_size"),
            sequential_head=sequential_head,
            markov_rank=rank if rank > 0 else 256,
            enable_confidence_head=config_dict.get("enable_confidence_head", False),
            confidence_head_with_markov=config_dict.get("confidence_head_with_markov", False),
            confidence_temperatures=config_dict.get("confidence_temperatures"),
            num_anchors=config_dict.get("num_anchors", 512),
            draft_vocab_size=_draft_vocab_size(config_dict),
            dtype=config_dict.get("dtype") or config_dict.get("torch_dtype"),
        )

    def to_reference_dict(self) -> dict[str, Any]:
        """The ``config.json`` a reference ``Qwen3DSparkModel`` folder carries (what serving engines read)."""
        has_head = self.sequential_head != "none"
        dtype = self.dtype
        if dtype is not None and not isinstance(dtype, str):
            dtype = str(dtype).removeprefix("torch.")
        return {
            "architectures": [REFERENCE_ARCHITECTURE],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": dict(self.rope_parameters),
            "rope_theta": self.rope_parameters.get("rope_theta", 10000.0),
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": self.attention_dropout,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "dtype": dtype,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.target_hidden_size,
            "num_anchors": self.num_anchors,
            "markov_rank": self.markov_rank if has_head else 0,
            "markov_head_type": REFERENCE_HEAD_NAMES[self.sequential_head] if has_head else "vanilla",
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov and has_head,
            "sample_from_anchor": True,
            **({"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}),
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
        }


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """Evenly spaced target layers from layer 1 up to (not including) the last one, as the reference picks them
    (Qwen3-4B, 36 layers, 5 taps: [1, 9, 17, 25, 33])."""
    if num_target_layers < 2:
        raise ValueError(f"a target needs at least 2 layers to feed a drafter, got {num_target_layers}")
    num_layers = max(1, min(num_layers, num_target_layers - 1))
    start, end = 1, num_target_layers - 3
    if num_layers == 1 or end <= start:
        return sorted({min(start, num_target_layers - 2)} | set(range(0, min(num_layers, num_target_layers - 1))))[
            :num_layers
        ]
    step = (end - start) / (num_layers - 1)
    ids = sorted({int(round(start + k * step)) for k in range(num_layers)})
    return ids


def _draft_vocab_size(config_dict: dict[str, Any]) -> int | None:
    size = config_dict.get("draft_vocab_size")
    return None if size in (None, config_dict["vocab_size"]) else int(size)


def _default_mask_token_id(text_config: PreTrainedConfig) -> int:
    # A token the target never emits as content works best; without a dedicated one, use the pad (or EOS) token.
    # Ids outside the vocabulary (a config's family default left in place on a resized model) are passed over.
    vocab_size = text_config.vocab_size
    for key in ("mask_token_id", "pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(text_config, key, None)
        for candidate in value if isinstance(value, list) else [value]:
            if candidate is not None and 0 <= int(candidate) < vocab_size:
                return int(candidate)
    return 0


def _required(text_config: PreTrainedConfig, name: str) -> Any:
    """A field every decoder-only target has (under its family's own name: configs map the common names)."""
    value = getattr(text_config, name, None)
    if value is None:
        raise ValueError(f"cannot build a drafter for {type(text_config).__name__}: its config has no {name}")
    return value


def _first(text_config: PreTrainedConfig, *names: str) -> Any:
    return next((value for value in (getattr(text_config, n, None) for n in names) if value is not None), None)


def _key_value_heads(text_config: PreTrainedConfig, heads: int) -> int:
    """The target's key/value heads, under the names families use (``num_kv_heads``, Falcon's ``multi_query``)."""
    count = _first(text_config, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if count is None and getattr(text_config, "multi_query", False):
        count = 1
    return int(count or heads)


__all__ = ["DSparkConfig", "default_target_layer_ids"]
