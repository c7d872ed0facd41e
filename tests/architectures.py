"""Tiny random targets of many transformers families, for the architecture matrix (tests/test_architectures.py).

Each entry builds a decoder-only causal LM small enough to run every route in seconds, covering what the families
differ in: grouped-query and multi-query attention, mixture-of-experts MLPs, sliding-window and alternating
local/global layers, logit soft-capping, parallel attention/MLP blocks, partial rotary, scaled embeddings, tied and
untied embeddings, and a multimodal model whose text config is not its top-level config."""

from __future__ import annotations

import torch
import transformers

VOCAB = 128
# A window shorter than the prompts plus outputs the tests generate, so every route runs past it.
WINDOW = 16
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
             pad_token_id=None, tie_word_embeddings=False)

# family -> (config class, model class, config overrides, what it covers)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "dense, GQA"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}, "sliding window on every layer"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "dense, GQA, attention biases"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, "QK norm"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "decoder_sparse_step": 1}, "mixture of experts"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2},
                "mixture of experts"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16, "num_key_value_heads": 1, "tie_word_embeddings": True},
              "multi-query attention, scaled embeddings, tied embeddings"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": WINDOW,
                                                     "final_logit_softcapping": 30.0,
                                                     "attn_logit_softcapping": 50.0},
               "alternating local/global layers, logit soft-capping"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": WINDOW,
                                                              "sliding_window_pattern": 2},
                    "alternating local/global layers, two rotary bases"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}, "fused QKV and gate/up projections"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "post-norm blocks, QK norm"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 2.0, "logits_scaling": 2.0},
                "scaled embeddings and logits"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {"partial_rotary_factor": 0.5}, "partial rotary"),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"tie_word_embeddings": True, "logit_scale": 0.5},
               "parallel attention/MLP block, tied embeddings"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.25, "use_parallel_residual": True},
                 "parallel residual, partial rotary, no GQA"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {}, "learned positions, tied embeddings"),
    "phi": ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}, "parallel block, partial rotary"),
    "falcon": ("FalconConfig", "FalconForCausalLM", {"new_decoder_architecture": False, "multi_query": True,
                                                     "parallel_attn": True}, "multi-query, parallel attention"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, "rotary skipped on some layers"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16, "partial_rotary_factor": 0.5}, "partial rotary"),
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", {}, "multimodal: the text config is a sub-config"),
}
# Families with sliding-window layers
SLIDING = ("mistral", "gemma2", "gemma3_text")
# Families whose configs name their fields differently
_RENAMES = {
    "gpt2": {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
             "max_position_embeddings": "n_positions", "intermediate_size": "n_inner"},
}
_DROP = {"gpt2": ("num_key_value_heads",), "gpt_neox": ("num_key_value_heads",), "phi": ("num_key_value_heads",),
         "falcon": ("num_key_value_heads", "intermediate_size")}


def _llava_config() -> transformers.LlavaConfig:
    """A Llama language model behind a tiny CLIP vision tower (text-only prompts never reach the tower)."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=16, patch_size=8)
    return transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(**_BASE),
                                    image_token_id=VOCAB - 1)


def make_family_target(family: str, seed: int = 0):
    config_name, model_name, overrides, _ = FAMILIES[family]
    kwargs = {k: v for k, v in _BASE.items() if k not in _DROP.get(family, ())}
    kwargs.update(overrides)
    for old, new in _RENAMES.get(family, {}).items():
        kwargs[new] = kwargs.pop(old)
    torch.manual_seed(seed)
    config = _llava_config() if family == "llava" else getattr(transformers, config_name)(**kwargs)
    model = getattr(transformers, model_name)(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model
