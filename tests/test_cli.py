"""The command line: every command's help, errors refused before any model loads (exit 2, in the flag's own name),
old spellings, ``--json`` output, quiet progress bars, and the policy-name table."""

import json

import pytest
import torch

from hf_dspark.cli import COMMANDS, build_parser, main, subparser


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading a target or a drafter fails the test: what these commands refuse, they refuse before loading."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    import transformers

    import hf_dspark.defaults
    import hf_dspark.target

    monkeypatch.setattr(hf_dspark.target, "load_smollm2", refuse)
    monkeypatch.setattr(hf_dspark.defaults, "load_drafter_for", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.fixture
def progress_bars():
    """The transformers / huggingface_hub progress bars turned back on after the test."""
    from huggingface_hub.utils import enable_progress_bars
    from transformers.utils import logging as transformers_logging

    yield transformers_logging
    transformers_logging.enable_progress_bar()
    enable_progress_bars()


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_every_help_shows_each_flag_described_with_its_default(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"] if command else ["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "(default: " in text
    parser = subparser(build_parser(), command) if command else build_parser()
    for action in parser._actions:
        assert action.help, f"{command} {action.option_strings}: no help"


def test_the_default_policy_and_sizes_show_in_generate_help(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 128)" in text and "(default: float32)" in text and "default: hybrid" in text


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--policy", "nonsense"], "--policy: unknown policy 'nonsense'; choose from fixed, threshold"),
    (["generate", "--max-new-tokens", "-3"], "--max-new-tokens must be >= 1, got -3"),
    (["generate", "--policy", "threshold", "--threshold", "7"], "--threshold must be in [0, 1], got 7"),
    (["generate", "--threshold", "0.4"], "--threshold applies to --policy threshold only"),
    (["generate", "--policy", "fixed", "--threshold", "0.4"], "--threshold applies to --policy threshold only"),
    (["bench", "--prompts", "p.jsonl", "--policies", "threshold=2"], "the threshold must be in [0, 1]"),
    (["bench", "--prompts", "p.jsonl", "--policies", "sometimes"], "--policies: unknown policy 'sometimes'"),
    (["bench-serve", "--prompts", "p.jsonl", "--policies", "plain", "fixed", "--schedule", "topk"],
     "--schedule applies to the scheduler and hybrid policies only"),
    (["bench-serve", "--prompts", "p.jsonl", "--top-p", "1.5"], "--top-p must be in [0, 1], got 1.5"),
    (["data", "--prompts", "p.jsonl", "--output", "o", "--max-prompts", "0"], "--max-prompts must be >= 1"),
    (["train", "--data", "d", "--output", "o", "--lr", "-1"], "--learning-rate must be >= 0"),
    (["train", "--data", "d", "--output", "o", "--warmup-ratio", "2"], "--warmup-ratio must be in [0, 1]"),
    (["eval", "--data", "d", "--output", "o", "--speed-prompts", "60"],
     "--speed-prompts (60) cannot exceed --num-prompts (50)"),
    (["eval", "--data", "d", "--output", "o", "--num-shards", "2"], "--num-shards and --shard-index go together"),
    (["profile", "--time-budget-s", "-1"], "--time-budget-s must be >= 0"),
    (["demo", "--port", "70000"], "--port must be in [1, 65535]"),
    (["push", "--drafter", "nowhere", "--repo-id", "a/b"], "--drafter: not a drafter folder"),
    (["bench", "--prompts", "missing.jsonl"], "--prompts: prompt file or folder not found: missing.jsonl"),
    (["bench-serve", "--prompts", "p.jsonl", "--device", "auto", "--concurrency", "0"], "--concurrency must be >= 1"),
])
def test_bad_values_exit_2_before_any_model_loads_in_the_flags_name(capsys, no_model_loads, tmp_path,
                                                                    monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("hf-dspark: error: ") and message in lines[-1], lines


def test_argparse_own_errors_exit_2(capsys, no_model_loads):
    for argv in (["generate", "--dtype", "float64"], ["generate", "--max-new-tokens", "many"], ["nonsense"],
                 ["generate", "--optimize-target", "fast"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def parsed(argv):
    """The settings ``argv`` gives its command, and what was printed on stderr while parsing."""
    from hf_dspark.cli.arguments import build_settings, note_deprecated

    parser = build_parser()
    args = parser.parse_args(argv)
    sub = subparser(parser, args.command)
    note_deprecated(sub, argv)
    return build_settings(sub, args, COMMANDS[args.command].SETTINGS)


def test_target_optimization_and_remeasure_flags():
    (generate,) = parsed(["generate"])
    assert generate.optimize_target == "auto"
    (serve,) = parsed(["bench-serve", "--prompts", "p.jsonl", "--optimize-target", "off"])
    assert serve.optimize_target == "off"
    (profile,) = parsed(["profile", "--remeasure"])
    assert profile.remeasure and profile.optimize_target == "auto"


def test_old_spellings_still_parse_with_a_note(capsys):
    (serve,) = parsed(["bench-serve", "--methods", "plain", "scheduled"])
    assert serve.policies == ["plain", "scheduled"]
    (profile,) = parsed(["profile", "--time-budget", "5"])
    assert profile.time_budget_s == 5.0
    err = capsys.readouterr().err
    assert "--methods is deprecated; use --policies" in err
    assert "--time-budget is deprecated; use --time-budget-s" in err
    from hf_dspark.cli.bench_serve import _check_policies, engine_specs

    _check_policies(serve)  # today's names in the settings, the engine's in what it runs
    assert serve.policies == ["plain", "scheduler"] and engine_specs(serve) == ["plain", "scheduler"]
    assert "--policies scheduled is deprecated; use scheduler" in capsys.readouterr().err


def test_short_and_negative_spellings():
    (train,) = parsed(["train", "--data", "d", "--output", "o", "--lr", "1e-3", "--grad-accum", "2",
                       "--no-confidence-head", "--num-layers", "3", "--target-layer-ids", "28,29", "--lora"])
    assert (train.learning_rate, train.gradient_accumulation_steps, train.enable_confidence_head) == (1e-3, 2, False)
    assert (train.num_hidden_layers, train.target_layer_ids, train.lora) == (3, [28, 29], True)
    assert train.mixed_precision == "auto"  # the command line's default; the Python API's stays "no"
    evaluation, job = parsed(["eval", "--output", "o", "--data", "d", "--first-turn-only", "--no-scheduler"])
    assert not evaluation.multi_turn and not evaluation.scheduler and job.phases == ["quality", "speed"]
    (push,) = parsed(["push", "--drafter", "d", "--repo-id", "a/b", "--branch", "dev"])
    assert push.revision == "dev"
    regeneration, _ = parsed(["data", "--prompts", "p", "--output", "o", "--exclude"])
    assert regeneration.dtype == "float32" and regeneration.exclude == []


def test_policy_names_reach_registered_policies_and_engine_policies():
    from hf_dspark.cli.policies import POLICIES
    from hf_dspark.policy_names import DEFAULT_POLICY, DEPRECATED_POLICIES
    from hf_dspark.scheduling import VERIFICATION_POLICIES

    # the engine's policy is a name in the same registry generate() reads; old names stand for registered ones
    assert {policy for policy, _ in POLICIES.values()} <= set(VERIFICATION_POLICIES)
    assert {policy for _, policy in POLICIES.values() if policy} <= set(VERIFICATION_POLICIES)
    assert set(DEPRECATED_POLICIES.values()) <= set(VERIFICATION_POLICIES) and DEFAULT_POLICY in POLICIES


def test_every_entry_point_defaults_to_the_one_policy(capsys):
    """generate, serve, bench, bench-serve and demo on the command line (and in their help), the engine's
    ``EngineConfig`` and the demo's functions all start from ``policy_names.DEFAULT_POLICY``; bench-serve compares it
    with plain, its baseline."""
    import inspect

    from hf_dspark.demo import DemoRunner, build_demo, launch_default
    from hf_dspark.engine import EngineConfig
    from hf_dspark.policy_names import DEFAULT_POLICY, PLAIN

    (generate,) = parsed(["generate"])
    (serve,) = parsed(["serve"])
    (bench,) = parsed(["bench", "--prompts", "p.jsonl"])
    (bench_serve,) = parsed(["bench-serve", "--prompts", "p.jsonl"])
    (demo,) = parsed(["demo"])
    assert generate.policy == serve.policy == demo.policy == DEFAULT_POLICY == "hybrid"
    assert bench.policies == [DEFAULT_POLICY] and bench_serve.policies == [PLAIN, DEFAULT_POLICY]
    assert EngineConfig().policy == DEFAULT_POLICY
    for function in (DemoRunner, build_demo, launch_default):
        assert inspect.signature(function).parameters["policy"].default == DEFAULT_POLICY, function
    for command in ("generate", "serve", "bench", "demo", "bench-serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown = "(default: plain hybrid)" if command == "bench-serve" else "(default: hybrid)"
        assert shown in " ".join(capsys.readouterr().out.split()), command


class FakeStats:
    def to_dict(self):
        return {"accepted_length": 2.5, "rounds": 4}


class FakeModel(torch.nn.Module):
    """Stands in for the target (``generate``; no linears, so no optimisation) and the drafter (``last_stats``): 10
    new tokens with a drafter, 8 without, the texts different."""

    last_stats = FakeStats()

    def generate(self, input_ids, max_new_tokens, assistant_model=None, **kwargs):
        width = 10 if assistant_model is not None else 8
        return torch.cat([input_ids, torch.full((1, min(width, max_new_tokens)), 1 if assistant_model else 2)], 1)


class FakeTokenizer:
    def apply_chat_template(self, *args, **kwargs):
        return {"input_ids": torch.tensor([[5, 6, 7]])}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def test_generate_json_prints_only_json_on_stdout(capsys, monkeypatch):
    import hf_dspark.cli.generate as generate

    model = FakeModel()
    monkeypatch.setattr(generate, "_load", lambda settings: (model, FakeTokenizer(), model, "fake", "fixed"))
    assert main(["generate", "--json", "--dtype", "bfloat16"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert "verification policy: fixed" in captured.err
    assert summary["dspark"]["tokens"] == 10 and summary["plain"]["tokens"] == 8
    ratio = summary["dspark"]["tokens_per_s"] / summary["plain"]["tokens_per_s"]
    assert summary["speedup"] == pytest.approx(ratio)  # per token: runs of different lengths compare fairly
    assert not summary["identical_output"] and "near-tied logits" in summary["note"]
    assert summary["text"] == " ".join(["1"] * 10) and summary["policy"] == "fixed"
    assert summary["target_optimization"]["applied"] is False and "plain_stock" not in summary


def test_generate_explains_a_bf16_difference_where_it_prints_it(capsys, monkeypatch):
    import hf_dspark.cli.generate as generate

    model = FakeModel()
    monkeypatch.setattr(generate, "_load", lambda settings: (model, FakeTokenizer(), model, "fake", "fixed"))
    assert main(["generate", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "(tokens/s); identical output: False" in out and "note: bfloat16 rounds near-tied logits" in out


def test_progress_bars_are_quiet_unless_verbose(no_model_loads, progress_bars):
    main(["generate", "--max-new-tokens", "0"])
    assert not progress_bars.is_progress_bar_enabled()
    progress_bars.enable_progress_bar()
    main(["generate", "--max-new-tokens", "0", "--verbose"])
    assert progress_bars.is_progress_bar_enabled()


def test_demo_prints_its_address_without_gradios_share_hint(capsys, monkeypatch):
    import hf_dspark.cli.demo as demo_command
    import hf_dspark.demo

    launched = {}

    def launch(**kwargs):
        launched.update(kwargs)
        return None, "http://127.0.0.1:7860/", None

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_dspark.demo, "launch_default", launch)
    monkeypatch.setattr(demo_command.time, "sleep", interrupt)
    assert main(["demo", "--max-new-tokens", "64", "--draft-tree", "auto"]) == 130
    assert launched["quiet"] and launched["prevent_thread_lock"] and launched["max_new_tokens"] == 64
    assert launched["draft_tree"] == "auto"
    assert "serving on http://127.0.0.1:7860/" in capsys.readouterr().out


def test_bench_prints_its_tables_and_with_json_its_report(capsys, monkeypatch, tmp_path):
    """By default the tables ``--markdown`` writes (torch's thread count, singular counts); ``--json``: the report."""
    import hf_dspark.cli.bench as bench
    import hf_dspark.evaluation

    row = {"tokens": 10, "seconds": 1.0, "tokens_per_s": 10.0, "speedup": 1.0}
    report = {group: {"plain": row, "dspark:fixed": {**row, "speedup": 1.5, "accepted_length": 2.0,
                                                     "identical_to_baseline": "1/1"}} for group in ("set/chat", "all")}
    model = FakeModel()
    monkeypatch.setattr(bench, "setup_target", lambda settings: (model, FakeTokenizer(), torch.float32))
    monkeypatch.setattr(bench, "_methods", lambda settings, target, dtype: (
        {"plain": {"assistant": False}, "dspark:fixed": {"assistant": True, "verification_policy": "fixed"}},
        {"dspark": "fake drafter"}))
    monkeypatch.setattr(hf_dspark.evaluation, "run_rollouts", lambda *args, **kwargs: report)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "turns": ["Hi"]}) + "\n")
    argv = ["bench", "--prompts", "p.jsonl", "--policies", "fixed", "--num-prompts", "1", "--max-new-tokens", "1"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# Speed of draft sources: float32, 1 new token, 1 prompt per set"
    assert "| chat | 1.00x | 1.50x (tau 2.00) 1/1 same |" in lines
    machine = next(line for line in lines if line.startswith("- Machine:")).split(";")[0]
    threads = torch.get_num_threads()
    assert machine.endswith(f"cores, {threads} torch thread{'' if threads == 1 else 's'})"), machine
    assert main([*argv, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["results"]["report"] == report and payload["results"]["drafters"] == {"dspark": "fake drafter"}


@pytest.mark.parametrize(("dtype", "device", "flags", "faster"), [
    ("float32", "cpu", set(), None),
    ("float16", "cuda", set(), None),
    ("bfloat16", "cuda", set(), None),
    ("float16", "cpu", {"avx2", "fma"}, "float32"),
    ("float16", "cpu", {"avx512f", "avx512_bf16"}, "bfloat16"),
    ("float16", "cpu", {"avx512_fp16"}, None),
    ("float16", "cpu", {"amx_fp16"}, None),
    ("bfloat16", "cpu", {"avx2", "fma"}, "float32"),
    ("bfloat16", "cpu", {"avx512_bf16"}, None),
    ("bfloat16", "cpu", {"amx_bf16"}, None),
])
def test_slow_dtype_warning_names_the_faster_dtype(dtype, device, flags, faster):
    from hf_dspark.cpu_features import slow_dtype_warning

    message = slow_dtype_warning(dtype, device, flags)
    if faster is None:
        assert message is None
    else:
        assert message.startswith(f"{dtype} is slow on this CPU: it has no ") and message.endswith(
            f"; {faster} is faster here")


def test_setup_target_warns_of_a_slow_dtype_on_the_cpu(capsys, monkeypatch):
    from types import SimpleNamespace

    import hf_dspark.cli.common as common
    import hf_dspark.cpu_features

    monkeypatch.setattr(hf_dspark.cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(common, "load_target", lambda name, dtype: (FakeModel(), FakeTokenizer()))
    _, _, dtype = common.setup_target(SimpleNamespace(dtype="float16", target=None, threads=None))
    assert dtype == torch.float16
    assert capsys.readouterr().err.splitlines() == [
        "hf-dspark: warning: float16 is slow on this CPU: it has no avx512_fp16 or amx_fp16 instructions, so torch "
        "emulates float16 matrix products; float32 is faster here"]
    common.setup_target(SimpleNamespace(dtype="float32", target=None, threads=None))
    assert capsys.readouterr().err == ""
