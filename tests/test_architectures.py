"""The architecture matrix: tiny random targets of 21 transformers families (tests/architectures.py) crossed with
every route a drafter takes. Greedy output equals plain ``generate()`` everywhere; sampling runs and keeps its
length; one training step and a save/load round trip work for every family."""

from __future__ import annotations

import pytest
import torch

import hf_dspark  # noqa: F401  (installs the generate() dispatch)
from hf_dspark import DSparkConfig, DSparkDrafter
from hf_dspark.scheduling import StepsPerSecond
from tests.architectures import FAMILIES, SLIDING, VOCAB, WINDOW, make_family_target

NEW_TOKENS = WINDOW + 8  # past every sliding window
# A profile where a round of any width costs a little more than one token: drafts pay when confidences are high
SPS = StepsPerSecond([1, 2, 4, 8, 16, 32], [100.0, 98.0, 96.0, 92.0, 85.0, 70.0])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    target = make_family_target(request.param)
    torch.manual_seed(0)
    config = DSparkConfig.for_target(target.config, num_hidden_layers=1, block_size=4)
    drafter = DSparkDrafter(config).eval().attach_target(target)
    prompt = torch.randint(2, VOCAB - 1, (1, 10),
                           generator=torch.Generator().manual_seed(1))
    plain = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    return request.param, target, drafter, prompt, plain


def _with_policy(drafter, policy: str) -> None:
    drafter.generation_config.verification_policy = policy
    drafter.generation_config.sps_profile = SPS.to_dict() if policy in ("scheduler", "hybrid") else None


@pytest.mark.parametrize("policy", ["fixed", "hybrid"])
def test_generate_greedy_equals_plain(pair, policy):
    _, target, drafter, prompt, plain = pair
    _with_policy(drafter, policy)
    out = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, plain)
    assert drafter.last_stats.rounds > 0


def test_token_tree_rounds_keep_greedy_output(pair):
    """Every round a token tree (``draft_tree="always"``, priced by a profile where width is nearly free): the output
    is still plain greedy's; a sliding-window family's cache cannot keep a tree's path, and says so."""
    family, target, drafter, prompt, plain = pair
    drafter.generation_config.verification_policy = "scheduler"
    drafter.generation_config.sps_profile = SPS.to_dict()
    drafter.generation_config.draft_tree = "always"
    try:
        if family in SLIDING:
            with pytest.raises(ValueError, match="draft_tree='always'.*DynamicSlidingWindowLayer"):
                target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
            return
        out = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, plain)
        assert drafter.last_stats.sources.count("tree") > 0
    finally:
        drafter.generation_config.draft_tree = None


def test_engine_token_tree_rounds_keep_greedy_output(pair):
    """The batched engine with a token tree in every greedy drafting row (two requests in a step): each output is
    plain greedy's; a sliding-window family says why it cannot take trees."""
    from hf_dspark.engine import SamplingParams, generate_batch
    from hf_dspark.profiling import BatchedStepsPerSecond

    family, target, drafter, prompt, plain = pair
    other = torch.randint(2, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(2))
    other_plain = target.generate(other, max_new_tokens=NEW_TOKENS, do_sample=False)
    drafter.generation_config.draft_tree = "always"
    try:
        run = lambda: generate_batch(target, [prompt[0], other[0]], drafter,  # noqa: E731
                                     SamplingParams(max_new_tokens=NEW_TOKENS), policy="scheduler",
                                     sps=BatchedStepsPerSecond({1: SPS, 2: SPS}))
        if family in SLIDING:
            with pytest.raises(ValueError, match="draft_tree='always'.*sliding-window"):
                run()
            return
        out = run()
    finally:
        drafter.generation_config.draft_tree = None
    assert out.outputs[0].token_ids == plain[0, prompt.shape[1]:].tolist()
    assert out.outputs[1].token_ids == other_plain[0, other.shape[1]:].tolist()
    assert sum(o.stats.sources.count("tree") for o in out.outputs) > 0


