"""The target features a draft head reads: the last hidden state, optionally with earlier layers.

A head built with ``feature_layers = (a, b)`` reads, at every position, the concatenation
``[r_a, r_b, h]`` ``[(k + 1) * H]``: the residual stream right after decoder layers ``a`` and ``b``
(0-based, before any final norm) and the last hidden state ``h`` after the final norm (the one the
LM head reads). With ``feature_layers = ()`` the features are ``h`` alone. Fusing low, middle and top
layers is one of the changes of EAGLE-3 (Li et al., "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test", arXiv 2503.01840).

Every place that produces features goes through here or follows the same layout: the target runners
(``forward(..., need_hidden=True, feature_layers=...)``), the distillation corpus and the
measurements, so a head sees the same numbers when it trains and when it drafts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def num_decoder_layers(model) -> int:
    """Decoder layers of a Hugging Face causal LM."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    if n is None:
        raise ValueError(f"{type(model).__name__}: cannot tell how many decoder layers it has")
    return int(n)


def normalise_feature_layers(layers) -> tuple[int, ...]:
    """``layers`` (a list or tuple of ints, e.g. read from JSON) as a tuple of strictly increasing
    indices >= 0; a ``ValueError`` naming the problem otherwise (the target's depth is not checked)."""
    if not isinstance(layers, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                         for x in layers):
        raise ValueError(f"feature layers must be a list of decoder layer indices, got {layers!r}")
    out = tuple(layers)
    if any(b <= a for a, b in zip(out, out[1:])) or (out and out[0] < 0):
        raise ValueError(f"feature layers must be strictly increasing layer indices >= 0, got {list(out)}")
    return out


def check_feature_layers(layers, num_layers: int) -> tuple[int, ...]:
    """``layers`` as a tuple of strictly increasing layer indices in ``[0, num_layers - 2]``.

    The last layer is excluded: its output is what the final norm turns into ``h``, which the
    features always hold.
    """
    out = tuple(int(x) for x in layers)
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"feature layers must be strictly increasing, got {list(out)}")
    if out and (out[0] < 0 or out[-1] > num_layers - 2):
        raise ValueError(f"feature layers must lie in [0, {num_layers - 2}] for a target with {num_layers} "
                         f"decoder layers (the last hidden state is always included), got {list(out)}")
    return out


def join_features(layer_outputs: Sequence[torch.Tensor] | Mapping[int, torch.Tensor], last_hidden: torch.Tensor,
                  layers: tuple[int, ...]) -> torch.Tensor:
    """``[..., (k + 1) * H]`` from the outputs of the decoder layers (``layer_outputs[i]`` ``[..., H]`` = layer
    ``i``, a sequence or a mapping) and the last hidden state ``[..., H]``; ``last_hidden`` itself when
    ``layers`` is empty (k = ``len(layers)``)."""
    if not layers:
        return last_hidden
    return torch.cat([layer_outputs[i].to(last_hidden.dtype) for i in layers] + [last_hidden], dim=-1)


def model_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   layers: tuple[int, ...] = ()) -> torch.Tensor:
    """Features ``[B, L, (k + 1) * H]`` of a plain (cache-free) forward of a Hugging Face causal LM.

    input_ids ``[B, L]``; attention_mask ``[B, L]`` (1 = token, 0 = padding) or None; k = ``len(layers)``."""
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=bool(layers))
    return join_features(hf_layer_outputs(out), out.last_hidden_state, layers)


def hf_layer_outputs(out) -> tuple[torch.Tensor, ...]:
    """The decoder layers' outputs of a Hugging Face base-model output with ``output_hidden_states``.

    Its ``hidden_states`` are (embeddings, output of layer 0, ..., output of layer L - 2, final
    normed state): entry ``i + 1`` is layer ``i``'s output for every ``i <= L - 2``.
    """
    states = out.hidden_states
    return tuple(states[1:-1]) if states is not None else ()
