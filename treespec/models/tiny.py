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


#: architectures :func:`tiny_gguf` writes (both load in llama.cpp; gemma3 has sliding-window layers)
GGUF_ARCHITECTURES = ("llama", "gemma3")


def tiny_gguf(path, arch: str = "llama", vocab_size: int = 64, seed: int = 0, *, hidden_size: int = 64,
              num_layers: int = 2, sliding_window: int = 4, context: int = 512, logit_scale: float = 1.0):
    """Write a tiny random GGUF model that llama.cpp loads (float32 weights, a SentencePiece-style
    vocabulary of ``vocab_size`` tokens: ``<unk>``, ``<s>``, ``</s>``, then, when ``vocab_size`` leaves room
    (at least 259), the 256 byte tokens ``<0x00>`` .. ``<0xFF>`` that let llama.cpp tokenize any text, then
    ``t3``, ``t4``, ... up to the size). A vocabulary without byte tokens serves token ids only: llama.cpp
    aborts the process on text it cannot tokenize.

    ``gemma3`` takes ``num_layers`` rounded up to 6 (llama.cpp's pattern: five sliding-window layers, then
    a full one) and a small ``sliding_window`` so short generations cross it. ``logit_scale`` scales
    the output weights (peakier next-token laws). Returns ``path``.
    """
    import gguf
    import numpy as np

    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unknown tiny GGUF architecture {arch!r}; expected one of {GGUF_ARCHITECTURES}")
    if vocab_size < 4:
        raise ValueError(f"a tiny GGUF needs at least 4 tokens (3 special ones), got {vocab_size}")
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim, ff = 4, 2, hidden_size // 4, 2 * hidden_size
    layers = max(6, num_layers) if arch == "gemma3" else num_layers

    def w(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden_size)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_sliding_window(sliding_window)
    writer.add_tokenizer_model("llama")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if vocab_size >= 3 + 256 else []
    words = [f"t{i}" for i in range(3 + len(byte_tokens), vocab_size)]
    writer.add_token_list(["<unk>", "<s>", "</s>", *byte_tokens, *words])
    writer.add_token_scores([0.0] * (3 + len(byte_tokens)) + [-float(i) for i in range(len(words))])
    # unknown, control, control, bytes (6), normal (1)
    writer.add_token_types([2, 3, 3] + [6] * len(byte_tokens) + [1] * len(words))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    # tensors in HF layout [out, in] (GGUF stores the reverse, as the writer does)
    writer.add_tensor("token_embd.weight", w(vocab_size, hidden_size, scale=0.5))
    # norm gains of one (GGUF stores Gemma's (1 + w) already added)
    writer.add_tensor("output_norm.weight", np.ones(hidden_size, np.float32))
    writer.add_tensor("output.weight", w(vocab_size, hidden_size, scale=0.5 * logit_scale))
    for i in range(layers):
        one = np.ones(hidden_size, np.float32)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", one)
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(heads * head_dim, hidden_size))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(kv_heads * head_dim, hidden_size))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(kv_heads * head_dim, hidden_size))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(hidden_size, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", one.copy())
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(ff, hidden_size))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(ff, hidden_size))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(hidden_size, ff))
        if arch == "gemma3":
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, np.float32))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, np.float32))
            writer.add_tensor(f"blk.{i}.post_attention_norm.weight", one.copy())
            writer.add_tensor(f"blk.{i}.post_ffw_norm.weight", one.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
