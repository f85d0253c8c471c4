"""Command line: ``treespec generate "PROMPT"`` on the embedded Gemma-3-270M (or any HF model).

Examples::

    treespec generate "The capital of France is" --max-new-tokens 64
    treespec generate "def fib(n):" --temperature 0.8 --top-p 0.95 --json
    treespec generate "Once upon a time" --plain            # plain autoregressive decoding
    treespec generate "def f(x):" --draft ngram:8,4         # n-gram lookup: 4 continuations of 8 tokens
    treespec generate "Hello" --draft path/to/small-lm --tree 2,2,1 --law without_replacement
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the engine loads only once a command runs: building the parser imports no torch
    import torch

    from .drafting.base import Drafter
    from .models.runner import ModelRunner

#: the parser's choices, copied from the engine's registries so that ``--help`` imports no torch
#: (tests/treespec/test_cli_help.py checks each against its registry): ``--verifier`` names with what each means
#: (:data:`treespec.verify.VERIFIERS`), ``--law`` (:data:`treespec.tree.DRAFT_LAWS`), ``--draft-quantize`` and
#: ``--quantize`` modes (:data:`treespec.models.fast.QUANTIZE_MODES`, ``TARGET_QUANTIZE_MODES``) and the embedded
#: GGUF's ``--target`` word
#: (:data:`treespec.drafters.EMBEDDED_GGUF`)
VERIFIER_MEANINGS = {
    "greedy": "temperature 0: accept drafted tokens while they are the target's argmax",
    "single": "one i.i.d. child per node, accepted with probability min(1, p/q)",
    "rrs": "recursive rejection sampling over i.i.d. children",
    "rrs_without_replacement": "recursive rejection sampling over children drawn without replacement",
    "deterministic": "children fixed by the draft (n-gram lookup, top-k)",
    "kseq": "K-SEQ over i.i.d. children",
    "greedy_draft": "children drawn by the greedy_draft law",
    "spechub": "SpecHub's pair law (1 or 2 children per node)",
    "block": "a drafted chain verified jointly (block verification)",
    "traversal": "an i.i.d.-drafted tree verified leaf to root, whole sequences at a time (traversal verification)",
}
DRAFT_LAWS = ("iid", "without_replacement", "deterministic", "greedy_draft", "spechub")
QUANTIZE_MODES = ("int4",)
TARGET_QUANTIZE_MODES = ("int4", "int8-head")
#: the line ``--quantize int8-head`` prints on an x86 CPU without an 8-bit dot product (it still decodes as asked)
INT8_HEAD_WITHOUT_VNNI = ("treespec: note: --quantize int8-head on a CPU without VNNI (no avx512_vnni, avx_vnni or "
                          "amx_int8 flag): oneDNN's int8 product has no dot-product instructions here, and on such a CPU "
                          "it was measured slower than the float LM head for passes of a few rows, with 7-bit "
                          "activations (docs/cli.md)")
EMBEDDED_GGUF = "embedded-gguf"

#: names of the engine this module calls, imported on first use and read through :func:`_engine` (a test may
#: substitute one on this module): name -> (module, attribute)
_ENGINE = {
    "generate": (".generate", "generate"),
    "build_drafter": (".drafters", "build_drafter"),
    "HUB_PROBE_S": (".models.loading", "HUB_PROBE_S"),
    "_hub_reachable": (".models.loading", "hub_reachable"),
    "_cached_snapshot": (".models.loading", "cached_snapshot"),
}


def __getattr__(name: str) -> Any:
    if name not in _ENGINE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _ENGINE[name]
    value = getattr(importlib.import_module(module, __package__), attribute)
    globals()[name] = value
    return value


def _engine(name: str) -> Any:
    """The engine function ``name`` of :data:`_ENGINE` as this module holds it now."""
    return getattr(sys.modules[__name__], name)


def _branching(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tree takes comma-separated children per depth like 2,2,1; got {text!r}")
    if not widths or any(w < 1 for w in widths):
        raise argparse.ArgumentTypeError(f"--tree widths must be positive integers; got {text!r}")
    return widths


#: the largest draft tree (nodes, root excluded) the CLI builds; bigger trees are refused before allocation
MAX_TREE_NODES = 1024
#: --draft words; anything else must be ngram:DEPTH,BRANCHES, an existing local path, a hub id "owner/name", or
#: early-exit:L
DRAFT_WORDS = ("auto", "lookup+head", "head", "ngram", "none")


class CliInputError(ValueError):
    """A command-line value the CLI refuses before loading anything."""


def resolve_target(args: argparse.Namespace, dtype: torch.dtype | None = None) -> tuple[str, str | None]:
    """``--target`` with ``auto`` (the default) resolved, and why (None unless auto chose): the embedded
    Gemma-3-270M on the engine measured fastest for the run's dtype and temperature,
    :data:`~treespec.drafters.DEFAULT_TARGETS`: PyTorch at T=0 where the CPU computes bf16 natively, llama.cpp at
    T > 0 there and at every temperature where it does not. ``auto`` stays on PyTorch where llama-cpp-python is not
    installed, where the run is on a GPU, and where the command asks for PyTorch (:func:`_pytorch_asked`)."""
    from .drafters import DEFAULT_TARGETS, default_target

    if args.target != "auto":
        return args.target, None
    if dtype is None:
        dtype = resolve_cli_dtype(args)
    if (device := resolve_cli_device(args)).type != "cpu":
        return "embedded", f"--target auto: the PyTorch target (a {device.type} device)"
    if (dtype_word := str(dtype).removeprefix("torch.")) not in {key[0] for key in DEFAULT_TARGETS}:
        return "embedded", None
    if (flag := _pytorch_asked(args, dtype_word)) is not None:
        return "embedded", f"--target auto: the PyTorch target ({flag})"
    chosen = default_target(dtype, args.temperature)
    regime = "at T=0" if args.temperature <= 0 else "at T > 0"
    why = f"measured fastest for {dtype_word} {regime} on this kind of CPU: {chosen.evidence}"
    if chosen.target == "embedded":
        return "embedded", f"--target auto: the PyTorch target ({why})"
    from .models.llama_cpp import llama_cpp_available

    if (missing := llama_cpp_available()) is not None:
        return "embedded", (f"--target auto: the PyTorch target; llama.cpp would be faster here ({why}) but "
                            f"{missing})")
    return EMBEDDED_GGUF, f"--target auto: llama.cpp on the embedded model's Q4_K_M GGUF ({why})"


def _pytorch_asked(args: argparse.Namespace, dtype_word: str) -> str | None:
    """Why ``--target auto`` keeps the PyTorch target whatever the table says, in words (None: nothing asks):
    an option of PyTorch targets (``--dtype``, ``--exact``, ``--quantize``, ``--runner``, ``--draft-quantize``); a
    draft llama.cpp cannot feed (a draft model, an early exit, a head reading earlier layers); a tree beyond a
    llama.cpp pass; and, where the CPU computes bf16 natively, a draft or verifier the engines were not compared
    with (the table measured ``--draft auto``; a named draft, a shaping option or ``--verifier`` stays on the
    target it was tuned on)."""
    gguf_draft = (args.draft in DRAFT_WORDS or args.draft.endswith(".safetensors") or _is_ngram(args.draft)) \
        and _layers_head(args.draft) is None  # lookup+H.safetensors included
    for flag, used in (("--dtype", args.dtype != "auto"), ("--exact", args.exact),
                       ("--quantize", args.quantize != "none"), ("--runner", args.runner != "auto"),
                       ("--draft-quantize", args.draft_quantize not in ("auto", "none")),
                       ("--judge", getattr(args, "judge", None) is not None),
                       (f"--draft {args.draft}", not gguf_draft)):
        if used:
            return f"{flag} asks for it"
    if (excess := _beyond_llama_pass(args.draft, args.tree)) is not None:
        return excess
    named = not args.plain and args.draft not in ("auto", "none")
    flag = f"--draft {args.draft}" if named else _shaping_flag(args) or \
        ("--verifier" if args.verifier != "auto" and not args.plain else None)
    if dtype_word == "bfloat16" and flag is not None:
        return f"the engines were compared with --draft auto; {flag} stays on the target it was tuned on"
    return None


def _leaf_logits(args: argparse.Namespace) -> bool:
    """``--leaf-logits`` as :class:`GenerationConfig`'s ``leaf_logits`` (``auto``: the target's measured setting)."""
    from .drafters import default_leaf_logits

    if args.leaf_logits != "auto":
        return args.leaf_logits == "on"
    draft = "none" if args.plain else _resolved_draft(args)
    return default_leaf_logits(args.target, "ngram" if _is_ngram(draft) else draft)


def _is_ngram(draft: str) -> bool:
    """Whether a ``--draft`` word is n-gram lookup alone: ``ngram`` or ``ngram:DEPTH,BRANCHES``."""
    return draft == "ngram" or draft.startswith("ngram:")


def _shaping_flag(args: argparse.Namespace) -> str | None:
    """The first of ``--tree``, ``--law``, ``--min-confidence``, ``--max-reject`` the command gives (options that
    shape a model or head draft), None without one."""
    for flag, value in (("--tree", args.tree), ("--law", args.law), ("--min-confidence", args.min_confidence),
                        ("--max-reject", args.max_reject)):
        if value is not None:
            return flag
    return None


def _reads_head(draft: str) -> bool:
    """Whether a resolved ``--draft`` word drafts with a head (the shipped one or a head file)."""
    from .drafters import is_head_path

    return draft in ("head", "lookup+head") or is_head_path(draft)


def tree_nodes(branching: tuple[int, ...]) -> int:
    """Number of drafted nodes of a static tree with ``branching[d]`` children per node at depth d."""
    total, level = 0, 1
    for width in branching:
        level *= width
        total += level
    return total


def _resolved_draft(args: argparse.Namespace, dtype: torch.dtype | None = None) -> str:
    """``--draft`` with ``auto`` resolved: :func:`~treespec.drafters.default_draft` (the measured table
    :data:`~treespec.drafters.DEFAULT_DRAFTS`) for the run's target, dtype (``dtype``, else the one ``args`` asks
    for) and temperature. ``--tree``, ``--law`` and ``--min-confidence`` shape the head of what auto picks; where
    auto picks a draft without one (n-gram lookup or none), they ask for the shipped head on the embedded targets
    and are refused on others (the head fits Gemma-3-270M only). The head's own settings per temperature (tree,
    confidence, law, 4-bit weights) are :data:`~treespec.drafting.shipped.DEFAULT_HEAD_SETTINGS`."""
    from .drafters import default_draft

    if args.draft != "auto":
        return args.draft
    if dtype is None:
        dtype = resolve_cli_dtype(args)
    target = resolve_target(args, dtype)[0]
    draft = default_draft(target, dtype, args.temperature)
    flag = _shaping_flag(args)
    if flag is None or not (_is_ngram(draft) or draft == "none"):
        return draft
    if target in ("embedded", EMBEDDED_GGUF):
        return "head"
    spelled = " (for n-gram lookup spell its shape --draft ngram:DEPTH,BRANCHES, e.g. ngram:8,4)" \
        if flag == "--tree" else ""
    auto = "drafts with n-gram lookup" if _is_ngram(draft) else "decodes without a draft"
    raise CliInputError(f"{flag} shapes a model or head draft, and --draft auto {auto} on this target, which the "
                        f"shipped head does not fit: name a --draft model or head file{spelled}, or drop {flag}")


def _layers_head(draft: str) -> str | None:
    """What the head file ``draft`` (``lookup+`` allowed) is when it reads more of the target than its last hidden
    state, which is all llama.cpp returns: a Kangaroo adapter (the target's early layers and KV cache) or an EAGLE-3
    head (three earlier layers); None otherwise (no such file, or an EAGLE head)."""
    from .drafting.head_files import head_class_of, is_speculators_checkpoint

    path = draft.removeprefix("lookup+")
    if is_speculators_checkpoint(path):
        return "an EAGLE-3 checkpoint"
    if not path.endswith(".safetensors") or not os.path.isfile(path):
        return None

    return {"KangarooAdapter": "a Kangaroo adapter", "Eagle3Head": "an EAGLE-3 head"}.get(
        head_class_of(path).__name__)


def _check_gguf_args(args: argparse.Namespace) -> None:
    """A GGUF target runs in llama.cpp: its weights and kernels are the file's, so the PyTorch target options
    do not apply, and the draft head fits the embedded model's GGUF only."""
    if args.target != EMBEDDED_GGUF and not os.path.isfile(args.target):
        raise CliInputError(f"--target {args.target}: no GGUF file there")
    for flag, used in (("--quantize", args.quantize != "none"), ("--runner", args.runner != "auto"),
                       ("--exact", args.exact), ("--device", args.device not in ("auto", "cpu")),
                       ("--judge", args.judge is not None)):
        if used:
            raise CliInputError(f"{flag} applies to PyTorch targets; a GGUF target runs llama.cpp on the file's own "
                                f"weights")
    draft = "none" if args.plain else _resolved_draft(args)
    kind = _layers_head(draft)
    if kind is not None:
        raise CliInputError(f"--draft {draft} is {kind}, which reads the target's earlier layers: it needs a PyTorch "
                            f"target (--target embedded)")
    if _reads_head(draft) and args.target != EMBEDDED_GGUF:
        raise CliInputError(f"--draft {draft} reads the hidden states of the embedded Gemma-3-270M; on another GGUF "
                            f"use --draft ngram or none")
    if draft.startswith("early-exit:") or (draft not in DRAFT_WORDS and not _is_ngram(draft)
                                            and not _reads_head(draft) and not draft.startswith("lookup+")):
        raise CliInputError(f"--draft {draft} needs a PyTorch target; a GGUF target drafts with ngram, head, "
                            f"lookup+head or a head file")
    if (excess := _beyond_llama_pass(draft, args.tree)) is not None:  # checked before anything loads
        raise CliInputError(excess)


def _beyond_llama_pass(draft: str, tree: list[int] | None) -> str | None:
    """Where an n-gram shape (``ngram:D,B``) or a ``--tree`` holds more than one llama.cpp pass takes (the
    runner's cells and leaves), that in words; None where it fits or there is no shape (a malformed ``ngram:``
    spelling is refused by :func:`_check_tree`, in its own words)."""
    from .drafters import ngram_config, tree_widths
    from .models.llama_cpp import DEFAULT_MAX_LEAVES, DEFAULT_TREE_CELLS

    if draft.startswith("ngram:"):
        try:
            config = ngram_config(draft)
        except ValueError:
            return None
        what, nodes, leaves = f"--draft {draft}", config.depth * config.branches, config.branches
    elif tree is not None:
        widths = tree_widths(tree)
        what, nodes, leaves = f"--tree {','.join(map(str, tree))}", tree_nodes(widths), math.prod(widths)
    else:
        return None
    if nodes + 1 > DEFAULT_TREE_CELLS or leaves > DEFAULT_MAX_LEAVES:
        return (f"{what}: {nodes} draft nodes and {leaves} leaves; a llama.cpp pass takes at most "
                f"{DEFAULT_TREE_CELLS - 1} nodes and {DEFAULT_MAX_LEAVES} leaves")
    return None


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity set where the OS has one, else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_tree(args: argparse.Namespace) -> None:
    """``--tree`` shapes a model or head draft only: refused, with the right spelling, for n-gram lookup (which
    takes ``--draft ngram:DEPTH,BRANCHES``) and for a run without a draft; a malformed ``ngram:`` spelling and a
    tree above :data:`MAX_TREE_NODES` nodes are refused too."""
    if args.draft.startswith("ngram:") and not args.plain:
        from .drafters import ngram_config

        try:
            ngram_config(args.draft)
        except ValueError as err:
            raise CliInputError(f"--draft {err}") from None
    if args.tree is None:
        return
    tree = ",".join(map(str, args.tree))
    if args.plain or args.draft == "none":
        raise CliInputError(f"--tree {tree} shapes a draft tree, and {'--plain' if args.plain else '--draft none'} "
                            f"drafts nothing: drop --tree, or name a --draft to speculate with")
    if _is_ngram(args.draft):
        spelled = f"ngram:{tree}" if len(args.tree) == 2 else "ngram:DEPTH,BRANCHES (e.g. ngram:8,4)"
        raise CliInputError(f"--tree shapes a model or head draft; n-gram lookup takes its shape in the draft "
                            f"word: --draft {spelled}")
    from .drafters import tree_widths

    nodes = tree_nodes(tree_widths(args.tree))
    if nodes > MAX_TREE_NODES:
        raise CliInputError(f"--tree {tree} asks for {nodes} draft nodes; the limit is {MAX_TREE_NODES}")


def _check_max_reject(args: argparse.Namespace) -> None:
    """``--max-reject``: a number in [0, 1), not beside ``--min-confidence``, for the shipped head only."""
    if args.max_reject is None:
        return
    if not 0.0 <= args.max_reject < 1.0:
        raise CliInputError(f"--max-reject must be in [0, 1), got {args.max_reject}")
    if args.min_confidence is not None:
        raise CliInputError("--max-reject replaces --min-confidence as the stopping rule: give one of them")
    draft = "none" if args.plain else _resolved_draft(args)
    if draft not in ("head", "lookup+head"):
        raise CliInputError(f"--max-reject reads the shipped acceptance head, trained for the shipped draft head "
                            f"(--draft head or lookup+head); this run drafts with {draft!r}")


def _check_args(args: argparse.Namespace) -> None:
    import torch

    from .drafters import target_kind

    _check_tree(args)
    if not args.plain:
        _resolved_draft(args)  # --draft auto refuses a --tree / --law / --min-confidence it cannot follow
    _check_max_reject(args)
    _check_judge(args)
    if args.threads is not None and args.threads < 1:
        raise CliInputError(f"--threads must be a positive integer, got {args.threads}")
    if args.threads is not None and args.threads > usable_cores():
        raise CliInputError(f"--threads {args.threads}: this process may run on {usable_cores()} CPU cores; "
                            f"use at most {usable_cores()} (more threads than cores only slow decoding down)")
    device = resolve_cli_device(args)
    if target_kind(args.target) == "gguf":
        _check_gguf_args(args)
    elif device.type != "cpu":
        for flag, mode in (("--quantize", args.quantize), ("--draft-quantize", args.draft_quantize)):
            if mode not in ("none", "auto"):
                kernel = "oneDNN's int8 CPU kernel" if mode == "int8-head" else "torch's int4 CPU kernel"
                raise CliInputError(f"{flag} {mode} runs on {kernel}; this run's device is {device} (use --device cpu)")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise CliInputError(f"the prompt is not valid UTF-8 text ({err.reason} at byte {err.start})") from None
    if args.quantize != "none" and args.runner in ("eager", "graphs"):
        raise CliInputError(f"--quantize {args.quantize} runs on the fast runner; it cannot be combined with "
                            f"--runner {args.runner}")
    if args.draft_quantize not in ("auto", "none") and resolve_cli_dtype(args) != torch.bfloat16:
        raise CliInputError(f"--draft-quantize {args.draft_quantize} needs bfloat16 (--dtype bfloat16; this run "
                            f"would use {str(resolve_cli_dtype(args)).replace('torch.', '')})")
    if args.draft_quantize not in ("auto", "none"):
        draft = "none" if args.plain else _resolved_draft(args)
        if not _reads_head(draft):
            raise CliInputError(f"--draft-quantize {args.draft_quantize} applies to a draft head (--draft head, "
                                f"lookup+head or a head .safetensors); this run drafts with {draft!r}")
    draft = args.draft
    if args.plain or draft in DRAFT_WORDS or _is_ngram(draft) or draft.startswith("early-exit:"):
        return
    path = draft.removeprefix("lookup+")
    if path.endswith(".safetensors") or draft.startswith("lookup+"):
        from .drafting.head_files import is_speculators_checkpoint

        if not (os.path.isfile(path) or is_speculators_checkpoint(path)):
            raise CliInputError(f"--draft {draft}: no head file {path!r}")
        return
    if os.path.exists(path):
        return
    if path.startswith(("/", ".", "~")) or os.sep + os.sep in path:
        raise CliInputError(f"--draft {draft}: no draft model directory {path!r}")
    if "/" not in draft:
        raise CliInputError(f"unknown --draft {draft!r}: expected one of {', '.join(DRAFT_WORDS)}, "
                            f"ngram:DEPTH,BRANCHES, early-exit:L, a .safetensors head file, or an existing draft "
                            f"model directory")


def _check_judge(args: argparse.Namespace) -> None:
    """``--judge`` (LOSSY judge decoding): temperature 0, a draft, never with ``--exact``, an existing file."""
    if args.judge is None:
        if args.judge_threshold is not None:
            raise CliInputError("--judge-threshold applies to --judge")
        return
    draft = "none" if args.plain else _resolved_draft(args)
    for flag, used in (("--exact", args.exact), ("--plain", args.plain), (f"--draft {draft}", draft == "none"),
                       (f"--temperature {args.temperature}", args.temperature != 0),
                       (f"--verifier {args.verifier}", args.verifier not in ("auto", "greedy")),
                       ("--leaf-logits off", args.leaf_logits == "off")):
        if used:
            why = {"--exact": "--exact promises the target's own output and judge decoding is lossy",
                   "--plain": "plain decoding drafts nothing to judge", f"--draft {draft}": "nothing is drafted to "
                   "judge", "--leaf-logits off": "a judged path may end at a leaf, whose row the judge needs"}.get(
                flag, "judge decoding is defined here at temperature 0 with its own verifier")
            raise CliInputError(f"--judge cannot be combined with {flag}: {why}")
    if args.judge == "shipped" and args.target not in ("embedded", EMBEDDED_GGUF):
        raise CliInputError(f"--judge shipped was trained for the embedded Gemma-3-270M, not {args.target}: train a "
                            f"judge for it (python -m treespec.distill judge) and pass its file")
    if args.judge != "shipped" and not os.path.isfile(args.judge):
        raise CliInputError(f"--judge {args.judge}: no judge file there (or 'shipped')")
    if args.judge_threshold is not None and math.isnan(args.judge_threshold):
        raise CliInputError("--judge-threshold must be a number")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treespec", description="Lossless token-tree speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    _model_arguments(g)
    _draft_arguments(g)
    _sampling_arguments(g)
    _engine_arguments(g)
    return parser


def _model_arguments(g: argparse.ArgumentParser) -> None:
    """The prompt and the target."""
    g.add_argument("prompt", help="the prompt text (Gemma-3-270M is a base model: plain text, no chat template)")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user turn in the tokenizer's chat template, with the assistant's "
                        "generation prompt (instruction-tuned models; refused for a tokenizer without a template, "
                        "as the embedded Gemma-3-270M's)")
    g.add_argument("--target", default="auto",
                   help="target model: 'auto' (default: the embedded Gemma-3-270M on the engine measured fastest "
                        "for this CPU and temperature: PyTorch at T=0 where the CPU computes bf16 natively, llama.cpp "
                        "at T>0 there and at every temperature where it does not, when llama-cpp-python is "
                        "installed; the run names its choice), 'embedded' (Gemma-3-270M in PyTorch, de-quantised), "
                        "'embedded-gguf' (its Q4_K_M GGUF in llama.cpp), a .gguf file (llama.cpp; pip install "
                        "llama-cpp-python) or a Hugging Face path/id")


