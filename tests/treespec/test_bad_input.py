"""Bad input gets a clear error that names the problem."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from treespec.cli import main as cli_main
from treespec.drafting.ngram import NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.compat import check_tokenizers, check_vocab_sizes
from treespec.models.tiny import tiny_model
from treespec.sampling import NonFiniteLogitsError, SamplingConfig
from treespec.tree import TokenTree
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape
from treespec.verify import VERIFIERS


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


def test_tokenizer_mismatch_is_named():
    a = word_tokenizer(["<unk>", "hello", "world"])
    check_tokenizers(a, word_tokenizer(["<unk>", "hello", "world"]))  # same: fine
    with pytest.raises(ValueError, match="tokenizers differ: token 'hello' is id 1"):
        check_tokenizers(a, word_tokenizer(["<unk>", "world", "hello"]))
    with pytest.raises(ValueError, match="vocabularies of 4 and 3 tokens"):
        check_tokenizers(a, word_tokenizer(["<unk>", "hello", "world", "extra"]))


def test_draft_vocabulary_larger_than_target_is_refused():
    target, draft = tiny_model("llama", 32), tiny_model("llama", 48)
    with pytest.raises(ValueError, match=r"draft vocabulary \(48 logits\) is larger than the target's \(32\)"):
        check_vocab_sizes(target, draft)
    with pytest.raises(ValueError, match="draft vocabulary"):
        ShapeDrafter(draft, TreeShape.chain(2), "iid", target_vocab_size=32)


def test_draft_that_cannot_read_target_tokens_is_refused():
    target, draft = tiny_model("llama", 40), tiny_model("llama", 32)
    with pytest.raises(ValueError, match="draft embeds 32 token ids but the target emits 40"):
        check_vocab_sizes(target, draft)
    with pytest.raises(ValueError, match="draft embeds 32 token ids"):
        ShapeDrafter(draft, TreeShape.chain(2), "iid", target_vocab_size=40)


def test_empty_prompt():
    with pytest.raises(ValueError, match="empty prompt"):
        generate(tiny_model("llama", 32), [], None)
    assert cli_main(["generate", "   ", "--target", "unused"]) == 2


def test_prompt_tokens_outside_vocabulary():
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        generate(tiny_model("llama", 32), [1, 40], None)


def test_context_overflow():
    model = tiny_model("llama", 32, max_positions=64)
    with pytest.raises(ValueError, match=r"context overflow: prompt \(60 tokens\) \+ max_new_tokens \(10\)"):
        generate(model, list(range(30)) * 2, None, GenerationConfig(max_new_tokens=10))
    # exactly at the limit is fine, and speculation never positions a node past it
    out = generate(model, list(range(30)) * 2, NgramDrafter(), GenerationConfig(
        max_new_tokens=4, sampling=SamplingConfig(0.0), stop_on_eos=False))
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), "temperature must be a number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
])
def test_invalid_sampling_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_invalid_generation_options():
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown verifier 'magic'"):
        GenerationConfig(verifier="magic")


def test_cli_reports_invalid_sampling(capsys):
    assert cli_main(["generate", "hi", "--temperature", "-1", "--target", "unused"]) == 2
    assert "temperature must be a number >= 0" in capsys.readouterr().err


def test_nan_logits_are_named():
    model = tiny_model("llama", 32)
    with torch.no_grad():
        model.get_output_embeddings().weight[3, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError, match="produced NaN logits"):
        generate(model, [1, 2, 3], None)


def test_unsupported_tree_verifier_pair():
    model = tiny_model("llama", 32)
    cfg = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(1.0), verifier="rrs")
    with pytest.raises(ValueError, match="verifier 'rrs' needs a tree drafted under 'iid'.*'deterministic'"):
        generate(model, [1, 2, 3, 1, 2], NgramDrafter(), cfg)
    tree = TokenTree.from_lists([-1, 0], [1, 2], "iid")
    with pytest.raises(ValueError, match="draft_probs .* must match target_probs"):
        VERIFIERS["rrs"](tree, torch.full((2, 8), 1 / 8), torch.full((2, 9), 1 / 9))
