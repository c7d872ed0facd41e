"""The static drafting round (``DSparkStaticRound``): the fixed-shape form of a round that a CUDA graph replays.

On CPU the round runs eagerly; these tests pin down what capture needs and what replay must reproduce:
- it drafts what the eager round drafts (same tokens, logits and confidences up to float rounding), round after round,
  however many positions each round appends;
- its computation depends on nothing but its buffers: a trace of one round (``make_fx`` bakes every host value in, as
  a CUDA graph does) replayed with other inputs gives exactly the eager round's outputs, and reads nothing back to
  the host;
- ``generate()`` with it stays lossless, and the settings that cannot run statically are refused by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_dspark.block_source import static_round_for
from hf_dspark.static_round import DSparkStaticRound
from tests.helpers import make_drafter, make_target, random_prompts

CHEAP_VERIFY = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 98.0]}


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


def features_of(target, drafter, length: int, seed: int = 1) -> torch.Tensor:
    ids = random_prompts(1, length, target.config.vocab_size, seed=seed)[0]
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return ids, torch.cat([out.hidden_states[i] for i in drafter.target_hidden_states_indices()], dim=-1)


def assert_same_draft(eager, static):
    assert torch.equal(eager.draft_ids, static.draft_ids), (eager.draft_ids.tolist(), static.draft_ids.tolist())
    torch.testing.assert_close(static.sampled_logits, eager.sampled_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static.base_logits, eager.base_logits, rtol=1e-5, atol=1e-5)
    if eager.confidences is not None:
        torch.testing.assert_close(static.confidences, eager.confidences, rtol=1e-5, atol=1e-6)
    assert (static.to_full_vocab is None) == (eager.to_full_vocab is None)


# Appended positions per round: the prompt (more than the window of block_size + 1), then rounds of every size,
# and one more than the window again (features kept back by rounds that did not draft).
STEPS = [11, 3, 1, 8, 12, 2]


@pytest.mark.parametrize("head", ["none", "markov", "gated", "rnn"])
@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_static_round_drafts_what_the_eager_round_drafts(target, head, draft_vocab):
    drafter = make_drafter(target, head=head, block_size=7, num_hidden_layers=2,
                           **({"draft_vocab_size": draft_vocab} if draft_vocab else {}))
    if draft_vocab:
        drafter.set_draft_vocab(torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(2))[:40])
    drafter.config.confidence_temperatures = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    ids, features = features_of(target, drafter, sum(STEPS) + 1)
    cache = drafter.new_context_cache()
    static = DSparkStaticRound(drafter, capacity=64)
    position = 0
    for step in STEPS:
        new = features[:, position:position + step]
        position += step
        eager = drafter.draft(ids[:, position], position, new, cache)
        assert_same_draft(eager, static.draft(ids[:, position], position, new))
        assert static.length == cache.length == position
        for layer in range(2):  # the buffers hold the context's keys/values, in place
            torch.testing.assert_close(static.keys[layer][:, :, :position], cache.keys[layer], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(static.values[layer][:, :, :position], cache.values[layer], rtol=1e-5,
                                       atol=1e-5)


def _set_inputs(static: DSparkStaticRound, anchor, features) -> None:
    """What ``draft`` does before running the round, for a window that fits."""
    n = features.shape[1]
    static.features[:, :n].copy_(features)
    static.start.fill_(static.length)
    static.valid.fill_(n)
    static.anchor.copy_(anchor.reshape(1))


@pytest.mark.parametrize("sampling", [False, True])
def test_a_traced_round_replays_with_new_inputs(target, sampling):
    """A CUDA graph replays the kernels of one captured round on the same addresses with every host value frozen.
    ``make_fx`` records the same thing on CPU: a round traced once and re-run on the buffers refilled for later
    rounds must give exactly what the eager round gives, and contain no read back to the host."""
    drafter = make_drafter(target, head="rnn", block_size=7, num_hidden_layers=2, draft_vocab_size=40)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    kwargs = dict(processors=processors if sampling else None, do_sample=sampling)
    ids, features = features_of(target, drafter, 40)
    traced_round, eager_round = DSparkStaticRound(drafter, 64, **kwargs), DSparkStaticRound(drafter, 64, **kwargs)
    for static in (traced_round, eager_round):
        static.draft(ids[:, 9], 9, features[:, :9])
    _set_inputs(traced_round, ids[:, 12], features[:, 9:12])
    with torch.no_grad():
        graph = make_fx(lambda unused: traced_round._round())(torch.zeros(()))
    ops = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert not {op for op in ops if "_local_scalar_dense" in op or "nonzero" in op}, sorted(ops)
    position = 9
    for step in (3, 1, 8, 5):  # the traced round's own inputs first, then others
        anchor, new = ids[:, position + step], features[:, position:position + step]
        torch.manual_seed(position)
        expected = eager_round.draft(anchor, position + step, new)
        _set_inputs(traced_round, anchor, new)
        torch.manual_seed(position)
        with torch.no_grad():
            replayed = graph(torch.zeros(()))
        traced_round.length += step
        position += step
        assert torch.equal(replayed[1], expected.draft_ids)
        assert torch.equal(replayed[2], expected.sampled_logits)
        assert torch.equal(replayed[5], expected.confidences)
        assert torch.equal(traced_round.keys[1][:, :, :position], eager_round.keys[1][:, :, :position])


@pytest.fixture(scope="module")
def trained(tiny_targets, trained_drafters):
    return tiny_targets["llama"], trained_drafters["llama"]


@pytest.mark.parametrize("policy", ["fixed", "threshold", "scheduler", "hybrid"])
def test_generate_with_the_static_round_is_lossless(trained, policy):
    target, drafter = trained
    drafter.generation_config.verification_policy = policy
    drafter.generation_config.sps_profile = CHEAP_VERIFY
    taus = {}
    try:
        for mode in ("eager", "static"):
            drafter.generation_config.draft_round = mode
            for index, prompt in enumerate(random_prompts(48, 8, target.config.vocab_size, seed=1)[:3]):
                if index == 2:
                    prompt = torch.cat([prompt, prompt[:, :5], prompt], dim=1)  # repeated text: lookup fires
                kwargs = dict(do_sample=False, max_new_tokens=40, min_new_tokens=40)
                plain = target.generate(prompt, **kwargs)
                assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), plain), (mode, index)
                taus[mode, index] = drafter.last_stats.accepted_length
    finally:
        drafter.generation_config.verification_policy = "fixed"
        drafter.generation_config.draft_round = "auto"
        del drafter.generation_config.sps_profile
    if policy in ("fixed", "threshold"):  # the same drafts, so the same rounds
        assert all(taus["eager", i] == taus["static", i] for i in range(3)), taus
    assert max(taus.values()) > 2.0, taus


def test_the_drafter_reuses_its_static_round_while_nothing_changed(target):
    drafter = make_drafter(target, block_size=4, draft_vocab_size=40)
    first = drafter.static_round(256)
    first.draft(torch.tensor([3]), 5, torch.zeros(1, 5, first.features.shape[-1]))
    assert first.length == 5
    again = drafter.static_round(256)
    assert again is first and again.length == 0  # reset for the next sequence
    assert drafter.static_round(512) is not first
    warm = LogitsProcessorList([TemperatureLogitsWarper(0.7)])
    with_warper = drafter.static_round(512, processors=warm, do_sample=True)
    assert drafter.static_round(512, processors=LogitsProcessorList([TemperatureLogitsWarper(0.7)]),
                                do_sample=True) is with_warper  # equal settings, new objects
    assert drafter.static_round(512, processors=LogitsProcessorList([TemperatureLogitsWarper(0.9)]),
                                do_sample=True) is not with_warper
    current = drafter.static_round(512)
    drafter.set_draft_vocab(torch.arange(40) + 3)  # the gathered draft-head rows change: a graph would be stale
    assert drafter.static_round(512) is not current
    current = drafter.static_round(512)
    drafter.config.confidence_temperatures = [2.0] * 4
    assert drafter.static_round(512) is not current


def test_a_round_keeps_its_own_head_rows_and_temperatures(target):
    """A graph reads the draft-head rows and STS temperatures by address: the round holds its own, so other calls that
    replace the drafter's shared cached copies (another block size, another thread) neither free nor change them."""
    drafter = make_drafter(target, block_size=4, draft_vocab_size=40)
    drafter.config.confidence_temperatures = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    ids, features = features_of(target, drafter, 12)
    static = DSparkStaticRound(drafter, 64)
    rows, temperatures = static.head_rows, static.temperatures
    assert temperatures.tolist() == [0.5, 1.0, 1.5, 2.0] and rows.shape == (40, target.config.hidden_size)
    before = static.draft(ids[:, 9], 9, features[:, :9])
    drafter.confidences(torch.zeros(1, 7))  # another block size: the shared temperature copy is replaced
    drafter.confidences(torch.zeros(1, 4, dtype=torch.float64))
    assert drafter.__dict__["_temperature_cache"][1] is not temperatures
    assert static.temperatures is temperatures and static.head_rows is rows
    static.reset()
    after = static.draft(ids[:, 9], 9, features[:, :9])
    assert_same_draft(before, after)


