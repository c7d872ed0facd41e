"""Gradio demo: plain ``generate()`` and DSpark-assisted ``generate()`` streaming side by side.

``build_demo(target, tokenizer, drafter)`` returns a ``gr.Blocks`` app for any target / tokenizer / DSpark drafter
(``demo/app.py`` and ``hf-dspark demo`` launch it on ``hf_dspark.load_default()``). Each request runs plain greedy
decoding, then DSpark-assisted greedy decoding, one after the other so each gets the whole machine and its
tokens/s is honest; tokens arrive through transformers' streamer (``streamer.put``), and DSpark's per-round drafts
through ``drafter.round_callback`` (``hf_dspark.generation.DSparkRound``). ``round_html`` (a pure function) renders
one round with accepted, rejected, unverified and bonus tokens in distinct colours and each draft's confidence.
"""

from __future__ import annotations

import html
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .generation import DSparkRound
from .policy_names import DEFAULT_POLICY
from .scheduling import VerificationPolicy, build_policy
from .stats import DSparkStats
from .token_tree import DRAFT_TREES, tree_obstacle

POLICIES = ("hybrid", "fixed", "threshold", "scheduler")  # the policies the demo offers, the default first
UPDATE_INTERVAL_S = 0.1  # at most ~10 UI updates per second: rendering must not eat the generation's CPU
ROUNDS_SHOWN = 64  # the draft panel keeps the latest rounds
DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."
EMPTY_PROMPT_MESSAGE = "Enter a prompt to compare plain and DSpark generation."

# status -> (background, text colour, style of the token text)
TOKEN_STYLES = {
    "accepted": ("#bff0c4", "#0b4d16", ""),
    "rejected": ("#f7c0c0", "#7a0c0c", ""),
    "unverified": ("#e4e4e7", "#71717a", ""),
    "bonus": ("#c3d9fb", "#0b3a7a", "font-weight:600;"),
}
# draft source -> (colour of the round's left border, label)
SOURCE_STYLES = {
    "block": ("#7c3aed", "drafter"),
    "tree": ("#059669", "drafter's token tree"),
    "lookup": ("#d97706", "lookup"),
    "none": ("#a1a1aa", "target alone"),
}
BOX_STYLE = ("display:inline-block;margin:1px;padding:1px 4px;border-radius:4px;text-align:center;"
             "font-family:monospace;white-space:pre;")
# A rejected draft keeps its text legible (no strike-through over punctuation): its box gets a dashed red outline.
BORDER_STYLES = {"rejected": "outline:2px dashed #b91c1c;outline-offset:-2px;"}
# What each verification policy does, shown under the policy choice.
POLICY_HELP = {
    "hybrid": "hybrid (the default): each round drafts from the drafter's block or a prompt lookup, or not at "
              "all, whichever the target's measured speed profile says yields the most tokens per second",
    "fixed": "fixed: verify exactly N drafter tokens every round",
    "threshold": "threshold: verify drafts up to the first confidence c_k below t (at most N)",
    "scheduler": "scheduler: the paper's prefix scheduler, the length with the most expected tokens per second "
                 "on the target's speed profile (at most N); drafter block only",
}
TREE_HELP = ("chain: verify the block's chain; auto: a round verifies a tree of the block's second and third "
             "choices where the speed profile prices it above the chain; always: a tree every drafting round "
             "(scheduler and hybrid only; greedy output unchanged)")
LEGEND = {
    "accepted": "accepted draft",
    "rejected": "rejected draft",
    "unverified": "not verified (policy or length limit)",
    "bonus": "target's token (bonus / correction)",
}


# ------------------------------------------------------------------------------------------------------------------
# Rendering (pure)
# ------------------------------------------------------------------------------------------------------------------
def token_text(text: str) -> str:
    """A token's text made visible in a box: spaces as '␣', newlines as '⏎', tabs as '⇥' (HTML-escaped)."""
    shown = text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
    return html.escape(shown or "∅")


