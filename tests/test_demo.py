"""The Gradio demo: round rendering (pure), streaming through gradio_client on tiny models, a headless-browser
screenshot, and (slow) one run on the real default."""

import io
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from hf_dspark.demo import DemoRunner, make_policy, round_html
from hf_dspark.planner import Planner, RowState
from hf_dspark.generation import DSparkRound
from hf_dspark.scheduling import ConfidenceThresholdPolicy, FixedLengthPolicy
from tests.helpers import char_tokenizer, make_drafter, make_target, require_smollm2

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

PROMPT = "Hello there, tiny model"


@pytest.fixture(scope="module")
def tiny_models():
    target = make_target("llama")
    return target, char_tokenizer(target.config.vocab_size), make_drafter(target, block_size=4)


@pytest.fixture(scope="module")
def tiny_app(tiny_models):
    pytest.importorskip("gradio")
    from hf_dspark.demo import build_demo

    demo = build_demo(*tiny_models, max_new_tokens=48, update_interval_s=0.0)
    _, url, _ = demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True, share=False)
    yield demo, url
    demo.close()


# ------------------------------------------------------------------------------------------------------------------
# Pure rendering and policies
# ------------------------------------------------------------------------------------------------------------------
def spans(markup: str) -> list[tuple[str, str]]:
    """(status, "text|confidence") of each token box, in order."""
    boxes = re.findall(r'data-status="(\w+)".*?<span class="dspark-text"[^>]*>(.*?)</span>'
                       r'(?:<span class="dspark-conf"[^>]*>(.*?)</span>)?</span>', markup)
    return [(status, text + (f"|{conf}" if conf else "")) for status, text, conf in boxes]


def test_round_html_colours_and_confidences():
    record = DSparkRound(index=2, draft_ids=[10, 11, 12, 13, 14], verified=4, accepted=2, emitted_ids=[10, 11, 99],
                         confidences=[0.91, 0.8, 0.456, 0.3, 0.1])
    markup = round_html(record, lambda i: {10: "Hi", 11: " there", 12: "<b>", 99: "\n"}.get(i, f"t{i}"))
    assert spans(markup) == [
        ("accepted", "Hi|0.91"), ("accepted", "␣there|0.80"), ("rejected", "&lt;b&gt;|0.46"),
        ("rejected", "t13|0.30"), ("unverified", "t14|0.10"), ("bonus", "⏎"),
    ]
    colours = {status: re.search(rf'data-status="{status}"[^>]*background:(#\w+)', markup).group(1)
               for status in ("accepted", "rejected", "unverified", "bonus")}
    assert len(set(colours.values())) == 4
    assert "round 3: 2/4 accepted, 3 emitted (drafter)" in markup
    assert "<b>" not in markup  # token text is escaped
    # a rejected draft stays legible: outlined, never struck through
    assert "line-through" not in markup and re.search(r'data-status="rejected"[^>]*outline:2px dashed', markup)
    lookup = round_html(DSparkRound(index=0, draft_ids=[1, 2], verified=2, accepted=1, emitted_ids=[1, 5],
                                    confidences=None, source="lookup"), str)
    assert 'data-source="lookup"' in lookup and "(lookup)" in lookup and "#d97706" in lookup


def test_round_html_all_accepted_no_confidences_and_empty_round():
    record = DSparkRound(index=0, draft_ids=[1, 2], verified=2, accepted=2, emitted_ids=[1, 2, 3], confidences=None)
    assert spans(round_html(record, str)) == [("accepted", "1"), ("accepted", "2"), ("bonus", "3")]
    empty = DSparkRound(index=5, draft_ids=[], verified=0, accepted=0, emitted_ids=[7], confidences=None)
    assert spans(round_html(empty, str)) == [("bonus", "7")]


