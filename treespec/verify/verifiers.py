"""The verifier table: one :class:`VerifierSpec` per verifier, and the one function that runs any of them.

A verifier is a pure function ``(tree, target_probs, draft_probs, generator) -> VerifyResult``.
``target_probs`` ``[num_nodes, vocab]``: row i is the target's next-token distribution after node i
(already processed by the sampling controls). ``draft_probs`` ``[num_nodes, vocab]``: row i is the
draft distribution the children of node i were drawn from, processed identically; rows of leaves
are ignored. Each verifier states the draft law it needs and refuses a tree drafted under another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..sampling import SamplingConfig
from ..tree import TokenTree
from . import rules
from .block import verify_block
from .core import VerifyResult, check_inputs, check_law, verify_tree, verify_tree_greedy
from .greedy_draft import greedy_draft_rule
from .kseq import kseq_rule
from .spechub import spechub_rule
from .traversal import verify_traversal

Verifier = Callable[..., VerifyResult]


@dataclass(frozen=True)
class VerifierSpec:
    """One verifier.

    rule : the node rule (what :func:`verify_tree` samples from and ``output_law`` evaluates); None for a
        verifier that judges a whole path at once (``run``).
    laws : draft laws it accepts (None: any law, temperature 0 only).
    needs_q : whether it reads the draft probabilities.
    default : the verifier used for trees of law ``laws[0]`` when none is named.
    max_children : children per node it is defined for (None: any), and what to say beyond.
    run : a path verifier ``(tree, target_probs, draft_probs, generator) -> VerifyResult`` that replaces the
        node-rule walk (block verification of a chain, traversal verification of a tree), or None.
    """

    rule: Callable | None
    laws: tuple[str, ...] | None
    needs_q: bool
    default: bool = False
    max_children: tuple[int, str] | None = None
    run: Callable[..., VerifyResult] | None = None


SPECS: dict[str, VerifierSpec] = {
    # temperature 0: follow children equal to argmax p (any scores with the target's argmax)
    "greedy": VerifierSpec(rules.greedy_rule, None, False),
    # single-draft speculative sampling on a chain (Leviathan et al. 2211.17192)
    "single": VerifierSpec(rules.rrs_rule, ("iid",), True, max_children=(
        1, "takes at most one child per node, this tree has {n}; use 'rrs' for several i.i.d. children")),
    # recursive rejection sampling, children i.i.d. from q (SpecInfer 2305.09781)
    "rrs": VerifierSpec(rules.rrs_rule, ("iid",), True, default=True),
    # recursive rejection sampling, children without replacement (Jeon et al. 2402.14160)
    "rrs_without_replacement": VerifierSpec(rules.rrs_without_replacement_rule, ("without_replacement",), True,
                                            default=True),
    # deterministic candidates (top-k, n-gram, EAGLE-style), each tested as a point mass
    "deterministic": VerifierSpec(rules.deterministic_rule, ("deterministic",), False, default=True),
    # SpecTr K-SEQ (2310.15141), children i.i.d. from q; see treespec.verify.kseq
    "kseq": VerifierSpec(kseq_rule, ("iid",), True),
    # greedy drafting (Hu et al. 2502.18779): top-(n-1) of q fixed, the last child drawn from the rest
    "greedy_draft": VerifierSpec(greedy_draft_rule, ("greedy_draft",), True, default=True),
    # SpecHub (2411.05289): hub-token pairs; a node with one child is single-draft sampling
    "spechub": VerifierSpec(spechub_rule, ("spechub",), True, default=True, max_children=(
        2, "takes at most 2 children per node (its pair law is defined for two drafts), this tree has a "
           "node with {n}")),
    # block verification of a chain drawn from q (Sun et al. 2403.10444): the block judged jointly
    "block": VerifierSpec(None, ("iid",), True, max_children=(
        1, "verifies a chain (one child per node), this tree has a node with {n}; use 'rrs' for trees"),
        run=verify_block),
    # traversal verification of an i.i.d.-drafted tree (Weng et al. 2505.12398): sequences judged leaf to root
    "traversal": VerifierSpec(None, ("iid",), True, run=verify_traversal),
}


def verifier(name: str) -> Verifier:
    """The verifier function of ``SPECS[name]``: checks the tree's law, its width and the inputs, then
    samples the accepted path from the node rule."""
    spec = SPECS[name]

    def verify(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> VerifyResult:
        """target_probs ``[num_nodes, V]`` (or ``[verified nodes, V]``; any scores for ``greedy``);
        draft_probs ``[num_nodes, V]``, or None for a verifier that does not read q."""
        if spec.laws is not None:
            check_law(tree, spec.laws, name)
        if spec.max_children is not None and tree.max_children > spec.max_children[0]:
            raise ValueError(f"verifier {name!r} " + spec.max_children[1].format(n=tree.max_children))
        check_inputs(tree, target_probs, draft_probs, spec.needs_q, name)
        if spec.laws is None:
            return verify_tree_greedy(tree, target_probs)
        if spec.run is not None:
            return spec.run(tree, target_probs, draft_probs, generator)
        return verify_tree(tree, target_probs, draft_probs if spec.needs_q else None, generator, spec.rule)

    verify.__name__ = verify.__qualname__ = f"verify_{name}"
    return verify


def resolve_verifier(name: str, law: str, sampling: SamplingConfig) -> str:
    """The verifier to use: ``name``, or for ``"auto"`` greedy at temperature 0, else the default for ``law``."""
    if name == "auto":
        return "greedy" if sampling.greedy else next(n for n, s in SPECS.items() if s.default and s.laws[0] == law)
    return name