@pytest.mark.parametrize("policy", ["fixed", "hybrid"])
def test_optimised_target_greedy_equals_stock_plain(pair, policy):
    """With the target's linears prepacked (hf_dspark.optimize_target), generate() and the engine still give plain
    greedy generate()'s output on the stock target."""
    from hf_dspark.engine import SamplingParams, generate_batch
    from hf_dspark.optimization import optimize_target, restore_target
    from hf_dspark.profiling import BatchedStepsPerSecond

    _, target, drafter, prompt, plain = pair
    _with_policy(drafter, policy)
    assert optimize_target(target, "on").applied
    try:
        out = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, plain)
        batch = generate_batch(target, [prompt[0]], drafter, SamplingParams(max_new_tokens=NEW_TOKENS),
                               policy="fixed" if policy == "fixed" else "scheduler",
                               sps=BatchedStepsPerSecond({1: SPS}), optimize_target=None)
        assert batch.outputs[0].token_ids == plain[0, prompt.shape[1]:].tolist()
    finally:
        restore_target(target)


def test_generate_sampling_runs(pair):
    _, target, drafter, prompt, _ = pair
    _with_policy(drafter, "fixed")
    out = target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8,
                          assistant_model=drafter)
    assert out.shape[1] == prompt.shape[1] + NEW_TOKENS


@pytest.mark.parametrize("method", ["plain", "fixed", "scheduler"])
def test_engine_greedy_equals_plain(pair, method):
    from hf_dspark.engine import SamplingParams, generate_batch
    from hf_dspark.profiling import BatchedStepsPerSecond

    family, target, drafter, prompt, plain = pair
    if family in SLIDING:  # the rows pass the window, with holes (padding, rejected drafts) in the cache
        assert NEW_TOKENS > WINDOW
    other = torch.randint(2, VOCAB - 1, (1, 7),
                          generator=torch.Generator().manual_seed(2))
    other_plain = target.generate(other, max_new_tokens=NEW_TOKENS, do_sample=False)
    out = generate_batch(target, [prompt[0], other[0]], None if method == "plain" else drafter,
                         SamplingParams(max_new_tokens=NEW_TOKENS), policy=method,
                         sps=BatchedStepsPerSecond({1: SPS, 2: SPS}))
    assert out.outputs[0].token_ids == plain[0, prompt.shape[1]:].tolist()
    assert out.outputs[1].token_ids == other_plain[0, other.shape[1]:].tolist()


def test_training_step_and_round_trip(pair, tmp_path):
    from hf_dspark.training.losses import drafter_training_step

    _, target, drafter, _, _ = pair
    ids = torch.randint(2, VOCAB - 1, (2, 24), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 8:] = True
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    features = drafter.gather_target_hidden(out.hidden_states, drafter.config.target_layer_ids)
    drafter.train()
    try:
        losses = drafter_training_step(drafter, features, out.hidden_states[-1], ids, mask, num_anchors=4,
                                       generator=torch.Generator().manual_seed(0))
        losses["loss"].backward()
    finally:
        drafter.eval()
        drafter.zero_grad(set_to_none=True)
    assert torch.isfinite(losses["loss"])
    drafter.save_pretrained(tmp_path)
    loaded = DSparkDrafter.from_pretrained(tmp_path).eval().attach_target(target)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name



@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_speed_profiles_run_past_a_sliding_window(family):
    """The SPS profiles time forwards over a cache longer than the window and crop each one back."""
    from hf_dspark.generation import _two_point_profile
    from hf_dspark.profiling import measure_batched_steps_per_second, measure_steps_per_second

    target = make_family_target(family)
    sps, _ = measure_steps_per_second(target, [1, 4], context_lengths=[2 * WINDOW], repeats=1)
    assert sps(4) > 0
    assert _two_point_profile(target, 4, context=2 * WINDOW, repeats=1)(1) > 0
    batched, _ = measure_batched_steps_per_second(target, 2, [1, 3], context_length=2 * WINDOW, repeats=1)
    assert batched(2) > 0


