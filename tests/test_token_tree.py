"""Token trees: grown from the block, priced by the planner, verified in one target forward with the accepted path
kept in the cache, and lossless through generate() (greedy); sampling verifies the chain."""

import copy

import pytest
import torch
from transformers import DynamicCache, RepetitionPenaltyLogitsProcessor

from hf_dspark.budget import BatchShare, chain_rate, tree_schedule
from hf_dspark.scheduling import StepsPerSecond
from hf_dspark.token_tree import TokenTree, draft_tree_mode, grow_tree, tree_obstacle
from hf_dspark.tree_round import PathForward, path_forward, verify_tree
from tests.helpers import make_drafter, random_prompts
from tests.test_greedy_equality import assert_same_greedy

FREE_WIDTH = {"sample_batch_tokens": [1, 40], "sample_steps_per_sec": [100.0, 99.0]}
DEAR_WIDTH = {"sample_batch_tokens": [1, 2, 40], "sample_steps_per_sec": [100.0, 50.0, 2.0]}


def hand_tree() -> TokenTree:
    """anchor -> 5 (-> 7 -> 9, -> 8), anchor -> 6 (-> 7); in decreasing survival."""
    return TokenTree(tokens=torch.tensor([5, 6, 7, 8, 9, 7]), parents=torch.tensor([-1, -1, 0, 0, 2, 1]),
                     depths=torch.tensor([1, 1, 2, 2, 3, 2]),
                     survival=torch.tensor([0.6, 0.3, 0.4, 0.1, 0.2, 0.05]),
                     chain=torch.tensor([True, False, True, False, True, False]))


def test_the_walk_follows_the_targets_choices_down_the_tree():
    tree = hand_tree()
    choices = {0: 6, 2: 7, 6: 3}  # row -> the target's token there
    path, next_token = tree.accepted_path(lambda row, path: choices[row])
    assert path == [1, 5] and next_token == 3  # anchor -> 6 -> 7, then 3 which no child carries
    path, next_token = tree.accepted_path(lambda row, path: {0: 5, 1: 7, 3: 9, 5: 1}[row])
    assert path == [0, 2, 4] and next_token == 1
    path, next_token = tree.accepted_path(lambda row, path: 4)
    assert path == [] and next_token == 4


def test_each_row_sees_the_anchor_its_ancestors_and_itself():
    seen = hand_tree().visibility()
    assert seen[0].tolist() == [True] + [False] * 6
    assert seen[5].tolist() == [True, True, False, True, False, True, False]  # node 4 (9): anchor, 5, 7, itself
    assert seen[6].tolist() == [True, False, True, False, False, False, True]  # node 5 (7 under 6)
    assert seen.sum().item() == 1 + 2 + 2 + 3 + 3 + 4 + 3


def test_a_prefix_and_a_reranking_stay_trees():
    tree = hand_tree()
    assert tree.prefix(3).tokens.tolist() == [5, 6, 7] and not tree.prefix(3).is_chain()
    assert tree.prefix(1).is_chain() and tree.chain_length() == 3
    ranked = tree.ranked(torch.tensor([0.2, 0.9, 0.1, 0.05, 0.1, 0.8]))
    assert ranked.tokens.tolist() == [6, 7, 5, 7, 9, 8]
    for i, parent in enumerate(ranked.parents.tolist()):
        assert parent < i  # parents before children


def test_a_grafted_branch_shares_the_trees_prefix_and_keeps_it_a_tree():
    tree = hand_tree()
    grown = tree.graft(torch.tensor([5, 7, 4, 4]), torch.tensor([0.9, 0.8, 0.5, 0.5]))
    assert grown.size == tree.size + 2  # 5 -> 7 exist; 4 and 4 below them are new
    by_path = {}
    for i, (parent, token) in enumerate(zip(grown.parents.tolist(), grown.tokens.tolist())):
        by_path[i] = (by_path[parent] if parent >= 0 else ()) + (token,)
        assert parent < i
    survival = dict(zip(by_path.values(), grown.survival.tolist()))
    assert survival[(5,)] == pytest.approx(0.9) and survival[(5, 7)] == pytest.approx(0.72)  # raised by the branch
    assert survival[(5, 7, 4, 4)] == pytest.approx(0.9 * 0.8 * 0.25)
    assert survival[(6,)] == pytest.approx(0.3) and not grown.chain[grown.size - 1]
    assert bool((grown.survival[:-1] >= grown.survival[1:]).all())


