"""Hub round trips: the complete drafter folder (code, custom_generate/, sts.json, model card from reports), and
push / pull against real servers on 127.0.0.1: an olah mirror serving local git repos (pulls pinned by commit
sha) and tests/hub_server.py (pushes through huggingface_hub, then pulls).

The Hub-facing side of the server tests runs in a subprocess (tests/_hub_client.py): huggingface_hub reads
HF_ENDPOINT / HF_TOKEN / HF_HOME when it is first imported, which in this process happened at collection time
(conftest imports transformers), so only a fresh interpreter started with that environment talks to our servers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import hf_dspark
from hf_dspark import DSparkDrafter
from hf_dspark.drafter_files import module_closure
from hf_dspark.hub import evaluation_text, load_report, training_text, write_hub_folder
from hf_dspark.training.checkpoints import INIT_CARD
from tests._hub_client import state_digest
from tests.helpers import REPO, load_script, make_drafter, make_target, python_files, random_prompts, written_code
from tests.hub_server import HubServer

BENCH_REPORT = REPO / "reports" / "bench-smollm2-fp32.json"
TRAINED = REPO / "hf_dspark" / "drafters" / "smollm2-135m-instruct-dspark"
TINY_TARGET_NAME = "hf-dspark-tests/tiny-llama"
_PACKAGE = Path(hf_dspark.__file__).resolve().parent
# A pushed folder: weights, configs and card, the model file with every module it imports, and custom_generate/
# with generation.py (as generate.py) and every module that imports
HUB_FILES = ({"config.json", "model.safetensors", "generation_config.json", "custom_generate/requirements.txt",
              "README.md"}
             | {path.name for path in module_closure(_PACKAGE / "modeling_dspark.py")}
             | {"custom_generate/" + ("generate.py" if path.name == "generation.py" else path.name)
                for path in module_closure(_PACKAGE / "generation.py")})


@pytest.fixture(scope="module")
def tiny_target():
    return make_target("llama")


def fresh_drafter(target, seed: int = 0, temperatures: list[float] | None = None) -> DSparkDrafter:
    drafter = make_drafter(target, seed=seed)
    drafter.config.confidence_temperatures = temperatures
    return drafter


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def bench_rows(report: dict) -> list[str]:
    """The table rows the card must show, read straight from the report."""
    rows = []
    for group, per_method in report["results"]["report"].items():
        for method, r in per_method.items():
            tau = f"{r['accepted_length']:.2f}" if "accepted_length" in r else "1 (plain)"
            rows.append(f"| {method} | {group} | {tau} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x |")
    return rows


# --------------------------------------------------------------------------------------------------------------
# The folder a push uploads
# --------------------------------------------------------------------------------------------------------------
def test_hub_folder_is_complete(tmp_path, tiny_target):
    report = load_report(BENCH_REPORT)
    drafter = fresh_drafter(tiny_target, temperatures=[1.5, 0.75, 1.0, 2.0])
    folder = write_hub_folder(drafter, tmp_path / "hub", repo_id="org/tiny-dspark", target_name=TINY_TARGET_NAME,
                              report=report, training="- Data: four random prompts.")
    assert HUB_FILES | {"sts.json"} <= files_under(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_dspark.DSparkConfig",
                                  "AutoModel": "modeling_dspark.DSparkDrafter"}
    assert json.loads((folder / "sts.json").read_text()) == {"temperatures": [1.5, 0.75, 1.0, 2.0]}
    card = (folder / "README.md").read_text()
    assert f"base_model: {TINY_TARGET_NAME}" in card and "# tiny-dspark" in card
    assert 'DSparkDrafter.from_pretrained("org/tiny-dspark")' in card
    assert "| block size | 4 " in card and "(STS-calibrated)" in card and "- Data: four random prompts." in card
    for row in bench_rows(report):
        assert row in card
    reloaded = DSparkDrafter.from_pretrained(folder)
    assert reloaded.config.confidence_temperatures == [1.5, 0.75, 1.0, 2.0]
    assert state_digest(reloaded) == state_digest(drafter)

    plain = write_hub_folder(fresh_drafter(tiny_target), tmp_path / "plain", repo_id="org/p",
                             target_name=TINY_TARGET_NAME)
    assert "sts.json" not in files_under(plain)
    assert "Not evaluated yet." in (plain / "README.md").read_text()


def test_card_and_calibration_metadata_carry_over(tmp_path, tiny_target):
    """Re-packaging a folder keeps what only its card / sts.json know: target id, training text, evaluation,
    calibration metadata (when the temperatures still match)."""
    source = write_hub_folder(fresh_drafter(tiny_target, temperatures=[1.0, 2.0, 3.0, 4.0]), tmp_path / "src",
                              repo_id="org/src", target_name=TINY_TARGET_NAME, report=load_report(BENCH_REPORT),
                              training="- Budget: 3 steps.")
    sts = {"temperatures": [1.0, 2.0, 3.0, 4.0], "dataset": "unit", "num_samples": 12, "ece_before": 0.2,
           "ece_after": 0.05}
    (source / "sts.json").write_text(json.dumps(sts))
    drafter = DSparkDrafter.from_pretrained(source)
    out = write_hub_folder(drafter, tmp_path / "out", repo_id="someone/copy")
    assert json.loads((out / "sts.json").read_text()) == sts
    card = (out / "README.md").read_text()
    assert f"base_model: {TINY_TARGET_NAME}" in card and "- Budget: 3 steps." in card and "# copy" in card
    assert all(row in card for row in bench_rows(load_report(BENCH_REPORT)))

    drafter.config.confidence_temperatures = [1.0, 1.0, 1.0, 1.0]  # recalibrated: the old metadata no longer applies
    out = write_hub_folder(drafter, tmp_path / "recal", repo_id="someone/copy")
    assert json.loads((out / "sts.json").read_text()) == {"temperatures": [1.0, 1.0, 1.0, 1.0]}

    with pytest.raises(ValueError, match="target model's Hub id"):
        write_hub_folder(fresh_drafter(tiny_target), tmp_path / "x", repo_id="org/x")


def test_committed_drafter_card_rerenders(tmp_path):
    drafter = DSparkDrafter.from_pretrained(TRAINED, dtype="auto")
    out = write_hub_folder(drafter, tmp_path / "out", repo_id="me/smollm2-dspark")
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert 'from_pretrained("me/smollm2-dspark")' in card and "800 steps" in card
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"  # not upcast on the way


def test_evaluation_text_from_bench_report():
    report = load_report(BENCH_REPORT)
    text = evaluation_text(report)
    assert f"{report['settings']['num_prompts']} prompts per set" in text
    assert [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:] == sorted(
        bench_rows(report), key=lambda row: row.split(" | ")[1])
    assert evaluation_text(None) == "Not evaluated yet."
    with pytest.raises(ValueError, match="unrecognised evaluation report"):
        evaluation_text({"results": {"tau": 2.0}})


def write_run(tmp_path: Path) -> Path:
    """A training run folder (trainer state, log, two regenerated shards) as `hf-dspark train` leaves it."""
    data = tmp_path / "regen"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"settings": {"temperature": 0.2, "top_p": 0.9,
                                                                 "max_new_tokens": 256}}))
    shards = []
    for i, sets in enumerate([["gsm8k", "gsm8k", "mbpp"], ["gsm8k"]]):
        shard = data / f"shard-{i:05d}.jsonl"
        shard.write_text("".join(json.dumps({"set": s, "prompt_ids": [1]}) + "\n" for s in sets))
        shards.append(str(shard))
    run = tmp_path / "run"
    (run / "checkpoint-last").mkdir(parents=True)
    args = {"data_dirs": [str(data)], "batch_size": 4, "gradient_accumulation_steps": 2, "num_anchors": 64,
            "block_size": 7, "learning_rate": 6e-4, "warmup_ratio": 0.04, "gamma": 4.0,
            "loss_weights": {"ce": 0.1, "tv": 0.9, "confidence": 1.0}}
    (run / "checkpoint-last" / "trainer_state.json").write_text(json.dumps({"args": args, "step": 120,
                                                                             "shards": shards}))
    log = [{"loss": 3.0, "ce": 5.0, "tv": 1.5, "confidence": 0.6, "accuracy": 0.2, "elapsed_s": 60.0},
           {"loss": 2.5, "ce": 4.25, "tv": 1.25, "confidence": 0.5, "accuracy": 0.3125, "elapsed_s": 1800.0}]
    (run / "train_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in log))
    return run


def test_training_text_from_run(tmp_path):
    run = write_run(tmp_path)
    state = json.loads((run / "checkpoint-last" / "trainer_state.json").read_text())
    args, shards = state["args"], state["shards"]
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    text = training_text(run)
    assert "(temperature 0.2, top-p 0.9, up to 256 new tokens) to 4 conversation turns from 2 shards" in text
    assert "prompt sets: gsm8k (3), mbpp (1)" in text
    assert "120 steps x 8 sequences, 64 anchors per sequence, block 7, lr 0.0006 (warmup 4%, cosine), 30 min" in text
    assert "loss 2.500, CE 4.250, TV(L1) 1.250, confidence 0.500, block accuracy 0.312" in text
    assert "Initialised" not in text
    # a warm-started run names the drafter it continued and that drafter's own budget
    child = tmp_path / "child"
    (child / "checkpoint-last").mkdir(parents=True)
    (child / "checkpoint-last" / "trainer_state.json").write_text(json.dumps(
        {"args": {**args, "init_drafter": str(run / "drafter")}, "step": 50, "shards": shards}))
    (child / "train_log.jsonl").write_text(json.dumps(log[-1]) + "\n")
    text = training_text(child)
    assert "50 steps x 8 sequences" in text
    assert f"- Initialised from an earlier drafter (`{run / 'drafter'}`: 120 steps x 8 sequences, 64 anchors per " \
           "sequence, 2 shards, lr 0.0006)." in text
    (child / "checkpoint-last" / "trainer_state.json").write_text(json.dumps(
        {"args": {**args, "init_drafter": str(tmp_path / "elsewhere")}, "step": 50, "shards": shards}))
    assert "neither its run folder nor a model card with a training section was found" in training_text(child)
    # a packaged drafter (no run folder) is described by its model card's training section, quoted
    packaged = tmp_path / "elsewhere"
    packaged.mkdir()
    (packaged / "README.md").write_text("# d\n\n## Training\n\n- Data: earlier turns.\n- Budget: 9 steps.\n\n"
                                        "## Evaluation\n\nx\n")
    text = training_text(child)
    assert text.endswith(f"- Initialised from the packaged drafter `{packaged}` as it stood when this run started, "
                         "itself trained as follows:\n"
                         "  - Data: earlier turns.\n  - Budget: 9 steps.")
    # once that folder carries this run's own card, packaging the run again would quote itself: refused
    (packaged / "README.md").write_text(f"# d\n\n## Training\n\n{text}\n")
    with pytest.raises(ValueError, match="already describes this run"):
        training_text(child)
    # the copy of the starting card that the run kept when it started wins over the folder's card now
    (child / INIT_CARD).write_text("# d\n\n## Training\n\n- Budget: 3 steps.\n\n## Usage\n\ny\n")
    assert training_text(child).endswith(f"`{packaged}` as it stood when this run started, itself trained as "
                                         "follows:\n  - Budget: 3 steps.")
    # and a run continued from that run quotes the same kept card one level down
    grandchild = tmp_path / "grandchild"
    (grandchild / "checkpoint-last").mkdir(parents=True)
    (grandchild / "checkpoint-last" / "trainer_state.json").write_text(json.dumps(
        {"args": {**args, "init_drafter": str(child / "drafter")}, "step": 7, "shards": shards}))
    (grandchild / "train_log.jsonl").write_text(json.dumps(log[0]) + "\n")
    assert training_text(grandchild).endswith("itself trained as follows:\n  - Budget: 3 steps.")
    (child / INIT_CARD).unlink()
    (packaged / "README.md").unlink()
    # a fine-tune of the confidence head alone: the base drafter's whole description, then that stage
    head = tmp_path / "head"
    (head / "checkpoint-last").mkdir(parents=True)
    (head / "checkpoint-last" / "trainer_state.json").write_text(json.dumps(
        {"args": {**args, "init_drafter": str(run / "drafter"), "train_modules": ["confidence_head"],
                  "confidence_target": "greedy", "batch_size": 2}, "step": 30, "shards": shards[1:]}))
    (head / "train_log.jsonl").write_text(json.dumps(log[0]) + "\n")
    text = training_text(head)
    assert text.startswith(training_text(run) + "\n- Then `confidence_head` alone was fine-tuned (everything else "
                           "frozen) on the target's own responses (temperature 0.2, top-p 0.9, up to 256 new tokens) "
                           "to 1 conversation turns from 1 shards; prompt sets: gsm8k (1); 30 steps x 4 sequences")
    assert "confidence labels: greedy acceptance (draft argmax = target argmax); final: loss 3.000" in text
    (head / "checkpoint-last" / "trainer_state.json").write_text(json.dumps(
        {"args": {**args, "init_drafter": str(tmp_path / "elsewhere"), "train_modules": ["confidence_head"]},
         "step": 30, "shards": shards}))
    text = training_text(head)
    assert "- Trained modules: confidence_head (the rest frozen)." in text and "nor a model card" in text
    with pytest.raises(FileNotFoundError, match="not a training run folder"):
        training_text(tmp_path / "nothing")


# --------------------------------------------------------------------------------------------------------------
# Real servers on 127.0.0.1
# --------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_env(tmp_path: Path, endpoint: str, token: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") or k.startswith("HF_DSPARK")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "modules"),
               HF_HUB_OFFLINE="0", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def run_client(mode: str, spec: dict, env: dict, timeout: int = 300) -> dict:
    result = subprocess.run([sys.executable, "-m", "tests._hub_client", mode, json.dumps(spec)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_push_pull_round_trip(tmp_path, tiny_target):
    tiny_target.save_pretrained(tmp_path / "target")
    drafter = fresh_drafter(tiny_target, seed=3)
    drafter.save_pretrained(tmp_path / "drafter")
    calibrated = fresh_drafter(tiny_target, seed=4, temperatures=[0.5, 1.0, 1.5, 2.0])
    calibrated.save_pretrained(tmp_path / "calibrated")
    sts = {"temperatures": [0.5, 1.0, 1.5, 2.0], "dataset": "unit", "num_samples": 40, "ece_before": 0.3,
           "ece_after": 0.1}
    (tmp_path / "calibrated" / "sts.json").write_text(json.dumps(sts))
    prompt = random_prompts(1, 8, tiny_target.config.vocab_size, seed=5)[0][0].tolist()

    bad_tokens = {"wrong": "hf_not_a_valid_token", "read_only": "hf_bob_read", "none": False}
    with HubServer({"hf_alice_write": ("alice", True), "hf_bob_read": ("bob", False)}) as hub:
        out = run_client("push", {"repo_id": "alice/tiny-dspark", "drafter": str(tmp_path / "drafter"),
                                  "bad_tokens": bad_tokens,
                                  "calibrated": str(tmp_path / "calibrated"), "target": str(tmp_path / "target"),
                                  "report": str(BENCH_REPORT), "target_name": TINY_TARGET_NAME,
                                  "prompt": prompt, "max_new_tokens": 20},
                         client_env(tmp_path, hub.endpoint, token="hf_alice_write"))
        assert hub.unhandled == []
        repo = hub.repos["alice/tiny-dspark"]

    # A bad token fails with one message naming the problem, from the API and from the CLI.
    errors = out["token_errors"]
    assert all(e.startswith("cannot push to alice/tiny-dspark on http://127.0.0.1:") for e in errors.values())
    assert "(HTTP 401): the token was rejected" in errors["wrong"]
    assert "(HTTP 403): the token was rejected or lacks write access" in errors["read_only"]
    assert "(HTTP 403): the token was rejected or lacks write access" in out["read_only_existing_repo"]
    assert "(HTTP 401): no Hub token" in errors["none"]
    assert out["cli_wrong_token"]["rc"] == 1
    assert out["cli_wrong_token"]["stderr"].strip() == f"hf-dspark: error: {errors['wrong']}"

    main = repo.commits[out["main_commit"]]
    assert repo.branches["main"] == main.oid
    assert HUB_FILES | {".gitattributes"} == set(main.files)
    card = main.files["README.md"].decode()
    assert f"base_model: {TINY_TARGET_NAME}" in card
    assert all(row in card for row in bench_rows(load_report(BENCH_REPORT)))
    assert main.files["model.safetensors"] == (tmp_path / "drafter" / "model.safetensors").read_bytes()

    assert out["cli_rc"] == 0 and out["calibrated_commit"] in out["cli_stdout"]
    with_sts = repo.commits[out["calibrated_commit"]]
    assert json.loads(with_sts.files["sts.json"]) == sts and "(STS-calibrated)" in with_sts.files["README.md"].decode()
    without_sts = repo.commits[out["uncalibrated_commit"]]
    assert repo.branches["calibrated"] == without_sts.oid and without_sts.parent == with_sts.oid
    assert HUB_FILES | {".gitattributes"} == set(without_sts.files)  # the stale sts.json was deleted

    assert out["pulled_digest"] == out["pushed_digest"] == state_digest(drafter)
    assert out["remote_digest"] == state_digest(calibrated) and out["remote_temperatures"] == sts["temperatures"]
    assert out["assisted_local"] == out["plain"] and out["assisted_remote"] == out["plain"]
    assert len(out["plain"]) == 20


# -- olah ------------------------------------------------------------------------------------------------------
def commit_folder(repo: Path, folder: Path, message: str) -> str:
    """Make the git repo ``repo`` hold exactly ``folder`` and commit it, with safetensors files stored as git-LFS
    pointers plus objects under .git/lfs (as Hub repos hold them). Returns the commit sha."""
    git = ["git", "-C", str(repo), "-c", "user.name=hf-dspark tests", "-c", "user.email=tests@hf-dspark.invalid"]
    if not (repo / ".git").is_dir():
        repo.mkdir(parents=True)
        subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    for entry in repo.iterdir():
        if entry.name != ".git":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    shutil.copytree(folder, repo, dirs_exist_ok=True)
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    for path in repo.rglob("*.safetensors"):
        content = path.read_bytes()
        oid = hashlib.sha256(content).hexdigest()
        store = repo / ".git" / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
        store.parent.mkdir(parents=True, exist_ok=True)
        store.write_bytes(content)
        path.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {len(content)}\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", message], check=True)
    return subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()


class Olah:
    """olah (PyPI) in offline mode, serving the git repos under ``mirrors/models/<org>/<name>`` as Hub repos."""

    def __init__(self, root: Path):
        self.root, self.port = root, free_port()
        self.mirrors = root / "mirrors"
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def repo_dir(self, repo_id: str) -> Path:
        return self.mirrors / "models" / repo_id

    def __enter__(self) -> "Olah":
        self.mirrors.mkdir(parents=True)
        config = self.root / "olah.toml"
        config.write_text("\n".join([
            "[basic]", 'host = "127.0.0.1"', f"port = {self.port}", f'repos-path = "{self.root / "cache"}"',
            f'mirrors-path = ["{self.mirrors}"]', 'mirror-scheme = "http"', f'mirror-netloc = "127.0.0.1:{self.port}"',
            f'mirror-lfs-netloc = "127.0.0.1:{self.port}"', "", "[accessibility]", "offline = true", ""]))
        self.log = open(self.root / "olah.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "olah.server", "-c", str(config), "--log-path", str(self.root / "logs")],
            cwd=self.root, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/api/models/none/none/revision/main", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # answering (404 for the unknown repo): up
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError(f"olah did not start:\n{(self.root / 'olah.log').read_text()[-3000:]}")
                time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


@pytest.mark.parametrize("policy", [None, "fixed"])
def test_package_drafter_script_writes_a_card_and_the_chosen_policy(tmp_path, tiny_target, policy, monkeypatch):
    """scripts/package_drafter.py: bf16 weights, the card's training section from the run, and the policy: hybrid
    for a drafter with a confidence head unless --verification-policy names another (the DFlash ablation: fixed)."""
    import sys

    run = write_run(tmp_path)
    fresh_drafter(tiny_target).save_pretrained(run / "drafter")
    out = tmp_path / "packaged"
    script = load_script("package_drafter")
    argv = ["package_drafter.py", "--run", str(run), "--output", str(out), "--name", "tiny-dspark"]
    monkeypatch.setattr(sys, "argv", argv + (["--verification-policy", policy] if policy else []))
    script.main()
    packaged = DSparkDrafter.from_pretrained(out, dtype="auto")
    assert packaged.dtype == torch.bfloat16
    assert packaged.generation_config.verification_policy == (policy or "hybrid")
    assert "120 steps x 8 sequences" in (out / "README.md").read_text()


@pytest.fixture
def olah(tmp_path):
    pytest.importorskip("olah", reason="olah (pip install hf-dspark[hub-test]) serves the mirror")
    if shutil.which("git") is None:
        pytest.skip("git is needed to build the mirrored repos")
    with Olah(tmp_path / "olah") as server:
        yield server


def test_pull_through_olah_pinned_by_sha(tmp_path, tiny_target, olah):
    tiny_target.save_pretrained(tmp_path / "target")
    first, second = fresh_drafter(tiny_target, seed=1), fresh_drafter(tiny_target, seed=2)
    repo = olah.repo_dir("hf-dspark-tests/tiny-dspark")
    shas = [commit_folder(repo, write_hub_folder(d, tmp_path / f"v{i}", repo_id="hf-dspark-tests/tiny-dspark",
                                                 target_name=TINY_TARGET_NAME), f"drafter v{i}")
            for i, d in enumerate((first, second))]
    prompt = random_prompts(1, 8, tiny_target.config.vocab_size, seed=6)[0][0].tolist()
    out = run_client("pull", {"repo_id": "hf-dspark-tests/tiny-dspark", "revision": shas[0],
                              "other_revisions": ["main", shas[1]], "target": str(tmp_path / "target"),
                              "prompt": prompt, "max_new_tokens": 20}, client_env(tmp_path, olah.endpoint))
    assert out["remote_module"].startswith("transformers_modules")
    assert out["remote_digest"] == out["local_digest"] == state_digest(first)  # the pinned commit, not main
    assert out["other_digests"] == {"main": state_digest(second), shas[1]: state_digest(second)}
    assert out["assisted_remote"] == out["plain"] and out["assisted_local"] == out["plain"]
    assert len(out["plain"]) == 20


@pytest.mark.slow
def test_trained_drafter_through_olah_with_smollm2(tmp_path, olah):
    from hf_dspark.target import load_smollm2, smollm2_folder

    target, tokenizer = load_smollm2(dtype=torch.float32)
    repo_id = "hf-dspark/smollm2-135m-instruct-dspark"
    folder = write_hub_folder(DSparkDrafter.from_pretrained(TRAINED, dtype="auto"), tmp_path / "trained",
                              repo_id=repo_id)
    sha = commit_folder(olah.repo_dir(repo_id), folder, "trained drafter")
    messages = [{"role": "user", "content": "What is 12 times 7? Answer briefly."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    out = run_client("pull", {"repo_id": repo_id, "revision": sha, "target": str(smollm2_folder()),
                              "prompt": list(prompt), "max_new_tokens": 24}, client_env(tmp_path, olah.endpoint))
    local = DSparkDrafter.from_pretrained(TRAINED, dtype=torch.float32)
    assert out["remote_digest"] == out["local_digest"] == state_digest(local)
    assert out["assisted_remote"] == out["plain"] and out["assisted_local"] == out["plain"]
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert out["plain"] == expected


@pytest.mark.parametrize("name", ["smollm2-135m-instruct-dspark", "smollm2-135m-instruct-dflash"])
def test_embedded_drafters_get_the_package_code_when_written(name, tmp_path):
    """The embedded drafter folders commit no code: written as a push writes them, they carry the package's own
    modules byte for byte, the same files as any other drafter's folder."""
    package = Path(hf_dspark.__file__).parent
    drafter = DSparkDrafter.from_pretrained(package / "drafters" / name, dtype="auto")
    folder = write_hub_folder(drafter, tmp_path / name, repo_id=f"hf-dspark/{name}")
    code = written_code(package)
    assert python_files(folder) == set(code)
    for shipped, source in code.items():
        assert (folder / shipped).read_bytes() == source.read_bytes(), shipped


def test_reports_name_the_weights_they_measured(tiny_target, tmp_path):
    """load_drafter_for's origin carries the digest of the folder's weights: a report written before a folder is
    re-packaged with new weights says which ones it measured."""
    from hf_dspark.defaults import load_drafter_for, weights_digest

    drafter = make_drafter(tiny_target)
    drafter.save_pretrained(tmp_path / "d")
    digest = weights_digest(tmp_path / "d")
    assert digest is not None and len(digest) == 12
    _, origin = load_drafter_for(tiny_target, str(tmp_path / "d"))
    assert origin == f"{tmp_path / 'd'} (weights sha256 {digest})"
    with torch.no_grad():
        next(drafter.parameters()).add_(1.0)
    drafter.save_pretrained(tmp_path / "d")
    assert weights_digest(tmp_path / "d") != digest
    assert weights_digest(tmp_path / "missing") is None and weights_digest("org/a-hub-id") is None
