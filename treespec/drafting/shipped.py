"""The draft head shipped with treespec for the embedded Gemma-3-270M.

``treespec/assets/gemma3-270m-head.safetensors`` is an :class:`~treespec.drafting.head.EagleHead`
distilled with ``python -m treespec.distill`` (its model card, with the corpus, training run and
measured metrics, is ``treespec/assets/gemma3-270m-head.md``). It loads offline and attaches to
the target's own embedding and LM-head rows, so it only works with that target: loading it for
another model raises a clear error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .head import EagleHead
from .medusa import MedusaHeads
from .stopping import AcceptanceHead

#: the shipped weights (fp16, <= 16 MB)
DEFAULT_HEAD = Path(__file__).resolve().parents[1] / "assets" / "gemma3-270m-head.safetensors"

#: Medusa-style decoding heads for the same target (3 heads, 1.2M trained parameters, fp16;
#: ``python -m treespec.distill medusa`` on the same corpora, see the README)
DEFAULT_MEDUSA = Path(__file__).resolve().parents[1] / "assets" / "gemma3-270m-medusa.safetensors"

#: SpecDec++'s acceptance head for the shipped draft head (:class:`~treespec.drafting.stopping.AcceptanceHead`,
#: ``python -m treespec.distill acceptance``; recipe ``recipes/acceptance_head.sh``), read by ``--max-reject``
DEFAULT_STOP_HEAD = Path(__file__).resolve().parents[1] / "assets" / "gemma3-270m-stop.safetensors"
#: judge decoding's judge for the embedded Gemma-3-270M (LOSSY decoding, opt-in: ``--judge shipped``; trained by
#: recipes/judge_head.sh)
DEFAULT_JUDGE = Path(__file__).resolve().parents[1] / "assets" / "gemma3-270m-judge.safetensors"

#: how the CLI drafts with it when no --tree / --min-confidence / --law / --draft-quantize is given, at T=0 ("greedy") and at
#: T>0 ("sampled"); chosen on train prompts (benchmarks/results/tuning/; T=0: confidence 0.2 beat 0.4 for
#: lookup+head, 2.32x against 2.16x over plain decoding in fp32; T>0 keeps the same chain, drawn iid).
#: Re-checked for head v2 in bf16 (tuning/2026-11-25-6b9a6c8-bf16-v2-defaults: chains of 2 and 5, confidence
#: 0.1, 2,1 and 3,1,1 without replacement, 2,1,1 greedy-draft): no variant beat these settings beyond the
#: prompt-to-prompt spread at either temperature, and greedy-draft 2,1,1 was slower at T=1, so they stay.
#: The head drafts on 4-bit weights (``quantize``) where torch's int4 CPU kernel runs (bf16 on a CPU; elsewhere
#: it computes in the target's dtype), paired on 48 train prompts (AMD EPYC with avx512_bf16, head v2 continued
#: six times): at T>0 (tuning/2026-11-27-4b0e164-epyc-v2cont6-t1-paired) faster than the bf16 head on 36 prompts,
#: slower on 12 (sign test p = 0.0007), a median 1.07x, while trees of 4 siblings without replacement were not
#: faster; at T=0 lookup+head on it (tuning/2026-11-27-4b0e164-epyc-v2cont6-t0-paired) beat n-gram lookup alone
#: on 34 prompts of 48 (p = 0.0055), a median 1.06x (the head alone at T=0 follows the same setting, unmeasured).
DEFAULT_HEAD_SETTINGS = {
    "greedy": {"tree": (1, 1, 1), "min_confidence": 0.2, "quantize": "int4"},
    "sampled": {"tree": (1, 1, 1), "min_confidence": 0.2, "law": "iid", "quantize": "int4"},
}


def load_default_head(target) -> EagleHead:
    """The shipped head, attached to ``target`` (the embedded Gemma-3-270M)."""
    if not DEFAULT_HEAD.exists():
        raise FileNotFoundError(f"the shipped draft head is missing ({DEFAULT_HEAD}); reinstall treespec or "
                                "pass --draft ngram")
    try:
        return EagleHead.load(DEFAULT_HEAD, target)
    except ValueError as err:
        raise ValueError(f"the shipped draft head belongs to the embedded Gemma-3-270M: {err}") from err


def load_default_medusa(target) -> MedusaHeads:
    """The shipped Medusa heads, attached to ``target`` (the embedded Gemma-3-270M)."""
    if not DEFAULT_MEDUSA.exists():
        raise FileNotFoundError(f"the shipped Medusa heads are missing ({DEFAULT_MEDUSA}); reinstall treespec")
    try:
        return MedusaHeads.load(DEFAULT_MEDUSA, target)
    except ValueError as err:
        raise ValueError(f"the shipped Medusa heads belong to the embedded Gemma-3-270M: {err}") from err


def load_default_stop_head(device: torch.device | str = "cpu") -> AcceptanceHead:
    """The shipped acceptance head (SpecDec++'s stopping rule for the shipped draft head)."""
    if not DEFAULT_STOP_HEAD.exists():
        raise FileNotFoundError(f"the shipped acceptance head is missing ({DEFAULT_STOP_HEAD}); reinstall treespec "
                                "or drop --max-reject")
    from ..files import file_sha256

    stop_head = AcceptanceHead.load(DEFAULT_STOP_HEAD, device)
    trained_for = getattr(stop_head, "extra", {}).get("head_sha256")
    if trained_for != file_sha256(DEFAULT_HEAD):
        raise ValueError(f"the shipped acceptance head ({DEFAULT_STOP_HEAD.name}) was trained for another draft head "
                         "than the shipped one; retrain it with recipes/acceptance_head.sh")
    return stop_head
