"""The command line's policy names and what they are called below it: the one table to update when the engine's
or the verification policies' names change."""

from __future__ import annotations

import sys

from .arguments import UsageError

# command-line name -> (generate()'s verification_policy, the batched engine's method); None: not offered there
POLICIES = {
    "fixed": ("fixed", "fixed"),
    "threshold": ("threshold", "threshold"),
    "scheduler": ("scheduler", "scheduler"),
    "hybrid": ("hybrid", "hybrid"),
}
# old command-line names, still accepted with a note
DEPRECATED_NAMES = {"scheduled": "scheduler"}
POLICY_HELP = ("hybrid: per round, the drafter's block or a prompt lookup, whichever the cost model prices higher | "
               "fixed: verify the whole block | threshold: verify drafts while their confidence stays at or above the "
               "threshold | "
               "scheduler: verify as many drafts as the SPS curve says pays")


def current_name(name: str, flag: str) -> str:
    """``name`` in today's vocabulary, with a note on stderr where it is an old one."""
    if name in DEPRECATED_NAMES:
        print(f"hf-dspark: note: {flag} {name} is deprecated; use {DEPRECATED_NAMES[name]}", file=sys.stderr)
        return DEPRECATED_NAMES[name]
    return name


def generation_policy(name: str, flag: str) -> str:
    """The verification_policy that generate() runs for ``name``: a name of the table, or any registered policy."""
    from ..scheduling import VERIFICATION_POLICIES

    name = current_name(name, flag)
    policy = POLICIES[name][0] if name in POLICIES else name
    if policy not in VERIFICATION_POLICIES:
        raise UsageError(f"{flag}: unknown policy {name!r}; choose from {', '.join(known_policies())}")
    return policy


def known_policies() -> list[str]:
    """The table's names, then the other registered policies."""
    from ..scheduling import VERIFICATION_POLICIES

    return [*POLICIES, *sorted(set(VERIFICATION_POLICIES) - {p for p, _ in POLICIES.values()})]


def _split(spec: str) -> tuple[str, str]:
    """``scheduler=prefix,hold=0`` -> ``("scheduler", "=prefix,hold=0")``."""
    head, comma, options = spec.partition(",")
    name, eq, value = head.partition("=")
    return name, f"{eq}{value}{comma}{options}"


def current_spec(spec: str, flag: str) -> str:
    """A bench-serve policy spec with its name in today's vocabulary (a note where it was an old one)."""
    name, rest = _split(spec)
    return current_name(name, flag) + rest


def engine_method(spec: str, flag: str) -> str:
    """A bench-serve policy spec (``scheduler=prefix,hold=0``) as the engine's method spec
    (the same name: the engine reads the policy registry); a policy the engine does not offer is refused."""
    name, rest = _split(spec)
    name = DEPRECATED_NAMES.get(name, name)
    if name in POLICIES and POLICIES[name][1] is None:
        offered = ["plain", *(n for n, (_, method) in POLICIES.items() if method)]
        raise UsageError(f"{flag}: {name} runs in generate() only; the batched engine offers {', '.join(offered)}")
    return (POLICIES[name][1] if name in POLICIES else name) + rest