def test_a_graph_refuses_what_reads_values_back_to_the_host(target, monkeypatch):
    """The eta and top-h warpers (``Categorical`` validates its logits) and a dynamic / LongRoPE rotary embedding read
    values back to the host while a round runs: a static round runs them eagerly, a graph refuses them by name and
    ``auto`` drafts with the eager round instead."""
    from transformers import EtaLogitsWarper

    drafter = make_drafter(target, block_size=4)
    eta = LogitsProcessorList([TemperatureLogitsWarper(0.7), EtaLogitsWarper(0.01)])
    assert drafter.static_round_obstacle(eta) is None
    assert "EtaLogitsWarper" in drafter.static_round_obstacle(eta, graph=True)
    assert drafter.static_round_obstacle(LogitsProcessorList([TopKLogitsWarper(5)]), graph=True) is None
    ids, features = features_of(target, drafter, 12)
    DSparkStaticRound(drafter, 64, processors=eta, do_sample=True).draft(ids[:, 9], 9, features[:, :9])
    with pytest.raises(ValueError, match="CUDA graph of the drafting round cannot run logits processors that read "
                                         "values back to the host"):
        DSparkStaticRound(drafter, 64, processors=eta, do_sample=True, graph=True)
    config = copy.deepcopy(target.generation_config)
    config.max_length = 100
    monkeypatch.setattr(type(drafter), "device", property(lambda self: torch.device("cuda")))
    assert static_round_for(drafter, config.max_length, eta, True) is None  # auto on CUDA: the eager round
    monkeypatch.setattr(drafter.rotary_emb, "rope_type", "dynamic")
    assert "rope_type 'dynamic'" in drafter.static_round_obstacle(LogitsProcessorList(), graph=True)
    assert drafter.static_round_obstacle(LogitsProcessorList()) is None
    assert static_round_for(drafter, config.max_length, LogitsProcessorList(), False) is None


