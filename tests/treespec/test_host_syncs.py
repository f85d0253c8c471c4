"""Host syncs per generate step do not grow with the tree (issue 46: device-clean hot paths).

Counted on the CPU with :class:`sync_helpers.SyncCounter` (what would block the host on CUDA: ``.item()`` and
friends, ``.tolist()`` / ``.numpy()`` / ``.cpu()``, data-dependent shapes). Each step is split in two:

* the target side (the tree pass, ``logits_to_probs``, the verifier, the commits): at most
  :data:`TARGET_SIDE` syncs, the same for a 2-node tree and a 100-node tree of depth 4, a chain of 1 and of 8;
* the proposal: at most :data:`PROPOSAL` plus :data:`PER_DRAFT_FORWARD` per draft forward (a tree builder
  decides each depth on the host from the level before), the same for trees of one depth and any width.

Counts at the time of writing (llama tiny models, T = 1 unless greedy): target side 5 (greedy, block), 7
(deterministic), 8 (rrs: one more for the support of q); per draft forward 6 for a causal-LM draft (the
runner's finite check and node read-back, ``logits_to_probs``' finite check, two in ``TokenTree``'s
validation, the level's read-back), 5 for the head.
"""

import pytest
import torch

from treespec.drafting.head import new_head
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.dyspec import DySpecDrafter
from treespec.trees.eagle2 import Eagle2Drafter
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

from sync_helpers import SyncCounter

#: syncs of one step outside the proposal, whatever the tree
TARGET_SIDE = 8
#: syncs of one proposal besides its draft forwards (the proposed tree's validation)
PROPOSAL = 2
#: syncs per draft forward (one per depth for the level-by-level builders)
PER_DRAFT_FORWARD = 6

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5]


@pytest.fixture(scope="module")
def models():
    gemma = tiny_model("gemma3", 64, seed=0, logit_scale=8)
    return {"target": tiny_model("llama", 64, seed=0, logit_scale=8),
            "draft": tiny_model("llama", 64, seed=1, logit_scale=8),
            "gemma": gemma, "head": new_head(gemma, torch.arange(32), num_heads=4, intermediate_size=64)}


def step_syncs(target, drafter, verifier: str, temperature: float, max_new_tokens: int = 16):
    """Per step after the first (which also holds the prefill): (target-side syncs, proposal syncs, draft
    forwards, drafted nodes)."""
    counter = SyncCounter()
    steps, proposals = [], []
    inner = drafter.propose

    def propose(*args, **kwargs):
        before = counter.total
        draft = inner(*args, **kwargs)
        proposals.append((counter.total - before, getattr(drafter, "draft_forwards", 0), draft.tree.num_nodes - 1))
        return draft

    def on_tokens(tokens):
        steps.append(counter.total)
        counter.reset()

    drafter.propose = propose
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature), seed=0,
                           stop_on_eos=False, verifier=verifier)
    with counter:
        generate(target, PROMPT, drafter, cfg, on_tokens=on_tokens)
    rows = [(total - prop, prop, forwards, nodes) for total, (prop, forwards, nodes) in zip(steps, proposals)]
    assert len(rows) >= 2
    return rows[1:]


VERIFIERS = {"rrs": ("iid", 1.0), "greedy": ("deterministic", 0.0), "deterministic": ("deterministic", 1.0)}


def _check(rows, label):
    for target_side, proposal, forwards, nodes in rows:
        assert target_side <= TARGET_SIDE, (label, nodes, target_side)
        assert proposal <= PROPOSAL + PER_DRAFT_FORWARD * forwards, (label, nodes, forwards, proposal)


@pytest.mark.parametrize("verifier", sorted(VERIFIERS))
def test_static_trees_small_and_large(models, verifier):
    """widths (2,) .. (4, 4, 2, 2) (2 to 100 drafted nodes): the target side is one constant; a proposal's
    syncs depend on its depth only (two trees of depth 2, 6 and 20 nodes, cost the same)."""
    law, temperature = VERIFIERS[verifier]
    target_sides, by_depth = set(), {}
    for widths in [(2,), (2, 2), (4, 4), (4, 2, 1), (4, 4, 2, 2)]:
        rows = step_syncs(models["target"], ShapeDrafter(models["draft"], TreeShape.widths(widths), law),
                          verifier, temperature)
        _check(rows, widths)
        target_sides.update(r[0] for r in rows if r[3])  # (a last step cut to the root alone drafts nothing)
        full = [r for r in rows if r[2] == len(widths)]  # steps that drafted every level
        by_depth.setdefault(len(widths), set()).update(r[1] for r in full)
    assert len(target_sides) == 1, target_sides  # 2 or 100 nodes: the same
    assert len(by_depth[2]) == 1, by_depth  # widths (2, 2) and (4, 4): the same


