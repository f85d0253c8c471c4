"""Tree verifiers: pure functions of (tree, target_probs, draft_probs, generator).

Which draft law each verifier needs (draw the children with
``treespec.drafting.laws.draw_children(q, n, LAW_OF_VERIFIER[name], generator)``):

========================== ======================= ==================================================
verifier                   draft law               children per node
========================== ======================= ==================================================
greedy                     any (temperature 0)     any
single                     iid                     at most 1
rrs                        iid                     any
kseq                       iid                     any
rrs_without_replacement    without_replacement     any (truncated at the support of q)
deterministic              deterministic           any
greedy_draft               greedy_draft            any (at most the vocabulary size)
spechub                    spechub                 1 or 2
========================== ======================= ==================================================
"""

from . import rules
from .core import VerifyResult, output_law, verify_tree
from .greedy_draft import greedy_draft_rule
from .kseq import kseq_rule
from .spechub import spechub_rule
from .verifiers import (
    verify_deterministic,
    verify_greedy,
    verify_greedy_draft,
    verify_kseq,
    verify_rrs,
    verify_rrs_without_replacement,
    verify_single,
    verify_spechub,
)

#: verifier name -> function
VERIFIERS = {
    "greedy": verify_greedy,
    "single": verify_single,
    "rrs": verify_rrs,
    "rrs_without_replacement": verify_rrs_without_replacement,
    "deterministic": verify_deterministic,
    "kseq": verify_kseq,
    "greedy_draft": verify_greedy_draft,
    "spechub": verify_spechub,
}

#: verifier name -> draft laws it accepts (None: any law)
VERIFIER_LAWS = {
    "greedy": None,
    "single": ("iid",),
    "rrs": ("iid",),
    "rrs_without_replacement": ("without_replacement",),
    "deterministic": ("deterministic",),
    "kseq": ("iid",),
    "greedy_draft": ("greedy_draft",),
    "spechub": ("spechub",),
}

#: verifier name -> the draft law to draw its children under (greedy accepts any; top-k
#: candidates, i.e. "deterministic", are the natural choice at temperature 0)
LAW_OF_VERIFIER = {
    name: ("deterministic" if laws is None else laws[0]) for name, laws in VERIFIER_LAWS.items()
}

#: draft law -> the verifier used when none is named (at temperature > 0)
DEFAULT_VERIFIER = {
    "iid": "rrs",
    "without_replacement": "rrs_without_replacement",
    "deterministic": "deterministic",
    "greedy_draft": "greedy_draft",
    "spechub": "spechub",
}

#: verifier name -> its node rule (what verify_tree samples from and output_law evaluates)
VERIFIER_RULES = {
    "greedy": rules.greedy_rule,
    "single": rules.rrs_rule,
    "rrs": rules.rrs_rule,
    "rrs_without_replacement": rules.rrs_without_replacement_rule,
    "deterministic": rules.deterministic_rule,
    "kseq": kseq_rule,
    "greedy_draft": greedy_draft_rule,
    "spechub": spechub_rule,
}

__all__ = ["VERIFIERS", "VERIFIER_LAWS", "DEFAULT_VERIFIER", "LAW_OF_VERIFIER", "VERIFIER_RULES", "VerifyResult",
           "output_law", "verify_tree", *[f.__name__ for f in VERIFIERS.values()]]
