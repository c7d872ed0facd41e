"""Hub folders and round trips: the reference (DeepSpec ``Qwen3DSparkModel``) export format that serving engines
read, model cards, ``sts.json``, and pushing a complete drafter folder to the Hugging Face Hub."""

from __future__ import annotations

import json
import re
import tempfile
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from .modeling_dspark import DSparkDrafter
from .training.checkpoints import INIT_CARD, STATE, latest_checkpoint

# Files a push owns: when the new folder lacks one (an uncalibrated drafter has no sts.json, weights changed from
# sharded to single-file), the stale remote copy is deleted in the same commit. Other files in the repo are kept.
MANAGED_REMOTE_FILES = ["*.safetensors", "*.safetensors.index.json", "sts.json", "custom_generate/*"]
DEFAULT_TARGET_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what `hf-dspark train` uses when no --target is given


def export_reference_format(drafter: DSparkDrafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``drafter`` as a reference-format folder: ``config.json`` (Qwen3 copy with ``architectures:
    ["Qwen3DSparkModel"]``, DSpark fields, ``sample_from_anchor`` and ``dflash_config``) and ``model.safetensors``
    with un-prefixed names plus copies of the target's embedding and LM head (the format requires them, so the
    drafter must be attached to its target or loaded from a reference folder)."""
    if drafter.embed_tokens is None or drafter.lm_head is None:
        raise ValueError("export needs the target's embedding and LM head: call drafter.attach_target(target) first")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or drafter.dtype
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in drafter.state_dict().items()}
    tensors["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().to(dtype).contiguous().clone()
    tensors["lm_head.weight"] = drafter.lm_head.weight.detach().to(dtype).contiguous().clone()
    if drafter.draft_vocab is not None:
        # Draft-vocabulary drafters also carry EAGLE-3 style offsets (target id = draft index + d2t[draft index]).
        tensors["draft_vocab"] = drafter.draft_vocab.detach().clone()
        tensors["d2t"] = (drafter.draft_vocab - torch.arange(drafter.draft_vocab.numel())).detach().clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = drafter.config.to_reference_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


# --------------------------------------------------------------------------------------------------------------
# Model cards
# --------------------------------------------------------------------------------------------------------------
MODEL_CARD_TEMPLATE = Path(__file__).resolve().parent / "model_card.md.jinja"  # package data: works from a wheel


def render_model_card(drafter: DSparkDrafter, *, name: str, repo_id: str, target_name: str, training_text: str,
                      evaluation_text: str, template: str | Path | None = None) -> str:
    """The model card: ``huggingface_hub``'s ``ModelCardData`` metadata (``{{ card_data }}`` in the template) and the
    template rendered with the drafter's config and the given training / evaluation texts."""
    from huggingface_hub import ModelCard, ModelCardData

    path = Path(template) if template else MODEL_CARD_TEMPLATE
    if not path.is_file():
        raise FileNotFoundError(f"model card template not found: {path}")
    data = ModelCardData(library_name="transformers", license="apache-2.0", base_model=target_name,
                         tags=["speculative-decoding", "dspark", "hf-dspark"], pipeline_tag="text-generation")
    card = ModelCard.from_template(
        data, template_path=str(path), name=name, repo_id=repo_id, target_name=target_name, config=drafter.config,
        num_parameters=sum(p.numel() for p in drafter.parameters()), training_text=training_text,
        evaluation_text=evaluation_text,
    )
    return f"{card}\n"  # jinja drops the template's final newline


