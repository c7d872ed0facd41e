"""The command line's policy names and what they are called below it: the one table to update when the engine's
or the verification policies' names change. The default every command shares is ``policy_names.DEFAULT_POLICY``."""

from __future__ import annotations

import sys

from ..policy_names import DEFAULT_POLICY, DEPRECATED_POLICIES, PLAIN
from .arguments import UsageError

# command-line name -> (generate()'s verification_policy, the batched engine's policy); None: not offered there
POLICIES = {
    "fixed": ("fixed", "fixed"),
    "threshold": ("threshold", "threshold"),
    "scheduler": ("scheduler", "scheduler"),
    "hybrid": ("hybrid", "hybrid"),
}
POLICY_HELP = ("hybrid: per round, the drafter's block or a prompt lookup, whichever the cost model prices higher "
               "(a drafter without a confidence head verifies whole blocks instead) | "
               "fixed: verify the whole block | threshold: verify drafts while their confidence stays at or above the "
               "threshold | "
               "scheduler: verify as many drafts as the SPS curve says pays")


def current_name(name: str, flag: str) -> str:
    """``name`` in today's vocabulary, with a note on stderr where it is an old one."""
    if name in DEPRECATED_POLICIES:
        print(f"hf-dspark: note: {flag} {name} is deprecated; use {DEPRECATED_POLICIES[name]}", file=sys.stderr)
        return DEPRECATED_POLICIES[name]
    return name


def generation_policy(name: str, flag: str) -> str:
    """The verification_policy that generate() runs for ``name``: a name of the table, or any registered policy."""
    name = current_name(name, flag)
    policy = POLICIES[name][0] if name in POLICIES else name
    if policy not in registered_policies():
        raise UsageError(f"{flag}: unknown policy {name!r}; choose from {', '.join(known_policies())}")
    return policy


def registered_policies() -> set[str]:
    """generate()'s policy names (``scheduling.VERIFICATION_POLICIES``). Only code that imported ``scheduling`` can
    have registered a policy of its own; until then the names are the built-in ones, the table's (a test keeps the
    two equal), and reading them loads no torch: the command line refuses a bad name at once."""
    scheduling = sys.modules.get("hf_dspark.scheduling")
    if scheduling is None:
        return {policy for policy, _ in POLICIES.values()}
    return set(scheduling.VERIFICATION_POLICIES)


def known_policies() -> list[str]:
    """The table's names, then the other registered policies."""
    return [*POLICIES, *sorted(registered_policies() - {p for p, _ in POLICIES.values()})]


def _split(spec: str) -> tuple[str, str]:
    """``scheduler=prefix,hold=0`` -> ``("scheduler", "=prefix,hold=0")``."""
    head, comma, options = spec.partition(",")
    name, eq, value = head.partition("=")
    return name, f"{eq}{value}{comma}{options}"


def current_spec(spec: str, flag: str) -> str:
    """A bench-serve policy spec with its name in today's vocabulary (a note where it was an old one)."""
    name, rest = _split(spec)
    return current_name(name, flag) + rest


def engine_spec(spec: str, flag: str) -> str:
    """A bench-serve or serve policy spec (``scheduler=prefix,hold=0``) as the engine's policy spec
    (the same name: the engine reads the policy registry); a policy the engine does not offer is refused."""
    name, rest = _split(spec)
    name = DEPRECATED_POLICIES.get(name, name)
    if name in POLICIES and POLICIES[name][1] is None:
        offered = [PLAIN, *(n for n, (_, policy) in POLICIES.items() if policy)]
        raise UsageError(f"{flag}: {name} runs in generate() only; the batched engine offers {', '.join(offered)}")
    return (POLICIES[name][1] if name in POLICIES else name) + rest


def drafter_policy(policy: str, drafter) -> str:
    """``policy`` for ``drafter``: the default policy reads the drafter's confidences, so a drafter without a
    confidence head (a DFlash-style ablation) verifies whole blocks (``fixed``) instead, with a note on stderr."""
    if policy == DEFAULT_POLICY and drafter.confidence_head is None:
        print(f"hf-dspark: note: the default policy {DEFAULT_POLICY} needs a drafter with a confidence head; this "
              f"one has none: fixed", file=sys.stderr)
        return "fixed"
    return policy
