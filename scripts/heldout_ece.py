"""ECE of STS temperatures on rollouts they were NOT fitted on: the DSpark whole-block rounds that `hf-dspark eval`
stored in its units (raw confidence logits per round), scored raw and with each given sts.json.

    python scripts/heldout_ece.py --eval reports/eval-smollm2-final --temperature 0 \
        --sts v2=reports/calibration-smollm2/sts.json v3=runs/calibrated-dspark-v3/sts.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_dspark.evaluation.metrics import calibration_metrics


def load_rounds(folder: Path, temperature: float, method: str) -> tuple[list, list, list, list[str]]:
    logits, verified, accepted, sets = [], [], [], []
    for path in sorted((folder / "units").glob("quality-*.json")):
        unit = json.loads(path.read_text())
        if unit.get("phase") != "quality" or float(unit.get("temperature", -1)) != temperature:
            continue
        if method not in unit["results"]:
            raise ValueError(f"{path}: no {method!r} results (has {sorted(unit['results'])})")
        for per_domain in unit["results"][method].values():
            logits += per_domain["confidence_logits"]
            verified += per_domain["verified"]
            accepted += per_domain["accepted"]
        sets.append(unit["set"])
    if not verified:
        raise ValueError(f"no quality units at temperature {temperature} under {folder / 'units'}")
    return logits, verified, accepted, sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--eval", required=True, help="hf-dspark eval output folder (with units/)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--method", default="dspark", help="method whose rounds to score (must have confidences)")
    parser.add_argument("--sts", nargs="+", required=True, help="LABEL=path/to/sts.json")
    parser.add_argument("--output", default=None, help="also write the numbers here (JSON)")
    args = parser.parse_args()
    logits, verified, accepted, sets = load_rounds(Path(args.eval), args.temperature, args.method)
    out = {"eval": args.eval, "temperature": args.temperature, "sets": sets, "rounds": len(verified), "ece": {}}
    for spec in args.sts:
        label, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--sts {spec!r}: expected LABEL=path")
        temperatures = json.loads(Path(path).read_text())["temperatures"]
        metrics = calibration_metrics(logits, verified, accepted, temperatures)
        out["ece"].setdefault("raw", metrics["ece_raw"])
        out["ece"][label] = metrics["ece_calibrated"]
        out["num_samples"] = metrics["num_samples"]
    print(f"{len(verified)} rounds ({', '.join(sets)}), T={args.temperature}; ECE per position (%):")
    for label, values in out["ece"].items():
        print(f"  {label:>8}: " + " ".join("  n/a" if v is None else f"{100 * v:5.2f}" for v in values))
    print("  samples : " + " ".join(f"{n:5d}" for n in out["num_samples"]))
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