def test_a_tree_round_is_drawn_as_its_tree():
    """anchor -> 10 (-> 12, -> 13), anchor -> 11; the target took 10 then 13, then its own 99."""
    tree = {"tokens": [10, 11, 12, 13], "parents": [-1, -1, 0, 0], "path": [0, 3]}
    record = DSparkRound(index=1, draft_ids=[10, 13], verified=4, accepted=2, emitted_ids=[10, 13, 99],
                         confidences=[0.9, 0.4], source="tree", tree=tree)
    markup = round_html(record, lambda i: f"t{i}")
    assert spans(markup) == [("accepted", "t10"), ("rejected", "t12"), ("accepted", "t13"), ("rejected", "t11"),
                             ("bonus", "t99")]
    assert markup.count('<ul class="dspark-tree"') == 2  # the anchor's children, and node 10's
    assert "round 2: 2/4 accepted, 3 emitted (drafter's token tree)" in markup
    cropped = DSparkRound(index=1, draft_ids=[10], verified=4, accepted=1, emitted_ids=[10, 13], confidences=None,
                          source="tree", tree=tree)  # the loop cropped the path (a length limit)
    assert [status for status, _ in spans(round_html(cropped, str))].count("accepted") == 1


def test_runner_draws_the_trees_it_verifies(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))
    target, tokenizer, drafter = tiny_models
    runner = DemoRunner(target, tokenizer, drafter, sps_time_budget_s=2.0, update_interval_s=0.0)
    assert runner.trees and runner.start_tree == "chain"
    assert DemoRunner(target, tokenizer, drafter, draft_tree="auto").start_tree == "auto"
    with pytest.raises(ValueError, match="unknown token-tree setting 'bushy'"):
        DemoRunner(target, tokenizer, drafter, draft_tree="bushy")
    final = list(runner.run(PROMPT, 16, "scheduler", 0.5, 4, "always"))[-1]
    assert "identical to plain greedy: yes" in final[5] and final[2] == final[0]
    assert 'data-source="tree"' in final[4] and "dspark-tree" in final[4]
    assert getattr(drafter.generation_config, "draft_tree", None) in (None, "chain")  # restored
    with pytest.raises(ValueError, match="scheduler or hybrid"):
        next(runner.run(PROMPT, 8, "fixed", 0.5, 4, "auto"))
    with pytest.raises(ValueError, match="unknown token-tree setting 'bushy'"):
        next(runner.run(PROMPT, 8, "scheduler", 0.5, 4, "bushy"))


def test_make_policy():
    assert isinstance(make_policy("fixed", 3, 0.5, 7), FixedLengthPolicy)
    assert make_policy("fixed", 3, 0.5, 7).num_to_verify(None, 7) == 3
    assert isinstance(make_policy("threshold", 7, 0.5, 7), ConfidenceThresholdPolicy)
    capped = make_policy("threshold", 2, 0.5, 7)
    assert isinstance(capped, ConfidenceThresholdPolicy) and capped.max_verify == 2
    planner = Planner(capped, 7)
    plan = planner.plan([RowState(4)], None)  # the cap applies wherever the planner runs the policy
    assert plan.caps == [2] and plan.drafting == [0]
    assert planner.lengths(plan, torch.tensor([[0.9, 0.9, 0.9, 0.1, 0, 0, 0]]), None) == [2]
    assert planner.lengths(plan, torch.tensor([[0.9, 0.2, 0.9, 0.1, 0, 0, 0]]), None) == [1]
    with pytest.raises(ValueError, match="1..7"):
        make_policy("fixed", 0, 0.5, 7)
    with pytest.raises(ValueError, match="SPS profile"):
        make_policy("scheduler", 3, 0.5, 7)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("magic", 3, 0.5, 7)


def test_round_callback_matches_stats_and_output(tiny_models):
    import hf_dspark  # noqa: F401

    target, tokenizer, drafter = tiny_models
    prompt = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    plain = target.generate(prompt, max_new_tokens=21, do_sample=False)
    records: list[DSparkRound] = []
    drafter.round_callback = records.append
    try:
        out = target.generate(prompt, max_new_tokens=21, do_sample=False, assistant_model=drafter)
    finally:
        drafter.round_callback = None
    stats = drafter.last_stats
    assert torch.equal(out, plain)
    assert [r.index for r in records] == list(range(stats.rounds))
    assert [r.verified for r in records] == stats.verified and [r.accepted for r in records] == stats.accepted
    assert [r.confidences or [] for r in records] == stats.confidences  # None: nothing drafted (length budget)
    assert all(len(r.draft_ids) in (0, 4) and r.emitted_ids[:r.accepted] == r.draft_ids[:r.accepted] for r in records)
    # the prefill's token, then each round's emitted tokens, are exactly the output
    emitted = [t for r in records for t in r.emitted_ids]
    assert out[0, prompt.shape[1] + 1:].tolist() == emitted