def test_tree_schedule_admits_nodes_while_the_expected_rate_rises():
    table = torch.tensor([0.0, 100.0, 99.0, 98.0, 50.0])
    nodes, rate = tree_schedule(torch.tensor([0.9, 0.5, 0.1]), table)
    assert nodes == 2 and rate == pytest.approx(2.4 * 98.0)  # a third node: 2.5 * 50 < 2.4 * 98
    assert tree_schedule(torch.tensor([0.0, 0.0]), table) == (0, 100.0)
    assert chain_rate(torch.tensor([0.9, 0.5, 0.5]), 2, table) == pytest.approx((1 + 0.9 + 0.45) * 98.0)


def test_a_row_in_a_batch_pays_for_the_rows_its_tree_slows():
    """Within a batch the row's tree is priced by the whole step: the other rows' expected tokens count in the rate,
    and a padded step widened by the tree costs every row's width."""
    table = torch.tensor([100.0 / (1 + 0.02 * b) for b in range(41)])
    table[0] = 0.0
    survival = torch.tensor([0.9, 0.5, 0.3, 0.2, 0.1])
    alone, _ = tree_schedule(survival, table)
    # three more rows expected to deliver 6 tokens, each verifying 4 (anchor included): a packed step (prefix) adds
    # the row's width to their 12 tokens; a padded one runs all four rows as wide as the widest
    packed = BatchShare(expected=6.0, tokens=12, width=4, rows=4)
    padded = BatchShare(expected=6.0, tokens=12, width=4, rows=4, padded=True)
    nodes, rate = tree_schedule(survival, table, packed)
    expected = 6.0 + 1 + float(survival[:nodes].sum())
    assert rate == pytest.approx(expected * float(table[12 + 1 + nodes]))
    assert nodes < alone  # the others' tokens make each width dearer in tokens per second
    nodes, rate = tree_schedule(survival, table, padded)
    assert nodes == 3  # up to the step's width 4 the tree is free; past it every row widens
    assert rate == pytest.approx((6.0 + 1 + 0.9 + 0.5 + 0.3) * float(table[16]))
    assert chain_rate(torch.tensor([0.9, 0.5]), 2, table, padded) == pytest.approx((6.0 + 1 + 0.9 + 0.45)
                                                                                  * float(table[16]))
    with pytest.raises(ValueError, match="prices batches of at most 40 tokens"):
        tree_schedule(survival, table, BatchShare(tokens=40, rows=2))


@pytest.fixture(scope="module")
def llama_pair(tiny_targets, trained_drafters):
    return tiny_targets["llama"], copy.deepcopy(trained_drafters["llama"])


def test_a_grown_tree_holds_the_blocks_chain_with_its_confidences(llama_pair):
    target, drafter = llama_pair
    prompt = random_prompts(1, 9, target.config.vocab_size, seed=3)[0]
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        features = drafter.gather_target_hidden(out.hidden_states, drafter.config.target_layer_ids)
        draft = drafter.draft(prompt[:, -1], prompt.shape[1] - 1, features[:, :-1], drafter.new_context_cache())
        tree = grow_tree(drafter, draft.base_logits[0], draft.hidden_states[0], int(prompt[0, -1]), max_nodes=24)
    assert tree.size == 24
    parents, survival = tree.parents.tolist(), tree.survival
    assert all(p < i for i, p in enumerate(parents))
    assert bool((survival[:-1] >= survival[1:]).all())
    assert all(p < 0 or survival[i] <= survival[p] for i, p in enumerate(parents))
    chain = sorted(zip(tree.depths[tree.chain].tolist(), tree.tokens[tree.chain].tolist(),
                       survival[tree.chain].tolist()))
    g = len(chain)
    assert [t for _, t, _ in chain] == draft.draft_ids[0, :g].tolist()  # the first choices: the greedy block
    expected = torch.cumprod(draft.confidences[0, :g].float(), 0)
    assert torch.allclose(torch.tensor([s for _, _, s in chain]), expected, atol=1e-5)
    # siblings share their parent's survival: it never grows
    for parent in set(parents):
        below = survival[torch.tensor(parents) == parent].sum()
        assert float(below) <= (1.0 if parent < 0 else float(survival[parent])) + 1e-5


