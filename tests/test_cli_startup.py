"""What ``hf-dspark`` loads before a command runs: building the parser, every ``--help`` and every flag refused
before a model loads leave torch unimported (the console script enters through ``hf_dspark_entry``, which defers the
package's registration with transformers); the registration still happens, at ``import hf_dspark`` for a library
and before the command runs for the command line. Each check runs in a fresh interpreter, where ``sys.modules``
tells what was imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from hf_dspark.cli import COMMANDS
from hf_dspark.cli.policies import POLICIES

REPO = Path(__file__).resolve().parents[1]

# what the command line refuses before a model loads (argparse, a bound, a command's check), with a file to read
REFUSED = [
    ["generate", "--bogus"],
    ["generate", "--dtype", "float64"],
    ["bench", "--num-prompts", "0", "--prompts", "p.jsonl"],
    ["bench", "--prompts", "p.jsonl", "--policies", "sometimes"],
    ["bench", "--prompts", "missing.jsonl"],
    ["generate", "--policy", "nonsense"],
    ["generate", "--threshold", "0.4"],
    ["bench-serve", "--prompts", "p.jsonl", "--interleave", "--concurrency", "4"],
    ["bench-serve", "--prompts", "p.jsonl", "--pretouch", "-1"],
    ["data", "--prompts", "missing.jsonl", "--output", "o"],
    ["train", "--data", "missing", "--output", "o"],
    ["features", "--data", "missing", "--output", "o"],
    ["eval", "--data", "p.jsonl", "--output", "o", "--speed-prompts", "60"],
    ["eval", "--output", "o", "--benchmarks", "b.md", "--benchmarks-include", "p.jsonl"],
    ["calibrate", "--prompts", "missing.jsonl", "--output", "o"],
    ["push", "--drafter", "missing", "--repo-id", "a/b"],
    ["serve", "--policy", "fixed=2"],
    ["export", "--engine", "vllm"],
]


def _python(code: str, cwd: Path) -> dict:
    """Runs ``code`` in a fresh interpreter (``hf_dspark_entry`` importable from the checkout) and returns the JSON
    object its last line prints."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HF_DSPARK_DEFER_REGISTRATION", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# Calls hf_dspark_entry.main() (what the console script runs) once per command line in ARGVS, quietly; prints the
# exit statuses, whether torch was imported and whether the package registered.
ENTER = """
import contextlib, io, json, os, sys
import hf_dspark_entry

statuses = []
for argv in ARGVS:
    sys.argv = ["hf-dspark", *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            statuses.append(hf_dspark_entry.main())
        except SystemExit as exit_:
            statuses.append(exit_.code)
import hf_dspark
print(json.dumps({"statuses": statuses, "torch": "torch" in sys.modules, "registered": hf_dspark._registered,
                  "deferral_left": "HF_DSPARK_DEFER_REGISTRATION" in os.environ}))
"""


def test_the_console_script_enters_through_the_deferring_module():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"hf-dspark": "hf_dspark_entry:main"}


def test_help_and_refused_flags_load_no_torch(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "turns": ["Hi"]}) + "\n")
    helps = [["--help"], *([command, "--help"] for command in COMMANDS)]
    result = _python(f"ARGVS = {helps + REFUSED!r}\n" + ENTER, tmp_path)
    assert result["statuses"] == [0] * len(helps) + [2] * len(REFUSED)
    assert not result["torch"] and not result["registered"] and not result["deferral_left"]


def test_the_command_line_registers_before_a_command_runs(tmp_path):
    """The deferred registration is complete when the command's ``run`` starts (here a stand-in for ``profile``'s)."""
    code = ENTER.replace("import hf_dspark\n", """import hf_dspark
import hf_dspark.cli
seen = {}

def run(settings):
    from transformers import AutoConfig

    seen["config"] = type(AutoConfig.for_model("dspark")).__name__
    return 0

hf_dspark.cli.COMMANDS["profile"].run = run
sys.argv = ["hf-dspark", "profile"]
statuses.append(hf_dspark_entry.main())
""").replace('"statuses": statuses', '"statuses": statuses, "seen": seen')
    result = _python('ARGVS = [["profile", "--help"]]\n' + code, tmp_path)
    assert result["statuses"] == [0, 0] and result["seen"] == {"config": "DSparkConfig"}
    assert result["torch"] and result["registered"] and not result["deferral_left"]


def test_importing_the_package_registers_it(tmp_path):
    """A library's ``import hf_dspark`` registers at once; the public names resolve; the registry of verification
    policies holds exactly the command line's table (which the command line reads before torch loads)."""
    result = _python("""
import json
import hf_dspark
from hf_dspark import DSparkDrafter
from transformers import AutoConfig
from transformers.generation.utils import GenerationMixin
from transformers.models.auto.modeling_auto import MODEL_MAPPING
from hf_dspark.scheduling import VERIFICATION_POLICIES

print(json.dumps({"registered": hf_dspark._registered, "config": type(AutoConfig.for_model("dspark")).__name__,
                  "model": MODEL_MAPPING[type(AutoConfig.for_model("dspark"))].__name__,
                  "drafter": DSparkDrafter.__name__,
                  "dispatch": any(getattr(v, "_hf_dspark_patch", False) for v in vars(GenerationMixin).values()),
                  "policies": sorted(VERIFICATION_POLICIES)}))
""", tmp_path)
    assert result["registered"] and result["config"] == "DSparkConfig" and result["model"] == "DSparkDrafter"
    assert result["drafter"] == "DSparkDrafter" and result["dispatch"]
    assert result["policies"] == sorted(policy for policy, _ in POLICIES.values())
