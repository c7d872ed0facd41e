"""The Markdown of an ``hf-dspark bench`` report."""

import pytest

from hf_dspark.evaluation.bench_report import render_bench_markdown


def _row(speedup, **extra):
    return {"tokens": 100, "seconds": 10.0, "tokens_per_s": 10.0 * speedup, "speedup": speedup, **extra}


def test_bench_markdown_tables():
    hybrid = dict(accepted_length=1.5, identical_to_baseline="2/2",
                  sources={"block": {"rounds": 2, "verified": 4, "accepted": 1},
                           "lookup": {"rounds": 6, "verified": 12, "accepted": 9},
                           "none": {"rounds": 2, "verified": 0, "accepted": 0}},
                  time_split={"drafting_s": 0.5, "verification_s": 8.0, "bookkeeping_s": 1.0})
    report = {
        "set/a": {"plain": _row(1.0), "dspark:hybrid": _row(1.21, **hybrid), "prompt_lookup": _row(1.1)},
        "set/b": {"plain": _row(1.0), "dspark:hybrid": _row(0.99, **hybrid), "prompt_lookup": _row(0.8)},
        "all": {"plain": _row(1.0), "dspark:hybrid": _row(1.1, **hybrid), "prompt_lookup": _row(0.95)},
    }
    payload = {"settings": {"dtype": "float32", "max_new_tokens": 64, "num_prompts": 2, "threads": 2},
               "results": {"report": report, "drafters": {"dspark": "d (weights sha256 0123456789ab)"}}}
    text = render_bench_markdown(payload, {"command": "hf-dspark bench ...", "cpu": "cpu", "cpu_count": 2})
    lines = text.splitlines()
    assert "- Drafters: dspark: `d (weights sha256 0123456789ab)`" in lines  # which weights were measured
    assert "| set | plain | dspark:hybrid | prompt_lookup |" in lines
    assert "| a | 1.00x | 1.21x (tau 1.50) 2/2 same | 1.10x |" in lines
    geomean = next(line for line in lines if line.startswith("| geometric mean"))
    assert f"{(1.21 * 0.99) ** 0.5:.2f}x" in geomean and f"{(1.1 * 0.8) ** 0.5:.2f}x" in geomean
    assert "| a | dspark:hybrid | 20% / 60% / 20% | 1/4, 9/12 | 5% / 80% / 10% |" in lines
    assert not any("prompt_lookup |" in line and "%" in line for line in lines)  # no rounds table for lookup


def test_tree_rounds_get_their_columns():
    """A method that verified token trees shows them beside the chain: their share of rounds, and the accepted path
    depth over the nodes verified."""
    def method(sources):
        return _row(1.2, accepted_length=2.0, identical_to_baseline="1/1", sources=sources)

    chain = method({"block": {"rounds": 2, "verified": 10, "accepted": 3}, "none": {"rounds": 2}})
    tree = method({"tree": {"rounds": 3, "verified": 30, "accepted": 6}, "none": {"rounds": 1}})
    report = {group: {"plain": _row(1.0), "dspark:hybrid:tree=chain": chain, "dspark:hybrid:tree=auto": tree}
              for group in ("set/a", "all")}
    payload = {"settings": {"dtype": "float32", "max_new_tokens": 64, "num_prompts": 1, "threads": 2},
               "results": {"report": report}}
    lines = render_bench_markdown(payload, {"command": "c", "cpu": "cpu", "cpu_count": 2}).splitlines()
    assert any(line.startswith("| set | method | rounds: block / tree / lookup / none | accepted per verified draft "
                               "(block, tree, lookup) |") for line in lines)
    assert any(line.startswith("| a | dspark:hybrid:tree=chain | 50% / 0% / 0% / 50% | 3/10, -, - |") for line in lines)
    assert any(line.startswith("| a | dspark:hybrid:tree=auto | 0% / 75% / 0% / 25% | -, 6/30, - |") for line in lines)


def test_bench_markdown_with_the_stock_baseline():
    """Where the target was optimised, plain on its stock linears is the baseline, and a second mean row gives each
    method over plain on the optimised target (speculation alone)."""
    report = {group: {"plain_stock": _row(1.0, speedup_vs_plain=0.5), "plain": _row(2.0, speedup_vs_plain=1.0),
                      "dspark:hybrid": _row(3.0, speedup_vs_plain=1.5, identical_to_baseline="2/2")}
              for group in ("set/a", "all")}
    payload = {"settings": {"dtype": "float32", "max_new_tokens": 64, "num_prompts": 2, "threads": 2},
               "results": {"report": report, "target_optimization": {"reason": "measured faster"}}}
    lines = render_bench_markdown(payload, {"command": "c", "cpu": "cpu", "cpu_count": 2}).splitlines()
    assert lines[1].startswith("# Speed of draft sources, optimised target: float32")
    assert "| set | plain_stock | plain | dspark:hybrid |" in lines
    assert "| geometric mean over sets | 1.00x | 2.00x | 3.00x |" in lines
    assert "| geometric mean over plain on the optimised target | 0.50x | 1.00x | 1.50x |" in lines
    assert any("`plain_stock` is plain on torch's stock linears" in line for line in lines)


def test_bench_markdown_needs_sets():
    with pytest.raises(ValueError, match="no prompt-set results"):
        render_bench_markdown({"settings": {}, "results": {"report": {}}}, {})