def test_tree_verification_equals_a_chain_forward_over_the_accepted_path(llama_pair):
    target, _ = llama_pair
    prompt = random_prompts(1, 9, target.config.vocab_size, seed=4)[0]
    with torch.no_grad():
        greedy = target.generate(prompt, max_new_tokens=3, do_sample=False)[0, prompt.shape[1]:].tolist()
        wrong = [(t + 1) % target.config.vocab_size for t in greedy]
        # the target's path is 0 -> 3 -> 4 (the first two of its greedy tokens); decoys around it
        tree = TokenTree(tokens=torch.tensor([wrong[0], greedy[0], wrong[1], greedy[1], wrong[2]]),
                         parents=torch.tensor([-1, -1, 0, 1, 3]), depths=torch.tensor([1, 1, 2, 2, 3]),
                         survival=torch.tensor([0.5, 0.4, 0.3, 0.3, 0.1]),
                         chain=torch.tensor([True, False, True, False, False]))
        cache = DynamicCache(config=target.config)
        target(prompt[:, :-1], cache=cache, use_cache=True)
        verified = verify_tree(target, cache, prompt, tree, [0, 2])
        assert verified.path == [1, 3] and verified.next_token == greedy[2]
        chain_cache = DynamicCache(config=target.config)
        target(prompt[:, :-1], cache=chain_cache, use_cache=True)
        chain = target(torch.tensor([[int(prompt[0, -1]), greedy[0], greedy[1]]]), cache=chain_cache, use_cache=True,
                       output_hidden_states=[0, 2])
    assert verified.tokens.tolist() == [int(prompt[0, -1]), greedy[0], greedy[1]]
    assert torch.allclose(verified.outputs.logits, chain.logits, atol=1e-5)
    assert torch.allclose(verified.outputs.hidden_states[2], chain.hidden_states[2], atol=1e-5)
    assert cache.get_seq_length() == chain_cache.get_seq_length() == prompt.shape[1] + 2
    for mine, theirs in zip(cache.layers, chain_cache.layers):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
        assert torch.allclose(mine.values, theirs.values, atol=1e-5)


def test_the_path_forward_answers_only_the_forward_over_its_path():
    calls = []
    hook = PathForward(lambda **kwargs: calls.append(kwargs) or "ran")
    assert hook(input_ids=torch.tensor([[1, 2]])) == "ran"
    from hf_dspark.tree_round import VerifiedPath

    hook.pending = VerifiedPath([0], 3, torch.tensor([1, 2]), "stashed")
    assert hook(input_ids=torch.tensor([[1, 2]])) == "stashed" and len(calls) == 1
    hook.pending = VerifiedPath([0], 3, torch.tensor([1, 2]), "stashed")
    with pytest.raises(RuntimeError, match="accepted path"):
        hook(input_ids=torch.tensor([[1, 5]]))


def test_the_path_forward_is_shared_and_removed_by_the_last_call_out(llama_pair):
    target, _ = llama_pair
    assert "forward" not in target.__dict__
    with path_forward(target) as hook:
        assert target.forward is hook
        with path_forward(target) as inner:
            assert inner is hook and hook.users == 2
        assert target.forward is hook
    assert "forward" not in target.__dict__
    own = target.forward
    target.forward = lambda *args, **kwargs: own(*args, **kwargs)  # an instance forward, as accelerate's hooks set
    wrapped = target.__dict__["forward"]
    with path_forward(target) as hook:
        assert hook.forward is wrapped
    assert target.__dict__["forward"] is wrapped
    del target.forward


def _tree_policy(drafter, mode: str, profile: dict = FREE_WIDTH) -> None:
    drafter.generation_config.verification_policy = "scheduler"
    drafter.generation_config.sps_profile = profile
    drafter.generation_config.draft_tree = mode


@pytest.mark.parametrize("mode", ["always", "auto"])
def test_tree_rounds_keep_greedy_output(tiny_targets, trained_drafters, family, mode):
    target, drafter = tiny_targets[family], copy.deepcopy(trained_drafters[family])
    _tree_policy(drafter, mode)
    trees = 0
    for prompt in random_prompts(4, 8, target.config.vocab_size, seed=5):
        assert_same_greedy(target, drafter, prompt, max_new_tokens=30)
        trees += drafter.last_stats.sources.count("tree")
    assert trees > 0  # width is nearly free here: the planner takes trees


def test_tree_rounds_with_processors_stops_and_scores(llama_pair):
    target, drafter = llama_pair
    _tree_policy(drafter, "always")
    prompt = random_prompts(1, 8, target.config.vocab_size, seed=6)[0]
    assert_same_greedy(target, drafter, prompt, max_new_tokens=25, repetition_penalty=1.3)
    assert "tree" in drafter.last_stats.sources
    for new in (1, 2, 5, 11):
        assert_same_greedy(target, drafter, prompt, max_new_tokens=new)
    stopped = 0
    for candidate in random_prompts(48, 8, target.config.vocab_size, seed=1)[:6]:
        free = target.generate(candidate, do_sample=False, max_new_tokens=20)[0, candidate.shape[1]:].tolist()
        eos = next((t for i, t in enumerate(free) if i >= 4 and t not in free[:i]), None)
        if eos is not None:
            out = assert_same_greedy(target, drafter, candidate, max_new_tokens=20, eos_token_id=eos)
            stopped += int(out[0, -1]) == eos
    assert stopped > 0
    plain = target.generate(prompt, do_sample=False, max_new_tokens=12, output_scores=True,
                            return_dict_in_generate=True)
    out = target.generate(prompt, do_sample=False, max_new_tokens=12, output_scores=True,
                          return_dict_in_generate=True, assistant_model=drafter)
    assert torch.equal(out.sequences, plain.sequences) and len(out.scores) == len(plain.scores)
    for mine, theirs in zip(out.scores, plain.scores):
        assert torch.allclose(mine, theirs, atol=1e-4)