def test_runner_streams_and_matches_plain(tiny_models):
    target, tokenizer, drafter = tiny_models
    runner = DemoRunner(target, tokenizer, drafter, update_interval_s=0.0)
    updates = list(runner.run(PROMPT, 24, "threshold", 0.3, 3))
    plain_text, plain_speed, dspark_text, dspark_speed, rounds, summary = updates[-1]
    assert len(updates) > 4 and "done" in plain_speed and "done" in dspark_speed
    expected = target.generate(**tokenizer(PROMPT, return_tensors="pt"), max_new_tokens=24, do_sample=False)
    assert plain_text == dspark_text == tokenizer.decode(expected[0, len(tokenizer(PROMPT)["input_ids"]):])
    assert "identical to plain greedy: yes" in summary
    # threshold policy capped at 3 verified drafts; the setting does not leak into the drafter afterwards
    verified = [int(v) for v in re.findall(r"round \d+: \d+/(\d+) accepted", rounds)]
    assert verified and max(verified) <= 3
    assert drafter.generation_config.verification_policy in (None, "fixed")
    assert getattr(drafter, "round_callback", None) is None
    with pytest.raises(ValueError, match="empty"):
        next(runner.run("  ", 8, "fixed", 0.5, 4))


def test_runner_starts_on_the_default_policy(tiny_models):
    """The UI starts on the policy every entry point defaults to (or the one it is given), whatever the drafter's
    generation config says; a drafter without a confidence head starts on fixed, the one policy it offers."""
    from hf_dspark.policy_names import DEFAULT_POLICY

    target, tokenizer, drafter = tiny_models
    assert DemoRunner(target, tokenizer, drafter).default_policy == DEFAULT_POLICY == "hybrid"
    assert DemoRunner(target, tokenizer, drafter, policy="threshold").default_policy == "threshold"
    with pytest.raises(ValueError, match="unknown policy 'scheduled'"):
        DemoRunner(target, tokenizer, drafter, policy="scheduled")
    head, drafter.confidence_head = drafter.confidence_head, None
    try:
        runner = DemoRunner(target, tokenizer, drafter)
        assert runner.policies == ["fixed"] and runner.default_policy == "fixed"
    finally:
        drafter.confidence_head = head


def test_rounds_panel_keeps_the_newest_round_in_view():
    from hf_dspark.demo import ROUNDS_SHOWN, rounds_panel_html

    rows = [f'<div data-round="{i}"></div>' for i in range(ROUNDS_SHOWN + 3)]
    panel = rounds_panel_html(rows)
    assert "flex-direction:column-reverse" in panel  # the box's scroll origin is its bottom: the newest round
    shown = [int(i) for i in re.findall(r'data-round="(\d+)"', panel)]
    assert shown == list(range(ROUNDS_SHOWN + 2, 2, -1))  # newest first in the markup, so last on screen
    assert "3 earlier rounds" in panel


def test_runner_scheduler_profiles_first(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))  # a fresh SPS profile, measured within the budget
    target, tokenizer, drafter = tiny_models
    runner = DemoRunner(target, tokenizer, drafter, sps_time_budget_s=2.0, update_interval_s=0.0)
    updates = list(runner.run(PROMPT, 12, "scheduler", 0.5, 4))
    assert updates[0] == ("", "", "", "", "", "plain generate() runs first, then DSpark")  # stale figures cleared
    assert "speed profile" in updates[1][5] and not updates[1][0]
    assert list((tmp_path / "profiles").glob("sps-*.json"))
    assert "identical to plain greedy: yes" in updates[-1][5] and updates[-1][2] == updates[-1][0]


