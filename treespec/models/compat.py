"""Checks that a draft can speak for a target: same tokenizer, compatible vocabulary."""

from __future__ import annotations


def check_tokenizers(target_tokenizer, draft_tokenizer) -> None:
    """Raise ValueError naming the first difference between two tokenizers' vocabularies."""
    tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if tv == dv:
        return
    if len(tv) != len(dv):
        raise ValueError(
            f"draft and target tokenizers differ: vocabularies of {len(dv)} and {len(tv)} tokens; "
            "a draft must share the target's tokenizer"
        )
    for token, idx in tv.items():
        if dv.get(token) != idx:
            raise ValueError(
                f"draft and target tokenizers differ: token {token!r} is id {idx} for the target and "
                f"{dv.get(token)} for the draft; a draft must share the target's tokenizer"
            )


def check_vocab_sizes(target_model, draft_model) -> None:
    """The draft's output vocabulary may be a prefix of the target's (probability 0 elsewhere), not larger."""
    tv = target_model.get_output_embeddings().weight.shape[0]
    dv = draft_model.get_output_embeddings().weight.shape[0]
    if dv > tv:
        raise ValueError(f"draft vocabulary ({dv} logits) is larger than the target's ({tv})")