def _token_span(text: str, status: str, confidence: float | None) -> str:
    background, colour, text_style = TOKEN_STYLES[status]
    title = LEGEND[status] + ("" if confidence is None else f", confidence {confidence:.2f}")
    conf = "" if confidence is None else (
        f'<span class="dspark-conf" style="display:block;font-size:0.7em;opacity:0.8;">{confidence:.2f}</span>'
    )
    return (
        f'<span class="dspark-tok dspark-{status}" data-status="{status}" title="{html.escape(title)}" '
        f'style="{BOX_STYLE}background:{background};color:{colour};{BORDER_STYLES.get(status, "")}">'
        f'<span class="dspark-text" style="{text_style}">{token_text(text)}</span>{conf}</span>'
    )


def round_html(record: DSparkRound, decode: Callable[[int], str]) -> str:
    """One round as a row of coloured token boxes: the drafted block (accepted / rejected / unverified, each with
    its confidence c_k when the drafter has a confidence head), then the target's own token. A token-tree round
    draws its tree instead (``tree_html``).

    ``decode`` maps a token id to its text (e.g. ``lambda i: tokenizer.decode([i])``).
    """
    confidences = record.confidences or []
    spans = []
    if record.tree is not None:
        spans.append(tree_html(record.tree, record.accepted, decode))
    else:
        for k, token_id in enumerate(record.draft_ids):
            status = "accepted" if k < record.accepted else "rejected" if k < record.verified else "unverified"
            spans.append(_token_span(decode(token_id), status, confidences[k] if k < len(confidences) else None))
    # The last emitted token is the target's own: the bonus when every verified draft was accepted, else the
    # correction of the first rejected one.
    if len(record.emitted_ids) > record.accepted:
        spans.append(_token_span(decode(record.emitted_ids[-1]), "bonus", None))
    summary = f"{record.accepted}/{record.verified} accepted, {len(record.emitted_ids)} emitted"
    source = SOURCE_STYLES.get(record.source, SOURCE_STYLES["block"])
    return (
        f'<div class="dspark-round" data-round="{record.index}" data-source="{html.escape(record.source)}" '
        f'style="margin:2px 0;border-left:4px solid {source[0]};padding-left:4px;">'
        f'<span style="display:inline-block;width:14em;font-size:0.8em;opacity:0.75;">round {record.index + 1}: '
        f"{summary} ({source[1]})</span>{''.join(spans)}</div>"
    )