def test_engine_window_counts_positions_not_cache_columns():
    """A hole (a rejected draft, padding) takes a cache column but no position: the sliding mask skips it."""
    import types

    from hf_dspark.engine.cache import AttentionLayout

    config = types.SimpleNamespace(sliding_window=2, layer_types=["full_attention", "sliding_attention"])
    layout = AttentionLayout.of(config)
    assert layout.windowed and layout.kinds == {"full_attention", "sliding_attention"}
    valid = torch.tensor([[True, False, True, True, True]])
    positions = valid.long().cumsum(1) - 1  # columns hold positions 0, -, 1, 2, 3
    masks = layout.masks(valid, positions, torch.tensor([[2, 3]]))
    assert masks["full_attention"][0, 0].tolist() == [[True, False, True, True, False],
                                                      [True, False, True, True, True]]
    assert masks["sliding_attention"][0, 0].tolist() == [[False, False, True, True, False],
                                                         [False, False, False, True, True]]
    eager = layout.masks(valid, positions, torch.tensor([[3]]), eager_dtype=torch.float32)["sliding_attention"]
    assert eager[0, 0, 0, 3] == 0 and eager[0, 0, 0, 2] == torch.finfo(torch.float32).min
    every = AttentionLayout.of(types.SimpleNamespace(sliding_window=4))  # Mistral: every layer slides
    assert every.kinds == {"sliding_attention"} and torch.is_tensor(every.masks(valid, positions, positions))
    assert not AttentionLayout.of(types.SimpleNamespace(sliding_window=None)).windowed


@pytest.mark.parametrize("kinds", [["linear_attention", "full_attention"], ["conv", "full_attention"]])
def test_targets_with_recurrent_layers_are_refused_up_front(kinds):
    """Layers whose state absorbs every token read cannot roll rejected drafts back: both routes refuse such a
    target before any forward, naming the layer kind and where it is."""
    from hf_dspark.engine import SamplingParams, generate_batch
    from tests.helpers import make_drafter, make_target

    target = make_target("llama", seed=0).eval()
    drafter = make_drafter(target).eval()
    target.config.layer_types = kinds + ["full_attention"] * (target.config.num_hidden_layers - len(kinds))
    prompt = torch.tensor([[1, 5, 9, 3]])
    with pytest.raises(ValueError, match=rf"cannot serve this target: .*'{kinds[0]}' layers \[0\]"):
        target.generate(prompt, max_new_tokens=4, do_sample=False, assistant_model=drafter)
    with pytest.raises(ValueError, match=rf"batched engine cannot serve this target: .*'{kinds[0]}' layers \[0\]"):
        generate_batch(target, [prompt[0]], drafter, SamplingParams(max_new_tokens=4), policy="fixed")


def test_the_engine_refuses_attention_kinds_it_cannot_mask():
    from hf_dspark.engine import SamplingParams, generate_batch
    from tests.helpers import make_target

    target = make_target("llama", seed=0).eval()
    target.config.layer_types = ["chunked_attention"] + ["full_attention"] * (target.config.num_hidden_layers - 1)
    with pytest.raises(ValueError, match=r"full and sliding-window attention layers; .*\['chunked_attention'\]"):
        generate_batch(target, [torch.tensor([1, 5, 9])], None, SamplingParams(max_new_tokens=2), policy="plain")


@pytest.mark.parametrize("family", SLIDING)
def test_sliding_targets_on_the_folder_route_static_round_and_a_stop(family, tmp_path):
    """Past the window: the custom_generate folder route, the static draft round, and a stopping criterion that
    fires inside a round all give plain greedy's tokens."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    target = make_family_target(family)
    torch.manual_seed(0)
    drafter = DSparkDrafter(DSparkConfig.for_target(target.config, num_hidden_layers=1, block_size=4))
    drafter = drafter.eval().attach_target(target)
    folder = tmp_path / "drafter"
    drafter.save_pretrained(folder)
    prompt = torch.randint(2, VOCAB - 1, (1, 10), generator=torch.Generator().manual_seed(1))
    length = prompt.shape[1] + WINDOW + 5

    class StopAtLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= length, dtype=torch.bool)

    def run(**extra):
        return target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                               stopping_criteria=StoppingCriteriaList([StopAtLength()]), **extra)

    plain = run()
    assert plain.shape[1] == length
    _with_policy(drafter, "fixed")
    assert torch.equal(run(assistant_model=drafter, custom_generate=str(folder), trust_remote_code=True), plain)
    drafter.generation_config.draft_round = "static"
    try:
        assert torch.equal(run(assistant_model=drafter), plain)
    finally:
        drafter.generation_config.draft_round = None
