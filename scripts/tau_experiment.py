"""What buys tau fastest: more steps, more data, or more drafter? One controlled experiment, the same wall-clock
budget per arm, all arms starting from the shipped DSpark drafter, read on the held-out proxy the trainer logs
(teacher-forced tau on data/regen-smollm2-heldout, the same 64 sequences and anchors at every evaluation).

    python scripts/tau_experiment.py run [--budget-s 3600] [--output runs/tau-experiment] [--features DIR]
    python scripts/tau_experiment.py table [--output runs/tau-experiment]

Arms (`--arms` picks some; all by default):
  steps        the control: more steps on the shipped drafter's own data (data/regen-smollm2, -b, -c)
  greedy-data  that data plus data/regen-smollm2-d: greedy (temperature 0) regenerations of training prompts no
               earlier round used, the decoding users run; its regeneration time counts against the arm
  capacity     the shipped drafter grown by one layer (`--add-layers 1`: starts as the same function) on its own data

`scripts/acceptance_caps.py` measured first which of these can move tau: the shipped drafter matches the target
far better on its training turns than on held-out ones (data-bound), and the draft vocabulary's ceiling lies far
above today's tau.

The budget becomes steps per arm from a short probe of each arm's seconds per step (written once to plan.json, so a
restarted experiment keeps its plan; another --budget-s re-plans from the stored probes). Each arm is evaluated at
its start, half-way and its end. Every arm is an ordinary `hf-dspark train` run: re-running `run` after an
interruption resumes the unfinished arm from its last checkpoint and skips finished ones. Run it detached
(`setsid ... > log 2>&1 &`) and pause it (kill -STOP / -CONT) while anything is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hf_dspark.training.trainer import seconds_per_step  # noqa: E402
SHIPPED = "hf_dspark/drafters/smollm2-135m-instruct-dspark"
OWN_DATA = ["data/regen-smollm2", "data/regen-smollm2-b", "data/regen-smollm2-c"]
NEW_DATA = "data/regen-smollm2-d"
ARMS = {
    "steps": {"data": OWN_DATA, "extra": []},
    "greedy-data": {"data": OWN_DATA + [NEW_DATA], "extra": [], "made": NEW_DATA},
    "capacity": {"data": OWN_DATA, "extra": ["--add-layers", "1"]},
}


def data_seconds(arm: str) -> float:
    """Seconds its new data took to make (the regeneration's own log, summed over its workers), 0 for none."""
    folder = ARMS[arm].get("made")
    log = REPO / folder / "progress.log" if folder else None
    if log is None or not log.is_file():
        return 0.0
    total, last = 0.0, {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        worker = entry.get("worker", 0)
        if entry["elapsed_s"] < last.get(worker, 0.0):  # a restarted job counts its seconds from zero again
            total += last[worker]
        last[worker] = entry["elapsed_s"]
    return total + sum(last.values())
# Steps per probe: step times vary with the batch's sequence lengths, and the first step warms up; the arms on the
# same data see the same batches, so their probes differ by what the arm costs, not by the data drawn.
PROBE_STEPS = 12


def train_command(arm: str, output: Path, steps: int, args, eval_every: int | None = None) -> list[str]:
    command = [sys.executable, "-c", "import sys; from hf_dspark.cli import main; sys.exit(main())", "train",
               "--data", *ARMS[arm]["data"], "--init-drafter", SHIPPED, "--output", str(output),
               "--max-length", "512", "--batch-size", "4", "--num-anchors", "64", "--max-steps", str(steps),
               "--lr", "5e-4", "--save-every", "20", "--log-every", "2", "--threads", str(args.threads),
               "--confidence-target", "greedy", *ARMS[arm]["extra"]]
    if args.features:
        command += ["--features", args.features]
    if eval_every is not None:
        command += ["--eval-data", "data/regen-smollm2-heldout", "--eval-every", str(eval_every),
                    "--eval-sequences", "64"]
    return command


def run_train(command: list[str], log_file: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    with open(log_file, "a", encoding="utf-8") as log:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[3:6])}... failed (exit {done.returncode}); see {log_file}")


def plan(args, output: Path) -> dict:
    path = output / "plan.json"
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored["budget_s"] != args.budget_s:
            # A new budget re-plans from the stored probes; an arm already started with other steps is refused by
            # the trainer's resume check (delete its folder to restart it).
            stored["budget_s"] = args.budget_s
            stored["steps"] = {arm: max(1, int(args.budget_s / s)) for arm, s in stored["s_per_step"].items()}
            path.write_text(json.dumps(stored, indent=2))
        return stored
    probes = {}
    for arm in args.arms:
        probe = output / f"probe-{arm}"
        shutil.rmtree(probe, ignore_errors=True)
        run_train(train_command(arm, probe, PROBE_STEPS, args), output / "experiment.log")
        probes[arm] = seconds_per_step(probe)[0]
        shutil.rmtree(probe)
        print(f"probe {arm}: {probes[arm]:.2f} s/step", flush=True)
    steps = {arm: max(1, int(args.budget_s / s)) for arm, s in probes.items()}
    result = {"budget_s": args.budget_s, "s_per_step": probes, "steps": steps, "threads": args.threads,
              "features": args.features}
    path.write_text(json.dumps(result, indent=2))
    return result


def run(args) -> int:
    output = Path(args.output).resolve()
    output.mkdir(parents=True, exist_ok=True)
    chosen = plan(args, output)
    print(f"plan: {chosen['steps']} steps for {chosen['budget_s']:.0f} s per arm", flush=True)
    for arm, steps in chosen["steps"].items():
        if arm not in args.arms:
            continue
        run_dir = output / arm
        if (run_dir / "drafter" / "config.json").is_file():
            continue
        run_train(train_command(arm, run_dir, steps, args, eval_every=max(1, -(-steps // 2))), output / "experiment.log")
        print(f"{arm}: done", flush=True)
    return table(args)


def table(args) -> int:
    output = Path(args.output).resolve()
    chosen = json.loads((output / "plan.json").read_text())
    print("| arm | steps | s/step | data CPU-h | held-out tau at start | at the end | change | per CPU-hour |")
    print("|---|---|---|---|---|---|---|---|")
    for arm in chosen["steps"]:
        made = data_seconds(arm) / 3600
        evals = output / arm / "eval_log.jsonl"
        if not evals.is_file():
            print(f"| {arm} | {chosen['steps'][arm]} | {chosen['s_per_step'][arm]:.2f} | {made:.2f} | not run yet "
                  "| | | |")
            continue
        entries = [json.loads(line) for line in open(evals)]
        start, end = entries[0], entries[-1]
        finished = "" if end["step"] == chosen["steps"][arm] else f" (step {end['step']})"
        change = end["eval_accepted_length"] - start["eval_accepted_length"]
        # CPU-hours: the training's wall clock on its threads, plus the data's regeneration
        hours = end["step"] * chosen["s_per_step"][arm] * chosen["threads"] / 3600 + made
        print(f"| {arm} | {chosen['steps'][arm]} | {chosen['s_per_step'][arm]:.2f} | {made:.2f} | "
              f"{start['eval_accepted_length']:.3f} | {end['eval_accepted_length']:.3f}{finished} | "
              f"{change:+.3f} | {change / hours if hours else float('nan'):+.3f} |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "table"])
    parser.add_argument("--budget-s", type=float, default=3600.0, help="training seconds per arm")
    parser.add_argument("--output", default="runs/tau-experiment")
    parser.add_argument("--features", default=None, help="cached target features of all arms' data (optional)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms to run")
    args = parser.parse_args(argv)
    return run(args) if args.command == "run" else table(args)


if __name__ == "__main__":
    raise SystemExit(main())
