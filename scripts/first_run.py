"""What a newcomer waits for, timed from a fresh clone: `./scripts/run.sh` until its first generated text, `hf-dspark
serve` until it says ready and then until its first chat completion, and `hf-dspark --help` and a refused flag.

    python scripts/first_run.py --output reports/first-run.md

The repository is cloned (its committed HEAD) into a temporary folder with an empty model cache
(``HF_DSPARK_CACHE``), so the environment, the GGUF conversion, the optimisation verdict and both SPS profiles are
all made the first time, as on a new machine; package downloads may come from this machine's pip/uv caches. Run it on
a quiet machine: it times the first run, and anything else running slows it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEPARATOR = b"-" * 60  # what `hf-dspark generate` prints before the streamed text


def cpu_flags_note() -> str:
    """The flags that decide which kernels and dtypes run fast here (the verification forward's cost)."""
    from hf_dspark.cpu_features import cpu_flags

    kept = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in cpu_flags()]
    return ", ".join(kept) if kept else "no AVX2"


def timed_lines(command: list[str], cwd: Path, env: dict, until: bytes | None = None,
                timeout: float = 900.0) -> tuple[list[tuple[float, str]], float | None, int]:
    """Runs ``command``, stdout and stderr merged; returns each line with its second since the start, the second the
    first output after ``until`` appeared (None without it), and the exit status."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, pending, seen_until, first_after = [], b"", until is None, None
    while True:
        chunk = process.stdout.read1(4096)
        now = time.perf_counter() - started
        if not chunk:
            break
        if now > timeout:
            process.kill()
            raise TimeoutError(f"{' '.join(command)} ran past {timeout:.0f} s")
        pending += chunk
        if seen_until and first_after is None and until is not None:
            first_after = now
        if not seen_until and until in pending:
            seen_until = True
            if pending.split(until, 1)[1].strip():
                first_after = now
        *complete, pending = pending.split(b"\n")
        lines.extend((now, line.decode(errors="replace")) for line in complete)
    if pending:
        lines.append((time.perf_counter() - started, pending.decode(errors="replace")))
    return lines, first_after, process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_serve(clone: Path, env: dict, timeout: float = 900.0) -> dict:
    """Starts `hf-dspark serve` and returns the seconds until it said ready and until its first chat completion."""
    port = free_port()
    started = time.perf_counter()
    process = subprocess.Popen([str(clone / ".venv/bin/hf-dspark"), "serve", "--port", str(port)], cwd=clone, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        ready = None
        while ready is None:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError("serve exited before it was ready:\n" + "".join(lines[-20:]))
            lines.append(line.decode(errors="replace"))
            if "ready after" in lines[-1]:
                ready = time.perf_counter() - started
            if time.perf_counter() - started > timeout:
                raise TimeoutError("serve did not get ready")
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 64, "temperature": 0,
                           "messages": [{"role": "user", "content": "Write a Python function that returns the "
                                         "factorial of n."}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        sent = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as answer:
            reply = json.loads(answer.read())
        completed = time.perf_counter() - sent
    finally:
        process.terminate()
        process.wait(30)
    return {"ready_s": ready, "first_completion_s": completed,
            "completion_tokens": reply["usage"]["completion_tokens"],
            "log": [line.rstrip() for line in lines if line.startswith("hf-dspark serve")]}


def best_time(command: list[str], cwd: Path, env: dict, repeats: int = 3) -> tuple[float, int]:
    best, status = float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        status = subprocess.run(command, cwd=cwd, env=env, capture_output=True).returncode
        best = min(best, time.perf_counter() - started)
    return best, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="write the Markdown report here (default: stdout only)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary clone")
    parser.add_argument("--commit", default="HEAD", help="the commit to time (an older one gives the baseline)")
    parser.add_argument("--no-serve", action="store_true", help="time run.sh, --help and a refusal only (a commit "
                        "whose serve does not announce that it is ready)")
    args = parser.parse_args()
    from hf_dspark.optimization import cpu_description

    work = Path(tempfile.mkdtemp(prefix="hf-dspark-first-run-"))
    clone, cache = work / "hf-dspark", work / "cache"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "checkout", "--quiet", args.commit], cwd=clone, check=True)
    env = {**os.environ, "HF_DSPARK_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, check=True, capture_output=True,
                            text=True).stdout.strip()
    try:
        lines, first_text, status = timed_lines(["./scripts/run.sh"], clone, env, until=SEPARATOR)
        if status != 0:
            raise RuntimeError("run.sh failed:\n" + "\n".join(line for _, line in lines[-30:]))
        stages = [(seconds, line) for seconds, line in lines if line.startswith("[")]
        serve = None
        if not args.no_serve:
            # serve needs the server's extras, which run.sh's runtime environment leaves out
            subprocess.run(["./scripts/setup_env.sh"], cwd=clone, env=env, check=True, capture_output=True)
            serve = time_serve(clone, env)
        entry = [str(clone / ".venv/bin/hf-dspark")]
        help_s, _ = best_time([*entry, "--help"], clone, env)
        refusal_s, refusal_status = best_time([*entry, "generate", "--max-new-tokens", "0"], clone, env)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report = ["<!-- generated by `python scripts/first_run.py`; do not edit by hand -->",
              "# A newcomer's first run, from a fresh clone", "",
              f"Commit {commit}. {cpu_description()['cpu']}, {os.cpu_count()} CPUs ({cpu_flags_note()}); the environment, the model conversion and every "
              "profile made for the first time.", "",
              "| what | seconds |", "|---|---|",
              f"| `./scripts/run.sh` from a fresh clone until its first generated text | {first_text:.1f} |",
              *([] if serve is None else [
                  f"| then `hf-dspark serve` (its batched profile not yet measured) until it says ready | "
                  f"{serve['ready_s']:.1f} |",
                  f"| then its first chat completion ({serve['completion_tokens']} tokens) | "
                  f"{serve['first_completion_s']:.1f} |"]),
              f"| `hf-dspark --help` (best of 3) | {help_s:.2f} |",
              f"| `hf-dspark generate --max-new-tokens 0`, refused with exit {refusal_status} (best of 3) | "
              f"{refusal_s:.2f} |", "", "`./scripts/run.sh`, each announced stage (seconds since the start):", "",
              "```", *(f"{seconds:6.1f}  {line[:150]}" for seconds, line in stages), "```", "",
              *([] if serve is None else ["`hf-dspark serve`:", "", "```", *serve["log"], "```", ""])]
    text = "\n".join(report)
    print(text)
    if args.output:
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
