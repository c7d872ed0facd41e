"""Starting a drafter from its target: the output norm and decoder layers copied from target layers, and layers
added to a trained drafter (``DSparkTrainer``'s ``init_layers_from_target`` and ``add_layers``)."""

from __future__ import annotations

import torch

from ..modeling_dspark import DSparkDrafter


def init_output_norm_from_target(drafter: DSparkDrafter, target) -> bool:
    """Start the drafter's final norm at the target's: its hidden states feed the target's LM head, which expects
    the target's per-channel output scale. Returns whether it applied."""
    base = getattr(target, "model", None)
    norm = getattr(base, "norm", None)
    weight = getattr(norm, "weight", None)
    if weight is None or weight.shape != drafter.norm.weight.shape:
        return False
    with torch.no_grad():
        drafter.norm.weight.copy_(weight.detach().float())
    return True


def init_layers_from_target(drafter: DSparkDrafter, target, layer_ids: list[int]) -> list[str]:
    """Start drafter layer ``i`` from target decoder layer ``layer_ids[i]``: every parameter the two share by name
    and shape (attention projections, MLP, the two layer norms) is copied; the drafter's own (per-head q/k norms)
    keep their initialisation. Returns the names of the drafter parameters left as they were."""
    layers = getattr(getattr(target, "model", None), "layers", None)
    if layers is None:
        raise ValueError("init_layers_from_target: the target has no `model.layers` to copy decoder layers from")
    if len(layer_ids) != len(drafter.layers):
        raise ValueError(f"init_layers_from_target names {len(layer_ids)} target layers for a drafter with "
                         f"{len(drafter.layers)} layers: give one target layer per drafter layer")
    kept = []
    for i, layer_id in enumerate(layer_ids):
        if not 0 <= layer_id < len(layers):
            raise ValueError(f"init_layers_from_target: target layer {layer_id} does not exist (the target has "
                             f"layers 0..{len(layers) - 1})")
        source = layers[layer_id].state_dict()
        copied = 0
        with torch.no_grad():
            for name, param in drafter.layers[i].named_parameters():
                if name not in source:
                    kept.append(f"layers.{i}.{name}")
                    continue
                if source[name].shape != param.shape:
                    raise ValueError(f"init_layers_from_target: layers.{i}.{name} is {tuple(param.shape)} in the "
                                     f"drafter but {tuple(source[name].shape)} in target layer {layer_id}")
                param.copy_(source[name].to(param.dtype))
                copied += 1
        if not copied:
            raise ValueError(f"init_layers_from_target: target layer {layer_id} shares no parameter with the drafter's "
                             "layers (not a Llama/Qwen-style decoder layer)")
    return kept


def grow_layers(drafter: DSparkDrafter, count: int) -> DSparkDrafter:
    """Append ``count`` decoder layers to ``drafter`` in place, each a copy of its last layer whose attention
    ``o_proj`` and MLP ``down_proj`` are zero: a new layer adds nothing to the residual stream until it trains, so the
    grown drafter computes what the original did (drafts, confidences, losses) and training continues from there
    instead of from a worse start. The config's ``num_hidden_layers`` follows."""
    import copy

    if count < 0:
        raise ValueError(f"add_layers must be >= 0, got {count}")
    for _ in range(count):
        layer = copy.deepcopy(drafter.layers[-1])
        layer.self_attn.layer_idx = len(drafter.layers)
        with torch.no_grad():
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            for bias in (layer.self_attn.o_proj.bias, layer.mlp.down_proj.bias):
                if bias is not None:
                    bias.zero_()
        drafter.layers.append(layer)
    drafter.config.num_hidden_layers = len(drafter.layers)
    return drafter
