"""Training throughput of `hf-dspark train`: steps and blocks per second with the shipped round's settings (cached
target features, 4 sequences x 64 anchors, the shipped drafter as the start), for this checkout and, with --base,
for another git revision run the same way on the same data, alternating runs (A B A B ...) so drift on a shared
machine hits both alike.

    python scripts/bench_training.py --data DIR --features DIR [--base REV] [--steps 12] [--repeats 2]
        [--base-args "..."] [-- further train arguments]

Each run trains --steps steps from the same start; the time per step is read from the run's own train_log.jsonl
(`elapsed_s`, the trainer's clock, which leaves out loading) between the first and the last log line, so the first
(warm-up) steps do not count. Blocks per step are the nominal batch_size x num_anchors (the revision under test may
not log its kept blocks). Prints one line per run and the ratio of medians; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hf_dspark.training.trainer import seconds_per_step  # noqa: E402


def run_once(source: Path, args, output: Path, extra: list[str]) -> dict:
    command = [sys.executable, "-c", "import sys; from hf_dspark.cli import main; sys.exit(main())", "train",
               "--data", *args.data, "--features", args.features, "--init-drafter", args.drafter,
               "--output", str(output), "--max-length", "512", "--batch-size", str(args.batch_size),
               "--num-anchors", str(args.num_anchors), "--max-steps", str(args.steps), "--lr", "5e-4",
               "--save-every", "100000", "--log-every", "2", "--threads", str(args.threads),
               "--confidence-target", "greedy", *extra]
    env = {**os.environ, "PYTHONPATH": str(source), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"training in {source} failed:\n{done.stderr[-3000:]}")
    if sum(1 for _ in open(output / "train_log.jsonl")) < 2:
        raise SystemExit(f"{output}: fewer than two log lines; raise --steps")
    seconds, last = seconds_per_step(output)
    return {"s_per_step": seconds, "blocks_per_s": args.batch_size * args.num_anchors / seconds,
            "logged_blocks_per_s": last.get("blocks_per_s"),
            "split": {k[5:]: last[k] for k in last if k.startswith("time_")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help="regenerated-data folder(s) to train on")
    parser.add_argument("--features", required=True, help="their cached target features (hf-dspark features)")
    parser.add_argument("--drafter", default=str(ROOT / "hf_dspark/drafters/smollm2-135m-instruct-dspark"))
    parser.add_argument("--base", default=None, help="a git revision to measure the same way (e.g. HEAD~3)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-anchors", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the runs and the ratio here")
    parser.add_argument("--base-args", default=None,
                        help="the base revision's further train arguments, as one string (default: the same as "
                             "this checkout's, e.g. --base-args='' when the base lacks a flag)")
    parser.add_argument("extra", nargs="*", help="further `hf-dspark train` arguments (after --)")
    args = parser.parse_args()
    args.data = [str(Path(d).resolve()) for d in args.data]
    args.features, args.drafter = str(Path(args.features).resolve()), str(Path(args.drafter).resolve())
    work = Path(tempfile.mkdtemp(prefix="bench-training-"))
    sources = {"this checkout": ROOT}
    try:
        if args.base:
            base = work / "base"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(base), args.base],
                           check=True, capture_output=True)
            sources = {f"base {args.base}": base, **sources}
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        extras = {name: args.extra for name in sources}
        if args.base and args.base_args is not None:
            extras[f"base {args.base}"] = shlex.split(args.base_args)
        for repeat in range(args.repeats):
            for name, source in sources.items():
                result = run_once(source, args, work / f"run-{len(runs[name])}-{name.split()[0]}", extras[name])
                runs[name].append(result)
                split = " ".join(f"{k} {100 * v:.0f}%" for k, v in result["split"].items())
                print(f"{name:>20s} run {repeat}: {result['s_per_step']:.2f} s/step, "
                      f"{result['blocks_per_s']:.1f} blocks/s {split}", flush=True)
        medians = {name: statistics.median(r["blocks_per_s"] for r in rs) for name, rs in runs.items()}
        summary = {"runs": runs, "median_blocks_per_s": medians, "settings": vars(args)}
        if args.base:
            ratio = medians["this checkout"] / medians[f"base {args.base}"]
            summary["speedup"] = ratio
            print(f"this checkout / base {args.base}: {ratio:.2f}x blocks per second (medians of {args.repeats})")
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    finally:
        if args.base:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "base")],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
