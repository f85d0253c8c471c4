"""Tiny randomly initialised Hugging Face causal LMs, built in-process (tests, examples, CI).

Nothing is downloaded: configs are written here and weights drawn from a seeded generator.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

ARCHITECTURES = ("llama", "gpt2", "gemma3")


def tiny_model(arch: str = "llama", vocab_size: int = 64, seed: int = 0, *, hidden_size: int = 32,
               num_layers: int = 2, sliding_window: int = 8, max_positions: int = 512,
               dtype: torch.dtype = torch.float32, logit_scale: float = 1.0) -> PreTrainedModel:
    """A tiny random causal LM of the given architecture.

    ``gemma3`` alternates sliding-window and full layers with a small ``sliding_window`` so short
    generations cross it. ``logit_scale`` multiplies the LM head weights: larger values make the
    next-token distributions peakier (more realistic acceptance rates).
    """
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                             num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=max_positions, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    elif arch == "gpt2":
        config = GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=4,
                            n_positions=max_positions, bos_token_id=0, eos_token_id=1)
        model = GPT2LMHeadModel(config)
    elif arch == "gemma3":
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(max(num_layers, 2))]
        config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                  num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, sliding_window=sliding_window, layer_types=layer_types,
                                  max_position_embeddings=max_positions, pad_token_id=0)
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHITECTURES}")
    if logit_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    return model.to(dtype).eval()
