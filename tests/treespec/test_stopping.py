"""SpecDec++'s stopping rule (:class:`treespec.drafting.stopping.PredictedStop`) and its acceptance head.

1. The rule's decisions inside :class:`~treespec.trees.grow.ShapeDrafter` against a reference written from the
   definition (a loop over the proposed tree: a node's path acceptance is the product of the head's predictions
   from the root down, each computed row by row; a node has children exactly when that product is at least
   ``1 - max_reject`` and the template gives it some; no drawn child is ever dropped), at T = 0 and T = 1, with a
   twin that forgets the parent's product and fails the reference.
2. The output law at T = 1 with the rule (the small trained head of test_distill, vocabulary 6): G test over seeds
   0..399 (N = 400, alpha 1e-3, cells of expected count < 5 pooled); its twin tells the verifier a uniform q the
   children were not drawn from and must fail. A rule that drops a drawn child at T > 0 is refused by the drafter.
3. Greedy output with the rule equals plain decoding; the acceptance head's file round trip and refusals; the
   training rows' labels against :func:`~treespec.drafting.head_runner.head_depth_logits`; training beats the
   draft's confidence on rows whose acceptance the confidence does not tell.
"""

from __future__ import annotations

import math

import pytest
import torch

from treespec.distill.acceptance import (AcceptanceRows, AcceptanceRowsOptions, AcceptanceTrainOptions, score,
                                         sequence_rows, split_rows, train_acceptance_head)
from treespec.drafting.base import DraftState
from treespec.drafting.head import new_head
from treespec.drafting.head_runner import head_depth_logits
from treespec.drafting.stopping import (REGIMES, AcceptanceHead, AcceptanceHeadConfig, ConfidenceStop,
                                        PredictedStop, StopDecision, child_numbers)
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

from .test_distill import _small_head, prompts  # noqa: F401
from .test_end_to_end_stats import ALPHA, UniformQ, exact_law, g_test, sample_counts

V = 128  # test_distill.prompts() draws token ids below 128


@pytest.fixture(scope="module")
def target():
    return tiny_model("gemma3", V, seed=0, logit_scale=6.0)


@pytest.fixture(scope="module")
def head(target):
    return new_head(target, torch.arange(0, V, 2), num_heads=2, seed=1).eval()


def acceptance_head(hidden_size: int, seed: int = 0, bias: float = 1.0) -> AcceptanceHead:
    """A random acceptance head whose predictions spread over (0, 1) (``bias`` shifts them up)."""
    torch.manual_seed(seed)
    ah = AcceptanceHead(AcceptanceHeadConfig(hidden_size, width=8))
    with torch.no_grad():
        for net in ah.nets.values():
            net[2].weight.mul_(8.0)
            net[2].bias.fill_(bias)
    return ah.eval()


class Recording:
    """Wraps a stopping rule and keeps every level's inputs and decision (for the reference)."""

    def __init__(self, inner) -> None:
        self.inner, self.levels = inner, []
        self.needs_feature, self.tracks_path = inner.needs_feature, inner.tracks_path

    def decide(self, deterministic, q, columns, feature, parent_accept, depth) -> StopDecision:
        out = self.inner.decide(deterministic, q, columns, feature, parent_accept, depth)
        self.levels.append((deterministic, q.clone(), columns.clone(), feature.clone(), parent_accept.clone(),
                            depth.clone(), out))
        return out


class ForgetsParent(PredictedStop):
    """Deliberately broken: a child's path acceptance is its own prediction (the parent's product forgotten)."""

    def decide(self, deterministic, q, columns, feature, parent_accept, depth) -> StopDecision:
        return super().decide(deterministic, q, columns, feature, torch.ones_like(parent_accept), depth)


def propose(target, head, rule, widths, temperature: float, seed: int, prompt_len: int = 10):
    prompt = prompts()[0][:prompt_len]
    hidden = target.base_model(input_ids=torch.tensor([prompt[:-1]])).last_hidden_state[0]
    drafter = ShapeDrafter(head, TreeShape.widths(widths), "iid", stop=rule)
    drafter.begin(prompt)
    draft = drafter.propose(DraftState(prompt, 8, hidden), SamplingConfig(temperature),
                            torch.Generator().manual_seed(seed))
    return draft, drafter


