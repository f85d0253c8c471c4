"""Fast paths against their slow, obvious references."""

import torch

from treespec.tree import TokenTree
from treespec.verify import VERIFIERS, rules
from treespec.verify.core import verify_tree


def random_tree(n: int, vocab: int, gen: torch.Generator) -> TokenTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return TokenTree.from_lists(parents, torch.randint(0, vocab, (n,), generator=gen).tolist())


def test_greedy_fast_path_equals_rule_based_verification():
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        vocab = int(torch.randint(2, 6, (1,), generator=gen))
        tree = random_tree(int(torch.randint(1, 12, (1,), generator=gen)), vocab, gen)
        # integer-valued logits make ties common: both paths must break them the same way
        logits = torch.randint(0, 3, (tree.num_nodes, vocab), generator=gen).float()
        fast = VERIFIERS["greedy"](tree, logits)
        onehot = torch.zeros_like(logits).scatter_(1, logits.argmax(1, keepdim=True), 1.0)
        slow = verify_tree(tree, onehot, None, torch.Generator().manual_seed(trial), rules.greedy_rule)
        assert fast == slow
