"""The cache bookkeeping every PyTorch runner holds (:class:`treespec.models.runner.CacheBook`): what a
forward appends, which keys each new query sees (against a slow, obvious reference), the commit of an
accepted path and the rollback of a tree."""

import pytest
import torch

from treespec.models.runner import CacheBook
from treespec.tree import TokenTree

CPU = torch.device("cpu")


def random_tree(num_nodes: int, gen: torch.Generator) -> TokenTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    return TokenTree.from_lists(parents, torch.randint(0, 50, (num_nodes,), generator=gen).tolist())


def reference_visible(parents: list[int], slots: list[int], new: list[int], m: int, base: int) -> list[list[bool]]:
    """Entry by entry: a chain token sees the prefix and the chain up to itself; a node sees the prefix,
    the whole chain and the tree entries (``slots`` then ``new``) holding itself or one of its ancestors."""
    def lineage(node: int) -> set[int]:
        out = set()
        while node >= 0:
            out.add(node)
            node = parents[node]
        return out

    keys = [("prefix", k) for k in range(base)] + [("chain", j) for j in range(m)] + [("node", s) for s in slots + new]
    rows = []
    for j in range(m):
        rows.append([kind == "prefix" or (kind == "chain" and k <= j) for kind, k in keys])
    for node in new:
        mine = lineage(node)
        rows.append([kind in ("prefix", "chain") or k in mine for kind, k in keys])
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_visible_keys_match_the_reference_level_by_level(seed):
    gen = torch.Generator().manual_seed(seed)
    tree = random_tree(15, gen)
    book = CacheBook(length=5)
    levels = [torch.nonzero(tree.depths == d).flatten() for d in range(int(tree.max_depth) + 1)]
    chain = torch.randint(0, 50, (3,), generator=gen)
    for i, nodes in enumerate(levels):
        piece = chain if i == 0 else None  # the chain goes with the first call only
        base, slots_before = book.length, list(book.slots)
        m, n, ids, q_pos = book.inputs(tree, nodes, piece, CPU)
        total = base + m + len(slots_before) + n
        visible = book.visible_keys(nodes, m, n, base, total, CPU)  # [m + n, total]
        expected = reference_visible(tree.parents.tolist(), slots_before, nodes.tolist(), m, base)
        assert visible.tolist() == expected
        assert ids.tolist() == (chain.tolist() if m else []) + tree.tokens[nodes].tolist()
        root_position = 5 + 3  # after the prefix and the chain of the first call
        assert q_pos.tolist() == list(range(5, 5 + m)) + (tree.depths[nodes] + root_position).tolist()
        book.finish(base, m, nodes.tolist())
    assert book.length == 8 and book.root_position == 8 and book.tree is tree
    assert book.slots == torch.cat(levels).tolist()


def test_commit_of_an_accepted_path_and_rollback():
    tree = TokenTree.from_lists([-1, 0, 0, 1, 2, 3], [7, 8, 9, 10, 11, 12])
    book = CacheBook(length=4)
    m, n = book.begin(tree, torch.tensor([0, 2, 1]), None)
    assert (m, n) == (0, 3) and book.root_position == 4
    book.finish(4, 0, [0, 2, 1])
    book.begin(tree, torch.tensor([4, 3]), None)
    book.finish(4, 0, [4, 3])
    assert book.slots == [0, 2, 1, 4, 3]
    # the accepted path 0 -> 1 -> 3 -> 5: entries 4 (node 0), 6 (node 1), 8 (node 3); node 5 was never fed
    kept = book.kept_entries([0, 1, 3, 5])
    assert kept == [4, 6, 8] and book.length == 4 and book.slots == [0, 2, 1, 4, 3]  # reading changes nothing
    book.committed(len(kept))
    assert book.length == 7 and book.slots == [] and book.tree is None
    # a rollback: a tree fed, then nothing of it kept
    book.begin(tree, torch.tensor([0, 1]), None)
    book.finish(7, 0, [0, 1])
    assert book.kept_entries([]) == []
    book.committed(0)
    assert book.length == 7 and book.slots == [] and book.tree is None
    m, n = book.begin(None, None, torch.tensor([1, 2]))  # a committed chain may follow again
    book.finish(7, m, [])
    assert book.length == 9


def test_already_in_place_path_keeps_entries_in_order():
    tree = TokenTree.chain(3, [4, 5])
    book = CacheBook()
    book.begin(tree, torch.arange(3), torch.tensor([1, 2]))
    book.finish(0, 2, [0, 1, 2])
    assert book.kept_entries([0, 1]) == [2, 3]  # the root path sits right after the prefix


def test_bad_forwards_are_refused():
    tree = TokenTree.chain(3, [4, 5])
    book = CacheBook()
    with pytest.raises(ValueError, match="nothing to forward"):
        book.begin(None, None, None)
    with pytest.raises(ValueError, match="tree nodes need their tree"):
        book.begin(None, torch.tensor([0]), None)
    book.begin(tree, torch.tensor([0]), None)
    book.finish(0, 0, [0])
    with pytest.raises(RuntimeError, match="committed chain cannot follow"):
        book.begin(None, None, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="another tree"):
        book.begin(TokenTree.chain(3, []), torch.tensor([0]), None)