def _draft_arguments(g: argparse.ArgumentParser) -> None:
    """What drafts, in which shape and law, and how it is verified."""
    g.add_argument("--draft", default="auto",
                   help="'auto' (default: the best measured on train prompts; on the embedded target in bf16 "
                        "'lookup+head' at T=0 and the shipped head at T>0, both on 4-bit head weights; in float32 "
                        "n-gram lookup at T=0 and no draft at T>0, where every drafter measured slower than plain "
                        "decoding; no draft on GGUF targets, where plain decoding measured fastest; n-gram lookup "
                        "on other models), "
                        "'lookup+head' (prompt lookup where the context repeats, the shipped Gemma-3-270M draft "
                        "head elsewhere), 'head' (the shipped head alone), 'ngram' (prompt lookup alone: an adaptive "
                        "chain of up to 8 tokens, the measured default), 'ngram:DEPTH,BRANCHES' (prompt lookup "
                        "drafting up to BRANCHES continuations of DEPTH tokens, e.g. ngram:8,4), 'none', "
                        "a draft causal LM path/id sharing the tokenizer, an EAGLE or EAGLE-3 head or a Kangaroo "
                        "adapter .safetensors "
                        "(python -m treespec.distill; 'lookup+PATH.safetensors' pairs it with lookup) or an "
                        "EAGLE-3 checkpoint folder in the layout of vLLM's speculators, or "
                        "early-exit:L (the target's first L layers as its own draft)")
    g.add_argument("--min-confidence", type=float, default=None,
                   help="adaptive draft length of a head draft, at any temperature: a drafted token gets children "
                        "only if the head gives it at least this probability (at temperature 0 a candidate below it "
                        "is dropped; at T > 0 every drawn child is kept, so the draft law is untouched); 0 drafts "
                        "the whole tree (default: the shipped head's measured setting, 0.2 at either temperature; "
                        "0 for a head file of your own)")
    g.add_argument("--max-reject", type=float, default=None,
                   help="SpecDec++'s stopping rule for the shipped head, instead of --min-confidence: a drafted path "
                        "stops growing once the shipped acceptance head's predicted chance that some token on it is "
                        "rejected exceeds this (0 <= H < 1; the token that crosses it is still proposed); up to the "
                        "depth --tree allows (default: off, the confidence rule)")
    g.add_argument("--tree", type=_branching, default=None,
                   help="children per depth of a model or head draft, e.g. 4 (a chain of 4: 1,1,1,1) or 2,2,1; "
                        "with --draft auto it shapes the head of what auto picks, and where auto picks n-gram "
                        "lookup or no draft it asks for the shipped head (embedded targets). N-gram lookup takes "
                        "its shape in --draft ngram:DEPTH,BRANCHES instead (default: the shipped head's measured "
                        "tree, a chain of 3; a chain of 4 for a head file or draft model)")
    g.add_argument("--law", choices=DRAFT_LAWS, default=None,
                   help="draft law of a model draft at temperature > 0 (default: the shipped head's own "
                        "setting for T > 0, iid for other drafts)")
    g.add_argument("--verifier", choices=["auto", *sorted(VERIFIER_MEANINGS)], default="auto",
                   help="how drafted tokens are accepted, each lossless for its draft law: auto (default: greedy at "
                        "temperature 0, else the rule for the draft's law: rrs for iid, rrs_without_replacement, "
                        "deterministic, greedy_draft or spechub for the laws of those names); "
                        + "; ".join(f"{name}: {meaning}" for name, meaning in sorted(VERIFIER_MEANINGS.items())))
    g.add_argument("--judge", default=None, metavar="{shipped,PATH}",
                   help="LOSSY, opt-in: judge decoding (arXiv 2501.19309) at temperature 0: a trained judge also "
                        "accepts drafted tokens the target would not have chosen, when it finds them acceptable "
                        "(fewer target passes; the output is no longer the target's). 'shipped' = the judge trained "
                        "for the embedded Gemma-3-270M (recipes/judge_head.sh), or a judge file of "
                        "python -m treespec.distill judge. The run is marked lossy and counts the judged tokens; "
                        "never with --exact (default: off)")
    g.add_argument("--judge-threshold", type=float, default=None,
                   help="with --judge: accept a drafted token when the judge's logit is above this (default: the "
                        "threshold stored in the judge file, chosen for a precision on held-out rows)")
    g.add_argument("--leaf-logits", choices=["auto", "on", "off"], default="auto",
                   help="the target's logits at tree leaves: on (a path accepted down to a leaf also yields the "
                        "leaf's bonus token), off (LM-head rows for the root and the nodes with children only: "
                        "one row fewer per leaf, the same output law), auto (default: the measured setting for "
                        "the target, treespec.drafters.DEFAULT_LEAF_LOGITS)")