def test_a_dear_width_keeps_the_chain(llama_pair):
    target, drafter = llama_pair
    _tree_policy(drafter, "auto", DEAR_WIDTH)
    for prompt in random_prompts(3, 8, target.config.vocab_size, seed=7):
        assert_same_greedy(target, drafter, prompt, max_new_tokens=20)
        assert "tree" not in drafter.last_stats.sources


def test_sampling_verifies_the_chain_and_always_says_why(llama_pair):
    target, drafter = llama_pair
    _tree_policy(drafter, "auto")
    prompt = random_prompts(1, 8, target.config.vocab_size, seed=8)[0]
    target.generate(prompt, do_sample=True, max_new_tokens=10, assistant_model=drafter)
    assert "tree" not in drafter.last_stats.sources
    _tree_policy(drafter, "always")
    with pytest.raises(ValueError, match="draft_tree='always'.*sampling"):
        target.generate(prompt, do_sample=True, max_new_tokens=10, assistant_model=drafter)


def test_draft_tree_settings_are_checked(tiny_targets):
    target = tiny_targets["llama"]
    drafter = make_drafter(target, head="rnn")
    assert "state" in tree_obstacle(drafter)
    assert tree_obstacle(make_drafter(target, head="gated")) is None
    drafter.generation_config.draft_tree = "bushy"
    with pytest.raises(ValueError, match="unknown draft_tree 'bushy'"):
        draft_tree_mode(drafter)


def test_the_cli_offers_every_draft_tree_setting():
    from hf_dspark import cli, token_tree

    assert cli.DRAFT_TREES == token_tree.DRAFT_TREES
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "--draft-tree", "chain"]).draft_tree == "chain"
    assert parser.parse_args(["bench", "--prompts", "p", "--draft-tree", "chain", "auto"]).draft_tree == ["chain", "auto"]
    for command in (["bench-serve", "--prompts", "p"], ["serve"], ["demo"]):
        assert parser.parse_args(command + ["--draft-tree", "auto"]).draft_tree == "auto", command
    assert parser.parse_args(["demo"]).draft_tree == "chain" and parser.parse_args(["serve"]).draft_tree is None
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--draft-tree", "bushy"])


# ------------------------------------------------------------------------------------------------------------------
# The batched engine
# ------------------------------------------------------------------------------------------------------------------
ENGINE_FREE_WIDTH = StepsPerSecond([1, 4096], [100.0, 99.0])


@pytest.mark.parametrize("mode", ["always", "auto"])
def test_engine_tree_rounds_keep_greedy_output(tiny_targets, trained_drafters, family, mode):
    from hf_dspark.engine import SamplingParams, generate_batch
    from tests.test_engine import in_distribution_prompts, plain_greedy

    target, drafter = tiny_targets[family], copy.deepcopy(trained_drafters[family])
    drafter.generation_config.draft_tree = mode
    prompts = in_distribution_prompts(target, 5)
    max_new = [30, 3, 25, 1, 17]
    result = generate_batch(target, prompts, drafter, [SamplingParams(max_new_tokens=m) for m in max_new],
                            max_concurrency=3, policy="scheduler", sps=ENGINE_FREE_WIDTH)
    for prompt, m, out in zip(prompts, max_new, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, m), f"request {out.request_id} diverged"
    trees = sum(out.stats.sources.count("tree") for out in result.outputs)
    assert trees > 0  # width is nearly free here: the planner takes trees
    assert max(result.stats.widths) > drafter.config.block_size + 1 or mode == "auto"


def test_engine_a_dear_width_keeps_the_chain(llama_pair):
    from hf_dspark.engine import SamplingParams, generate_batch
    from tests.test_engine import in_distribution_prompts, plain_greedy

    target, drafter = llama_pair
    drafter = copy.deepcopy(drafter)
    drafter.generation_config.draft_tree = "auto"
    dear = StepsPerSecond([1, 2, 9, 40], [100.0, 80.0, 40.0, 2.0])
    prompts = in_distribution_prompts(target, 2)
    result = generate_batch(target, prompts, drafter, SamplingParams(max_new_tokens=16), policy="scheduler",
                            sps=dear)
    for prompt, out in zip(prompts, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, 16) and "tree" not in out.stats.sources


