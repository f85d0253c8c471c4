"""Self-speculative drafts: the target's own first layers, its final norm and its LM head.

``early_exit_model(target, num_layers)`` returns an ordinary Hugging Face causal LM that shares every
parameter with the target (no copy, no training) but runs only the first ``num_layers`` decoder
layers. Being a plain HF model it plugs into every drafter, tree builder and Hugging Face assisted
generation. It has its own KV cache (the target's cache holds the same first-layer keys/values for
committed tokens, but sharing them would couple the two caches' rollbacks; not done here).

Reference: Zhang et al. "Draft & Verify: Lossless Large Language Model Acceleration via
Self-Speculative Decoding", arXiv 2309.08168; Liu et al. "Kangaroo: Lossless Self-Speculative
Decoding via Double Early Exiting", arXiv 2404.18911.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel


def early_exit_model(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A causal LM made of ``target``'s first ``num_layers`` layers + final norm + LM head (shared weights)."""
    base = target.base_model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"early exit needs a decoder with a `layers` list; {type(target).__name__} has none")
    total = len(layers)
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be in [1, {total - 1}] for this {total}-layer model, got {num_layers}")
    config = copy.deepcopy(target.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.num_hidden_layers = num_layers
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(text.layer_types)[:num_layers]
    with torch.device("meta"):
        draft = type(target)(config)
    # share every module (and so every parameter) with the target
    draft_base = draft.base_model
    for name, module in base.named_children():
        setattr(draft_base, name, torch.nn.ModuleList(list(layers)[:num_layers]) if name == "layers" else module)
    for name, module in target.named_children():
        if module is not base:
            setattr(draft, name, module)
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()