def _sampling_arguments(g: argparse.ArgumentParser) -> None:
    """How many tokens, and the target's sampling law."""
    g.add_argument("--max-new-tokens", type=int, default=64,
                   help="the most tokens to generate (fewer at EOS, see --no-stop) (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy decoding (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most probable tokens only; 0 = no top-k filter (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the most probable tokens up to this total probability; 1 = no filter "
                        "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed, to reproduce a run (default: a fresh random seed per run, reported as "
                        "--json's \"seed\" and, at temperature > 0, in the closing line; pass it back to repeat the "
                        "run). Temperature 0 draws nothing: the seed is recorded but changes nothing")
    g.add_argument("--no-stop", action="store_true", help="do not stop at EOS")


def _engine_arguments(g: argparse.ArgumentParser) -> None:
    """How the target computes, and what is printed."""
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto (default): bf16 where the CPU computes it natively, else fp32. Every dtype is "
                        "lossless with "
                        "respect to the target as evaluated on tree passes; token-identity with --plain at "
                        "temperature 0 is guaranteed only in float32 (bf16 tree passes round differently from "
                        "one-token passes). See --exact")
    g.add_argument("--exact", action="store_true",
                   help="force float32 so that temperature-0 output is token-identical to --plain")
    g.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                   help="where a PyTorch target (and its draft) runs: auto (default) = the first CUDA GPU where "
                        "torch sees one, else the CPU; --dtype auto is then bf16 where the GPU computes it, else "
                        "fp32. A GGUF target runs in llama.cpp on the CPU")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads of torch and of llama.cpp (default: torch's own setting, one per physical "
                        "core)")
    g.add_argument("--runner", choices=["auto", "fast", "eager", "graphs"], default="auto",
                   help="target forward: 'fast' = lean Gemma-3 forward over a static cache (the same function, "
                        "tested against the eager one), 'eager' = the Hugging Face module, 'graphs' = the fast "
                        "forward at a few fixed shapes, replayed as CUDA graphs on a GPU (fewer kernel launches; "
                        "on a CPU the same passes without graphs, slower than fast), 'auto' (default) = fast "
                        "where it covers the model")
    g.add_argument("--quantize", choices=["none", *TARGET_QUANTIZE_MODES], default="none",
                   help="none (default): the target's own weights; int4: the target's linear layers (LM head "
                        "included) run on 4-bit weights (groups of 32, "
                        "CPU kernel; about the size of the GGUF it was de-quantised from); int8-head: the LM head "
                        "alone runs on 8-bit integers (oneDNN's int8 product, CPU): each a different, faster "
                        "model; speculative decoding is lossless with respect to it (compare with --plain "
                        "--quantize MODE)")
    g.add_argument("--draft-quantize", choices=["auto", "none", *QUANTIZE_MODES], default="auto",
                   help="int4: a draft head's products run on 4-bit weights (about a third of the bf16 bytes a step "
                        "reads; another q, so other acceptance; lossless either way; needs bfloat16); none: the "
                        "head computes in the run's dtype; auto (default): the shipped head's measured setting, "
                        "4-bit weights in bfloat16 on a CPU (both temperatures), else none; a head file of your own: "
                        "none")
    g.add_argument("--plain", action="store_true", help="plain autoregressive decoding of the target, for comparison")
    g.add_argument("--json", action="store_true", help="print text, token_ids and statistics as JSON")