def test_engine_trees_beside_sampled_rows_and_the_chain_setting(llama_pair):
    from hf_dspark.engine import DSparkEngine, SamplingParams, generate_batch
    from tests.test_engine import in_distribution_prompts, plain_greedy

    target, drafter = llama_pair
    drafter = copy.deepcopy(drafter)
    drafter.generation_config.draft_tree = "always"
    prompts = in_distribution_prompts(target, 4)
    params = [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=20, do_sample=True, seed=3),
              SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=20, do_sample=True, seed=4)]
    result = generate_batch(target, prompts, drafter, params, policy="scheduler", sps=ENGINE_FREE_WIDTH)
    for i in (0, 2):
        assert result.outputs[i].token_ids == plain_greedy(target, prompts[i], params[i].max_new_tokens)
        assert "tree" in result.outputs[i].stats.sources
    for i in (1, 3):  # sampled rows verify their chain
        assert "tree" not in result.outputs[i].stats.sources and len(result.outputs[i].token_ids) == 20
    drafter.generation_config.draft_tree = "chain"
    chain = generate_batch(target, prompts[:1], drafter, params[:1], policy="scheduler", sps=ENGINE_FREE_WIDTH)
    assert "tree" not in chain.outputs[0].stats.sources
    drafter.generation_config.draft_tree = "always"
    with pytest.raises(ValueError, match="draft_tree='always'.*SPS"):
        DSparkEngine(target, drafter, policy="fixed")


def test_the_engines_draft_tree_setting_and_the_bench_policy_option(llama_pair):
    from hf_dspark.engine import DSparkEngine, EngineConfig
    from hf_dspark.evaluation.engine_bench import parse_policy

    target, drafter = llama_pair
    drafter = copy.deepcopy(drafter)
    drafter.generation_config.draft_tree = None  # the drafter's default (earlier tests set the shared pair's)
    assert DSparkEngine(target, drafter, policy="scheduler", sps=ENGINE_FREE_WIDTH).trees.off == "draft_tree='chain'"
    engine = DSparkEngine(target, drafter, policy="scheduler", sps=ENGINE_FREE_WIDTH, draft_tree="auto")
    assert engine.trees.mode == "auto" and engine.trees.off is None
    drafter.generation_config.draft_tree = "always"
    with pytest.warns(UserWarning, match="EngineConfig.draft_tree='chain', not the drafter's .*'always'"):
        engine = DSparkEngine(target, drafter, policy="scheduler", sps=ENGINE_FREE_WIDTH, draft_tree="chain")
    assert engine.trees.mode == "chain"
    with pytest.raises(ValueError, match="unknown draft_tree 'bushy'"):
        EngineConfig(draft_tree="bushy")
    assert parse_policy("hybrid=prefix,tree=auto") == {"policy": "hybrid", "schedule": "prefix", "draft_tree": "auto"}
    assert parse_policy("plain") == {"policy": "plain"}
    with pytest.raises(ValueError, match="tree=T needs T in"):
        parse_policy("scheduler,tree=bushy")


def test_engine_trees_graft_the_lookups_offer(llama_pair, monkeypatch):
    """Under hybrid a drafting row's prompt-lookup offer joins its tree as one more branch; outputs stay plain's.
    (Every row drafts its block here: on a free width an offer would otherwise take its row.)"""
    from hf_dspark.engine import SamplingParams, generate_batch
    from hf_dspark.planner import Planner
    from tests.test_engine import in_distribution_prompts, plain_greedy
    from tests.test_engine_hybrid import repeated

    target, drafter = llama_pair
    drafter = copy.deepcopy(drafter)
    monkeypatch.setattr(Planner, "_offers", lambda self, *args: {})
    grafted = []
    graft = TokenTree.graft
    monkeypatch.setattr(TokenTree, "graft", lambda self, *a: grafted.append(1) or graft(self, *a))
    prompts = [repeated(p) for p in in_distribution_prompts(target, 3)]
    result = generate_batch(target, prompts, drafter, SamplingParams(max_new_tokens=24), policy="hybrid",
                            sps=ENGINE_FREE_WIDTH, draft_tree="always")
    for prompt, out in zip(prompts, result.outputs):
        assert out.token_ids == plain_greedy(target, prompt, 24)
    assert grafted and sum(o.stats.sources.count("tree") for o in result.outputs) > 0
