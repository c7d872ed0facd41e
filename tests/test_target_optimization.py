"""``optimize_target``: oneDNN-prepacked linears computing what the stock linears compute, kept in step with their
weights, applied by mode and by a cached measured verdict, and lossless end to end on the real target."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_dspark
from hf_dspark import onednn
from hf_dspark.optimization import (
    PrepackedLinear,
    TargetOptimization,
    linears_state,
    optimization_report,
    optimize_target,
    restore_target,
    stock_linears,
    verdict_path,
)
from tests.architectures import VOCAB, make_family_target
from tests.helpers import load_script, require_smollm2


def test_the_private_ops_keep_the_schemas_this_package_calls():
    """Fails loudly when torch renames or reshapes the two oneDNN ops (hf_dspark.onednn then keeps stock linears)."""
    found = onednn.schemas()
    assert found["_reorder_linear_weight"] == onednn.REORDER_SCHEMA
    assert found["_linear_pointwise"] == onednn.LINEAR_SCHEMA
    assert onednn.unavailable(torch.float32) is None


def test_unsupported_dtypes_are_named():
    assert "float64" in onednn.unavailable(torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_prepacked_linear_computes_the_stock_linear(dtype, bias):
    if onednn.unavailable(dtype):
        pytest.skip(onednn.unavailable(dtype))
    torch.manual_seed(0)
    layer = nn.Linear(48, 40, bias=bias).to(dtype)
    packed = nn.Sequential(nn.Linear(48, 40, bias=bias).to(dtype))
    packed[0].load_state_dict(layer.state_dict())
    assert optimize_target(_as_model(packed), "on").linears == 1
    assert type(packed[0]) is PrepackedLinear and isinstance(packed[0], nn.Linear)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for shape in [(48,), (1, 48), (7, 48), (2, 5, 48), (2, 0, 48)]:
            x = torch.randn(shape).to(dtype)
            torch.testing.assert_close(packed[0](x), layer(x), atol=tolerance, rtol=tolerance)


def _as_model(module: nn.Module) -> nn.Module:
    """A bare module dressed with the ``config`` optimize_target reads (only "auto" uses it)."""
    module.config = type("Config", (), {"model_type": "bare", "_name_or_path": ""})()
    return module


def test_a_weight_changed_or_replaced_is_repacked():
    torch.manual_seed(0)
    model = _as_model(nn.Sequential(nn.Linear(16, 8)))
    optimize_target(model, "on")
    x = torch.randn(3, 16)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # in place
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias))
        model[0].load_state_dict({"weight": torch.randn(8, 16), "bias": torch.zeros(8)})
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias))
    model[0].weight = nn.Parameter(torch.randn(8, 16))  # replaced
    with torch.no_grad():
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias))


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)


def test_projections_of_one_input_are_multiplied_together_and_release_their_outputs():
    from hf_dspark.optimization import SharedInputGroup

    torch.manual_seed(0)
    block = _as_model(_Attention())
    stock = {name: (m.weight.clone(), m.bias.clone()) for name, m in block.named_children()}
    optimize_target(block, "on")
    group = block.q_proj._shared
    assert isinstance(group, SharedInputGroup) and group is block.k_proj._shared is block.v_proj._shared
    x, other = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    with torch.inference_mode():
        for order in (("k_proj", "q_proj", "v_proj"), ("q_proj", "q_proj", "v_proj", "k_proj")):
            for name in order:
                weight, bias = stock[name]
                torch.testing.assert_close(getattr(block, name)(x), F.linear(x, weight, bias))
        torch.testing.assert_close(block.v_proj(other), F.linear(other, *stock["v_proj"]))  # another input
        block.q_proj(x), block.k_proj(x), block.v_proj(x)
        assert group._pending.outputs is None  # every member took its columns: nothing kept past the forward
        block.k_proj.weight.add_(1.0)  # a member's weight changed: the group repacks
        torch.testing.assert_close(block.k_proj(x), F.linear(x, block.k_proj.weight, block.k_proj.bias))


def test_two_threads_sharing_a_group_each_get_their_own_products():
    import threading

    torch.manual_seed(0)
    block = _as_model(_Attention())
    stock = {name: (m.weight.clone(), m.bias.clone()) for name, m in block.named_children()}
    optimize_target(block, "on")
    inputs = [torch.randn(4, 16) for _ in range(2)]
    wrong = []

    def run(x):
        with torch.inference_mode():
            for _ in range(300):
                for name in ("q_proj", "k_proj", "v_proj"):
                    if not torch.allclose(getattr(block, name)(x), F.linear(x, *stock[name]), atol=1e-5):
                        wrong.append(name)

    threads = [threading.Thread(target=run, args=(x,)) for x in inputs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong


def test_copies_writes_through_data_and_other_dtypes():
    import copy

    from hf_dspark.optimization import repack_target

    target = make_family_target("llama")
    prompt = torch.randint(2, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(3))
    optimize_target(target, "on")
    with torch.inference_mode():
        want = target(prompt).logits
        twin = copy.deepcopy(target)  # packs again at its first forward
        torch.testing.assert_close(twin(prompt).logits, want)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast takes the stock path, as it would unoptimised
            assert target(prompt).logits.dtype == restore_and_run(target, prompt).dtype
        optimize_target(target, "on")
        proj = target.model.layers[0].self_attn.k_proj
        proj.weight.data.mul_(3.0)  # invisible to the version counter
        repack_target(target)
        x = torch.randn(2, proj.in_features)
        torch.testing.assert_close(proj(x), F.linear(x, proj.weight, proj.bias))
        target.double()  # a dtype oneDNN does not pack: the stock path
        torch.testing.assert_close(proj(x.double()), F.linear(x.double(), proj.weight, proj.bias))


def restore_and_run(target, prompt):
    restore_target(target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return target(prompt).logits


def test_gradients_take_the_stock_path():
    torch.manual_seed(0)
    model = _as_model(nn.Sequential(nn.Linear(16, 8)))
    reference = nn.Linear(16, 8)
    reference.load_state_dict(model[0].state_dict())
    optimize_target(model, "on")
    x = torch.randn(4, 16)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    torch.testing.assert_close(model[0].weight.grad, reference.weight.grad)


def test_state_dict_ties_and_save_pretrained_are_unchanged(tmp_path):
    target = make_family_target("gemma")  # tied embeddings
    keys = list(target.state_dict())
    report = optimize_target(target, "on")
    assert report.applied and report.linears > 0 and report.packed_bytes > 0
    assert list(target.state_dict()) == keys
    assert target.lm_head.weight is target.get_input_embeddings().weight
    assert linears_state(target) == "onednn-prepacked"
    target.save_pretrained(tmp_path)
    reloaded = type(target).from_pretrained(tmp_path).eval()
    assert linears_state(reloaded) == "stock"
    prompt = torch.randint(2, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(target(prompt).logits, reloaded(prompt).logits, atol=1e-5, rtol=1e-5)


def test_modes_off_on_and_the_stock_context():
    target = make_family_target("llama")
    assert optimize_target(target, "on").applied
    assert optimize_target(target, "on") is optimization_report(target)  # kept, not repacked
    with stock_linears(target):
        assert linears_state(target) == "stock"
    assert linears_state(target) == "onednn-prepacked"
    off = optimize_target(target, "off")
    assert not off.applied and linears_state(target) == "stock"
    assert restore_target(target) == 0
    with pytest.raises(ValueError, match="expected one of auto, on, off"):
        optimize_target(target, "fast")


def test_auto_measures_once_then_reads_its_cached_verdict(tmp_path):
    target = make_family_target("qwen2")
    first = optimize_target(target, "auto", cache_folder=tmp_path)
    assert not first.cached_verdict and set(first.measured) == {"stock", "prepacked"}
    assert set(first.measured["stock"]) == {1, 8} and all(s > 0 for s in first.measured["stock"].values())
    assert first.applied == all(first.measured["prepacked"][w] < first.measured["stock"][w] for w in (1, 8))
    saved = json.loads(verdict_path(target, tmp_path).read_text())
    assert saved["key"]["dtype"] == "float32" and "cpu" in saved["key"]
    restore_target(target)
    second = optimize_target(target, "auto", cache_folder=tmp_path)
    assert second.cached_verdict and second.measured == first.measured


def test_auto_keeps_stock_linears_where_prepacked_measured_slower(tmp_path):
    target = make_family_target("llama")
    path = verdict_path(target, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"measured": {"stock": {"1": 0.010, "8": 0.020},
                                             "prepacked": {"1": 0.009, "8": 0.021}}}))
    report = optimize_target(target, "auto", cache_folder=tmp_path)
    assert not report.applied and "slower here at width 8" in report.reason
    assert linears_state(target) == "stock"


def test_a_damaged_cached_verdict_is_measured_again(tmp_path):
    target = make_family_target("llama")
    path = verdict_path(target, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    report = optimize_target(target, "auto", cache_folder=tmp_path)
    assert not report.cached_verdict and set(report.measured) == {"stock", "prepacked"}
    assert json.loads(path.read_text())["measured"]


def test_the_sps_profile_key_names_the_linears():
    from hf_dspark.profiling import profile_key

    target = make_family_target("llama")
    stock = profile_key(target)
    optimize_target(target, "on")
    assert stock["linears"] == "stock" and profile_key(target)["linears"] == "onednn-prepacked"


def test_report_summary_and_dict():
    report = TargetOptimization("auto", True, "measured faster", 3, 10,
                                {"stock": {1: 0.02, 8: 0.04}, "prepacked": {1: 0.01, 8: 0.01}})
    assert "width 8: 0.25x stock" in report.summary()
    assert json.loads(json.dumps(report.to_dict()))["linears"] == 3


def test_the_engine_optimises_by_default_and_leaves_a_target_alone_with_none():
    from hf_dspark.engine import DSparkEngine

    target = make_family_target("llama")
    DSparkEngine(target, None, policy="plain", optimize_target="on")
    assert linears_state(target) == "onednn-prepacked"
    DSparkEngine(target, None, policy="plain", optimize_target=None)
    assert linears_state(target) == "onednn-prepacked"
    with pytest.raises(ValueError, match="optimize_target"):
        DSparkEngine(target, None, policy="plain", optimize_target="yes")


@pytest.mark.slow
def test_smollm2_optimised_dspark_equals_stock_plain_on_the_bundled_prompts():
    """float32: DSpark-assisted greedy output on the prepacked target equals plain greedy generate() on the stock
    target, prompt for prompt."""
    require_smollm2()
    from hf_dspark.prompts import load_prompts

    target, tokenizer, drafter = hf_dspark.load_default(optimize="off")
    prompts = [record["turns"][0] for record in load_prompts(["bundled"])[::8]]  # one per set
    assert len(prompts) == 4
    plains = []
    for prompt in prompts:
        inputs = _chat(tokenizer, prompt)
        plains.append(target.generate(**inputs, max_new_tokens=24, do_sample=False))
    assert optimize_target(target, "on").applied
    drafter.generation_config.verification_policy = "fixed"  # the whole block verified every round
    for prompt, plain in zip(prompts, plains):
        out = target.generate(**_chat(tokenizer, prompt), max_new_tokens=24, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, plain), prompt


def _chat(tokenizer, text: str):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


@pytest.mark.slow
def test_forward_cost_script_splits_a_forward_and_names_the_floor(tmp_path):
    require_smollm2()
    script = load_script("forward_cost")
    threads = torch.get_num_threads()
    try:
        assert script.main(["--dtypes", "float32", "--contexts", "64", "--widths", "1", "2", "--repeats", "1",
                            "--threads", "1", "--output", str(tmp_path / "cost.md")]) == 0
    finally:
        torch.set_num_threads(threads)
    text = (tmp_path / "cost.md").read_text()
    assert text.startswith("<!-- generated by") and "floor" in text and "| prepacked | 64 | 2 |" in text
    rows = json.loads((tmp_path / "cost.json").read_text())["rows"]["float32"]["rows"]
    assert {(r["linears"], r["width"]) for r in rows} == {(l, w) for l in ("stock", "prepacked") for w in (1, 2)}
    for row in rows:  # every category measured, and the split adds up to the forward
        assert row["split"]["linears"] > 0 and row["split"]["lm_head"] > 0 and row["split"]["kv_cache"] > 0
        assert sum(row["split"].values()) == pytest.approx(row["seconds"], rel=0.05)