def tree_html(tree: dict, accepted: int, decode: Callable[[int], str]) -> str:
    """A token tree (``DSparkRound.tree``) as nested lists of token boxes, each node under its parent: the first
    ``accepted`` nodes of its path accepted, every other node verified and rejected."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(tree["parents"]):
        children.setdefault(parent, []).append(node)
    taken = set(tree["path"][:accepted])

    def node_span(node: int) -> str:
        return _token_span(decode(tree["tokens"][node]), "accepted" if node in taken else "rejected", None)

    def branch(parent: int) -> str:
        items = "".join(f'<li style="margin:0;">{node_span(node)}{branch(node)}</li>'
                        for node in children.get(parent, []))
        return (f'<ul class="dspark-tree" style="margin:0 0 0 1.2em;padding:0;list-style:none;'
                f'border-left:1px dotted #a1a1aa;">{items}</ul>') if items else ""

    return f'<div class="dspark-tree-round" style="display:inline-block;vertical-align:top;">{branch(-1)}</div>'


def legend_html() -> str:
    boxes = "".join(
        f'<span style="{BOX_STYLE}background:{background};color:{colour};{BORDER_STYLES.get(status, "")}">'
        f'<span style="{text_style}">{html.escape(LEGEND[status])}</span></span>'
        for status, (background, colour, text_style) in TOKEN_STYLES.items()
    )
    sources = "".join(
        f'<span style="border-left:4px solid {colour};padding-left:4px;margin-left:6px;font-size:0.8em;">'
        f"{html.escape(label)}</span>" for colour, label in SOURCE_STYLES.values()
    )
    return (boxes + '<span style="font-size:0.8em;opacity:0.75;"> &nbsp;numbers under drafts: confidence c_k; '
            '"a/b accepted, n emitted": a of the b verified drafts accepted, n tokens added this round (the accepted '
            "drafts plus the target's own token); round source:</span>" + sources)


def rounds_panel_html(round_rows: list[str]) -> str:
    """The latest rounds, oldest first, in a box that stays scrolled to the newest: the rows are written newest
    first in a ``column-reverse`` flex box, whose scroll origin is its bottom, so no script has to follow it."""
    hidden = len(round_rows) - ROUNDS_SHOWN
    note = f'<div style="font-size:0.8em;opacity:0.7;">... {hidden} earlier rounds</div>' if hidden > 0 else ""
    newest_first = "".join(reversed(round_rows[-ROUNDS_SHOWN:]))
    return (f'<div class="dspark-rounds" style="display:flex;flex-direction:column-reverse;overflow-y:auto;'
            f'max-height:400px;">{newest_first}{note}</div>')


def summary_markdown(stats: DSparkStats, plain_tps: float | None, dspark_tps: float | None,
                     identical: bool | None) -> str:
    """tau, acceptance and speedup so far."""
    if not stats.rounds:
        return "tau (accepted length incl. bonus): waiting for the first DSpark round"
    positions = ", ".join("n/a" if p is None else f"{p:.2f}" for p in stats.position_acceptance())
    lines = [
        f"**tau (accepted length incl. bonus) = {stats.accepted_length:.2f}** over {stats.rounds} rounds: the "
        f"tokens each target forward adds; acceptance rate {stats.acceptance_rate:.2f} "
        f"({sum(stats.accepted)}/{sum(stats.verified)} verified drafts)",
        f"per-position acceptance (draft k accepted, given drafts 1..k-1 were; n/a: no round verified position k): "
        f"{positions}",
    ]
    if plain_tps and dspark_tps:
        lines.append(f"**speedup {dspark_tps / plain_tps:.2f}x** ({dspark_tps:.1f} vs {plain_tps:.1f} tokens/s)")
    if identical is not None:
        lines.append("identical to plain greedy: " + ("yes" if identical else
                     "NO (float32 guarantees equality; in bfloat16/float16 near-ties can round differently)"))
    return "\n\n".join(lines)


def speed_markdown(name: str, tokens: int, seconds: float, done: bool) -> str:
    rate = tokens / seconds if seconds > 0 else 0.0
    state = "done" if done else "generating..."
    return f"**{name}**: {tokens} tokens in {seconds:.2f} s, **{rate:.1f} tokens/s** ({state})"


# ------------------------------------------------------------------------------------------------------------------
# Policies
# ------------------------------------------------------------------------------------------------------------------
def make_policy(name: str, num_verify: int, threshold: float, block_size: int, sps=None) -> VerificationPolicy:
    """The demo's policy: ``fixed`` verifies ``num_verify`` drafts; ``threshold`` and ``scheduler`` verify at most
    ``num_verify``; ``hybrid`` chooses its source and length itself (``sps``: the target's StepsPerSecond profile,
    needed by ``scheduler`` and ``hybrid``)."""
    if not 1 <= int(num_verify) <= block_size:
        raise ValueError(f"draft tokens to verify must be in 1..{block_size}, got {num_verify}")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name in ("hybrid", "scheduler") and sps is None:
        raise ValueError(f"the {name} policy needs the target's SPS profile")
    # every other setting at its default (the drafter's generation_config is not read)
    settings = {"hybrid": dict(sps_profile=sps), "fixed": dict(num_verify_tokens=int(num_verify)),
                "threshold": dict(confidence_threshold=float(threshold)), "scheduler": dict(sps_profile=sps)}[name]
    policy = build_policy(name, None, block_size, **settings)
    if name in ("threshold", "scheduler") and int(num_verify) != block_size:
        policy.max_verify = int(num_verify)  # a fixed cap is non-anticipating: still lossless
        policy.name = f"{name}(max {policy.max_verify})"
    return policy


# ------------------------------------------------------------------------------------------------------------------
# Streaming one generate() call
# ------------------------------------------------------------------------------------------------------------------
class _QueueStreamer(BaseStreamer):
    """transformers streamer: each ``put`` after the prompt is one step's (or round's) new tokens."""

    def __init__(self, events: queue.Queue):
        self.events, self.seen_prompt = events, False

    def put(self, value):
        if not self.seen_prompt:  # generate() first puts the prompt
            self.seen_prompt = True
            return
        self.events.put(("tokens", value.reshape(-1).tolist()))

    def end(self):
        pass


class _StopFlag(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


@dataclass
class Progress:
    """What one streaming ``generate`` produced so far."""

    ids: list[int] = field(default_factory=list)
    rounds: list[DSparkRound] = field(default_factory=list)
    start: float = 0.0
    seconds: float = 0.0
    done: bool = False

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else 0.0


def stream_generate(target, inputs: dict, settings: dict, drafter=None, stop: threading.Event | None = None,
                    interval_s: float = UPDATE_INTERVAL_S) -> Iterator[Progress]:
    """Run ``target.generate`` in a thread and yield its progress at most every ``interval_s`` (and once at the
    end, with ``seconds`` the wall time of the whole ``generate`` call). With ``drafter``, DSpark-assisted."""
    events: queue.Queue = queue.Queue()
    stop = stop or threading.Event()
    progress = Progress()
    kwargs = dict(inputs, **settings, streamer=_QueueStreamer(events),
                  stopping_criteria=StoppingCriteriaList([_StopFlag(stop)]))
    if drafter is not None:
        kwargs["assistant_model"] = drafter

    def work():
        try:
            if drafter is not None:
                drafter.round_callback = lambda record: events.put(("round", record))
            progress.start = time.perf_counter()
            with torch.inference_mode():
                target.generate(**kwargs)
            events.put(("done", time.perf_counter() - progress.start))
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
            events.put(("error", err))
        finally:
            if drafter is not None:
                drafter.round_callback = None

    thread = threading.Thread(target=work, name="hf-dspark-demo-generate", daemon=True)
    thread.start()
    last = 0.0
    try:
        while True:
            kind, payload = events.get()
            if kind == "tokens":
                progress.ids.extend(payload)
            elif kind == "round":
                progress.rounds.append(payload)
            elif kind == "error":
                raise payload
            else:
                progress.seconds, progress.done = payload, True
                yield progress
                return
            now = time.perf_counter()
            if now - last >= interval_s and events.empty():
                last = now
                progress.seconds = now - progress.start
                yield progress
    finally:
        stop.set()  # the consumer went away (cancelled / disconnected): end the generation early
        thread.join()


# ------------------------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------------------------
class DemoRunner:
    """The models plus one lock (the models are shared by every session; runs go one at a time). ``policy``: the
    policy the UI starts on (``default_policy``)."""

    def __init__(self, target, tokenizer, drafter, sps_time_budget_s: float = 30.0,
                 update_interval_s: float = UPDATE_INTERVAL_S, policy: str = DEFAULT_POLICY,
                 draft_tree: str = "chain"):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if draft_tree not in DRAFT_TREES:
            raise ValueError(f"unknown token-tree setting {draft_tree!r}; choose one of {', '.join(DRAFT_TREES)}")
        drafter.check_target(target)
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.block_size = drafter.config.block_size
        self.sps_time_budget_s = sps_time_budget_s
        self.update_interval_s = update_interval_s
        self.has_confidence = drafter.confidence_head is not None
        self.trees = self.has_confidence and tree_obstacle(drafter) is None  # trees are priced by the scheduler
        self.start_policy = policy
        self.start_tree = draft_tree if self.trees else "chain"  # the token-tree setting the UI starts on
        self.lock = threading.Lock()
        self._warm = False
        self._token_text: dict[int, str] = {}

    @property
    def default_policy(self) -> str:
        """The policy the UI starts on: ``start_policy`` where this drafter can run it, else ``fixed`` (a drafter
        without a confidence head)."""
        return self.start_policy if self.start_policy in self.policies else "fixed"

    @property
    def policies(self) -> list[str]:
        return list(POLICIES) if self.has_confidence else ["fixed"]

    def decode_token(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.tokenizer.decode([token_id])
        return self._token_text[token_id]

    def encode(self, prompt: str) -> dict:
        if not prompt or not prompt.strip():
            raise ValueError("the prompt is empty")
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                      return_tensors="pt", return_dict=True)
        return self.tokenizer(prompt, return_tensors="pt")

    def policy(self, name: str, num_verify: int, threshold: float) -> VerificationPolicy:
        if name in ("threshold", "scheduler", "hybrid") and not self.has_confidence:
            raise ValueError(f"the {name} policy needs a drafter with a confidence head; use fixed")
        sps = None
        if name in ("scheduler", "hybrid"):
            from .generation import sps_width
            from .profiling import load_or_profile  # measured once per device/dtype/threads, then cached

            sps = load_or_profile(self.target, sps_width(self.drafter), time_budget_s=self.sps_time_budget_s)
        return make_policy(name, num_verify, threshold, self.block_size, sps)

    def _warm_up(self, inputs: dict) -> None:
        """A few tokens each way first, so neither timed run pays one-off start-up costs."""
        if self._warm:
            return
        settings = dict(max_new_tokens=4, do_sample=False)
        with torch.inference_mode():
            self.target.generate(**inputs, **settings)
            self.target.generate(**inputs, **settings, assistant_model=self.drafter)
        self._warm = True

    def run(self, prompt: str, max_new_tokens: int, policy_name: str, threshold: float,
            num_verify: int, draft_tree: str = "chain") -> Iterator[tuple[str, str, str, str, str, str]]:
        """Yields (plain text, plain speed, DSpark text, DSpark speed, draft rounds HTML, summary). ``draft_tree``:
        ``token_tree.DRAFT_TREES``' setting for the run (trees need a policy priced by the SPS profile)."""
        inputs = self.encode(prompt)
        max_new_tokens = int(max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max new tokens must be >= 1, got {max_new_tokens}")
        if draft_tree not in DRAFT_TREES:
            raise ValueError(f"unknown token-tree setting {draft_tree!r}; choose one of {', '.join(DRAFT_TREES)}")
        if draft_tree != "chain" and policy_name not in ("scheduler", "hybrid"):
            raise ValueError(f"token trees are priced by the SPS profile: choose scheduler or hybrid, not "
                             f"{policy_name}")
        settings = dict(max_new_tokens=max_new_tokens, do_sample=False)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        with self.lock:
            yield "", "", "", "", "", "plain generate() runs first, then DSpark"  # the previous run's figures go
            if policy_name in ("scheduler", "hybrid"):
                yield "", "", "", "", "", "measuring the target's speed profile SPS(B) for the scheduler (once, cached)"
            config = self.drafter.generation_config
            saved = getattr(config, "verification_policy", None), getattr(config, "draft_tree", None)
            config.draft_tree = draft_tree  # before the policy: its profile covers a tree's width
            try:
                config.verification_policy = self.policy(policy_name, num_verify, threshold)
                self._warm_up(inputs)
                plain_text, plain_speed, plain = "", "", Progress()
                empty_stats = DSparkStats(block_size=self.block_size)
                for plain in stream_generate(self.target, inputs, settings, interval_s=self.update_interval_s):
                    plain_text = decode(plain.ids)
                    plain_speed = speed_markdown("plain generate()", len(plain.ids), plain.seconds, plain.done)
                    yield plain_text, plain_speed, "", "", "", summary_markdown(empty_stats, None, None, None)
                rows: list[str] = []
                stats = DSparkStats(block_size=self.block_size)
                for dspark in stream_generate(self.target, inputs, settings, drafter=self.drafter,
                                              interval_s=self.update_interval_s):
                    for record in dspark.rounds[stats.rounds:]:
                        stats.add_round(self.block_size, record.verified, record.accepted, record.confidences)
                        rows.append(round_html(record, self.decode_token))
                    identical = dspark.ids == plain.ids if dspark.done else None
                    yield (
                        plain_text, plain_speed, decode(dspark.ids),
                        speed_markdown("DSpark", len(dspark.ids), dspark.seconds, dspark.done),
                        rounds_panel_html(rows),
                        summary_markdown(stats, plain.tokens_per_s, dspark.tokens_per_s if dspark.done else None,
                                         identical),
                    )
            finally:
                config.verification_policy, config.draft_tree = saved


def _import_gradio():
    try:
        import gradio
    except ImportError as err:
        raise ImportError("the demo needs gradio: pip install 'hf-dspark[demo]'") from err
    return gradio


def build_demo(target, tokenizer, drafter, max_new_tokens: int = 128, title: str | None = None,
               update_interval_s: float = UPDATE_INTERVAL_S, drafter_label: str | None = None,
               policy: str = DEFAULT_POLICY, draft_tree: str = "chain"):
    """A ``gr.Blocks`` app: prompt, policy settings, plain vs DSpark streaming side by side, per-round drafts,
    tau and speedup. Any decoder-only target with its tokenizer and a DSpark drafter shaped for it; the UI is
    updated at most every ``update_interval_s`` seconds per run. The policy starts on ``policy`` (``fixed`` for a
    drafter without a confidence head), the token-tree choice on ``draft_tree`` (``chain`` for a drafter that
    cannot grow trees); ``drafter_label`` (e.g. its folder and weights digest) is shown under the title."""
    gr = _import_gradio()

    runner = DemoRunner(target, tokenizer, drafter, update_interval_s=update_interval_s, policy=policy,
                        draft_tree=draft_tree)
    target_name = Path(str(getattr(target.config, "_name_or_path", "") or "target")).name
    name = title or f"DSpark speculative decoding: {target_name}"
    with gr.Blocks(title="hf-dspark demo", analytics_enabled=False) as demo:
        gr.Markdown(f"## {html.escape(name)}\nGreedy decoding with plain `generate()` first, then with the DSpark "
                    f"drafter (block size {runner.block_size}); in float32 the two outputs are identical."
                    + (f"\n\nDrafter: {html.escape(drafter_label)}" if drafter_label else ""))
        prompt, run_button, stop_button = _prompt_row(gr)
        policy, num_verify, threshold, max_tokens, tree = _settings_row(gr, runner, max_new_tokens)
        plain_text, plain_speed, dspark_text, dspark_speed = _output_panels(gr)
        summary = gr.Markdown(elem_id="dspark-summary")
        gr.HTML(legend_html())
        rounds = gr.HTML(elem_id="dspark-rounds")
        inputs = [prompt, max_tokens, policy, threshold, num_verify, tree]
        outputs = [plain_text, plain_speed, dspark_text, dspark_speed, rounds, summary]
        _connect_events(gr, _generate_handler(gr, runner), prompt, run_button, stop_button, inputs, outputs)
    demo.runner = runner
    return demo


def _generate_handler(gr, runner: DemoRunner):
    """The app's ``generate`` event handler: ``runner.run``'s updates, or one message for an empty prompt."""

    def generate(prompt, max_tokens, policy_name, threshold, num_verify, draft_tree="chain"):
        if not (prompt or "").strip():  # one message, in the summary, instead of an error badge on every panel
            yield "", "", "", "", "", EMPTY_PROMPT_MESSAGE
            return
        try:
            yield from runner.run(prompt, max_tokens, policy_name, threshold, num_verify, draft_tree)
        except ValueError as err:
            raise gr.Error(str(err)) from err

    return generate


def _prompt_row(gr):
    """The prompt box beside the Generate and Stop buttons."""
    with gr.Row():
        prompt = gr.Textbox(label="Prompt", lines=3, scale=4,
                            value=DEFAULT_PROMPT, placeholder="Type a prompt")
        with gr.Column(scale=1):
            run_button = gr.Button("Generate", variant="primary", elem_id="generate-button",
                                   interactive=bool(DEFAULT_PROMPT.strip()))
            stop_button = gr.Button("Stop", elem_id="stop-button")
    return prompt, run_button, stop_button


def _settings_row(gr, runner: DemoRunner, max_new_tokens: int):
    """The verification policy, its N and threshold, the number of new tokens and the token-tree setting."""
    policies = runner.policies
    with gr.Row():
        policy = gr.Radio(policies, value=runner.default_policy, label="Verification policy",
                          info="; ".join(POLICY_HELP[p] for p in policies))
        num_verify = gr.Slider(1, runner.block_size, value=runner.block_size, step=1,
                               label="Draft tokens to verify (N)", info="exactly N for fixed, at most N otherwise")
        threshold = gr.Slider(0.0, 1.0, value=0.5, step=0.05, label="Confidence threshold t",
                              interactive=runner.has_confidence)
        max_tokens = gr.Slider(1, max(512, max_new_tokens), value=max_new_tokens, step=1, label="Max new tokens")
        tree = gr.Radio(list(DRAFT_TREES), value=runner.start_tree, label="Token trees", interactive=runner.trees,
                        info=TREE_HELP if runner.trees else "this drafter's sequential head cannot grow trees")
    return policy, num_verify, threshold, max_tokens, tree


def _output_panels(gr):
    """Plain and DSpark-assisted output side by side, each under its speed line."""
    with gr.Row(equal_height=True):
        with gr.Column():
            plain_speed = gr.Markdown(elem_id="plain-speed")
            plain_text = gr.Textbox(label="plain generate()", lines=10, elem_id="plain-output")
        with gr.Column():
            dspark_speed = gr.Markdown(elem_id="dspark-speed")
            dspark_text = gr.Textbox(label="DSpark-assisted generate()", lines=10, elem_id="dspark-output")
    return plain_text, plain_speed, dspark_text, dspark_speed


def _connect_events(gr, generate, prompt, run_button, stop_button, inputs: list, outputs: list) -> None:
    """Generate on the button or Enter, Stop cancelling either, and the button enabled only for a non-empty
    prompt."""
    # One run at a time across sessions: the runs share the models, and timing them side by side needs the CPU.
    events = [
        run_button.click(generate, inputs, outputs, api_name="generate", concurrency_limit=1,
                         concurrency_id="generate"),
        prompt.submit(generate, inputs, outputs, api_name=False, concurrency_limit=1, concurrency_id="generate"),
    ]
    stop_button.click(None, cancels=events)
    prompt.change(lambda text: gr.update(interactive=bool((text or "").strip())), prompt, run_button,
                  api_name=False, queue=False)


def launch_default(host: str = "127.0.0.1", port: int | None = None, drafter: str | None = None,
                   dtype: torch.dtype = torch.float32, max_new_tokens: int = 128, optimize_target: str = "auto",
                   policy: str = DEFAULT_POLICY, draft_tree: str = "chain", **launch_kwargs):
    """Serve the demo on SmolLM2-135M-Instruct with the embedded drafter (or ``drafter``, a folder), the UI starting
    on ``policy`` and ``draft_tree``; blocks until interrupted unless ``prevent_thread_lock=True``. Never shares a public link (the
    demo runs offline). ``optimize_target`` is :func:`hf_dspark.optimize_target`'s mode for the target."""
    from .defaults import load_drafter_for
    from .optimization import optimize_target as optimize
    from .target import load_smollm2

    _import_gradio()
    target, tokenizer = load_smollm2(dtype=dtype)
    optimize(target, optimize_target)
    model, origin = load_drafter_for(target, drafter, dtype=dtype)
    demo = build_demo(target, tokenizer, model, max_new_tokens=max_new_tokens,
                      title="DSpark on SmolLM2-135M-Instruct", drafter_label=drafter_label(origin), policy=policy,
                      draft_tree=draft_tree)
    return demo.launch(server_name=host, server_port=port, share=False, **launch_kwargs)


def drafter_label(origin: str) -> str:
    """``load_drafter_for``'s origin as the demo shows it: the drafter folder's name and its weights digest."""
    path, _, digest = origin.partition(" (weights sha256 ")
    name = Path(path).name if os.sep in path or "/" in path else path
    return name + (f", weights sha256 {digest.rstrip(')')}" if digest else "")


__all__ = ["DemoRunner", "build_demo", "launch_default", "make_policy", "round_html",
           "stream_generate"]