def test_bench_markdown_becomes_a_section(tmp_path):
    from hf_dspark.evaluation.report import included_markdown

    payload = {"settings": {"dtype": "bfloat16", "max_new_tokens": 64, "num_prompts": 2, "threads": 2},
               "results": {"report": {"set/a": {"plain": _row(1.0), "prompt_lookup": _row(1.3)}}}}
    bench = tmp_path / "bench.md"
    bench.write_text(render_bench_markdown(payload, {"command": "hf-dspark bench ..."}))
    section = included_markdown(bench)
    assert section.startswith("## Speed of draft sources: bfloat16") and "generated by" not in section
    assert "| a | 1.00x | 1.30x |" in section.splitlines()
    not_generated = tmp_path / "notes.md"
    not_generated.write_text("# notes\n")
    with pytest.raises(ValueError, match="not a generated report"):
        included_markdown(not_generated)


def _serve_row(tokens_per_s, tau=1.0, budget=0.0, **extra):
    return {"tokens_per_s": tokens_per_s, "accepted_length": tau, "mean_verify_tokens_per_step": budget, **extra}


def _ratios(*paired):
    geomean = 1.0
    for value in paired:
        geomean *= value
    return {"paired": list(paired), "paired_geomean": geomean ** (1 / len(paired))}


def _serve_payload():
    results = {
        "plain": {"1": _serve_row(20.0), "16": _serve_row(200.0)},
        "scheduled": {"1": _serve_row(31.0, 2.1, 3.2, vs_plain=_ratios(1.5, 1.6), identical_to_plain="4/4"),
                      "16": _serve_row(198.0, 1.0, 0.0, vs_plain=_ratios(0.98), identical_to_plain="4/4")},
    }
    settings = {"dtype": "bfloat16", "num_prompts": 4, "max_new_tokens": 32, "threads": 2, "repeats": 2,
                "lockstep": "pairs", "temperature": 0.0, "drafter_origin": "drafters/x",
                "prompts": ["eval"], "concurrency": [1, 16], "methods": ["plain", "scheduled"],
                "output": "serve.json"}
    return {"settings": settings, "results": results}


def test_serve_markdown_table():
    from hf_dspark.evaluation.bench_report import render_serve_markdown

    text = render_serve_markdown(_serve_payload(), {"command": "hf-dspark bench-serve ...", "cpu": "cpu",
                                                    "cpu_count": 2})
    lines = text.splitlines()
    assert lines[0].startswith("<!-- generated by") and lines[1] == (
        "# Batched serving: bfloat16, 4 prompts x 32 new tokens, greedy")
    assert "| concurrency | plain | scheduled |" in lines
    ratio = (1.5 * 1.6) ** 0.5
    assert (f"| 1 | 20.0 tok/s | **{ratio:.2f}x** (1.50-1.60), 31.0 tok/s, tau 2.10, 3.2 drafts/step, 4/4 same |"
            in lines)
    assert "| 16 | 200.0 tok/s | **0.98x**, 198.0 tok/s, tau 1.00, 0.0 drafts/step, 4/4 same |" in lines
    assert "- Machine: cpu (2 cores, 2 torch threads)" in text
    interleaved = _serve_payload()
    interleaved["results"]["scheduled"]["1"]["vs_plain"] = {"aggregate": 1.42, "aggregate_se_factor": 1.013}
    assert "| 1 | 20.0 tok/s | **1.42x** (s.e. x/÷1.013), 31.0 tok/s, tau 2.10, 3.2 drafts/step, 4/4 same |" in (
        render_serve_markdown(interleaved, {}).splitlines())
    trees = _serve_payload()
    trees["results"]["scheduled"]["1"]["by_source"] = {
        "block": {"rounds": 6, "verified": 18, "accepted": 9}, "tree": {"rounds": 2, "verified": 22, "accepted": 5},
        "none": {"rounds": 2, "verified": 0, "accepted": 0}}
    assert ("| 1 | 20.0 tok/s | **1.55x** (1.50-1.60), 31.0 tok/s, tau 2.10, 3.2 drafts/step, 4/4 same, trees 20% of "
            "rounds (11.0 nodes, 2.50 accepted) |") in render_serve_markdown(trees, {}).splitlines()
    no_machine = render_serve_markdown(_serve_payload(), {"command": "x"})
    assert "- Machine: not recorded in the report" in no_machine
    with pytest.raises(ValueError, match="no results"):
        render_serve_markdown({"settings": {}, "results": {}}, {})


def test_bench_serve_renders_an_earlier_report(tmp_path, capsys):
    """``bench-serve --from-report`` runs nothing: it writes the Markdown of a saved report, naming the command
    rebuilt from the report's settings when the report does not record it, and refuses what it cannot render."""
    import json

    from hf_dspark.cli import main
    from hf_dspark.cli.bench_serve import serve_command
    from hf_dspark.evaluation.report import included_markdown

    report = tmp_path / "serve.json"
    report.write_text(json.dumps(_serve_payload()))
    md = tmp_path / "serve.md"
    assert main(["bench-serve", "--from-report", str(report), "--markdown", str(md)]) == 0
    command = serve_command(_serve_payload()["settings"])
    assert command == ("hf-dspark bench-serve --prompts eval --num-prompts 4 --max-new-tokens 32 --concurrency 1 16 "
                       "--policies plain scheduled --repeats 2 --lockstep pairs --dtype bfloat16 --threads 2 "
                       "--output serve.json")
    assert f"- Command: `{command}`" in md.read_text()
    assert included_markdown(md).startswith("## Batched serving: bfloat16")
    for argv, message in ((["--from-report", str(report)], "give --markdown"),
                          (["--from-report", str(tmp_path / "none.json"), "--markdown", str(md)], "no file"),
                          (["--num-prompts", "3"], "--prompts is required")):
        assert main(["bench-serve", *argv]) == 2
        assert message in capsys.readouterr().err
