"""The embedded Gemma-3-270M (fp32): tree-speculative greedy output is token-identical to plain greedy
decoding for chains and trees, model drafts and n-gram drafts; the cache and the CLI work on it.

The first run converts the GGUF (about 90 s) and caches it; later runs load in seconds.
"""

import json

import pytest
import torch

from treespec.cli import main as cli_main
from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.drafting.shipped import load_default_medusa
from treespec.generate import GenerationConfig, generate
from treespec.models.loading import load_model, load_tokenizer
from treespec.models.runner import ModelRunner
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

pytestmark = pytest.mark.gemma

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Question: What is the boiling point of water at sea level?\nAnswer:",
]
GREEDY = GenerationConfig(max_new_tokens=64, sampling=SamplingConfig(0.0), stop_on_eos=False)


@pytest.fixture(scope="module")
def gemma():
    torch.set_num_threads(2)
    yield load_model("embedded", dtype="float32"), load_tokenizer("embedded")
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def plain_outputs(gemma):
    model, tok = gemma
    return [generate(model, tok(p)["input_ids"], None, GREEDY).token_ids for p in PROMPTS]


def test_plain_loop_matches_hugging_face_greedy(gemma, plain_outputs):
    model, tok = gemma
    ids = tok(PROMPTS[0], return_tensors="pt")
    hf = model.generate(**ids, max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert hf.tolist() == plain_outputs[0]


@pytest.mark.parametrize("drafter", ["ngram_chain", "ngram_tree", "self_chain", "self_tree", "shipped_medusa"])
def test_greedy_speculation_is_token_identical(gemma, plain_outputs, drafter):
    model, tok = gemma
    # n-gram drafts on all prompts; the (twice as costly) self-drafts on the first prompt
    cases = list(zip(PROMPTS, plain_outputs))[: 1 if drafter.startswith("self") else None]
    medusa = load_default_medusa(model) if drafter == "shipped_medusa" else None
    accepted = 0
    for prompt, plain in cases:
        make = {
            "ngram_chain": lambda: NgramDrafter(NgramConfig(depth=6, branches=1)),
            "ngram_tree": lambda: NgramDrafter(NgramConfig(depth=6, branches=4)),
            # the target as its own draft: every level accepted, deep commits of model-drafted nodes
            "self_chain": lambda: ShapeDrafter(model, TreeShape.chain(3), "iid"),
            "self_tree": lambda: ShapeDrafter(model, TreeShape.widths((2, 2)), "iid"),
            # the shipped Medusa heads: top-k candidates of each head along index paths
            "shipped_medusa": lambda: ShapeDrafter(medusa, TreeShape.from_paths([[0], [1], [0, 0], [0, 0, 0]]),
                                                   "deterministic"),
        }[drafter]
        out = generate(model, tok(prompt)["input_ids"], make(), GREEDY)
        assert out.token_ids == plain
        accepted += sum(s.accepted for s in out.steps)
        if drafter.startswith("self"):
            assert out.tau > 2.5
    assert accepted > 0  # drafts were used, not only bonus tokens


def test_cache_after_speculation_equals_fresh_prefill(gemma):
    """Past the 512-token sliding window: a long prompt, then speculative steps; the target cache
    then equals a fresh prefill, and the next logits equal a plain forward of the sequence."""
    model, tok = gemma
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 55)  # ~ 550 tokens
    ids = tok(text)["input_ids"]
    assert len(ids) > 512
    runner = ModelRunner(model)
    out = generate(runner, ids, NgramDrafter(NgramConfig(depth=6, branches=3)),
                   GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False))
    seq = ids + out.token_ids
    assert runner.length == len(seq) - 1 == runner.cache_length
    fresh = ModelRunner(model)
    fresh.forward(None, None, torch.tensor(seq[:-1]), need_logits=False)
    for mine, ref in zip(runner.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(mine.values, ref.values, atol=2e-4, rtol=1e-4)
    ref_logits = model(torch.tensor([seq])).logits[0, -1].float()
    from treespec.tree import TokenTree

    mine = runner.forward(TokenTree.chain(seq[-1], []), torch.arange(1))["logits"][0]
    torch.testing.assert_close(mine, ref_logits, atol=2e-3, rtol=1e-4)
    assert out.token_ids == generate(model, ids, None, GenerationConfig(
        max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)).token_ids


@pytest.mark.parametrize("draft, method", [([], "NgramDrafter"),  # the default (--draft auto)
                                           (["--draft", "lookup+head"], "FirstOf(NgramDrafter, ShapeDrafter)")])
def test_cli_json_speculative_equals_plain(capsys, gemma, draft, method):
    args = ["generate", "Once upon a time, there was a little", "--max-new-tokens", "24", "--dtype", "float32",
            "--json", "--no-stop"]
    assert cli_main(args + draft) == 0
    spec = json.loads(capsys.readouterr().out)
    assert cli_main(args + ["--plain"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 24
    assert spec["statistics"]["method"] == method and plain["statistics"]["method"] == "plain"
    assert plain["statistics"]["tau"] == 1.0
    assert isinstance(spec["text"], str) and spec["text"]


@pytest.mark.parametrize("temperature, argv, method, weights", [
    ("0", [], "FirstOf(NgramDrafter, ShapeDrafter)", {"int4"}),  # --draft auto at T=0 in bf16
    ("1", [], "ShapeDrafter", {"int4"}),  # --draft auto at T>0 in bf16
    ("1", ["--draft-quantize", "none"], "ShapeDrafter", {"packed", "plain"}),
    ("0", ["--draft", "ngram:8,4"], "NgramDrafter", None),  # n-gram lookup's shape is spelled in its draft word
])
def test_cli_defaults_in_bf16_draft_with_the_measured_head_setting(capsys, temperature, argv, method, weights):
    """The CLI's default drafters on the embedded target in bf16 (the tuned ones, treespec.cli._resolved_draft
    and DEFAULT_HEAD_SETTINGS): the run says which drafter and which head weights it drafted with."""
    args = ["generate", "Once upon a time, there was a little", "--max-new-tokens", "16", "--dtype", "bfloat16",
            "--temperature", temperature, "--json", "--no-stop", "--threads", "2", *argv]
    assert cli_main(args) == 0
    stats = json.loads(capsys.readouterr().out)["statistics"]
    assert stats["method"] == method and stats["new_tokens"] == 16
    if weights is None:
        assert "draft_weights" not in stats
    else:
        assert stats["draft_weights"] in weights


def test_int4_target_tree_pass_equals_its_per_path_passes():
    """The opt-in 4-bit target on the real model, in bf16 (its kernel's fast dtype): one tree pass gives,
    for every node, the logits of a causal pass over that node's path alone, up to bf16 rounding (within
    1.0: the unquantised bf16 runner differs by up to 0.5 on this tree, the int4 one by up to 0.75; a
    wrong mask or position moves logits by whole units), and the same argmax wherever the top two
    differ by more than that."""
    from treespec.models.fast import make_runner
    from treespec.tree import TokenTree

    tok = load_tokenizer("embedded")
    runner = make_runner(load_model("embedded", dtype="bfloat16"), quantize="int4")
    ids = tok(PROMPTS[0])["input_ids"]
    gen = torch.Generator().manual_seed(0)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8, 4]
    tree = TokenTree.from_lists(parents, [ids[-1]] + torch.randint(100, 20000, (11,), generator=gen).tolist())
    runner.reset()
    runner.forward(None, None, torch.tensor(ids[:-1]), need_logits=False)
    tree_logits = runner.forward(tree, torch.arange(tree.num_nodes))["logits"]  # [12, V]
    for node in range(tree.num_nodes):
        path = tree.root_path(node)
        runner.reset()
        chain = runner.forward(None, None, torch.tensor(ids[:-1] + tree.tokens[path].tolist()))["logits"][-1]
        gap = chain.topk(2).values
        assert float((tree_logits[node] - chain).abs().max()) < 1.0, node
        if float(gap[0] - gap[1]) > 1.0:
            assert int(tree_logits[node].argmax()) == int(chain.argmax()), node
