"""Package a trained drafter as a compact Hub-style folder with a model card generated from its logs and reports.

The folder gets the package's code as any written folder does; under ``hf_dspark/drafters/`` git ignores those copies
and the wheel leaves them out, since the embedded drafters load through the package.

    python scripts/package_drafter.py --run runs/smollm2-dspark --drafter runs/calibrated-dspark \
        --output hf_dspark/drafters/smollm2-135m-instruct-dspark --name smollm2-135m-instruct-dspark \
        --report reports/eval-smollm2-v6/report.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import hf_dspark  # noqa: F401
from hf_dspark import DSparkDrafter
from hf_dspark.hub import load_report, training_text, write_hub_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="training run folder (the card's training section)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--report", default=None, help="hf-dspark eval report.json (or bench JSON) for the card")
    parser.add_argument("--drafter", default=None, help="drafter folder, e.g. a calibrated copy (default: <run>/drafter)")
    parser.add_argument("--verification-policy", default=None,
                        help="the packaged generation_config's policy (default: hybrid for a drafter with a confidence "
                             "head, else the drafter's own); the DFlash ablation keeps 'fixed', the whole block")
    args = parser.parse_args()
    run = Path(args.run)
    drafter = DSparkDrafter.from_pretrained(args.drafter or run / "drafter", dtype=torch.float32)
    drafter = drafter.to(torch.bfloat16)  # compact: the card and tests use the bf16 weights
    drafter.config.dtype = torch.bfloat16
    if args.verification_policy is not None:
        drafter.generation_config.verification_policy = args.verification_policy
    elif drafter.confidence_head is not None:  # the fast default: drafter block or prompt lookup, priced per round
        drafter.generation_config.verification_policy = "hybrid"
    write_hub_folder(drafter, args.output, repo_id=f"hf-dspark/{args.name}", name=args.name,
                     target_name="HuggingFaceTB/SmolLM2-135M-Instruct", training=training_text(run),
                     report=load_report(args.report) if args.report else None)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
