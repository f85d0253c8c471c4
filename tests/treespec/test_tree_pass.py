"""Tree pass exactness: each node's logits from ONE tree forward equal a plain causal forward of its
root path; and the KV cache after commits equals a fresh prefill of the committed sequence."""

import pytest
import torch

from treespec.models.runner import ModelRunner
from treespec.models.tiny import ARCHITECTURES, tiny_model
from treespec.tree import TokenTree
from trees_common import random_tree

ATOL = 1e-5  # fp32; observed differences are ~1e-7 (different reduction orders)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("prefix_len", [1, 21])  # 21 > the tiny Gemma-3's sliding window of 8
def test_tree_logits_equal_per_path_causal_forward(arch, prefix_len):
    model = tiny_model(arch, vocab_size=64, seed=0)
    gen = torch.Generator().manual_seed(prefix_len)
    seq = torch.randint(0, 64, (prefix_len,), generator=gen)
    runner = ModelRunner(model)
    if prefix_len > 1:
        runner.forward(None, None, seq[:-1])
    tree = random_tree(12, int(seq[-1]), 64, gen)
    logits = runner.forward(tree, torch.arange(tree.num_nodes))["logits"]  # [12, V]
    for node in range(tree.num_nodes):
        path_ids = torch.cat([seq[:-1], tree.tokens[tree.root_path(node)]])
        reference = model(path_ids[None]).logits[0, -1].float()
        torch.testing.assert_close(logits[node], reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_level_by_level_tree_pass_matches(arch):
    """Feeding a tree in several calls (as drafters do) gives the same logits as one call."""
    model = tiny_model(arch, vocab_size=64, seed=3)
    gen = torch.Generator().manual_seed(7)
    seq = torch.randint(0, 64, (15,), generator=gen)
    tree = random_tree(10, int(seq[-1]), 64, gen)
    one = ModelRunner(model)
    one.forward(None, None, seq[:-1])
    full = one.forward(tree, torch.arange(10))["logits"]
    split = ModelRunner(model)
    # the chain is fed together with the first level, as the model drafter does
    first = split.forward(tree, torch.arange(4), seq[:-1])["logits"][-4:]
    second = split.forward(tree, torch.arange(4, 10))["logits"]
    torch.testing.assert_close(torch.cat([first, second]), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_committed_cache_equals_fresh_prefill(arch):
    """Commit random accepted paths for 60 steps; every layer's keys/values then equal a prefill."""
    model = tiny_model(arch, vocab_size=64, seed=1)
    gen = torch.Generator().manual_seed(11)
    runner = ModelRunner(model)
    seq = torch.randint(0, 64, (5,), generator=gen).tolist()
    runner.forward(None, None, torch.tensor(seq[:-1]))
    for _ in range(60):
        tree = random_tree(int(torch.randint(1, 8, (1,), generator=gen)), seq[-1], 64, gen)
        runner.forward(tree, torch.arange(tree.num_nodes))
        leaf = int(torch.randint(0, tree.num_nodes, (1,), generator=gen))
        path = tree.root_path(leaf)
        runner.commit(path)
        seq.extend(tree.tokens[path[1:]].tolist())
        seq.append(int(torch.randint(0, 64, (1,), generator=gen)))
        assert runner.length == len(seq) - 1 == runner.cache_length
    fresh = ModelRunner(model)
    fresh.forward(None, None, torch.tensor(seq[:-1]))
    for mine, ref in zip(runner.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(mine.values, ref.values, atol=ATOL, rtol=0)
    # and the next step's logits equal a plain forward of the whole sequence
    nxt = runner.forward(TokenTree.chain(seq[-1], []), torch.arange(1))["logits"][0]
    torch.testing.assert_close(nxt, model(torch.tensor([seq])).logits[0, -1].float(), atol=ATOL, rtol=0)


def test_commit_twice_is_rejected_and_foreign_tree_refused():
    model = tiny_model("llama", vocab_size=32)
    runner = ModelRunner(model)
    runner.forward(None, None, torch.tensor([1, 2, 3]))
    big = TokenTree.from_lists([-1, 0, 0], [4, 5, 6])
    runner.forward(big, torch.arange(2))
    with pytest.raises(RuntimeError, match="another tree"):
        runner.forward(TokenTree.chain(4, []), torch.arange(1))
    with pytest.raises(RuntimeError, match="chain"):
        runner.forward(None, None, torch.tensor([1]))
