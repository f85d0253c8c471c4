"""ot_bounds: optimal acceptance rates of multi-draft speculative decoding.

Notation: ``p`` = target distribution, ``q`` = draft distribution, ``n`` =
number of drafted children at a node.  For a draft law ``Q`` of the ordered
children, the best lossless verifier accepts with probability::

    alpha* = 1 + min_H [ p(H) - Q(all drafts in H) ]

Public API
----------
optimal_acceptance, optimal_subset       fast exact (dual / sorted prefixes)
lp_optimal_acceptance                    primal OT linear program (small V)
flow_optimal_acceptance                  max-flow / min-cut (small V)
brute_force_optimal_acceptance           minimum over all 2^V subsets (tiny V)
verifier_acceptance, verifier_outcome,
positional_acceptance                    exact acceptance of verifiers
prob_all_drafts_in, draft_tuple_law      draft laws
expected_accepted_length,
tree_acceptance_upper_bound,
optimal_node_acceptance                  tree level (Sequoia's F(T) and its node-local OT bound)
tree_acceptance,
lp_tree_optimal_acceptance,
sample_tree_acceptance                   rrs and traversal exactly, traversal sampled; the optimum (LP)
chain_acceptance,
chain_acceptance_upper_bound,
lp_chain_optimal_acceptance,
sample_chain_acceptance                  chain level (token and block verification, the optimum)
release_workspace                        free this thread's reusable scratch buffers

Submodules not imported here:
ot_bounds.study     batched full-vocabulary closed forms for the real-model
                    study (benchmarks/study_real_model.py)

References
----------
Hu et al., "Towards Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
Khisti et al., "Multi-Draft Speculative Sampling: Canonical Architectures and
Theoretical Limits", arXiv:2410.18234.
Sun et al., "SpecTr", arXiv:2310.15141.  Sun et al., "SpecHub", arXiv:2411.05289.
Chen et al., "Sequoia", arXiv:2402.12374.
"""

from .brute_force import brute_force_optimal_acceptance
from .chains import (
    CHAIN_VERIFIERS,
    chain_acceptance,
    chain_acceptance_upper_bound,
    lp_chain_optimal_acceptance,
    sample_chain_acceptance,
)
from .draft_laws import TUPLE_LAWS, TupleLaw, draft_tuple_law, prob_all_drafts_in
from .flow import FlowResult, flow_optimal_acceptance
from .lp import LPResult, lp_optimal_acceptance
from .optimal import OptimalAcceptance, optimal_acceptance, optimal_subset
from .trees import (
    TREE_VERIFIERS,
    SampledAcceptance,
    child_ranks,
    expected_accepted_length,
    lp_tree_optimal_acceptance,
    optimal_node_acceptance,
    sample_tree_acceptance,
    tree_acceptance,
    tree_acceptance_upper_bound,
)
from .verifiers import (
    VERIFIER_LAW,
    VERIFIERS,
    VerifierOutcome,
    positional_acceptance,
    verifier_acceptance,
    verifier_outcome,
)
from ._validation import SAMPLINGS
from ._workspace import release_workspace

__all__ = [
    "CHAIN_VERIFIERS",
    "SAMPLINGS",
    "TREE_VERIFIERS",
    "TUPLE_LAWS",
    "VERIFIERS",
    "VERIFIER_LAW",
    "FlowResult",
    "LPResult",
    "OptimalAcceptance",
    "SampledAcceptance",
    "TupleLaw",
    "VerifierOutcome",
    "brute_force_optimal_acceptance",
    "chain_acceptance",
    "chain_acceptance_upper_bound",
    "child_ranks",
    "draft_tuple_law",
    "expected_accepted_length",
    "flow_optimal_acceptance",
    "lp_chain_optimal_acceptance",
    "lp_tree_optimal_acceptance",
    "lp_optimal_acceptance",
    "optimal_acceptance",
    "optimal_node_acceptance",
    "optimal_subset",
    "positional_acceptance",
    "prob_all_drafts_in",
    "release_workspace",
    "sample_chain_acceptance",
    "sample_tree_acceptance",
    "tree_acceptance",
    "tree_acceptance_upper_bound",
    "verifier_acceptance",
    "verifier_outcome",
]