def check_against_reference(draft, drafter, recording: Recording, ah: AcceptanceHead, max_reject: float,
                            widths: tuple[int, ...]) -> None:
    """The proposed tree against the rule's definition, node by node (see the module docstring); the rule's
    inputs are checked too: each row's feature is its node's output in the head's runner, its q the softmax of
    the head's logits on that feature (at T = 1), each child's token the column it was drawn as."""
    tree, head = draft.tree, drafter.runner.head
    parents = tree.parents.tolist()
    depth = tree.depths.tolist()
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        if parent >= 0:
            children.setdefault(parent, []).append(node)
    # each level's expanded nodes, in order: the nodes with children, level by level (BFS order of the tree)
    expanded = [n for n in range(tree.num_nodes) if n in children]
    rows = [(lv, r) for lv, level in enumerate(recording.levels) for r in range(level[1].shape[0])]
    assert len(rows) == len(expanded), "one decision row per expanded node"
    path = {0: 1.0}
    for node, (lv, r) in zip(expanded, rows):
        deterministic, q, columns, feature, parent_accept, d, _ = recording.levels[lv]
        assert int(d[r]) == depth[node]
        assert torch.equal(feature[r], drafter.runner._features[node]), "the node's own feature"
        assert torch.allclose(q[r], torch.softmax(head.logits(feature[r][None]).float(), dim=-1)[0], atol=1e-6)
        assert math.isclose(float(parent_accept[r]), path[node], rel_tol=1e-5), "the parent's path product"
        regime = "greedy" if deterministic else "sampled"
        kids = children[node]
        assert len(kids) == widths[depth[node]], "no drawn child is dropped"
        for j, kid in enumerate(kids):
            assert int(tree.tokens[kid]) == int(head.vocab_ids[columns[r, j]]), "the child drawn as column j"
            numbers = torch.tensor([math.log(max(float(q[r, columns[r, j]]), 1e-30)),
                                    math.log(max(float(q[r].max()), 1e-30)),
                                    float(-(q[r] * torch.log(q[r].clamp(min=1e-30))).sum()), depth[node] + 1.0])
            with torch.no_grad():
                a = float(torch.sigmoid(ah.logit(regime, feature[r], numbers)))
            path[kid] = path[node] * a
            grows = path[kid] >= 1.0 - max_reject and depth[kid] < len(widths)
            assert (kid in children) == grows, f"node {kid}: path acceptance {path[kid]:.4f}"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_predicted_stop_follows_its_definition(target, head, temperature):
    ah = acceptance_head(head.cfg.hidden_size, seed=2)
    widths, max_reject = (2, 2, 2, 1), 0.45
    sizes = set()
    for seed in range(12):
        rec = Recording(PredictedStop(ah, max_reject))
        draft, drafter = propose(target, head, rec, widths, temperature, seed, prompt_len=6 + seed % 5)
        check_against_reference(draft, drafter, rec, ah, max_reject, widths)
        sizes.add(draft.tree.num_nodes)
    assert len(sizes) > 1 and min(sizes) < 23  # the rule did shape the trees (the whole template: 23 nodes)


def test_a_rule_that_forgets_the_parent_fails_the_reference(target, head):
    ah = acceptance_head(head.cfg.hidden_size, seed=2)
    failures = 0
    for seed in range(12):
        rec = Recording(ForgetsParent(ah, 0.45))
        draft, drafter = propose(target, head, rec, (2, 2, 2, 1), 1.0, seed, prompt_len=6 + seed % 5)
        try:
            check_against_reference(draft, drafter, rec, ah, 0.45, (2, 2, 2, 1))
        except AssertionError:
            failures += 1
    assert failures > 0


def test_child_numbers_against_a_loop():
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(3, 7, generator=gen) * 2, dim=-1)
    q[1, 3] = 0.0  # a zero probability stays finite
    columns = torch.tensor([[0, 3], [3, 1], [6, 6]])
    depth = torch.tensor([0, 2, 5])
    got = child_numbers(q, columns, depth)
    for m in range(3):
        h = -sum(float(x) * math.log(float(x)) for x in q[m] if x > 0)
        for j in range(2):
            want = [math.log(max(float(q[m, columns[m, j]]), 1e-30)), math.log(float(q[m].max())), h,
                    float(depth[m] + 1)]
            assert torch.allclose(got[m, j], torch.tensor(want), atol=1e-5)


def test_greedy_output_with_the_rule_equals_plain(target, head):
    ah = acceptance_head(head.cfg.hidden_size, seed=3, bias=3.0)
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(0.0), stop_on_eos=False)
    for prompt in [prompts()[1][:12], [5, 9], prompts()[2][:6]]:
        plain = generate(target, prompt, None, cfg).token_ids
        out = generate(target, prompt, ShapeDrafter(head, TreeShape.widths((2, 1, 1, 1)), "iid",
                                                    stop=PredictedStop(ah, 0.7)), cfg)
        assert out.token_ids == plain