def _drafter(args, target_model, target_tokenizer, dtype) -> Drafter | None:
    from .drafters import DraftOptions

    draft = "none" if args.plain else _resolved_draft(args, dtype)
    if draft == "none":
        return None
    # _check_args has refused a --tree for n-gram lookup (its shape is in the word: ngram:DEPTH,BRANCHES)
    options = DraftOptions(tuple(args.tree) if args.tree else None, args.law, args.min_confidence,
                           None if args.draft_quantize == "auto" else args.draft_quantize, args.max_reject)
    build_drafter = _engine("build_drafter")
    return build_drafter(draft, target_model, options, temperature=args.temperature, tokenizer=target_tokenizer,
                         dtype=dtype)


def _head_weights(drafter: Drafter | None) -> str | None:
    """The weight form of the draft head ``drafter`` drafts with (inside a ``FirstOf`` too), None without one."""
    from .drafting.compose import FirstOf

    for d in drafter.drafters if isinstance(drafter, FirstOf) else [drafter]:
        head = getattr(getattr(d, "runner", None), "head", None)
        if head is not None and hasattr(head, "inference_weights"):
            return head.inference_weights
    return None


def resolve_cli_dtype(args: argparse.Namespace) -> torch.dtype:
    """The model dtype the CLI uses: float32 under ``--exact`` (refusing ``--exact --dtype bfloat16``)."""
    import torch

    from .models.loading import resolve_dtype

    if args.exact:
        if args.dtype == "bfloat16":
            raise CliInputError("--exact needs float32; it cannot be combined with --dtype bfloat16")
        return torch.float32
    return resolve_dtype(args.dtype, resolve_cli_device(args))


