"""Tree builders drafting on a head's vocabulary subset (``need_logits="subset"``, ``DraftLogits``).

The reference is the same head behind a runner that returns full-vocabulary logits (-inf outside
the subset), the path every builder took before. At T = 0 every builder must grow the identical
tree from the identical context; at T = 1 the q rows handed to the verifier must equal the
full-vocabulary q of the same nodes (the output law with subset drafting is G-tested in
test_head_runner, whose head has a 4-of-6-token subset). A broken variant (columns not mapped back
to token ids) must fail the tree comparison.
"""

import pytest
import torch

from treespec.drafting.base import DraftState
from treespec.drafting.head_runner import HeadRunner
from treespec.sampling import SamplingConfig, logits_to_probs
from treespec.trees.common import DraftLogits
from treespec.trees.dyspec import DySpecDrafter
from treespec.trees.eagle2 import Eagle2Drafter
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

from .test_distill import corpus, prompts, target, trained  # noqa: F401


class FullVocabRunner(HeadRunner):
    """The reference: full-vocabulary logits whatever the builder asks for."""

    def forward(self, tree, nodes, chain=None, *, need_logits=True, need_hidden=False):
        return super().forward(tree, nodes, chain, need_logits=bool(need_logits), need_hidden=need_hidden)


class UnmappedRunner(HeadRunner):
    """Broken: subset logits handed out without their vocabulary ids (columns taken for token ids)."""

    def forward(self, tree, nodes, chain=None, *, need_logits=True, need_hidden=False):
        out = super().forward(tree, nodes, chain, need_logits=need_logits, need_hidden=need_hidden)
        if "vocab_ids" in out:
            n, vs = out["logits"].shape
            full = out["logits"].new_full((n, self.vocab_size), float("-inf"))
            full[:, :vs] = out["logits"]
            out = {**out, "logits": full}
            del out["vocab_ids"]
        return out


BUILDERS = {
    "eagle2": lambda r: Eagle2Drafter(r, 12, top_k=3, depth=4),
    "shape": lambda r: ShapeDrafter(r, TreeShape.widths((3, 2, 1)), "without_replacement"),
    "dyspec": lambda r: DySpecDrafter(r, 10, 4),
}


def _propose(target, head, runner_cls, builder: str, sampling: SamplingConfig, seed: int = 0):
    ids = prompts()[0][:24]
    hidden = target.base_model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]  # positions 0..L-2
    drafter = BUILDERS[builder](runner_cls(head))
    drafter.begin(ids)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return drafter.propose(DraftState(ids, 6, hidden), sampling, g)


@pytest.mark.parametrize("builder", sorted(BUILDERS))
@pytest.mark.parametrize("runner_cls", [HeadRunner, UnmappedRunner], ids=["subset", "broken"])
def test_subset_drafting_grows_the_full_vocabulary_tree_at_t0(target, trained, builder, runner_cls):  # noqa: F811
    _, head, _ = trained
    assert head.vocab_ids.numel() < target.config.vocab_size  # so columns and token ids differ
    ref = _propose(target, head, FullVocabRunner, builder, SamplingConfig(0.0))
    got = _propose(target, head, runner_cls, builder, SamplingConfig(0.0))
    same = torch.equal(ref.tree.parents, got.tree.parents) and torch.equal(ref.tree.tokens, got.tree.tokens)
    assert ref.tree.num_nodes > 3
    if runner_cls is UnmappedRunner:
        assert not same, "unmapped columns must change the tree"
    else:
        assert same


@pytest.mark.parametrize("builder", ["shape", "dyspec"])
def test_subset_q_rows_equal_the_full_vocabulary_q_at_t1(target, trained, builder):  # noqa: F811
    """Every q row handed to the verifier equals the full-vocabulary q of the same node (the node's
    logits from the reference runner, grown along the same tree)."""
    _, head, _ = trained
    sampling = SamplingConfig(1.0)
    got = _propose(target, head, HeadRunner, builder, sampling, seed=3)
    assert got.draft_probs is not None and got.draft_probs.shape[1] == target.config.vocab_size
    rows = [i for i in range(got.tree.num_nodes) if float(got.draft_probs[i].sum()) > 0]
    assert rows and float(got.draft_probs[:, head.vocab_ids].sum()) == pytest.approx(len(rows), abs=1e-4)
    ids = prompts()[0][:24]
    hidden = target.base_model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
    ref = FullVocabRunner(head)
    ref.observe(DraftState(ids, 6, hidden))
    depth = got.tree.depths
    with torch.no_grad():
        logits = torch.zeros(got.tree.num_nodes, target.config.vocab_size)
        chain = torch.tensor(ids[:-1])
        for d in range(int(depth.max()) + 1):  # level by level, as the builders feed the runner
            nodes = torch.nonzero(depth == d).flatten()
            logits[nodes] = ref.forward(got.tree, nodes, chain if d == 0 else None)["logits"]
    for i in rows:
        assert torch.allclose(got.draft_probs[i], logits_to_probs(logits[i:i + 1], sampling)[0], atol=1e-6), i


def test_draft_logits_maps_spreads_and_widens():
    ids = torch.tensor([2, 5, 7])
    d = DraftLogits(torch.tensor([[0.0, 1.0, 2.0]]), ids, 9)
    assert d.token_ids(torch.tensor([[2, 0, -1]])).tolist() == [[7, 2, -1]]
    assert torch.equal(d.spread(torch.tensor([[0.2, 0.3, 0.5]])), torch.tensor([[0, 0, 0.2, 0, 0, 0.3, 0, 0.5, 0]]))
    wide = d.at_least(4)
    assert wide.vocab_ids is None and wide.logits.shape == (1, 9)
    assert torch.equal(torch.softmax(wide.logits, -1)[0, ids], torch.softmax(d.logits, -1)[0])
    assert d.at_least(3) is d