class DropsUnlikely(PredictedStop):
    """Deliberately broken: at T > 0 it drops every drawn child that is not the draft's top token (a sampled
    child removed after its draw: the verifier's idea of the children's law is then wrong)."""

    def decide(self, deterministic, q, columns, feature, parent_accept, depth) -> StopDecision:
        out = super().decide(deterministic, q, columns, feature, parent_accept, depth)
        top = q.argmax(-1, keepdim=True) == columns  # [M, k]
        return StopDecision(top, out.grow & top, out.path_accept)


def test_the_drafter_refuses_a_rule_that_drops_a_sampled_child(target, head):
    ah = acceptance_head(head.cfg.hidden_size, seed=4)
    with pytest.raises(RuntimeError, match="dropped a sampled child"):
        for seed in range(6):
            propose(target, head, DropsUnlikely(ah, 0.5), (3, 1), 1.0, seed)


@pytest.mark.stats
@pytest.mark.parametrize("broken", [False, True])
def test_output_law_at_t1_with_the_rule(tmp_path, broken):
    small, small_head = _small_head(tmp_path)
    ah = acceptance_head(small_head.cfg.hidden_size, seed=4)
    wrap = UniformQ if broken else (lambda d: d)  # the twin: the verifier is told a q the children were not drawn from
    sampling = SamplingConfig(1.0)
    n = 400
    counts = sample_counts(small, lambda: wrap(ShapeDrafter(small_head, TreeShape.widths((2, 2, 1)), "iid",
                                                            stop=PredictedStop(ah, 0.5))), "rrs", sampling, n=n)
    p_value = g_test(counts, exact_law(small, sampling), n)
    if broken:
        assert p_value < ALPHA, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > ALPHA, f"output law differs from the target's (G-test p = {p_value:.2e})"


def test_acceptance_head_file_round_trip_and_refusals(tmp_path, target, head):
    ah = acceptance_head(head.cfg.hidden_size, seed=5)
    path = tmp_path / "stop.safetensors"
    ah.save(path, extra={"head_sha256": "x"})
    back = AcceptanceHead.load(path)
    feature, numbers = torch.randn(4, head.cfg.hidden_size), torch.randn(4, 4)
    for r in REGIMES:
        assert torch.equal(back.logit(r, feature, numbers), ah.logit(r, feature, numbers))
    assert back.extra == {"head_sha256": "x"}
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="acceptance head"):
        AcceptanceHead.load(tmp_path / "junk.safetensors")
    head.save(tmp_path / "head.safetensors")
    with pytest.raises(ValueError, match="not a treespec acceptance head"):
        AcceptanceHead.load(tmp_path / "head.safetensors")
    wrong = PredictedStop(acceptance_head(head.cfg.hidden_size + 1), 0.5)
    with pytest.raises(ValueError, match="width"):
        propose(target, head, wrong, (2, 1), 1.0, 0)
    with pytest.raises(ValueError, match="not both"):
        ShapeDrafter(head, TreeShape.widths((2,)), "iid", min_confidence=-0.1, stop=PredictedStop(ah, 0.5))
    with pytest.raises(ValueError, match="max_reject"):
        PredictedStop(ah, 1.0)
    with pytest.raises(ValueError, match="not both"):
        ShapeDrafter(head, TreeShape.widths((2,)), "iid", min_confidence=0.2, stop=PredictedStop(ah, 0.5))
    assert ShapeDrafter(head, TreeShape.widths((2,)), "iid", min_confidence=0.2).stop == ConfidenceStop(0.2)


