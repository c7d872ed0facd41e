"""Package a trained drafter as a compact Hub-style folder with a model card generated from its logs and reports.

    python scripts/package_drafter.py --run runs/smollm2-dspark --output hf_dspark/drafters/smollm2-135m-instruct-dspark \
        --bench runs/bench-fp32.json --name smollm2-135m-instruct-dspark
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import hf_dspark  # noqa: F401
from hf_dspark import DSparkDrafter
from hf_dspark.hub import evaluation_text, load_report, render_model_card, training_text


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
                             evaluation_text=evaluation_text(load_report(args.bench) if args.bench else None))
    (output / "README.md").write_text(card, encoding="utf-8")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
