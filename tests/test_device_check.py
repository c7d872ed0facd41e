"""scripts/device_check.py --quick runs on CPU: CUDA checks SKIP, the tiny greedy and round-cost checks PASS, one table,
exit 0."""

import json
import os
import subprocess
import sys

from tests.helpers import REPO


def test_device_check_quick_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    output = tmp_path / "device_check.json"
    result = subprocess.run([sys.executable, "scripts/device_check.py", "--quick", "--output", str(output)], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("check ") == 1 and "device  result" in result.stdout  # one table
    rows = {row["check"]: row for row in json.loads(output.read_text())}
    assert rows["triton_scheduler"]["result"] == "SKIP"
    assert rows["smollm2"]["result"] == "SKIP"
    cost = rows["round_cost"]
    assert cost["result"] == "PASS", cost
    for name in ("target_1tok_ms", "greedy_eager_ms", "greedy_static_ms", "sample_eager_ms", "sample_static_ms"):
        assert cost["numbers"][name] > 0, (name, cost)
    assert "greedy_graph_ms" not in cost["numbers"]  # CUDA only
    for policy in ("fixed", "scheduler", "hybrid"):
        row = rows[f"greedy[{policy}]"]
        assert row["result"] == "PASS" and row["device"] == "cpu", row
        assert row["numbers"]["rounds"] > 0 and "drafting_s" in row["numbers"]
        assert f"greedy[{policy}]" in result.stdout
    assert rows["greedy[hybrid]"]["numbers"]["by_source"].get("lookup", 0) > 0
