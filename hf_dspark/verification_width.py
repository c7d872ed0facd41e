"""How wide a round's verification forward is in ``generate()`` (``drafter.generation_config.verification_width``),
and whether transformers runs that forward as CUDA graphs, which decides it by default.

This file is self-contained (transformers + its sibling ``setting_choices``), because exported drafter folders carry it.
"""

from __future__ import annotations

from transformers import DynamicCache, StaticCache

try:  # inside the hf_dspark package, or a custom_generate/ folder carrying its siblings next to this file
    from .setting_choices import checked_choice
except ImportError:  # pragma: no cover - loaded as a top-level module
    from setting_choices import checked_choice  # type: ignore[no-redef]

# ``drafter.generation_config.verification_width``:
#   "auto"      (default) "fixed" where transformers runs the verification forward compiled into CUDA graphs (a
#               compilable target cache such as ``StaticCache``, passed in or ``cache_implementation="static"``, on
#               CUDA, with its default ``compile_config`` mode "reduce-overhead"): torch records one CUDA graph per
#               distinct input width, so every new width costs a recording; else "variable" (without graphs, dynamo's
#               dynamic shapes serve every width from one compiled graph)
#   "variable"  each round verifies what its policy chose
#   "fixed"     every block round verifies the whole block and every lookup round the policy's longest lookup draft
#               (padded past a shorter match), so the verification forward sees one width per source (and shorter
#               ones only where max_length leaves less room); the policy still chooses between block, lookup and
#               no draft. Greedy outputs are unchanged: a verified token is kept only where it is the target's own
#               choice, so verifying more tokens never changes what is emitted.
VERIFICATION_WIDTHS = ("auto", "variable", "fixed")
# torch.compile modes that capture CUDA graphs (inductor's cudagraph trees re-record for each distinct input shape).
GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


def _compilable_cache(cache) -> bool:
    return isinstance(cache, StaticCache) or (
        bool(getattr(cache, "is_compileable", False)) and not isinstance(cache, DynamicCache))


def verification_records_graphs(target, model_kwargs: dict, generation_config) -> bool:
    """Whether transformers' assisted decoding runs ``target``'s verification forward compiled into CUDA graphs for
    this call: its own auto-compile rule (``_valid_auto_compile_criteria``: a compilable cache, a device it compiles
    on, ``disable_compile`` unset), on CUDA, in a compile mode that captures graphs."""
    if target.device.type != "cuda":
        return False
    rule = getattr(target, "_valid_auto_compile_criteria", None)
    if rule is not None:
        compiles = bool(rule(model_kwargs, generation_config))
    else:  # a transformers without the rule: compile follows the cache
        compiles = _compilable_cache(model_kwargs.get("cache", model_kwargs.get("past_key_values")))
    if not compiles:
        return False
    compile_config = getattr(generation_config, "compile_config", None)
    if compile_config is None:  # what get_compiled_call falls back to
        default = getattr(target, "_default_compile_config", None)
        if default is not None:
            compile_config = default()
        else:
            from transformers.generation.configuration_utils import CompileConfig

            compile_config = CompileConfig()
    options = getattr(compile_config, "options", None) or {}
    return compile_config.mode in GRAPH_COMPILE_MODES or bool(options.get("triton.cudagraphs"))


def verification_width_mode(drafter, records_graphs: bool) -> str:
    """``"fixed"`` or ``"variable"`` for one call (see ``VERIFICATION_WIDTHS``); ``records_graphs``: whether the
    verification forward runs as CUDA graphs (``verification_records_graphs``)."""
    mode = checked_choice(drafter, "verification_width", VERIFICATION_WIDTHS, "auto")
    if mode == "auto":
        return "fixed" if records_graphs else "variable"
    return mode


__all__ = ["GRAPH_COMPILE_MODES", "VERIFICATION_WIDTHS", "verification_records_graphs", "verification_width_mode"]