def resolve_cli_device(args: argparse.Namespace) -> torch.device:
    """The device of a PyTorch target (``--device``, :func:`~treespec.models.loading.resolve_device`; one line
    naming the problem for a device this machine lacks). A GGUF target (llama.cpp) computes on the CPU."""
    from .drafters import target_kind
    from .models.loading import resolve_device

    if target_kind(args.target) == "gguf":
        return resolve_device("cpu")
    try:
        return resolve_device(getattr(args, "device", "auto"))
    except ValueError as err:
        raise CliInputError(f"--device: {err}") from None


def _guarantee(dtype: torch.dtype, temperature: float, plain: bool, runner: str = "fast",
               judged: int | None = None) -> str:
    import torch

    if judged is not None:
        return f"LOSSY: judge decoding kept {judged} drafted tokens the target would not have chosen"
    if plain:
        return "plain decoding"
    if runner == "llama.cpp":
        return "lossless w.r.t. llama.cpp's logits on tree passes; not token-identical to --plain (batched passes " \
               "round differently)"
    if dtype == torch.float32:
        return "lossless; T=0 token-identical to --plain" if temperature == 0 else "lossless"
    return "lossless w.r.t. the target on tree passes; not token-identical to --plain (use --exact)"


def _target_runner(target, choice: str, quantize: str = "none") -> ModelRunner:
    """The target's runner for ``--runner`` and ``--quantize`` (:func:`~treespec.models.fast.choose_runner`)."""
    from .models.fast import choose_runner

    try:
        return choose_runner(target, choice, quantize)
    except ValueError as err:
        raise CliInputError(str(err)) from None


