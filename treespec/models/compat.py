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
    for token, idx in sorted(tv.items(), key=lambda kv: kv[1]):  # report the lowest id that differs
        if dv.get(token) != idx:
            raise ValueError(
                f"draft and target tokenizers differ: token {token!r} is id {idx} for the target and "
                f"{dv.get(token)} for the draft; a draft must share the target's tokenizer"
            )


def check_vocab_sizes(target_model, draft_model) -> None:
    """The draft must read every target token, and its output vocabulary may be a prefix of the
    target's (probability 0 elsewhere), never larger."""
    check_draft_vocab(target_model.get_output_embeddings().weight.shape[0],
                      draft_model.get_input_embeddings().weight.shape[0],
                      draft_model.get_output_embeddings().weight.shape[0])


def check_draft_vocab(target_vocab: int, draft_input_vocab: int, draft_output_vocab: int) -> None:
    if draft_output_vocab > target_vocab:
        raise ValueError(f"draft vocabulary ({draft_output_vocab} logits) is larger than the target's ({target_vocab})")
    if draft_input_vocab < target_vocab:
        raise ValueError(
            f"draft vocabulary mismatch: the draft embeds {draft_input_vocab} token ids but the target emits "
            f"{target_vocab}; the draft could not read the target's tokens"
        )
