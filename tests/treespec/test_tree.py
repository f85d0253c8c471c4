"""TokenTree's derived structure against a naive parent walk, serialisation, and validation."""

from __future__ import annotations

import random

import pytest
import torch

from treespec.tree import DRAFT_LAWS, TokenTree


def random_tree(rng: random.Random, n: int, law: str = "iid") -> TokenTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(50) for _ in range(n)]
    return TokenTree.from_lists(parents, tokens, law)


def naive(parents: list[int]):
    n = len(parents)
    ancestors = []
    for i in range(n):
        chain, j = [], i
        while j != -1:
            chain.append(j)
            j = parents[j]
        ancestors.append(set(chain))
    depths = [len(a) - 1 for a in ancestors]
    children = [[j for j in range(1, n) if parents[j] == i] for i in range(n)]
    rank = [0] * n
    for kids in children:
        for r, c in enumerate(kids):
            rank[c] = r
    return ancestors, depths, children, rank


@pytest.mark.parametrize("seed", range(25))
def test_structure_matches_naive_parent_walk(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 5, 8, 17, 33, 64])
    tree = random_tree(rng, n, rng.choice(DRAFT_LAWS))
    parents = tree.parents.tolist()
    ancestors, depths, children, rank = naive(parents)
    mask = tree.ancestor_mask
    assert mask.dtype == torch.bool and mask.shape == (n, n)
    for i in range(n):
        assert {j for j in range(n) if mask[i, j]} == ancestors[i]
    assert tree.depths.tolist() == depths
    assert tree.max_depth == max(depths)
    assert tree.position_ids(100).tolist() == [100 + d for d in depths]
    assert tree.num_children.tolist() == [len(c) for c in children]
    assert tree.max_children == max(len(c) for c in children)
    table = tree.children.tolist()
    for i in range(n):
        row = [c for c in table[i] if c >= 0]
        assert row == children[i]  # draw order = index order
        assert all(c == -1 for c in table[i][len(row):])
    assert tree.sibling_rank.tolist() == rank
    for i in range(n):
        path = tree.root_path(i)
        assert path == sorted(ancestors[i]) and path[0] == 0 and path[-1] == i
    leaves = [i for i in range(n) if not children[i]]
    assert tree.paths() == [sorted(ancestors[leaf]) for leaf in leaves]


def test_chain_and_deep_chain():
    tree = TokenTree.chain(7, [1, 2, 3], law="iid")
    assert tree.parents.tolist() == [-1, 0, 1, 2] and tree.tokens.tolist() == [7, 1, 2, 3]
    deep = TokenTree.chain(0, list(range(200)))
    assert deep.max_depth == 200
    assert bool(deep.ancestor_mask[-1].all())


def test_json_round_trip(tmp_path):
    rng = random.Random(3)
    for law in DRAFT_LAWS:
        tree = random_tree(rng, 12, law)
        again = TokenTree.from_dict(tree.to_dict())
        assert torch.equal(again.parents, tree.parents) and torch.equal(again.tokens, tree.tokens)
        assert again.law == tree.law
        path = tmp_path / f"{law}.json"
        tree.save(path)
        loaded = TokenTree.load(path)
        assert loaded.to_dict() == tree.to_dict()


@pytest.mark.parametrize("parents, tokens, law, message", [
    ([-1, 0, 3, 1], [0, 1, 2, 3], "iid", "topological"),  # parent after child
    ([-1, 0, 2], [0, 1, 2], "iid", "topological"),  # self loop
    ([-1, -1, 0], [0, 1, 2], "iid", "topological"),  # a second root
    ([0, 0, 1], [0, 1, 2], "iid", "root"),  # node 0 is not the root
    ([-1, 0, 1], [0, 1], "iid", "shape"),  # shape mismatch
    ([-1, 0], [0, 1], "bogus", "unknown draft law"),
    ([], [], "iid", "at least its root"),
])
def test_bad_trees_raise(parents, tokens, law, message):
    with pytest.raises(ValueError, match=message):
        TokenTree.from_lists(parents, tokens, law)


def test_bad_tensor_ranks_raise():
    with pytest.raises(ValueError, match="1-D"):
        TokenTree(torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), "iid")


def test_unknown_law_error_lists_the_laws():
    with pytest.raises(ValueError) as err:
        TokenTree.from_lists([-1], [0], "top_p")
    assert "'top_p'" in str(err.value) and all(law in str(err.value) for law in DRAFT_LAWS)
