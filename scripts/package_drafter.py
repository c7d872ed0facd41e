"""Package a trained drafter as a compact Hub-style folder with a model card generated from its logs and reports.

    python scripts/package_drafter.py --run runs/smollm2-dspark --output hf_dspark/drafters/smollm2-135m-instruct-dspark \
        --bench runs/bench-fp32.json --name smollm2-135m-instruct-dspark
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import hf_dspark  # noqa: F401
from hf_dspark import DSparkDrafter
from hf_dspark.hub import render_model_card


def training_text(run: Path) -> str:
    state = json.loads((run / "checkpoint-last" / "trainer_state.json").read_text())
    args = state["args"]
    log = [json.loads(line) for line in open(run / "train_log.jsonl")]
    last = log[-1]
    shards = state["shards"]
    sequences = sum(sum(1 for _ in open(s)) for s in shards if Path(s).exists())
    return "\n".join([
        f"- Data: SmolLM2-135M-Instruct's own responses (temperature 0.2, top-p 0.9, up to 256 new tokens) to "
        f"{sequences} conversation turns from {len(shards)} shards of the shuffled training prompt mix "
        "(alpaca-libre, GPTeacher roleplay/codegen, hh-rlhf harmless, GSM8K train, MATH train, MBPP 601-974).",
        f"- Budget: {state['step']} steps x {args['batch_size']} sequences, {args['num_anchors']} anchors per "
        f"sequence, block {args['block_size']}, lr {args['learning_rate']} (warmup {args['warmup_ratio']:.0%}, "
        f"cosine), on a 2-core CPU ({last['elapsed_s'] / 60:.0f} min of training after the data steps).",
        f"- Losses (paper weights 0.1 CE / 0.9 TV / 1.0 confidence, decay gamma {args['gamma']}); final: "
        f"loss {last['loss']:.3f}, CE {last['ce']:.3f}, TV(L1) {last['tv']:.3f}, confidence "
        f"{last.get('confidence', float('nan')):.3f}, block accuracy {last['accuracy']:.3f}.",
        "- Recipe: `scripts/train_smollm2.sh`.",
    ])


def evaluation_text(bench: Path | None) -> str:
    if bench is None:
        return "Not evaluated yet."
    payload = json.loads(bench.read_text())
    settings = payload["settings"]
    lines = [f"`hf-dspark bench` ({settings['num_prompts']} prompts per set, {settings['max_new_tokens']} new tokens, "
             f"temperature {settings['temperature']}, {settings['dtype']}, 2-core CPU); speed is the ratio to plain "
             "`generate()` in the same run.", "",
             "| method | group | tau | tokens/s | speedup |", "|---|---|---|---|---|"]
    for group, per_method in sorted(payload["results"]["report"].items()):
        for method, r in per_method.items():
            tau = f"{r['accepted_length']:.2f}" if "accepted_length" in r else "1 (plain)"
            lines.append(f"| {method} | {group} | {tau} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--bench", default=None)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: <run>/drafter)")
    args = parser.parse_args()
    run = Path(args.run)
    drafter = DSparkDrafter.from_pretrained(args.drafter or run / "drafter", dtype=torch.float32)
    drafter = drafter.to(torch.bfloat16)
    drafter.config.dtype = torch.bfloat16
    output = Path(args.output)
    drafter.save_pretrained(output)
    card = render_model_card(drafter, name=args.name, repo_id=f"hf-dspark/{args.name}",
                             target_name="HuggingFaceTB/SmolLM2-135M-Instruct", training_text=training_text(run),
                             evaluation_text=evaluation_text(Path(args.bench) if args.bench else None))
    (output / "README.md").write_text(card, encoding="utf-8")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