def _runner_name(runner) -> str:
    from .models.fast import FastGemmaRunner
    from .models.llama_cpp import LlamaCppRunner

    if isinstance(runner, LlamaCppRunner):
        return "llama.cpp"
    from .models.fast import GraphedGemmaRunner

    if isinstance(runner, GraphedGemmaRunner):
        return "graphs" if runner.capture else "graphs (fixed shapes, no capture)"
    return "fast" if isinstance(runner, FastGemmaRunner) else "eager"


def _gguf_runner(args):
    """(llama.cpp runner, its tokenizer, the PyTorch model a draft head reads, or None) for a GGUF ``--target``.
    The embedded GGUF's draft head takes its embedding and LM head from the de-quantised embedded model."""
    import torch

    from .models.llama_cpp import LlamaCppRunner, LlamaCppTokenizer, llama_cpp_available
    from .models.loading import embedded_gguf, load_model

    reason = llama_cpp_available()
    if reason is not None:
        raise ImportError(reason)
    path = embedded_gguf() if args.target == EMBEDDED_GGUF else args.target
    draft = "none" if args.plain else _resolved_draft(args)
    needs_model = _reads_head(draft)
    also = " (and the embedded model in PyTorch, whose embedding and LM head the draft head reads)" \
        if needs_model else ""
    print(f"treespec: loading {_model_words(args.target, resolve_cli_dtype(args))}{also}...", file=sys.stderr,
          flush=True)
    # a head reads hidden states: captured from llama.cpp's graph, so that the prefill skips the LM head
    # room for the prompt (at most one token per byte, and a BOS), the new tokens and a tree; llama.cpp's runner
    # caps it at the model's trained context
    context = max(4096, len(args.prompt.encode("utf-8", "replace")) + 8 + args.max_new_tokens
                  + (1024 if args.chat else 0))  # a chat template's own tokens
    runner = LlamaCppRunner(path, context=context, threads=args.threads or torch.get_num_threads(),
                            capture_hidden=needs_model)
    target = load_model("embedded", dtype=resolve_cli_dtype(args)) if needs_model else None
    return runner, LlamaCppTokenizer(runner), target


def _model_words(target: str, dtype: torch.dtype, device: torch.device | None = None) -> str:
    """The target model in words, for the line printed while it loads (``device``: named unless the CPU)."""
    dtype_word = str(dtype).replace("torch.", "")
    if device is not None and device.type != "cpu":
        dtype_word += f" on {device}"
    if target == "embedded":
        return f"the embedded Gemma-3-270M (PyTorch, {dtype_word})"
    if target == EMBEDDED_GGUF:
        return "the embedded Gemma-3-270M's Q4_K_M GGUF in llama.cpp"
    if target.lower().endswith(".gguf"):
        return f"the GGUF {target} in llama.cpp"
    return f"{target} (PyTorch, {dtype_word})"


