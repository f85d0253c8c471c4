"""Public verifiers: pure functions ``(tree, target_probs, draft_probs, generator) -> VerifyResult``.

``target_probs`` ``[num_nodes, vocab]``: row i is the target's next-token distribution after node i
(already processed by the sampling controls). ``draft_probs`` ``[num_nodes, vocab]``: row i is the
draft distribution the children of node i were drawn from, processed identically; rows of leaves
are ignored. Each verifier states the draft law it needs and refuses a tree drafted under another.
"""

from __future__ import annotations

import torch

from ..tree import TokenTree
from . import rules
from .core import VerifyResult, check_inputs, check_law, verify_tree, verify_tree_greedy
from .greedy_draft import greedy_draft_rule
from .kseq import kseq_rule
from .spechub import spechub_rule


def verify_greedy(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> VerifyResult:
    """Temperature 0 (any draft law): follow children equal to argmax p; emit argmax p after.

    ``target_probs`` may be any row-wise scores with the target's argmax (probabilities or logits).
    """
    check_inputs(tree, target_probs, draft_probs, False, "greedy")
    return verify_tree_greedy(tree, target_probs)


def verify_single(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                  generator: torch.Generator | None = None) -> VerifyResult:
    """Single-draft speculative sampling on a chain (at most one child per node), law ``"iid"``."""
    check_law(tree, ("iid",), "single")
    if tree.max_children > 1:
        raise ValueError(
            f"verifier 'single' takes at most one child per node, this tree has {tree.max_children}; "
            "use 'rrs' for several i.i.d. children"
        )
    check_inputs(tree, target_probs, draft_probs, True, "single")
    return verify_tree(tree, target_probs, draft_probs, generator, rules.rrs_rule)


def verify_rrs(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
               generator: torch.Generator | None = None) -> VerifyResult:
    """Recursive rejection sampling, children drawn i.i.d. (with replacement) from q."""
    check_law(tree, ("iid",), "rrs")
    check_inputs(tree, target_probs, draft_probs, True, "rrs")
    return verify_tree(tree, target_probs, draft_probs, generator, rules.rrs_rule)


def verify_rrs_without_replacement(tree: TokenTree, target_probs: torch.Tensor,
                                   draft_probs: torch.Tensor | None,
                                   generator: torch.Generator | None = None) -> VerifyResult:
    """Recursive rejection sampling, children drawn from q without replacement."""
    check_law(tree, ("without_replacement",), "rrs_without_replacement")
    check_inputs(tree, target_probs, draft_probs, True, "rrs_without_replacement")
    return verify_tree(tree, target_probs, draft_probs, generator, rules.rrs_without_replacement_rule)


def verify_deterministic(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                         generator: torch.Generator | None = None) -> VerifyResult:
    """Deterministic candidates (top-k, n-gram, EAGLE-style): each tested as a point mass."""
    check_law(tree, ("deterministic",), "deterministic")
    check_inputs(tree, target_probs, draft_probs, False, "deterministic")
    return verify_tree(tree, target_probs, None, generator, rules.deterministic_rule)


def verify_kseq(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                generator: torch.Generator | None = None) -> VerifyResult:
    """SpecTr K-SEQ (arXiv 2310.15141), children drawn i.i.d. from q; see :mod:`treespec.verify.kseq`."""
    check_law(tree, ("iid",), "kseq")
    check_inputs(tree, target_probs, draft_probs, True, "kseq")
    return verify_tree(tree, target_probs, draft_probs, generator, kseq_rule)


def verify_greedy_draft(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                        generator: torch.Generator | None = None) -> VerifyResult:
    """Greedy drafting (Hu et al., arXiv 2502.18779): top-(n-1) of q fixed, last child drawn from the rest.

    See :mod:`treespec.verify.greedy_draft`.
    """
    check_law(tree, ("greedy_draft",), "greedy_draft")
    check_inputs(tree, target_probs, draft_probs, True, "greedy_draft")
    return verify_tree(tree, target_probs, draft_probs, generator, greedy_draft_rule)


def verify_spechub(tree: TokenTree, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None = None) -> VerifyResult:
    """SpecHub (arXiv 2411.05289): hub-token pairs, at most 2 children per node.

    See :mod:`treespec.verify.spechub`. A node with one child is verified as single-draft
    speculative sampling (its child is the first draw of a SpecHub pair, distributed as q).
    """
    check_law(tree, ("spechub",), "spechub")
    if tree.max_children > 2:
        raise ValueError(
            f"verifier 'spechub' takes at most 2 children per node (its pair law is defined for "
            f"two drafts), this tree has a node with {tree.max_children}"
        )
    check_inputs(tree, target_probs, draft_probs, True, "spechub")
    return verify_tree(tree, target_probs, draft_probs, generator, spechub_rule)
