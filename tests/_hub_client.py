"""Client side of the Hub round-trip tests (tests/test_hub.py), run as a subprocess:

    python -m tests._hub_client pull|push SPEC_JSON

huggingface_hub reads HF_ENDPOINT, HF_TOKEN and HF_HOME into module constants when it is first imported, and the
pytest process imported it long before a test can point it at a local server. So the Hub-facing side runs here, in
a fresh interpreter whose environment the test sets; every Hub-related import below happens inside a function,
after that environment is in place. The last stdout line is a JSON summary for the test to check.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys


def state_digest(model) -> str:
    """sha256 over the state dict (names, dtypes, shapes, bytes): equal digests mean identical weights."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _greedy(target, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    import torch

    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          **kwargs)
    return out[0, len(prompt):].tolist()


def pull(spec: dict) -> dict:
    """Pull spec["repo_id"] twice: with plain transformers (hf_dspark made unimportable; AutoModel +
    trust_remote_code, custom_generate from the repo) and with hf_dspark (DSparkDrafter.from_pretrained), both at
    spec["revision"]; also load spec["other_revisions"] and report their weight digests."""
    sys.modules["hf_dspark"] = None  # plain transformers first: any `import hf_dspark` fails
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(0)
    repo, revision, n = spec["repo_id"], spec["revision"], spec["max_new_tokens"]
    target = AutoModelForCausalLM.from_pretrained(spec["target"], dtype=torch.float32).eval()
    remote = AutoModel.from_pretrained(repo, revision=revision, trust_remote_code=True, dtype=torch.float32).eval()
    result = {
        "remote_module": type(remote).__module__,
        "remote_digest": state_digest(remote),
        "plain": _greedy(target, spec["prompt"], n),
        "assisted_remote": _greedy(target, spec["prompt"], n, assistant_model=remote, custom_generate=repo,
                                   trust_remote_code=True),
    }
    del sys.modules["hf_dspark"]
    import hf_dspark  # noqa: F401
    from hf_dspark import DSparkDrafter

    drafter = DSparkDrafter.from_pretrained(repo, revision=revision, dtype=torch.float32).eval()
    result["local_digest"] = state_digest(drafter)
    result["assisted_local"] = _greedy(target, spec["prompt"], n, assistant_model=drafter)
    result["tau"] = drafter.last_stats.accepted_length
    result["other_digests"] = {rev: state_digest(DSparkDrafter.from_pretrained(repo, revision=rev))
                               for rev in spec.get("other_revisions", [])}
    return result


def push(spec: dict) -> dict:
    """Push through ``hf_dspark.hub.push_drafter`` and ``hf-dspark push`` (including a wrong token), then pull back with
    ``DSparkDrafter.from_pretrained`` and ``AutoModel`` (hf_dspark is imported here, so AutoModel resolves to its
    registered class; the plain-transformers route is exercised by ``pull``)."""
    import torch
    from huggingface_hub import HfApi
    from transformers import AutoModel, AutoModelForCausalLM

    import hf_dspark
    from hf_dspark import DSparkDrafter
    from hf_dspark.cli import main as cli
    from hf_dspark.hub import load_report, push_drafter

    repo, n, target_name = spec["repo_id"], spec["max_new_tokens"], spec["target_name"]
    result = {}
    drafter = DSparkDrafter.from_pretrained(spec["drafter"], dtype=torch.float32).eval()

    result["token_errors"] = {}
    for case, token in spec["bad_tokens"].items():  # before the repo exists, and (below) after
        try:
            push_drafter(drafter, repo, token=token, target_name=target_name)
            result["token_errors"][case] = None
        except PermissionError as err:
            result["token_errors"][case] = str(err)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = cli(["push", "--drafter", spec["drafter"], "--repo-id", repo, "--token", "hf_not_a_valid_token",
                  "--target-name", target_name])
    result["cli_wrong_token"] = {"rc": rc, "stderr": stderr.getvalue()}

    result["main_commit"] = push_drafter(drafter, repo, report=load_report(spec["report"]), target_name=target_name,
                                                commit_message="Upload tiny drafter").oid
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        result["cli_rc"] = cli(["push", "--drafter", spec["calibrated"], "--repo-id", repo, "--branch", "calibrated",
                                "--target-name", target_name, "--report", spec["report"]])
    result["cli_stdout"] = stdout.getvalue()
    api = HfApi()
    result["calibrated_commit"] = api.model_info(repo, revision="calibrated").sha
    # The same branch again without calibration: the stale sts.json must go.
    result["uncalibrated_commit"] = push_drafter(drafter, repo, revision="calibrated", target_name=target_name).oid
    try:
        push_drafter(drafter, repo, token=spec["bad_tokens"]["read_only"], target_name=target_name)
        result["read_only_existing_repo"] = None
    except PermissionError as err:
        result["read_only_existing_repo"] = str(err)

    target = AutoModelForCausalLM.from_pretrained(spec["target"], dtype=torch.float32).eval()
    pulled = DSparkDrafter.from_pretrained(repo, revision=result["main_commit"], dtype=torch.float32).eval()
    remote = AutoModel.from_pretrained(repo, revision=result["calibrated_commit"], trust_remote_code=True,
                                       dtype=torch.float32).eval()
    result.update(
        pushed_digest=state_digest(drafter), pulled_digest=state_digest(pulled), remote_digest=state_digest(remote),
        remote_temperatures=remote.config.confidence_temperatures,
        plain=_greedy(target, spec["prompt"], n),
        assisted_local=_greedy(target, spec["prompt"], n, assistant_model=pulled),
        assisted_remote=_greedy(target, spec["prompt"], n, assistant_model=remote, custom_generate=repo,
                                trust_remote_code=True),
        hf_dspark_version=hf_dspark.__version__,
    )
    return result


if __name__ == "__main__":
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    summary = {"pull": pull, "push": push}[mode](spec)
    print(json.dumps(summary))