def _draft_words(draft: str, counts: list[int] | None = None) -> str:
    """A resolved ``--draft`` word in words, for the closing line; ``counts``: the trees each drafter of a
    ``lookup+...`` pair proposed."""
    if draft == "ngram":
        return "n-gram lookup"
    if _is_ngram(draft):
        depth, branches = draft.removeprefix("ngram:").split(",")
        return f"n-gram lookup ({branches} continuations of {depth} tokens)"
    if draft.startswith("early-exit:"):
        return f"the target's first {draft.removeprefix('early-exit:')} layers"
    if draft.startswith("lookup+"):
        head = _draft_words(draft.removeprefix("lookup+"))
        if counts is None or len(counts) != 2:
            return f"n-gram lookup, then {head}"
        trees = [f"{n} tree{'' if n == 1 else 's'}" for n in counts[:2]]
        return f"n-gram lookup ({trees[0]}), then {head} ({trees[1]})"
    if draft == "head":
        return "the shipped head"
    if _reads_head(draft):
        return f"the head {draft}"
    return f"the draft model {draft}"


def _hub_ids(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, id) of the models this run would fetch from the Hugging Face hub: a ``--target`` or ``--draft``
    model that is neither a local path nor the embedded model (a GGUF target is a file)."""
    from .drafters import target_kind
    from .models.loading import EMBEDDED_NAMES

    ids = []
    if target_kind(args.target) != "gguf" and args.target.lower() not in EMBEDDED_NAMES \
            and not os.path.exists(args.target):
        ids.append(("--target", args.target))
    draft = args.draft.removeprefix("lookup+")
    if not args.plain and "/" in draft and not draft.endswith(".safetensors") and not draft.startswith("early-exit:") \
            and not os.path.exists(draft):
        ids.append(("--draft", draft))
    return ids


def _check_hub_access(args: argparse.Namespace) -> None:
    """A hub id is read from the local Hugging Face cache when it is there (``args`` then names the cached
    folder: no request); otherwise the hub must answer at once: offline (HF_HUB_OFFLINE, or no connection
    within :data:`HUB_PROBE_S` s) the run ends with a named error instead of a minute of retries."""
    from huggingface_hub import constants

    missing = []
    for flag, name in _hub_ids(args):
        folder = _engine("_cached_snapshot")(name)
        if folder is None:
            missing.append((flag, name))
        elif flag == "--target":
            args.target = folder
        else:
            args.draft = args.draft.replace(name, folder)
    if not missing:
        return
    flag, name = missing[0]
    offline = any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
                  for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if offline or constants.HF_HUB_OFFLINE:
        raise CliInputError(f"{flag} {name}: no such local folder, not in the Hugging Face cache, and the hub is off "
                            f"(HF_HUB_OFFLINE): download it first or pass a local folder")
    reason = _engine("_hub_reachable")()
    if reason is not None:
        raise CliInputError(f"{flag} {name}: no such local folder and not in the Hugging Face cache, and the hub "
                            f"({constants.ENDPOINT}) cannot be reached ({reason}): connect to the network, or pass "
                            f"a local folder")


def run_generate(args) -> int:
    import torch

    from .generate import GenerationConfig
    from .hf import encode_prompt
    from .sampling import SamplingConfig

    generate = _engine("generate")

    if getattr(args, "target_reason", None):
        print(f"treespec: {args.target_reason}", file=sys.stderr, flush=True)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    # without --seed generate() draws a fresh seed (result.seed), reported so that --seed reproduces it
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                              stop_on_eos=not args.no_stop, verifier=args.verifier,
                              leaf_logits=_leaf_logits(args), judge=_judge(args))
    if not args.prompt.strip():
        raise ValueError("empty prompt: give some text to continue")
    _check_hub_access(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_cli_dtype(args)
    if args.quantize == "int4" and dtype != torch.bfloat16:
        raise CliInputError(f"--quantize {args.quantize} needs bfloat16 activations (--dtype bfloat16; this run "
                            f"would use {str(dtype).replace('torch.', '')}): torch's int4 CPU kernel runs float32 "
                            f"activations several times slower than the unquantised model")
    runner, tokenizer, target = _load_target(args, dtype)
    drafter = _drafter(args, target, tokenizer, dtype)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=args.chat)
    progress = args.progress = {"prompt_ids": prompt_ids, "token_ids": [], "tokenizer": tokenizer}
    if runner is None:
        runner = _target_runner(target, args.runner, args.quantize)
    _note_int8_head_without_vnni(args)
    result = generate(runner, prompt_ids, drafter, config, tokenizer=tokenizer,
                      on_tokens=_streamer(args, tokenizer, progress))
    info = _run_info(args, drafter, runner, dtype)
    if config.judge is not None:  # which judge ran, and where it accepts (LOSSY)
        t = config.judge.threshold
        info["judge"] = {"file": args.judge, "threshold": t if math.isfinite(t) else str(t)}
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "prompt_ids": result.prompt_ids,
                          "seed": result.seed, "statistics": {**result.summary(), **info,
                                                       "accepted_per_step": [s.accepted for s in result.steps]}}))
    else:
        print()
        _print_closing(args, result.summary(), info, drafter is None, dtype, result.seed)
    return 0


def _judge(args):
    """The ``--judge`` head (None without one), with ``--judge-threshold`` applied."""
    if args.judge is None:
        return None
    from .drafting.judge import JudgeHead
    from .drafting.shipped import DEFAULT_JUDGE

    head = JudgeHead.load(DEFAULT_JUDGE if args.judge == "shipped" else args.judge, resolve_cli_device(args))
    return head if args.judge_threshold is None else head.with_threshold(args.judge_threshold)


def _note_int8_head_without_vnni(args) -> None:
    """One line on stderr where ``--quantize int8-head`` runs on an x86 CPU without VNNI (:data:`INT8_HEAD_WITHOUT_VNNI`;
    silent where the CPU's flags are unknown)."""
    from .models.loading import cpu_has_vnni

    if args.quantize == "int8-head" and resolve_cli_device(args).type == "cpu" and cpu_has_vnni() is False:
        print(INT8_HEAD_WITHOUT_VNNI, file=sys.stderr, flush=True)


def _load_target(args, dtype):
    """``(runner, tokenizer, target)``: a GGUF target's llama.cpp runner (``target`` None unless a head reads it),
    or the loaded PyTorch model (``runner`` None: built around it later), with a line on stderr while it loads."""
    from .drafters import target_kind
    from .hf import chat_prompt
    from .models.loading import load_model, load_tokenizer

    if target_kind(args.target) == "gguf":
        return _gguf_runner(args)
    tokenizer = load_tokenizer(args.target)
    if args.chat:
        chat_prompt(tokenizer, args.prompt)  # a tokenizer without a template is refused before the model loads
    device = resolve_cli_device(args)
    print(f"treespec: loading {_model_words(args.target, dtype, device)}...", file=sys.stderr, flush=True)
    return None, tokenizer, load_model(args.target, dtype=dtype, device=device)


def _streamer(args, tokenizer, progress: dict):
    """The per-step hook (``on_tokens``): with ``--json`` it keeps the tokens (for a JSON document on Ctrl-C), else it
    prints the prompt with the first tokens and then the new text as it comes."""
    if args.json:
        def keep(new_ids: list[int]) -> None:
            progress["token_ids"].extend(new_ids)
        return keep
    shown = {"ids": progress["token_ids"], "text": ""}

    def show(new_ids: list[int]) -> None:
        if not shown["ids"]:  # the prompt is echoed with the first tokens: a refusal by generate() prints nothing
            print(args.prompt, end="")
        shown["ids"].extend(new_ids)
        text = tokenizer.decode(shown["ids"], skip_special_tokens=True)
        print(text[len(shown["text"]):], end="", flush=True)
        shown["text"] = text
    return show


def _run_info(args, drafter, runner, dtype) -> dict:
    """What ran, for ``--json``'s statistics and the closing line."""
    from .drafting.compose import FirstOf

    info = {"method": "plain" if drafter is None else type(drafter).__name__,
            "dtype": str(dtype).replace("torch.", ""), "device": str(resolve_cli_device(args)),
            "temperature": args.temperature,
            "runner": _runner_name(runner), "quantize": args.quantize}
    if isinstance(drafter, FirstOf):  # which drafter proposed how many trees
        info["method"] = f"FirstOf({', '.join(type(d).__name__ for d in drafter.drafters)})"
        info["proposals"] = drafter.counts
    head_weights = _head_weights(drafter)
    if head_weights is not None:  # "int4", "packed" (bf16, oneDNN layout) or "plain"
        info["draft_weights"] = head_weights
    return info


def _print_closing(args, summary: dict, info: dict, plain: bool, dtype, seed: int) -> None:
    """The closing line on stderr (tokens, target passes, tau, the drafter in words, the guarantee), and a
    hint where ``auto`` chose plain decoding."""
    weights = {"none": "", "int8-head": ", an 8-bit LM head"}.get(args.quantize, f", {args.quantize} weights")
    if "draft_weights" in info:
        weights += f", {info['draft_weights']} draft head"
    dtype_word = "GGUF weights" if info["runner"] == "llama.cpp" else info["dtype"]
    passes = "(plain decoding, one token per pass)" if plain else \
        f"({summary['tau']:.2f} tokens per pass, tau) drafted by " \
        f"{_draft_words(_resolved_draft(args, dtype), info.get('proposals'))}"
    sampled = f", seed {seed} (--seed {seed} repeats this run)" if args.temperature > 0 else ""
    judged = summary["judged_tokens"] if summary.get("lossy") else None
    print(f"treespec: {summary['new_tokens']} tokens in {summary['target_calls']} target passes {passes}; "
          f"{summary['wall_s']:.2f} s ({summary['tokens_per_s']:.1f} tokens/s), {dtype_word} target{weights}, "
          f"{info['runner']} runner{sampled}; "
          f"{_guarantee(dtype, args.temperature, plain, info['runner'], judged)}", file=sys.stderr)
    if plain and not args.plain and args.draft == "auto" and info["runner"] == "llama.cpp":
        print("(--draft auto decodes plainly on a GGUF target: no drafter measured faster than llama.cpp's plain "
              "decoding on this kind of CPU; name a --draft to speculate anyway)", file=sys.stderr)
    elif plain and not args.plain and args.draft == "auto":
        print("(--draft auto decodes plainly at T>0 in float32: every drafter measured slower there; "
              "--dtype bfloat16 where the CPU computes it natively, or name a --draft)", file=sys.stderr)


def _interrupted(args: argparse.Namespace) -> int:
    """Ctrl-C: one line on stderr and status 130; with ``--json`` a JSON document marked ``"interrupted": true``
    holding the tokens generated so far (none if generation had not started)."""
    progress = getattr(args, "progress", None) or {}
    ids = list(progress.get("token_ids") or [])
    if getattr(args, "json", False):
        text = ""
        if ids and progress.get("tokenizer") is not None:
            try:
                text = progress["tokenizer"].decode(ids, skip_special_tokens=True)
            except Exception:  # the ids stand on their own
                text = None
        print(json.dumps({"interrupted": True, "text": text, "token_ids": ids,
                          "prompt_ids": progress.get("prompt_ids"), "statistics": {"new_tokens": len(ids)}}),
              flush=True)
    elif ids:
        print(flush=True)  # end the streamed line
    print(f"treespec: interrupted (Ctrl-C) after {len(ids)} generated tokens", file=sys.stderr, flush=True)
    return 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    torch.set_grad_enabled(False)
    try:
        return _main(args)
    except KeyboardInterrupt:
        return _interrupted(args)


def _main(args: argparse.Namespace) -> int:
    try:
        if args.command == "generate":
            args.target, args.target_reason = resolve_target(args)
            _check_args(args)
            return run_generate(args)  # a run without hub ids never contacts a hub (_check_hub_access)
    except (ValueError, OSError, RuntimeError, KeyError, TypeError, ImportError) as err:
        # ValueError covers NonFiniteLogitsError, UnicodeError, JSON and safetensors header errors;
        # OSError covers missing files and read-only caches
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"treespec: error: {type(err).__name__}: {message}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
