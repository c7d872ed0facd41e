"""The policy names every entry point shares: the default, the engine's baseline without a drafter, and old spellings.

Without torch (and without any other import), so that the command line's parser reads the default before a model
loads. The policies themselves are registered in ``scheduling.VERIFICATION_POLICIES``.
"""

from __future__ import annotations

# The policy generate(), the batched engine (``EngineConfig.policy``), the demo and every command (generate, serve,
# bench, bench-serve, demo) start from: per round the drafter's block or a prompt lookup, whichever the cost model
# prices higher (measured fastest in generate() and in the engine at concurrency 1, even with it above).
DEFAULT_POLICY = "hybrid"
PLAIN = "plain"  # the engine's policy without a drafter: one token per request per step, the baseline
# old policy names, still accepted with a note, and the name each stands for today
DEPRECATED_POLICIES = {"scheduled": "scheduler"}


def current_policy(name: str) -> str:
    """``name`` in today's vocabulary (``"scheduled"`` -> ``"scheduler"``)."""
    return DEPRECATED_POLICIES.get(name, name)