def test_threads_get_their_own_round_and_copies_start_without_one(target):
    """Concurrent generate() calls must not share context buffers (nor a graph's outputs); a copied drafter builds its
    own round (a CUDA graph cannot be copied, and the copy's weights live elsewhere)."""
    import threading

    drafter = make_drafter(target, block_size=4)
    mine = drafter.static_round(256)
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(drafter.static_round(256)))
    worker.start()
    worker.join()
    assert theirs[0] is not mine and drafter.static_round(256) is mine
    clone = copy.deepcopy(drafter)
    assert not clone.__dict__["_static_rounds"]
    assert clone.static_round(256) is not mine and clone.static_round(256).drafter is clone


def test_static_round_errors_name_the_problem(target):
    drafter = make_drafter(target, block_size=4)
    prompt = random_prompts(1, 6, target.config.vocab_size)[0]
    drafter.generation_config.draft_round = "bogus"
    try:
        with pytest.raises(ValueError, match="unknown draft_round 'bogus'"):
            target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
        drafter.generation_config.draft_round = "graph"
        with pytest.raises(ValueError, match="captures a CUDA graph; the drafter is on cpu"):
            target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
        drafter.generation_config.draft_round = "static"
        with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
            target.generate(prompt, max_new_tokens=4, assistant_model=drafter, repetition_penalty=1.3)
    finally:
        drafter.generation_config.draft_round = "auto"
    static = DSparkStaticRound(drafter, capacity=16)
    width = static.features.shape[-1]
    with pytest.raises(ValueError, match="the anchor is at 7"):
        static.draft(torch.tensor([3]), 7, torch.zeros(1, 5, width))
    with pytest.raises(ValueError, match="past this round's capacity"):
        static.draft(torch.tensor([3]), 17, torch.zeros(1, 17, width))
    static.draft(torch.tensor([3]), 12, torch.zeros(1, 12, width))
    with pytest.raises(ValueError, match="past this round's capacity"):  # its window would reach position 16
        static.draft(torch.tensor([3]), 13, torch.zeros(1, 1, width))
    with pytest.raises(ValueError, match="smaller than one round's window"):
        DSparkStaticRound(drafter, capacity=4)


