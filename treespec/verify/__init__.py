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
block                      iid                     1 (a chain, verified jointly)
traversal                  iid                     any (root-to-node sequences, leaf to root)
========================== ======================= ==================================================

Every verifier in that table is lossless. Judge decoding (:mod:`.judge`) is not, and stands apart in
:data:`LOSSY_VERIFIERS`.
"""

from .core import VerifyResult, output_law, verify_tree
from .judge import JudgedResult, verify_judge
from .verifiers import SPECS, VerifierSpec, resolve_verifier, verifier

#: verifier name -> function ``(tree, target_probs, draft_probs, generator) -> VerifyResult``
VERIFIERS = {name: verifier(name) for name in SPECS}

#: verifier name -> draft laws it accepts (None: any law)
VERIFIER_LAWS = {name: spec.laws for name, spec in SPECS.items()}

#: verifier name -> the draft law to draw its children under (greedy accepts any; top-k
#: candidates, i.e. "deterministic", are the natural choice at temperature 0)
LAW_OF_VERIFIER = {name: ("deterministic" if laws is None else laws[0]) for name, laws in VERIFIER_LAWS.items()}

#: draft law -> the verifier used when none is named (at temperature > 0)
DEFAULT_VERIFIER = {spec.laws[0]: name for name, spec in SPECS.items() if spec.default}

#: verifier name -> its node rule (what verify_tree samples from and output_law evaluates); a path verifier
#: (``block``, ``traversal``) has none
VERIFIER_RULES = {name: spec.rule for name, spec in SPECS.items() if spec.rule is not None}

#: LOSSY verifiers, apart from the table above: never a default, never under ``--exact``. ``judge`` (judge decoding,
#: arXiv 2501.19309, temperature 0): ``(tree, target_scores, judge_logits, threshold) -> JudgedResult``, run by the
#: generate loop when its config names a judge (``--judge``)
LOSSY_VERIFIERS = {"judge": verify_judge}

__all__ = ["LOSSY_VERIFIERS", "JudgedResult", "verify_judge", "VERIFIERS", "VERIFIER_LAWS", "DEFAULT_VERIFIER",
           "LAW_OF_VERIFIER", "VERIFIER_RULES", "SPECS", "VerifierSpec", "VerifyResult", "output_law",
           "resolve_verifier", "verifier", "verify_tree"]
