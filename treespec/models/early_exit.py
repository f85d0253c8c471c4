"""Self-speculative drafts: the target's own first layers, its final norm and its LM head.

``early_exit_model(target, num_layers)`` returns an ordinary Hugging Face causal LM that shares every
parameter with the target (no copy, no training) but runs only the first ``num_layers`` decoder
layers. Being a plain HF model it plugs into every drafter, tree builder and Hugging Face assisted
generation. Inside treespec's engine it shares the target's KV cache (:class:`SharedCacheRunner`):
the target's first ``num_layers`` layers hold exactly the keys and values the draft would compute
for the committed tokens (same weights, tokens and positions), so the draft never prefills the
prompt or catches up on accepted tokens, and keeps no copy of the committed cache.

Reference: Zhang et al. "Draft & Verify: Lossless Large Language Model Acceleration via
Self-Speculative Decoding", arXiv 2309.08168; Liu et al. "Kangaroo: Lossless Self-Speculative
Decoding via Double Early Exiting", arXiv 2404.18911.
"""

from __future__ import annotations

import copy
import types

import torch
from transformers import PreTrainedModel

from .kv_cache import TreeKVCache, TreeKVLayer
from .runner import CacheBook, DraftObservation, ModelRunner

#: key under which an early-exit model records (target, num_layers) in its ``__dict__`` (not a submodule)
EARLY_EXIT_KEY = "treespec_early_exit"


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
    draft.__dict__[EARLY_EXIT_KEY] = (target, num_layers)  # plain attribute: not a registered submodule
    draft.as_runner = types.MethodType(SharedCacheRunner, draft)  # drafts through the shared cache
    return draft.eval()


class SharedCacheRunner(ModelRunner):
    """Runner of an early-exit draft that reads its committed keys/values from the target's cache.

    At the start of every proposal (:meth:`observe`, given the engine's target runner in
    ``state.target_runner``) each of the draft's layers is pointed at the buffers of the same
    target layer, filled up to the target's committed length; the draft then writes its tree
    nodes after them, into the part of the buffers the target's verify pass overwrites next
    (a buffer that has to grow becomes a private copy; the next proposal points at the target's
    again). :meth:`commit` never moves entries into the shared, committed part: the target has
    committed the accepted path itself. Without a target runner (another engine, HF assisted
    generation) it is an ordinary :class:`ModelRunner` with its own cache.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        target, num_layers = model.__dict__[EARLY_EXIT_KEY]
        super().__init__(model)
        self.target_model, self.num_layers = target, num_layers
        self.sharing = False

    def reset(self) -> None:
        super().reset()
        self.sharing = False

    def observe(self, state: DraftObservation) -> None:
        """Adopt the target's committed cache (see the class docs); no-op without a usable one (no
        target runner, another model's, one holding tree nodes, or one whose cache is not a
        :class:`ModelRunner`'s)."""
        target = state.target_runner
        if (target is None or target.model is not self.target_model or target.slots
                or not isinstance(target, ModelRunner)):
            if self.sharing:  # cannot go back to a private cache mid-sequence: rebuild it from scratch
                super().reset()
            self.sharing = False
            return
        layers = target.cache.layers[: self.num_layers]
        if len(layers) < self.num_layers or not all(layer.is_initialized for layer in layers):
            return  # nothing committed yet (a one-token prompt): the draft's own cache serves this step
        cache = TreeKVCache()
        for src in layers:
            dst = TreeKVLayer()
            dst.dtype, dst.device, dst.is_initialized = src.dtype, src.device, True
            dst._k, dst._v, dst._len = src._k, src._v, target.length
            cache.layers.append(dst)
        self.cache = cache
        self.book = CacheBook(length=target.length)  # the target's committed prefix, no tree
        self.key_positions = target.key_positions[: target.length].clone()
        self.sharing = True

    def commit(self, nodes: list[int]) -> None:
        if not self.sharing:
            super().commit(nodes)
            return
        for layer in self.cache.layers:  # drop the tree entries; the committed part is the target's
            layer._len = self.length
        self.key_positions = self.key_positions[: self.length]
        self.book.committed(0)  # a rollback: the target committed the accepted path itself
