"""One registry of drafters by name: what ``treespec generate --draft``, ``benchmarks/run.py`` and
``benchmarks/bench_trees.py`` build.

* :func:`build_drafter` (the CLI's ``--draft`` words): ``ngram``, ``ngram:DEPTH,BRANCHES``, ``head``, ``lookup+head``,
  ``lookup+H.safetensors``, ``H.safetensors``, ``early-exit:L`` or a Hugging Face draft model path;
* :func:`build_tree_drafter` (tree builders at a node budget, :data:`TREE_BUILDERS`): ``ngram``,
  ``chain``, ``specinfer``, ``spectr``, ``sequoia``, ``dyspec``, ``dyspec_threshold``, ``eagle2``,
  ``merged`` over any draft (a causal LM, an early exit, an EAGLE-style head, Medusa heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .drafting.base import Drafter
from .drafting.compose import FirstOf
from .drafting.ngram import NgramConfig, NgramDrafter
from .trees.dyspec import DySpecDrafter
from .trees.eagle2 import Eagle2Drafter
from .trees.grow import ShapeDrafter
from .trees.merged import MergedDrafter
from .trees.sequoia import SequoiaDP
from .trees.shape import TreeShape

#: the best measured n-gram default (benchmarks/results/speed): an adaptive chain of up to 8
LOOKUP = NgramConfig(depth=8, branches=1, adaptive=True)
#: the most draft nodes (root excluded) an ``ngram:DEPTH,BRANCHES`` spelling may ask for (the CLI's MAX_TREE_NODES)
MAX_NGRAM_NODES = 1024

TREE_BUILDERS = ("ngram", "chain", "specinfer", "spectr", "sequoia", "dyspec", "dyspec_threshold", "eagle2",
                 "merged")


@dataclass(frozen=True)
class DraftOptions:
    """``tree``: per-depth widths of a model or head draft (one number n: a chain of n); n-gram lookup takes
    its shape in its name instead (``ngram:DEPTH,BRANCHES``, :func:`ngram_config`), and refuses a ``tree``;
    ``law``: draft law of model / head trees at temperature > 0; ``min_confidence``: adaptive draft
    length of a head. None: the drafter's default (the shipped head's measured settings at the
    generation's temperature, :data:`~treespec.drafting.shipped.DEFAULT_HEAD_SETTINGS`; else a chain of 4,
    iid, no confidence threshold)."""

    tree: tuple[int, ...] | None = None
    law: str | None = None
    min_confidence: float | None = None
    #: a head's weights: "none" (the target's dtype, packed where that pays), "int4" (4-bit, bf16 on a CPU) or
    #: None (the shipped head's setting for the temperature where its kernel runs, else "none")
    quantize: str | None = None
    #: SpecDec++'s stopping rule instead of the confidence: a path stops growing once the shipped acceptance
    #: head's predicted chance that some token on it is rejected exceeds this (shipped head only)
    max_reject: float | None = None

    def __post_init__(self) -> None:
        from .models.fast.quant import QUANTIZE_MODES

        if self.quantize is not None and self.quantize not in ("none", *QUANTIZE_MODES):
            raise ValueError(f"quantize={self.quantize!r}: expected 'none', one of {QUANTIZE_MODES} or None")
        if self.max_reject is not None and self.min_confidence is not None:
            raise ValueError("max_reject replaces min_confidence as the stopping rule: give one of them")


@dataclass(frozen=True)
class DefaultDraft:
    """One entry of :data:`DEFAULT_DRAFTS`: the ``--draft`` word and the results folder that chose it."""

    draft: str
    evidence: str


_TUNING, _SPEED = "benchmarks/results/tuning/", "benchmarks/results/speed/"
#: ``--draft auto`` by (target kind, dtype, temperature regime): the best measured drafter, each with the paired
#: measurement behind it. Target kinds: ``embedded`` (Gemma-3-270M in PyTorch), ``gguf`` (any GGUF in llama.cpp),
#: ``other`` (any other PyTorch model: the shipped head does not fit it; n-gram lookup, not measured there).
DEFAULT_DRAFTS: dict[tuple[str, str, str], DefaultDraft] = {
    # lookup+head faster than n-gram lookup alone on 34 of 48 train prompts (sign test p = 0.0055)
    ("embedded", "bfloat16", "greedy"): DefaultDraft("lookup+head", _TUNING + "2026-11-27-4b0e164-epyc-v2cont6-t0-paired"),
    # the head 1.22x plain against 1.09x for n-gram lookup (head v2, Intel Xeon with native bf16)
    ("embedded", "bfloat16", "sampled"): DefaultDraft("head", _TUNING + "2026-11-25-6b9a6c8-bf16-v2-defaults"),
    # the best float32 row of the protocol
    ("embedded", "float32", "greedy"): DefaultDraft("ngram", _SPEED + "2026-11-26-b6a4522-epyc-v2cont3-protocol"),
    # every drafter slower than plain decoding (the head 0.68x, n-gram lookup 0.74x)
    ("embedded", "float32", "sampled"): DefaultDraft("none", _TUNING + "2026-11-25-d3a41aa-fp32-t1-defaults"),
    # GGUF targets where --dtype auto gives float32 (a CPU without native bf16): llama.cpp computes its LM head for
    # every tree node, and on an AVX2-only AMD EPYC every drafter lost to plain decoding on the embedded GGUF
    # (n-gram lookup 0.88x / 0.81x its plain decoding at T=0 / T=1, the head 0.63x / 0.58x)
    ("gguf", "float32", "greedy"): DefaultDraft("none", _SPEED + "2026-11-27-2a998ca-epyc-avx2-llama-target"),
    ("gguf", "float32", "sampled"): DefaultDraft("none", _SPEED + "2026-11-27-2a998ca-epyc-avx2-llama-target"),
    # GGUF targets on a native-bf16 CPU (AMD EPYC Zen 4, 24 train prompts, paired with plain decoding on llama.cpp):
    # at T=0 n-gram lookup tied (1.015x, faster on 12, slower on 12) and its greedy output left llama.cpp's own
    # plain decoding on most prompts (llama.cpp's batched passes round differently), the heads lost (0.95x,
    # 0.93x); at T=1 every drafter lost (n-gram lookup 0.82x, 1 of 24 faster; the head 0.73x)
    ("gguf", "bfloat16", "greedy"): DefaultDraft("none", _TUNING + "2026-11-28-a810d1f-zen4-gguf-t0-t1"),
    ("gguf", "bfloat16", "sampled"): DefaultDraft("none", _TUNING + "2026-11-28-a810d1f-zen4-gguf-t0-t1"),
}


@dataclass(frozen=True)
class DefaultLeafLogits:
    """One entry of :data:`DEFAULT_LEAF_LOGITS`: :class:`~treespec.generate.GenerationConfig`'s ``leaf_logits``
    and the results folder that chose it."""

    leaf_logits: bool
    evidence: str


_LEAF_ROWS = _SPEED + "2026-11-27-126cb5d-epyc-avx2-leaf-rows"
#: ``--leaf-logits auto`` by (target kind, resolved ``--draft`` word); a pair not listed computes every leaf's
#: logits (a PyTorch target's LM head over a few more rows costs little: its weights are read once per pass). On
#: llama.cpp, which computes an LM-head row (262,144 x 640, Q8_0) for every token it outputs, skipping the leaves'
#: rows made n-gram lookup 1.061x / 1.111x as fast at T=0 / T=1 (13 of 14 prompts faster, sign test p = 0.0018)
#: and lookup+head 1.039x / 1.045x; the head alone went 0.932x / 0.997x, so it keeps them (paired.md there).
DEFAULT_LEAF_LOGITS: dict[tuple[str, str], DefaultLeafLogits] = {
    ("gguf", "ngram"): DefaultLeafLogits(False, _LEAF_ROWS),
    ("gguf", "lookup+head"): DefaultLeafLogits(False, _LEAF_ROWS),
}


def default_leaf_logits(target: str, draft: str) -> bool:
    """What ``--leaf-logits auto`` stands for on ``target`` (a ``--target`` value) with ``draft`` (a resolved
    ``--draft`` word): an entry of :data:`DEFAULT_LEAF_LOGITS`, else True."""
    entry = DEFAULT_LEAF_LOGITS.get((target_kind(target), draft))
    return entry.leaf_logits if entry is not None else True


#: the ``--target`` word for the embedded Gemma-3-270M's own Q4_K_M GGUF, run by llama.cpp
EMBEDDED_GGUF = "embedded-gguf"


@dataclass(frozen=True)
class DefaultTarget:
    """One entry of :data:`DEFAULT_TARGETS`: the ``--target`` word ``auto`` stands for and the results folder
    that chose it."""

    target: str
    evidence: str


_ZEN4_T0_T1 = _TUNING + "2026-11-28-a810d1f-zen4-gguf-t0-t1"
#: ``--target auto`` (the CLI's default) by (the dtype ``--dtype auto`` gives on this CPU, temperature regime): the
#: engine on which the embedded Gemma-3-270M, with ``--draft auto`` there, decoded fastest in a paired run. Used
#: where llama-cpp-python is installed and nothing asks for PyTorch (``treespec.cli.resolve_target``).
DEFAULT_TARGETS: dict[tuple[str, str], DefaultTarget] = {
    # native bf16 (AMD EPYC Zen 4, 24 train prompts x 64 tokens, paired): at T=0 plain decoding on llama.cpp ran
    # 0.78x the PyTorch target's lookup+head (slower on 18 of 24, sign test p = 0.023), n-gram lookup there 0.81x
    ("bfloat16", "greedy"): DefaultTarget("embedded", _ZEN4_T0_T1),
    # same run at T=1: plain decoding on llama.cpp 1.35x the PyTorch target's head (faster on 23 of 24, p = 3e-6);
    # at T=0.7 with top-p 0.95 (tuning/2026-11-28-a810d1f-zen4-gguf-t07-topp095) 1.24x (faster on 17 of 24)
    ("bfloat16", "sampled"): DefaultTarget(EMBEDDED_GGUF, _ZEN4_T0_T1),
    # no native bf16 (AVX2-only AMD EPYC): llama.cpp's Q4_K_M decoding ran about 5x the PyTorch target in float32
    ("float32", "greedy"): DefaultTarget(EMBEDDED_GGUF, _SPEED + "2026-11-27-2a998ca-epyc-avx2-llama-target"),
    ("float32", "sampled"): DefaultTarget(EMBEDDED_GGUF, _SPEED + "2026-11-27-2a998ca-epyc-avx2-llama-target"),
}


def default_target(dtype: torch.dtype, temperature: float) -> DefaultTarget:
    """What ``--target auto`` stands for where ``--dtype auto`` gives ``dtype`` at ``temperature``, when
    llama.cpp is installed and nothing asks for PyTorch: an entry of :data:`DEFAULT_TARGETS`."""
    return DEFAULT_TARGETS[(str(dtype).removeprefix("torch."), "greedy" if temperature <= 0 else "sampled")]


def target_kind(target: str) -> str:
    """``embedded``, ``gguf`` or ``other`` for a ``--target`` value (the keys of :data:`DEFAULT_DRAFTS`)."""
    if target == "embedded":
        return "embedded"
    if target == EMBEDDED_GGUF or target.lower().endswith(".gguf"):
        return "gguf"
    return "other"


def default_draft(target: str, dtype: torch.dtype, temperature: float) -> str:
    """The ``--draft`` word that ``--draft auto`` stands for on ``target`` (a ``--target`` value) in ``dtype`` at
    ``temperature``: an entry of :data:`DEFAULT_DRAFTS`, else n-gram lookup (any other target: model-free, the
    one drafter that fits every vocabulary)."""
    key = (target_kind(target), str(dtype).removeprefix("torch."), "greedy" if temperature <= 0 else "sampled")
    entry = DEFAULT_DRAFTS.get(key)
    return entry.draft if entry is not None else "ngram"


def ngram_config(name: str) -> NgramConfig:
    """The n-gram lookup ``--draft name`` stands for: ``ngram``, the measured adaptive chain :data:`LOOKUP`, or
    ``ngram:DEPTH,BRANCHES``, up to BRANCHES distinct continuations of DEPTH tokens (DEPTH x BRANCHES nodes at
    most, bounded by :data:`MAX_NGRAM_NODES`). A malformed spelling raises ValueError naming it."""
    if name == "ngram":
        return LOOKUP
    spec = name.removeprefix("ngram:")
    try:
        depth, branches = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"{name}: n-gram lookup takes ngram:DEPTH,BRANCHES with two positive integers "
                         f"(e.g. ngram:8,4), or plain ngram") from None
    if depth < 1 or branches < 1:
        raise ValueError(f"{name}: DEPTH and BRANCHES must be positive integers (e.g. ngram:8,4)")
    if depth * branches > MAX_NGRAM_NODES:
        raise ValueError(f"{name} asks for {depth * branches} draft nodes (DEPTH x BRANCHES); the limit is "
                         f"{MAX_NGRAM_NODES}")
    return NgramConfig(depth=depth, branches=branches, max_nodes=depth * branches)


def tree_widths(tree: tuple[int, ...] | None, default: tuple[int, ...] = ()) -> tuple[int, ...]:
    """``--tree`` as per-depth widths (one number n: a chain of n); ``default`` where ``tree`` is None."""
    tree = tuple(tree or default)
    return (1,) * tree[0] if len(tree) == 1 else tree


def inference_head(target, path: str | None = None, quantize: str | None = None, temperature: float = 0.0):
    """The head ``--draft`` uses, set for drafting (:meth:`~treespec.drafting.subset_head.SubsetHead.for_inference`):
    the shipped one when ``path`` is None, attached to ``target``, computing in the target's dtype. ``quantize``
    None: the shipped head's measured setting for ``temperature`` (4-bit weights where torch's int4 kernel runs,
    bf16 on a CPU); a head file of its own computes in the target's dtype unless asked for int4. Returns the head
    and its settings (:data:`~treespec.drafting.shipped.DEFAULT_HEAD_SETTINGS` for the shipped one)."""
    from .drafting.head_files import load_head
    from .drafting.shipped import DEFAULT_HEAD_SETTINGS, load_default_head
    from .models.fast.quant import int4_kernel_missing

    head = load_default_head(target) if path is None else load_head(path, target)
    settings = (DEFAULT_HEAD_SETTINGS["greedy" if temperature <= 0 else "sampled"] if path is None
                else {"tree": (1, 1, 1, 1), "min_confidence": 0.0})
    if quantize is None:  # the measured setting, where its kernel runs (bf16 activations on a CPU)
        quantize = settings.get("quantize", "none")
        if quantize == "int4" and (target.dtype != torch.bfloat16 or head.lm_rows.device.type != "cpu"
                                   or int4_kernel_missing() is not None):
            quantize = "none"
    head.for_inference(target.dtype, quantize=None if quantize == "none" else quantize)
    return head, settings


def head_drafter(target, path: str | None, options: DraftOptions = DraftOptions(),
                 temperature: float = 0.0) -> ShapeDrafter:
    """An EAGLE-style head (the shipped one when ``path`` is None) growing per-depth widths, in the form
    :func:`inference_head` gives it. Options left None take the shipped head's settings for ``temperature``
    (0: greedy, else sampled)."""
    head, settings = inference_head(target, path, options.quantize, temperature)
    law = options.law or settings.get("law", "iid")
    shape = TreeShape.widths(tree_widths(options.tree, settings["tree"]))
    if options.max_reject is not None:
        if path is not None:
            raise ValueError("max_reject reads the shipped acceptance head, trained for the shipped draft head only")
        from .drafting.shipped import load_default_stop_head
        from .drafting.stopping import PredictedStop

        stop = PredictedStop(load_default_stop_head(head.lm_rows.device), options.max_reject)
        return ShapeDrafter(head, shape, law, stop=stop)
    confidence = settings["min_confidence"] if options.min_confidence is None else options.min_confidence
    return ShapeDrafter(head, shape, law, min_confidence=confidence)


def is_head_path(name: str) -> bool:
    """Whether a ``--draft`` word names a head file (``.safetensors``) or a ``speculators`` EAGLE-3 checkpoint folder."""
    from .drafting.head_files import is_speculators_checkpoint

    return name.endswith(".safetensors") or is_speculators_checkpoint(name)


def build_drafter(name: str, target, options: DraftOptions = DraftOptions(), *, temperature: float = 0.0,
                  tokenizer=None, dtype: torch.dtype | None = None) -> Drafter:
    """The drafter ``--draft name`` stands for, drafting for ``target`` (a Hugging Face causal LM) at
    ``temperature`` (which of the shipped head's default settings apply).

    ``tokenizer`` (the target's) and ``dtype`` are needed for a draft model path only.
    """
    if name == "head" or name.startswith("lookup+"):
        path = None if name in ("head", "lookup+head") else name.removeprefix("lookup+")
        head = head_drafter(target, path, options, temperature)
        return head if name == "head" else FirstOf(NgramDrafter(LOOKUP), head)
    if name == "ngram" or name.startswith("ngram:"):
        if options.tree is not None:
            raise ValueError(f"a tree of widths {options.tree} shapes a model or head draft; n-gram lookup takes "
                             f"its shape in its name: ngram:DEPTH,BRANCHES (e.g. ngram:8,4)")
        return NgramDrafter(ngram_config(name))
    if is_head_path(name):  # an EAGLE-style head (python -m treespec.distill) or a speculators EAGLE-3 folder
        return head_drafter(target, name, options, temperature)
    from .models.loading import load_draft_model, load_model, load_tokenizer

    widths = TreeShape.widths(tree_widths(options.tree, (1, 1, 1, 1)))
    if name.startswith("early-exit:"):  # the target's own first layers (self-speculative)
        return ShapeDrafter(load_draft_model(name, target), widths, options.law or "iid")
    from .models.compat import check_tokenizers, check_vocab_sizes

    check_tokenizers(tokenizer, load_tokenizer(name))
    draft = load_model(name, dtype=dtype, device=target.device)
    check_vocab_sizes(target, draft)
    return ShapeDrafter(draft, widths, options.law or "iid", target.get_output_embeddings().weight.shape[0])


def specinfer_widths(budget: int) -> tuple[int, ...]:
    """Per-depth widths <4, 2, 2, 1, 1, ...> grown while the tree fits the budget (SpecInfer's <k1..km>)."""
    plan, widths = [4, 2, 2] + [1] * 16, []
    for w in plan:
        if TreeShape.widths(tuple(widths + [w])).num_drafted > budget:
            break
        widths.append(w)
    return tuple(widths) or (min(budget, 1),)


def build_tree_drafter(builder: str, draft, budget: int, *, vocab: int | None = None,
                       acc: list[float] | None = None, max_depth: int = 8, min_confidence: float = 0.0) -> Drafter:
    """Tree builder ``builder`` of :data:`TREE_BUILDERS` drafting ``budget`` nodes (at most ``max_depth`` deep)
    with ``draft``; ``acc``: the acceptance rows of ``sequoia``; ``vocab``: the target's vocabulary;
    ``min_confidence``: the draft builders' confidence rule (:class:`~treespec.drafting.stopping.ConfidenceStop`;
    0: none; n-gram lookup has no draft probabilities and ignores it)."""
    law = "without_replacement"
    conf = {"min_confidence": min_confidence}
    if builder == "ngram":
        return NgramDrafter(NgramConfig(depth=min(8, budget), branches=max(1, math.ceil(budget / 8)),
                                        max_nodes=budget))
    if builder == "chain":
        return ShapeDrafter(draft, TreeShape.chain(min(budget, max_depth)), law, vocab, **conf)
    if builder == "specinfer":
        return ShapeDrafter(draft, TreeShape.widths(specinfer_widths(budget)), law, vocab, **conf)
    if builder == "spectr":
        return ShapeDrafter(draft, TreeShape.independent_chains(4, max(1, min(budget // 4, max_depth))), "iid",
                            vocab, **conf)
    if builder == "sequoia":
        return ShapeDrafter(draft, SequoiaDP(acc, budget, max_depth).shape(budget, max_depth), law, vocab, **conf)
    if builder == "dyspec":
        return DySpecDrafter(draft, budget, max_depth, target_vocab_size=vocab, **conf)
    if builder == "dyspec_threshold":
        return DySpecDrafter(draft, budget, max_depth, variant="threshold", target_vocab_size=vocab, **conf)
    if builder == "eagle2":
        return Eagle2Drafter(draft, budget, top_k=min(8, budget), depth=max_depth, target_vocab_size=vocab, **conf)
    if builder == "merged":
        extra = max(1, budget // 4)
        return MergedDrafter(Eagle2Drafter(draft, budget - extra, top_k=min(8, budget), depth=max_depth,
                                           target_vocab_size=vocab, **conf),
                             NgramConfig(depth=min(8, extra), branches=2, max_nodes=extra))
    raise ValueError(f"unknown tree builder {builder!r}; expected one of {TREE_BUILDERS}")