def test_training_rows_match_the_depth_logits(tmp_path):
    """Greedy labels and numbers equal what :func:`head_depth_logits` gives at the same positions and depths (a
    trained head, so that some labels are 1); each sampled label is min(1, p(x) / q(x)) for a token x of the
    subset whose q(x) is the row's."""
    small, small_head = _small_head(tmp_path)
    ids = [1 + b % 5 for b in prompts()[1][:30]]
    opts = AcceptanceRowsOptions(depths=3, positions=5, draws=2, seed=0)
    got = sequence_rows(small, small_head, ids, 12, opts, torch.Generator().manual_seed(0))
    # the rows sequence_rows samples: 5 of the entry rows 10 .. 27 (predicting the generated tokens 12 ..)
    rows = torch.randperm(len(ids) - 2 - 10, generator=torch.Generator().manual_seed(0))[:5] + 10
    rows, _ = rows.sort()
    t_logits, d_all = head_depth_logits(small_head, small, torch.tensor([ids]), 3)
    p = torch.softmax(t_logits, dim=-1)
    feat, numbers, label = got["greedy"]
    assert label.numel() == 15 and 0 < label.sum() < 15
    for k in range(3):
        for i, row in enumerate(rows.tolist()):
            n = k * 5 + i
            q_full = torch.softmax(d_all[k][row], dim=-1)
            x = int(q_full.argmax())
            assert float(label[n]) == float(x == int(p[row].argmax()))
            logq = torch.log(q_full[small_head.vocab_ids])
            want = [float(logq.max()), float(logq.max()), float(-(logq.exp() * logq).sum()), k + 1.0]
            assert torch.allclose(numbers[n], torch.tensor(want), atol=1e-4)
    _, s_numbers, s_label = got["sampled"]
    assert s_label.numel() == 30
    for n in range(30):
        k, rest = divmod(n, 10)  # per depth: every row's first draw, then every row's second
        row = rows[rest % 5]
        q_full = torch.softmax(d_all[k][row], dim=-1)
        x = int((q_full - float(s_numbers[n, 0].exp())).abs().argmin())
        assert math.isclose(float(s_label[n]), min(1.0, float(p[row, x] / q_full[x])), rel_tol=1e-3)


def test_training_beats_the_confidence_where_the_feature_tells():
    """Rows whose label is set by the feature's first coordinate, not by q(x): the trained head's held-out
    cross-entropy is far below the confidence's, and a head trained on shuffled labels is not."""
    gen = torch.Generator().manual_seed(0)
    n, h = 4000, 16

    def rows(shuffle: bool) -> AcceptanceRows:
        feature = torch.randn(n, h, generator=gen)
        numbers = torch.stack([torch.log(torch.rand(n, generator=gen)), torch.zeros(n), torch.ones(n),
                               torch.randint(1, 4, (n,), generator=gen).float()], dim=-1)
        label = (feature[:, 0] > 0).float()
        if shuffle:
            label = label[torch.randperm(n, generator=gen)]
        seq = torch.arange(n) // 10
        return AcceptanceRows(*({r: v for r in REGIMES} for v in (feature.half(), numbers, label, seq)))

    for shuffle in (False, True):
        train_rows, held = split_rows(rows(shuffle), 0.2, 0)
        ah = train_acceptance_head(train_rows, h, AcceptanceTrainOptions(width=16, epochs=10, batch=64))
        s = score(ah, held)["sampled"]
        if shuffle:
            assert s["head_xent"] > 0.6
        else:
            assert s["head_xent"] < 0.3 < s["confidence_xent"]


def test_rows_cache_round_trip_and_small_splits(tmp_path):
    """Rows saved under a key come back under that key only (a folder that does not exist yet is made); a
    validation share that would leave no rows to fit is refused by name."""
    from treespec.distill.acceptance import load_rows, save_rows

    n = 30
    feature, numbers = torch.randn(n, 8), torch.randn(n, 4)
    label, seq = torch.rand(n), torch.arange(n) // 10
    rows = AcceptanceRows(*({r: v for r in REGIMES} for v in (feature.half(), numbers, label, seq)))
    path = tmp_path / "new" / "rows.pt"
    save_rows(rows, path, {"a": 1})
    back = load_rows(path, {"a": 1})
    assert back is not None and all(torch.equal(back.label[r], rows.label[r]) for r in REGIMES)
    assert load_rows(path, {"a": 2}) is None and load_rows(tmp_path / "none.pt", {"a": 1}) is None
    fit, out = split_rows(rows, 0.99, 0)  # three sequences: one stays in
    assert fit.sizes["greedy"] == 10 and out.sizes["greedy"] == 20
    one = AcceptanceRows(*({r: v[:10] for r in REGIMES} for v in (feature.half(), numbers, label, seq)))
    with pytest.raises(ValueError, match="too few rows"):
        train_acceptance_head(one, 8, AcceptanceTrainOptions(width=4, epochs=1))
    ah = train_acceptance_head(rows, 8, AcceptanceTrainOptions(width=4, epochs=2, validation=0.0))
    assert ah.epochs == {"greedy": 2, "sampled": 2}  # no validation: the last epoch