def test_chains_1_to_8(models):
    """Chains of 1 .. 8 drafts under rrs: the target side does not grow with the depth."""
    target_sides = set()
    for length in (1, 2, 4, 8):
        rows = step_syncs(models["target"], ShapeDrafter(models["draft"], TreeShape.chain(length), "iid"), "rrs", 1.0)
        _check(rows, f"chain{length}")
        target_sides.update(r[0] for r in rows)
    assert max(target_sides) <= TARGET_SIDE


@pytest.mark.parametrize("variant", ["heap", "threshold"])
def test_dyspec_small_and_large(models, variant):
    for budget in (4, 16):
        for law, verifier, temperature in [("without_replacement", "rrs_without_replacement", 1.0),
                                           ("deterministic", "greedy", 0.0)]:
            drafter = DySpecDrafter(models["draft"], budget, 4, variant=variant, law=law)
            _check(step_syncs(models["target"], drafter, verifier, temperature), (variant, budget, law))


def test_eagle2_small_and_large(models):
    for budget, top_k in ((4, 2), (16, 4)):
        for verifier, temperature in (("deterministic", 1.0), ("greedy", 0.0)):
            drafter = Eagle2Drafter(models["draft"], budget, top_k=top_k, depth=4)
            _check(step_syncs(models["target"], drafter, verifier, temperature), (budget, verifier))


@pytest.mark.parametrize("verifier", ["rrs", "greedy"])
def test_head_small_and_large(models, verifier):
    """The shipped drafter's kind (an EAGLE-style head growing per-depth widths), tiny."""
    law, temperature = VERIFIERS[verifier]
    target_sides = set()
    for widths in [(2,), (4, 4, 2, 2)]:
        rows = step_syncs(models["gemma"], ShapeDrafter(models["head"], TreeShape.widths(widths), law),
                          verifier, temperature)
        _check(rows, widths)
        target_sides.update(r[0] for r in rows if r[3])
    assert len(target_sides) == 1, target_sides


@pytest.mark.parametrize("verifier", ["rrs", "greedy"])
@pytest.mark.parametrize("rule", ["confidence", "predicted"])
def test_head_with_a_stopping_rule_small_and_large(models, verifier, rule):
    """A stopping rule adds no sync per node: the confidence and SpecDec++'s predicted acceptance (its path
    products stay on the device; the kept / grown flags come back with the level's tokens)."""
    from treespec.drafting.stopping import AcceptanceHead, AcceptanceHeadConfig, PredictedStop

    law, temperature = VERIFIERS[verifier]
    for widths in [(2,), (4, 4, 2, 2)]:
        if rule == "confidence":
            drafter = ShapeDrafter(models["head"], TreeShape.widths(widths), law, min_confidence=0.01)
        else:
            ah = AcceptanceHead(AcceptanceHeadConfig(models["head"].cfg.hidden_size, width=8)).eval()
            drafter = ShapeDrafter(models["head"], TreeShape.widths(widths), law, stop=PredictedStop(ah, 0.9))
        _check(step_syncs(models["gemma"], drafter, verifier, temperature), (rule, widths))


@pytest.mark.parametrize("verifier,law,small,large", [
    ("kseq", "iid", TreeShape.widths((2,)), TreeShape.widths((4, 4, 2, 2))),
    ("greedy_draft", "greedy_draft", TreeShape.widths((2,)), TreeShape.widths((4, 4, 2, 2))),
    ("spechub", "spechub", TreeShape.widths((2,)), TreeShape.widths((2, 2, 2, 2))),
    ("rrs_without_replacement", "without_replacement", TreeShape.widths((2,)), TreeShape.widths((4, 4, 2, 2))),
    ("block", "iid", TreeShape.chain(1), TreeShape.chain(8)),
    ("single", "iid", TreeShape.chain(1), TreeShape.chain(8)),
])
def test_other_verifiers_small_and_large(models, verifier, law, small, large):
    most = []
    for shape in (small, large):
        rows = step_syncs(models["target"], ShapeDrafter(models["draft"], shape, law), verifier, 1.0)
        _check(rows, (verifier, shape))
        most.append(max(r[0] for r in rows))
    assert most[0] == most[1], most