def load_report(path: str | Path) -> dict:
    """Read an evaluation report JSON (``hf-dspark eval`` report.json or ``hf-dspark bench --output``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"evaluation report not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"evaluation report {path} is not valid JSON: {err}") from None


def evaluation_text(report: dict | None) -> str:
    """The model card's evaluation section, computed from an evaluation report (never typed by hand).

    Reads the ``hf-dspark eval`` ``report.json`` (schema ``hf-dspark-eval-v1``) or the ``hf-dspark bench --output``
    format: ``{"settings": {...}, "results": {"report": {group: {method: {tokens_per_s, speedup,
    accepted_length?}}}}}``."""
    if report is None:
        return "Not evaluated yet."
    if isinstance(report, dict) and report.get("schema") == "hf-dspark-eval-v1":
        return _eval_report_text(report)
    results = report.get("results") if isinstance(report, dict) else None
    if not isinstance(results, dict) or not isinstance(results.get("report"), dict) or "settings" not in report:
        raise ValueError("unrecognised evaluation report: expected the `hf-dspark bench --output` JSON "
                         "(keys 'settings' and 'results.report')")
    settings = report["settings"]
    threads = f", {settings['threads']} CPU threads" if settings.get("threads") else ""
    lines = [f"`hf-dspark bench` ({settings['num_prompts']} prompts per set, {settings['max_new_tokens']} new tokens, "
             f"temperature {settings['temperature']}, {settings['dtype']}{threads}); speed is the ratio to plain "
             "`generate()` in the same run.", "",
             "| method | group | tau | tokens/s | speedup |", "|---|---|---|---|---|"]
    for group, per_method in sorted(results["report"].items()):
        for method, r in per_method.items():
            tau = f"{r['accepted_length']:.2f}" if "accepted_length" in r else "1 (plain)"
            lines.append(f"| {method} | {group} | {tau} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def _eval_report_text(report: dict) -> str:
    s, env = report["settings"], report["environment"]
    lines = [f"`hf-dspark eval` ({s['num_prompts']} prompts per set for acceptance, {s['speed_prompts']} for speed, "
             f"up to {s['max_new_tokens']} new tokens, {report['models'].get('dtype', '?')}, {env['cpu']} with "
             f"{env['torch_threads']} torch threads). tau = accepted length incl. the bonus token, whole block "
             "verified; speed = ratio to plain `generate()` in the same run."]
    if report.get("missing"):
        lines.append(f"(Incomplete report: {len(report['missing'])} units not run.)")
    for t, entry in report["temperatures"].items():
        acc = entry.get("acceptance")
        if acc:
            methods = list(acc["all"])
            lines += ["", f"Temperature {t}: accepted length tau", "",
                      "| group | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
            for group, per in [*acc["sets"].items(), *((f"domain: {d}", v) for d, v in acc["domains"].items())]:
                lines.append(f"| {group} | " + " | ".join(f"{per[m]['accepted_length']:.2f}" if m in per else "-"
                                                          for m in methods) + " |")
            lines.append("| macro | " + " | ".join(f"{acc['macro'][m]['accepted_length']:.2f}" for m in methods) + " |")
        speed = entry.get("speed")
        if speed:
            lines += ["", f"Temperature {t}: speed vs plain `generate()`", "", "| method | tokens/s | speedup |",
                      "|---|---|---|"]
            for m, r in speed["all"].items():
                lines.append(f"| {m} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def training_text(run: str | Path) -> str:
    """The model card's training section from a training run folder (``hf-dspark train --output``): the regenerated
    data (sampling settings, prompt sets), the budget and the final losses. Shard paths in the trainer state are
    resolved like the trainer saw them (relative to the folder training ran in)."""
    run = Path(run)
    checkpoint, log_path = latest_checkpoint(run), run / "train_log.jsonl"
    if checkpoint is None or not log_path.is_file():
        raise FileNotFoundError(f"{run} is not a training run folder (needs a complete checkpoint-*/{STATE} and "
                                "train_log.jsonl)")
    state_path = checkpoint / STATE
    state = json.loads(state_path.read_text(encoding="utf-8"))
    args = state["args"]
    with open(log_path, encoding="utf-8") as f:
        last = json.loads(f.read().strip().splitlines()[-1])
    data = _data_text(state, state_path)
    weights = args["loss_weights"]
    sequences = args["batch_size"] * args.get("gradient_accumulation_steps", 1)
    budget = (f"{state['step']} steps x {sequences} sequences, {args['num_anchors']} anchors per sequence, "
              f"block {args['block_size']}, lr {args['learning_rate']} (warmup {args['warmup_ratio']:.0%}, cosine), "
              f"{last['elapsed_s'] / 60:.0f} min of training")
    label = ("; confidence labels: greedy acceptance (draft argmax = target argmax)"
             if args.get("confidence_target") == "greedy" else "")
    final = (f"final: loss {last['loss']:.3f}, CE {last['ce']:.3f}, TV(L1) {last['tv']:.3f}, "
             f"confidence {last.get('confidence', float('nan')):.3f}, block accuracy {last['accuracy']:.3f}")
    init = Path(args["init_drafter"]) if args.get("init_drafter") else None
    base_run = _run_folder(init) if init is not None else None
    if args.get("train_modules") and base_run is not None:
        # a fine-tune of some modules: the card describes the drafter it started from, then this stage
        modules = ", ".join(f"`{m}`" for m in args["train_modules"])
        return (training_text(base_run) + f"\n- Then {modules} alone was fine-tuned (everything else "
                f"frozen) on {data}; {budget}{label}; {final}.")
    lines = [
        f"- Data: {data}.",
        f"- Budget: {budget}.",
        f"- Losses (weights {weights['ce']} CE / {weights['tv']} TV / {weights['confidence']} confidence, decay gamma "
        f"{args['gamma']}{label}); {final}.",
    ]
    if args.get("train_modules"):
        lines.append(f"- Trained modules: {', '.join(args['train_modules'])} (the rest frozen).")
    if init is not None:
        lines.append(_warm_start_text(init, run, own_final=final))
    return "\n".join(lines)


def _data_text(state: dict, state_path: Path) -> str:
    """The card's description of a run's regenerated data: sampling settings, turns, shards, prompt sets."""
    shards = [Path(s) for s in state["shards"]]
    missing = [str(s) for s in shards if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"training shards listed in {state_path} not found (run this from the folder "
                                f"training ran in): {missing[:3]}")
    sets: Counter = Counter()
    for shard in shards:
        with open(shard, encoding="utf-8") as f:
            sets.update(json.loads(line).get("set", "unknown") for line in f if line.strip())
    sampling = {}
    for data_dir in state["args"]["data_dirs"]:
        manifest = Path(data_dir) / "manifest.json"
        if manifest.is_file():
            sampling = json.loads(manifest.read_text(encoding="utf-8"))["settings"]
    how = (f" (temperature {sampling['temperature']}, top-p {sampling['top_p']}, up to {sampling['max_new_tokens']} "
           "new tokens)") if sampling else ""
    return (f"the target's own responses{how} to {sum(sets.values())} conversation turns from {len(shards)} shards; "
            f"prompt sets: {', '.join(f'{name} ({n})' for name, n in sets.most_common())}")


def _run_folder(drafter: Path) -> Path | None:
    """The training run folder a drafter folder came from (its parent, for ``<run>/drafter``), if it is at hand."""
    parent = drafter.parent if drafter.name == "drafter" else drafter
    return parent if latest_checkpoint(parent) is not None else None


def _warm_start_text(init: Path, run: Path, own_final: str | None = None) -> str:
    """A card line for the run folder ``run`` that started from an earlier drafter (``hf-dspark train
    --init-drafter``), with that drafter's own budget when its run folder (the drafter's parent) is at hand, or else
    its card's training section (a packaged drafter, e.g. the embedded one a new round continued): the copy the run
    kept when it started, else the card in that folder now."""
    parent = _run_folder(init)
    if parent is None:
        kept = run / INIT_CARD
        section = _card_training_section(kept if kept.is_file() else init / "README.md")
        if section is None:
            return (f"- Initialised from the drafter `{init}` (neither its run folder nor a model card with a "
                    "training section was found, so its budget is not listed).")
        if own_final is not None and own_final in section:
            # packaging a run over the folder it started from, a second time: that card already describes this run
            raise ValueError(f"the card of {init} (this run's starting drafter) already describes this run; package "
                             "it from the starting drafter's original card (e.g. restore that folder from git)")
        quoted = "\n".join(f"  {line}" if line.strip() else line for line in section.splitlines())
        return (f"- Initialised from the packaged drafter `{init}` as it stood when this run started, itself trained "
                f"as follows:\n{quoted}")
    state = json.loads((latest_checkpoint(parent) / STATE).read_text(encoding="utf-8"))
    args = state["args"]
    sequences = args["batch_size"] * args.get("gradient_accumulation_steps", 1)
    text = (f"- Initialised from an earlier drafter (`{init}`: {state['step']} steps x {sequences} sequences, "
            f"{args['num_anchors']} anchors per sequence, {len(state['shards'])} shards, lr {args['learning_rate']}).")
    if args.get("init_drafter"):
        text += "\n" + _warm_start_text(Path(args["init_drafter"]), parent)
    return text


def _card_training_section(card: Path) -> str | None:
    """The "Training" section of a model card file, if the file exists and has one."""
    return _card_section(card.read_text(encoding="utf-8"), "Training") if card.is_file() else None


def _source_folder(drafter: DSparkDrafter) -> Path | None:
    """The local folder the drafter was loaded from, if any (its card and sts.json describe these weights)."""
    path = Path(drafter.name_or_path) if drafter.name_or_path else None
    return path if path is not None and path.is_dir() else None


def _card_section(text: str, title: str) -> str | None:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    return match.group(1).strip() if match else None


def sts_payload(drafter: DSparkDrafter) -> dict | None:
    """``sts.json`` for a calibrated drafter (``config.confidence_temperatures`` set), else None. The calibration
    metadata written by ``hf-dspark calibrate`` is kept when the source folder's sts.json has the same temperatures;
    without it the file carries the temperatures alone."""
    temperatures = drafter.config.confidence_temperatures
    if not temperatures:
        return None
    source = _source_folder(drafter)
    if source is not None and (source / "sts.json").is_file():
        saved = json.loads((source / "sts.json").read_text(encoding="utf-8"))
        if saved.get("temperatures") == list(temperatures):
            return saved
    return {"temperatures": list(temperatures)}


def write_hub_folder(drafter: DSparkDrafter, folder: str | Path, *, repo_id: str, target_name: str | None = None,
                     report: dict | None = None, training: str | None = None, name: str | None = None,
                     template: str | Path | None = None, max_shard_size: int | str | None = None) -> Path:
    """Write the complete Hub folder of ``drafter``: ``save_pretrained`` (weights, config with ``auto_map``, code
    files, ``custom_generate/``), ``sts.json`` when calibrated, and a ``README.md`` model card.

    The card's target, training and evaluation sections come from the arguments (``report``: an evaluation report,
    see ``evaluation_text``; ``training``: markdown, e.g. ``training_text(run)``); what is not given is carried over
    from the card of the folder the drafter was loaded from."""
    folder = Path(folder)
    source = _source_folder(drafter)
    card = None
    if source is not None and (source / "README.md").is_file():
        from huggingface_hub import ModelCard

        card = ModelCard.load(source / "README.md")
    target_name = target_name or (card.data.base_model if card is not None else None)
    if not target_name:
        raise ValueError("the model card needs the target model's Hub id: pass target_name (--target-name)")
    if training is None:
        training = (_card_section(card.text, "Training") if card is not None else None) or (
            "Not recorded with this drafter.")
    if report is not None or card is None:
        evaluation = evaluation_text(report)
    else:
        evaluation = _card_section(card.text, "Evaluation") or evaluation_text(None)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    drafter.save_pretrained(folder, **kwargs)
    sts = sts_payload(drafter)
    if sts is not None:
        (folder / "sts.json").write_text(json.dumps(sts, indent=2) + "\n", encoding="utf-8")
    text = render_model_card(drafter, name=name or repo_id.split("/")[-1], repo_id=repo_id, target_name=target_name,
                             training_text=training, evaluation_text=evaluation, template=template)
    (folder / "README.md").write_text(text, encoding="utf-8")
    return folder


# --------------------------------------------------------------------------------------------------------------
# Push
# --------------------------------------------------------------------------------------------------------------
def push_drafter(drafter: DSparkDrafter, repo_id: str, *, revision: str | None = None, private: bool | None = None,
                 token: str | bool | None = None, commit_message: str | None = None,
                 commit_description: str | None = None, create_pr: bool = False, endpoint: str | None = None,
                 report: dict | None = None, training: str | None = None, target_name: str | None = None,
                 max_shard_size: int | str | None = None):
    """Push the complete Hub folder of ``drafter`` (see ``write_hub_folder``) to ``repo_id`` in one commit, creating
    the repo (and the ``revision`` branch, from the default branch) if needed. Returns huggingface_hub's
    ``CommitInfo``. A missing or rejected token raises ``PermissionError`` naming the problem."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="dspark-push-") as folder:
        write_hub_folder(drafter, folder, repo_id=repo_id, target_name=target_name, report=report,
                         training=training, max_shard_size=max_shard_size)
        try:
            repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
            if revision is not None and revision != "main":
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            return api.upload_folder(
                repo_id=repo_id, folder_path=folder, revision=revision, create_pr=create_pr,
                commit_message=commit_message or "Upload DSpark drafter", commit_description=commit_description,
                delete_patterns=MANAGED_REMOTE_FILES,
            )
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else None
            if status not in (401, 403):
                raise
            from huggingface_hub import get_token

            if token is False or (token is None and get_token() is None):
                problem = "no Hub token: pass --token or set HF_TOKEN (a token with write access)"
            else:
                problem = "the token was rejected or lacks write access to this repo: check --token / HF_TOKEN"
            raise PermissionError(f"cannot push to {repo_id} on {api.endpoint} (HTTP {status}): {problem}") from None