def test_auto_takes_the_graph_on_cuda_only_where_the_round_allows(target, monkeypatch):
    drafter = make_drafter(target, block_size=4)
    config = copy.deepcopy(target.generation_config)
    config.max_length = 100
    assert static_round_for(drafter, config.max_length, LogitsProcessorList(), False) is None  # CPU: the eager round
    drafter.generation_config.draft_round = "static"
    try:
        static = static_round_for(drafter, config.max_length, LogitsProcessorList(), False)
        assert isinstance(static, DSparkStaticRound) and not static.graph and static.capacity == 256
    finally:
        drafter.generation_config.draft_round = "auto"
    monkeypatch.setattr(type(drafter), "device", property(lambda self: torch.device("cuda")))
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)])
    assert static_round_for(drafter, config.max_length, penalty, False) is None  # a processor that reads ids: eager
    with pytest.raises(ValueError, match="captures a CUDA graph"):  # otherwise the graph (weights here are on CPU)
        static_round_for(drafter, config.max_length, LogitsProcessorList(), False)


class TracedGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph``: the round traced once by ``make_fx`` (host values frozen, as in a
    capture) and re-run on replay, its results written into the outputs recorded at capture."""

    def __init__(self, static: DSparkStaticRound):
        self.static = static
        with torch.no_grad():
            self.traced = make_fx(lambda unused: static._round())(torch.zeros(()))
        self.replays = 0

    def replay(self):
        with torch.no_grad():
            for kept, new in zip(self.static._outputs, self.traced(torch.zeros(()))):
                kept.copy_(new)
        self.replays += 1


def traced_capture(self):
    with torch.no_grad():
        self._outputs = tuple(torch.empty_like(t) for t in self._round())  # shapes, as a warm-up gives them
    self._graph = TracedGraph(self)


def test_generate_replaying_a_traced_round_is_lossless(trained, monkeypatch):
    """The graph route end to end on CPU: generate() whose rounds are replays of one traced round (inputs copied
    into the static buffers, outputs cloned out of the captured ones) stays identical to plain greedy."""
    import hf_dspark.block_source as block_source

    target, drafter = trained
    monkeypatch.setattr(DSparkStaticRound, "_capture", traced_capture)
    built = []

    def graph_round(drafter, max_length, logits_processor, do_sample):
        drafter.generation_config.draft_round = "static"
        static = static_round_for(drafter, max_length, logits_processor, do_sample)
        static.graph = True
        built.append(static)
        return static

    monkeypatch.setattr(block_source, "static_round_for", graph_round)
    replays = []
    try:
        for prompt in random_prompts(48, 8, target.config.vocab_size, seed=1)[:2]:
            kwargs = dict(do_sample=False, max_new_tokens=40, min_new_tokens=40)
            plain = target.generate(prompt, **kwargs)
            assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), plain)
            assert drafter.last_stats.accepted_length > 2.0
            replays.append((built[-1]._graph.replays, drafter.last_stats.by_source()["block"]["rounds"]))
    finally:
        drafter.generation_config.draft_round = "auto"
    assert built[0] is built[1], "the second call reuses the first call's round (and its graph)"
    (first, first_rounds), (total, second_rounds) = replays
    assert first == first_rounds and total - first == second_rounds  # every block round was one replay


def test_a_failed_capture_under_auto_warns_and_drafts_eagerly(target, monkeypatch):
    drafter = make_drafter(target, block_size=4)
    ids, features = features_of(target, drafter, 12)

    def failing_capture(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DSparkStaticRound, "_capture", failing_capture)
    reference = DSparkStaticRound(drafter, 64).draft(ids[:, 9], 9, features[:, :9])
    strict, lenient = DSparkStaticRound(drafter, 64), DSparkStaticRound(drafter, 64, fallback=True)
    strict.graph = lenient.graph = True  # as on CUDA
    with pytest.raises(RuntimeError, match="stream is capturing"):
        strict.draft(ids[:, 9], 9, features[:, :9])
    with pytest.warns(RuntimeWarning, match="drafts with the static round run eagerly"):
        draft = lenient.draft(ids[:, 9], 9, features[:, :9])
    assert torch.equal(draft.draft_ids, reference.draft_ids) and not lenient.graph


def test_the_cli_offers_every_draft_round():
    from hf_dspark import block_source, cli

    assert cli.DRAFT_ROUNDS == block_source.DRAFT_ROUNDS
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "--draft-round", "static"]).draft_round == "static"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--draft-round", "bogus"])