def test_counter_sees_a_per_node_item(models, monkeypatch):
    """The bound can fail: a verifier that reads one value per node back (``.item()``) breaks it."""
    import treespec.verify.core as core

    walk = core._walk

    def walk_with_reads(tree, next_node):
        for i in range(tree.num_nodes):
            next_node[i].item()
        return walk(tree, next_node)

    monkeypatch.setattr(core, "_walk", walk_with_reads)
    rows = step_syncs(models["target"], ShapeDrafter(models["draft"], TreeShape.widths((4, 4)), "iid"), "rrs", 1.0)
    with pytest.raises(AssertionError):
        _check(rows, "per-node item")


@pytest.mark.parametrize("soft", ["subset", "topk"])
def test_distill_losses_read_the_host_mask_only(soft):
    """One training step's losses and backward: the two reads left are of the batch's mask, built on the host
    (no device sync), whatever the number of trained depths (one test per depth before, and a bool-mask
    gather per depth and per label)."""
    from treespec.distill.train import TrainConfig, _subset_index, compute_losses

    target = tiny_model("gemma3", 64, seed=0)
    head = new_head(target, torch.arange(32), num_heads=4, intermediate_size=64).float().train()
    g = torch.Generator().manual_seed(0)
    b, t, h, k = 3, 7, 32, 4
    mask = torch.arange(t)[None, :] < torch.tensor([7, 4, 2])[:, None]
    batch = {"hidden_in": torch.randn(b, t, h, generator=g), "hidden_out": torch.randn(b, t, h, generator=g),
             "tokens": torch.randint(64, (b, t), generator=g), "next": torch.randint(-1, 64, (b, t), generator=g),
             "topk_ids": torch.randint(64, (b, t, k), generator=g), "topk_logp": torch.randn(b, t, k, generator=g),
             "positions": torch.arange(1, t + 1).expand(b, t).contiguous(), "mask": mask}
    for depths in (1, 6):
        with SyncCounter() as counter, torch.enable_grad():  # (the tests run under no_grad, training does not)
            losses = compute_losses(head, batch, TrainConfig(depths=depths, soft=soft, w_tv=0.5),
                                    _subset_index(head, 64, torch.device("cpu")))
            losses["total"].backward()
        assert counter.total <= 2, (depths, counter.kinds)
        assert f"agree_d{depths}" in losses


# ---------------------------------------------------------------------------- the counter itself
def test_counter_counts_known_reads():
    t = torch.arange(6.0)
    with SyncCounter(stacks=True) as c:
        t[1].item()
        int(t[2])
        float(t.sum())
        bool(t[3] > 0)
        if t[4] > 0:
            pass
        t.tolist()
        t.numpy()
        t.cpu()
        t.to("cpu")
    assert c.kinds == {"scalar": 5, "readback": 4} and c.total == 9
    assert sum(c.sites.values()) == 9


def test_counter_counts_data_dependent_shapes():
    t = torch.tensor([0, 3, 0, 5])
    with SyncCounter() as c:
        torch.nonzero(t)
        t[t > 0]
        torch.masked_select(t, t > 0)
    assert c.kinds == {"shape": 3}


def test_counter_is_zero_on_device_work_and_restores_methods():
    t = torch.randn(8, 8)
    tolist = torch.Tensor.tolist
    with SyncCounter() as c:
        u = (t @ t).softmax(dim=-1).cumsum(dim=1)
        u = u.index_select(0, torch.tensor([1, 2])).gather(1, torch.zeros(2, 1, dtype=torch.long))
        torch.where(u > 0, u, -u).to(torch.device("cpu")).to(torch.float64)
        t[torch.tensor(3)] if False else t[3]
    assert c.total == 0
    assert torch.Tensor.tolist is tolist