# ------------------------------------------------------------------------------------------------------------------
# The served app
# ------------------------------------------------------------------------------------------------------------------
def test_gradio_client_streams_side_by_side(tiny_app, tiny_models):
    from gradio_client import Client

    _, url = tiny_app
    target, tokenizer, _ = tiny_models
    client = Client(url, verbose=False)
    job = client.submit(PROMPT, 40, "fixed", 0.5, 4, "chain", api_name="/generate")
    final = job.result(timeout=60)
    outputs = job.outputs()
    assert len(outputs) >= 4, "expected several streamed updates"
    plain_text, plain_speed, dspark_text, dspark_speed, rounds, summary = final
    # intermediate updates: plain text grows first (DSpark's still empty), then DSpark's grows
    plain_lengths = [len(o[0]) for o in outputs]
    assert plain_lengths == sorted(plain_lengths)
    assert any(o[0] and not o[2] for o in outputs)
    assert any(o[2] and dspark_text.startswith(o[2]) and len(o[2]) < len(dspark_text) for o in outputs)
    expected = target.generate(**tokenizer(PROMPT, return_tensors="pt"), max_new_tokens=40, do_sample=False)
    assert dspark_text == plain_text == tokenizer.decode(expected[0, len(tokenizer(PROMPT)["input_ids"]):])
    assert re.search(r"[\d.]+ tokens/s", plain_speed) and re.search(r"[\d.]+ tokens/s", dspark_speed)
    assert re.search(r"tau \(accepted length incl\. bonus\) = [\d.]+", summary)
    assert "speedup" in summary and "identical to plain greedy: yes" in summary
    assert 'data-status="bonus"' in rounds and "dspark-round" in rounds

    # an empty prompt: one message in the summary, every other panel cleared, no error
    from hf_dspark.demo import EMPTY_PROMPT_MESSAGE

    assert client.predict("   ", 8, "threshold", 0.5, 4, "chain", api_name="/generate") == (
        "", "", "", "", "", EMPTY_PROMPT_MESSAGE)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_browser_screenshot(tiny_app, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    Image = pytest.importorskip("PIL.Image")
    chromium = _chromium()
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (scripts/setup_env.sh installs it with apt-get when it can)")
    _, url = tiny_app
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.goto(url, wait_until="domcontentloaded", timeout=30_000)
            page.locator("#generate-button").wait_for(timeout=30_000)
            page.locator("textarea").first.fill("   ")  # an empty prompt disables the button
            page.wait_for_function("() => document.querySelector('#generate-button').disabled", timeout=10_000)
            page.locator("textarea").first.fill(PROMPT)
            page.wait_for_function("() => !document.querySelector('#generate-button').disabled", timeout=10_000)
            page.locator("#generate-button").click()
            page.wait_for_function(
                "() => /identical to plain greedy/.test(document.querySelector('#dspark-summary')?.innerText || '')",
                timeout=30_000,
            )
            plain = page.locator("#plain-output textarea").input_value()
            dspark = page.locator("#dspark-output textarea").input_value()
            tokens = page.locator("#dspark-rounds .dspark-tok")
            num_tokens = tokens.count()
            statuses = set(tokens.evaluate_all("els => els.map(e => e.dataset.status)"))
            backgrounds = set(tokens.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)"))
            png = page.screenshot(full_page=True, path=str(tmp_path / "demo.png"))
        finally:
            browser.close()
    assert plain and plain == dspark
    assert num_tokens > 0 and "bonus" in statuses and statuses <= {"accepted", "rejected", "unverified", "bonus"}
    # the spans are rendered coloured (inline styles survive), one colour per status
    assert len(backgrounds) == len(statuses) and not backgrounds & {"rgba(0, 0, 0, 0)", "transparent"}
    image = Image.open(io.BytesIO(png)).convert("L")
    low, high = image.getextrema()
    assert image.size[0] >= 1000 and high - low > 100, "the screenshot is blank"
    assert len(set(image.resize((64, 64)).getdata())) > 20


# ------------------------------------------------------------------------------------------------------------------
# The real default (short)
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_demo_on_default_model():
    pytest.importorskip("gradio")
    require_smollm2()
    from gradio_client import Client

    import hf_dspark
    from hf_dspark.demo import build_demo

    target, tokenizer, drafter = hf_dspark.load_default()
    demo = build_demo(target, tokenizer, drafter, max_new_tokens=24)
    _, url, _ = demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True, share=False)
    try:
        client = Client(url, verbose=False)
        plain_text, _, dspark_text, _, rounds, summary = client.predict(
            "What is 12 times 7?", 24, "fixed", 0.5, drafter.config.block_size, "chain", api_name="/generate")
    finally:
        demo.close()
    assert plain_text.strip() and dspark_text == plain_text
    assert "identical to plain greedy: yes" in summary and re.search(r"tau .* = [\d.]+", summary)
    assert 'data-status="accepted"' in rounds  # the trained drafter gets some drafts accepted
