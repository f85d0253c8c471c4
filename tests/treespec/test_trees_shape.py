"""Tree shapes (constructors, JSON) and the trees every builder proposes: connected, within
budget and depth, masks and positions consistent with the parent array, shapes grown exactly."""

import pytest
import torch

from treespec.drafting.base import DraftState
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

from trees_common import BUILDERS, MEDUSA, SHAPES


def test_constructors():
    assert TreeShape.chain(4).parents == (-1, 0, 1, 2, 3)
    assert TreeShape.kary(2, 3).num_drafted == 2 + 4 + 8
    w = TreeShape.widths((3, 2, 1))
    assert w.num_drafted == 3 + 6 + 6 and w.max_depth == 3
    assert [w.num_children[i] for i in range(w.num_nodes) if w.depths[i] == 1] == [2, 2, 2]
    s = TreeShape.independent_chains(3, 4)
    assert s.num_children[0] == 3 and s.num_drafted == 12 and s.max_depth == 4
    assert max(s.num_children[1:]) == 1
    assert MEDUSA.num_drafted == 8 and MEDUSA.num_children[0] == 3
    assert TreeShape.from_paths(MEDUSA.paths()) == MEDUSA
    # canonical breadth-first order whatever the input order
    assert TreeShape((-1, 0, 1, 0)) == TreeShape((-1, 0, 0, 1))
    with pytest.raises(ValueError):
        TreeShape.from_paths([[0, 0]])  # prefix [0] missing
    with pytest.raises(ValueError):
        TreeShape.from_paths([[1]])  # rank 0 missing
    assert TreeShape.from_paths([[1, 1]], fill=True).num_drafted == 4
    with pytest.raises(ValueError):
        TreeShape((-1, 1))
    assert TreeShape.widths((2, 2)).truncate(1) == TreeShape.widths((2,))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_json_round_trip(tmp_path, name):
    shape = SHAPES[name]
    shape.save(tmp_path / "s.json")
    back = TreeShape.load(tmp_path / "s.json")
    assert back == shape and back.name == shape.name
    assert TreeShape.from_dict({"paths": shape.paths()}) == shape


def _check_tree(tree, budget: int, max_depth: int):
    parents = tree.parents.tolist()
    n = len(parents)
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, n))  # connected, topological
    assert n - 1 <= budget
    depth = [0] * n
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
        depth[i] = int(anc[i].sum()) - 1
    assert torch.equal(tree.ancestor_mask.cpu(), anc)
    assert tree.depths.tolist() == depth and max(depth) <= max_depth
    assert tree.position_ids(17).tolist() == [17 + d for d in depth]


@pytest.fixture(scope="module")
def draft():
    return tiny_model("llama", 32, seed=1, logit_scale=4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_proposed_trees_are_well_formed(draft, builder, temperature):
    sampling = SamplingConfig(temperature)
    drafter = BUILDERS[builder](draft)
    gen = torch.Generator().manual_seed(0)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    drafter.begin(prompt)
    for max_depth in (4, 2, 0):
        out = drafter.propose(DraftState(prompt, max_depth), sampling, gen)
        budget = 16 if builder.startswith("shape") or builder.startswith("merged") else 8
        _check_tree(out.tree, budget, max_depth)
        assert out.tree.law == drafter.law(sampling)
        if out.draft_probs is not None:
            internal = out.tree.num_children > 0
            assert torch.allclose(out.draft_probs[internal].sum(-1), torch.ones(int(internal.sum())))
        drafter.runner.commit([0]) if hasattr(drafter, "runner") else drafter.model.runner.commit([0])


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shape_grown_exactly_at_temperature_zero(draft, name):
    drafter = ShapeDrafter(draft, SHAPES[name], "iid")
    out = drafter.propose(DraftState([1, 2, 3], 10), SamplingConfig(0.0), None)
    assert tuple(out.tree.parents.tolist()) == SHAPES[name].parents
    # siblings are the draft's top-k in order
    assert drafter.draft_forwards == SHAPES[name].max_depth


def test_without_replacement_truncates_and_drops_subtrees(draft):
    shape = TreeShape.from_paths([[0], [1], [2], [0, 0], [1, 0], [2, 0], [2, 0, 0]])
    drafter = ShapeDrafter(draft, shape, "without_replacement")
    sampling = SamplingConfig(1.0, top_k=2)  # q has 2 tokens: the rank-2 child and its subtree vanish
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        drafter.begin([1, 2])
        out = drafter.propose(DraftState([1, 2], 5), sampling, gen)
        tree = out.tree
        assert tree.num_children[0] == 2 and tree.num_nodes == 5 and tree.max_depth == 2
        kids = tree.children[0].tolist()
        assert tree.tokens[kids[0]] != tree.tokens[kids[1]]
        assert set(tree.tokens[kids].tolist()) == set(torch.nonzero(out.draft_probs[0]).flatten().tolist())


def test_spechub_shape_checked(draft):
    with pytest.raises(ValueError):
        ShapeDrafter(draft, TreeShape.widths((3,)), "spechub")
    ShapeDrafter(draft, TreeShape.widths((2, 2)), "spechub")
