"""Medusa-style decoding heads (:mod:`treespec.drafting.medusa`, :mod:`treespec.distill.medusa`).

1. Closed form: untrained heads (residual blocks start as the identity) give exactly the target's
   own next-token logits on the subset; the runner hands depth ``d`` head ``d + 1``'s logits; the
   parallel per-depth emulation used for calibration equals the runner along a path.
2. Greedy output of every tree builder drafting with the heads equals plain greedy decoding (fp32).
3. Output law at T = 1 (heads with random blocks on the vocabulary-6 Llama, subset of 4 tokens so
   q = 0 on two tokens): the first three generated tokens follow the exact target law for a Medusa
   tree of deterministic top-k candidates and for a path-list tree drawn i.i.d. from the heads;
   seeds 0..N-1, N = 400, G test with cells of expected count < 5 pooled, alpha = 1e-3. The twin
   (draft probabilities replaced by a uniform q the children were not drawn from) must fail.
   Power (stats_helpers): at N = 400, alpha = 1e-3, power 0.9 and df 10 it detects KL >= 0.044 nats,
   i.e. any total-variation shift >= 0.15.
4. Training on a distillation corpus lowers the loss and raises per-head agreement over the
   untrained heads; a run resumes; a run directory of another configuration is refused.
"""

import pytest
import torch

from treespec.calibration import measure_acceptance_vector
from treespec.distill.medusa import MedusaTrainConfig, PositionPool, evaluate_medusa, train_medusa
from treespec.drafting.base import DraftState
from treespec.drafting.medusa import MedusaConfig, MedusaHeads, MedusaRunner, medusa_depth_logits, new_medusa_heads
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree
from treespec.trees.dyspec import DySpecDrafter
from treespec.trees.eagle2 import Eagle2Drafter
from treespec.trees.grow import ShapeDrafter
from treespec.trees.sequoia import SequoiaDP
from treespec.trees.shape import TreeShape

from .test_distill import corpus, prompts, target  # noqa: F401
from .test_end_to_end_stats import ALPHA, UniformQ, exact_law, g_test, sample_counts

N = 400


def _random_heads(model, vocab_ids, num_heads=3, seed=0, scale=0.5):
    heads = new_medusa_heads(model, vocab_ids, num_heads=num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    return heads.eval()


@pytest.fixture(scope="module")
def heads(target):  # noqa: F811
    vocab = torch.arange(0, target.config.vocab_size, 2)  # every other token: q = 0 on half the vocabulary
    return _random_heads(target, vocab)


def test_untrained_heads_are_the_targets_own_head(target):  # noqa: F811
    vocab = torch.arange(target.config.vocab_size)
    fresh = new_medusa_heads(target, vocab, num_heads=2)
    ids = torch.tensor([prompts()[0][:10]])
    hidden = target.base_model(input_ids=ids).last_hidden_state[0]
    ref = target(ids).logits[0].float()  # [L, V]
    out = fresh(hidden)  # [L, 2, V]
    assert torch.allclose(out[:, 0], ref, atol=1e-4) and torch.allclose(out[:, 1], ref, atol=1e-4)


def test_runner_gathers_each_depths_head(target, heads):  # noqa: F811
    runner = MedusaRunner(heads)
    ids = prompts()[0][:9]
    hidden = target.base_model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
    runner.observe(DraftState(ids, 8, hidden))
    every = heads.full_logits(hidden[-1:])[0]  # [K, V]
    assert torch.isinf(every[:, 1::2]).all() and torch.isfinite(every[:, ::2]).all()
    tree = TokenTree.from_lists([-1, 0, 0, 1, 3], [ids[-1], 2, 4, 6, 8], "deterministic")
    out = runner.forward(tree, torch.tensor([0, 1, 2, 3]))["logits"]
    for row, depth in zip(out, [0, 1, 1, 2]):
        assert torch.equal(row, every[depth])
    with pytest.raises(ValueError, match="deeper than 3"):
        runner.forward(tree, torch.tensor([4]))
    with pytest.raises(ValueError, match="target_hidden"):
        runner.observe(DraftState([1, 2, 3], 4, None))


def test_depth_logits_match_the_runner_along_a_path(target, heads):  # noqa: F811
    ids = torch.tensor([prompts()[0][:16]])
    t_logits, per_depth = medusa_depth_logits(heads, target, ids, 3)
    assert t_logits.shape == per_depth[0].shape == (15, target.config.vocab_size)
    assert torch.isnan(per_depth[2][:2]).all() and not torch.isnan(per_depth[2][2:]).any()
    r = 8  # root position; the node at depth d predicts position r + d (row r + d - 2)
    hidden = target.base_model(input_ids=ids[:, :r]).last_hidden_state[0]
    runner = MedusaRunner(heads)
    runner.observe(DraftState(ids[0, : r + 1].tolist(), 3, hidden))
    tree = TokenTree.from_lists([-1, 0, 1], ids[0, r: r + 3].tolist(), "deterministic")
    out = runner.forward(tree, torch.tensor([0, 1, 2]))["logits"]
    for d in range(3):
        assert torch.allclose(out[d], per_depth[d][r + d - 1], atol=1e-5), d
    with pytest.raises(ValueError, match="depths"):
        medusa_depth_logits(heads, target, ids, 4)
    vec = measure_acceptance_vector(target, heads, [p[:24] for p in prompts()[:4]], SamplingConfig(0.0),
                                    width=3, depths=3)
    assert len(vec.by_depth) == 3 and all(0.0 <= sum(row) <= 1.0 + 1e-9 for row in vec.by_depth)


def test_save_load_and_wrong_target(tmp_path, target, heads):  # noqa: F811
    path = tmp_path / "m.safetensors"
    heads.save(path)
    back = MedusaHeads.load(path, target)
    h = torch.randn(5, heads.cfg.hidden_size)
    assert torch.equal(back(h), heads(h)) and torch.equal(back.vocab_ids, heads.vocab_ids)
    assert not list(tmp_path.glob(".*tmp*"))
    with pytest.raises(ValueError, match="another target"):
        MedusaHeads.load(path, tiny_model("gemma3", 64, seed=0))
    with pytest.raises(ValueError, match="not a treespec Medusa"):
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
        MedusaHeads.load(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="num_heads"):
        MedusaConfig(hidden_size=8, target_vocab_size=8, num_heads=0)
    with pytest.raises(ValueError, match="attach"):
        MedusaRunner(MedusaHeads(heads.cfg, heads.vocab_ids))


BUILDERS = {
    "medusa_topk": lambda h: ShapeDrafter(h, TreeShape.widths((3, 2, 1)), "deterministic"),
    "medusa_confident": lambda h: ShapeDrafter(h, TreeShape.widths((3, 2, 1)), "deterministic", min_confidence=0.02),
    "medusa_paths": lambda h: ShapeDrafter(h, TreeShape.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
                                           "deterministic"),
    "sequoia": lambda h: ShapeDrafter(h, SequoiaDP([0.5, 0.2, 0.1], 10, 3).shape(10, 3)),
    "dyspec_heap": lambda h: DySpecDrafter(h, 8, 3),
    "eagle2": lambda h: Eagle2Drafter(h, 8, top_k=3, depth=3),
}


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_every_builder_with_medusa_heads_is_greedy_exact(target, builder):  # noqa: F811
    vocab = torch.arange(target.config.vocab_size)
    heads = _random_heads(target, vocab, scale=0.05)  # close to the target's own head: drafts get accepted
    cfg = GenerationConfig(max_new_tokens=32, sampling=SamplingConfig(0.0), stop_on_eos=False)
    accepted = 0
    for prompt in [prompts()[1][:12] * 2, [5], prompts()[2][:6]]:
        plain = generate(target, prompt, None, cfg).token_ids
        out = generate(target, prompt, BUILDERS[builder](heads), cfg)
        assert out.token_ids == plain
        accepted += sum(s.accepted for s in out.steps)
    assert accepted > 0  # the heads' drafts were used, not only bonus tokens


def test_confidence_pruning_of_medusa_candidates(target, heads):  # noqa: F811
    """Deterministic candidates below ``min_confidence`` are dropped with their subtrees: the tree
    holds exactly the confident top-k tokens of each depth's head, nested."""
    ids = prompts()[0][:9]
    hidden = target.base_model(input_ids=torch.tensor([ids[:-1]])).last_hidden_state[0]
    probs = torch.softmax(heads.full_logits(hidden[-1:])[0], dim=-1)  # [K, V]
    widths = (3, 2, 1)
    for c in (0.0, 0.05, 0.2, 0.6):
        drafter = ShapeDrafter(heads, TreeShape.widths(widths), "deterministic", min_confidence=c)
        drafter.begin(ids)
        tree = drafter.propose(DraftState(ids, 8, hidden), SamplingConfig(0.0), None).tree
        kept = [int((probs[d].topk(w).values >= c).sum()) for d, w in enumerate(widths)]
        expected, level = 0, 1
        for k in kept:
            level *= k
            expected += level
        assert tree.num_nodes - 1 == expected, c
        for node in range(1, tree.num_nodes):
            d = int(tree.depths[node]) - 1
            assert float(probs[d, int(tree.tokens[node])]) >= c
    with pytest.raises(ValueError, match="min_confidence"):
        ShapeDrafter(heads, TreeShape.widths(widths), "deterministic", min_confidence=1.0)


LAW_CASES = {
    "medusa_topk": (lambda h: ShapeDrafter(h, TreeShape.widths((2, 2, 1)), "deterministic"), None),
    "paths_iid": (lambda h: ShapeDrafter(h, TreeShape.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]]), "iid"),
                  "rrs"),
    # adaptive draft length at T = 1: every drawn child kept, only confident ones expanded
    "paths_iid_adaptive": (lambda h: ShapeDrafter(h, TreeShape.widths((2, 2, 1)), "iid", min_confidence=0.3), "rrs"),
}


@pytest.mark.stats
@pytest.mark.parametrize("case,broken", [(c, False) for c in sorted(LAW_CASES)] + [("paths_iid", True)])
def test_output_law_at_t1_with_medusa_trees(case, broken):
    small = tiny_model("llama", 6, seed=0, logit_scale=6.0)
    heads = _random_heads(small, torch.tensor([1, 2, 3, 4]), scale=2.0, seed=1)
    make, verifier = LAW_CASES[case]
    sampling = SamplingConfig(1.0)
    wrap = UniformQ if broken else (lambda d: d)
    counts = sample_counts(small, lambda: wrap(make(heads)), verifier or "auto", sampling, n=N)
    p_value = g_test(counts, exact_law(small, sampling), N)
    if broken:
        assert p_value < ALPHA, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > ALPHA, f"{case}: output law differs from the target's (G-test p = {p_value:.2e})"


CFG = MedusaTrainConfig(steps=100, batch_size=64, lr=1e-2, warmup=5, num_heads=2, vocab_size=96, ckpt_every=10)


def test_training_improves_agreement_and_resumes(target, corpus, tmp_path):  # noqa: F811
    out, _ = corpus
    with torch.enable_grad():
        trained, summary = train_medusa(target, [out], tmp_path / "run", CFG, progress=False)
    h = target.config.hidden_size
    assert summary["steps"] == 100 and summary["trained_parameters"] == 2 * (h * h + h)
    assert (tmp_path / "run" / "summary.json").exists()
    ckpt = torch.load(tmp_path / "run" / "medusa-ckpt.pt", weights_only=True)
    losses = [h["loss"] for h in ckpt["history"]]
    assert losses[-1] < losses[0]
    fresh = new_medusa_heads(target, trained.vocab_ids, num_heads=2)
    # KL(p || q) per head on a fixed batch of 512 positions (the soft cross-entropy minus the entropy
    # of the target's look-ahead law, which no head can beat), and agreement over the corpus
    batch = PositionPool([out]).batch(512, 2, torch.Generator().manual_seed(123))

    def kl(heads):
        with torch.no_grad():
            logq = torch.log_softmax(heads(batch["h"]), dim=-1)
            p = torch.softmax(heads.logits(batch["h_label"]), dim=-1)
            per = (p * (torch.log(p.clamp(min=1e-30)) - logq)).sum(-1) * batch["ok_soft"]
            return per.sum(0) / batch["ok_soft"].sum(0)

    assert (kl(trained) < 0.9 * kl(fresh)).all()  # measured: -17% / -18% at seed 0
    before, after = evaluate_medusa(fresh, out), evaluate_medusa(trained, out)
    assert all(a > b for a, b in zip(after["top1_agreement_subset"], before["top1_agreement_subset"]))
    # resuming a finished run does nothing; an interrupted run (stopped before its first step)
    # finishes to the same weights as the uninterrupted one
    with torch.enable_grad():
        again, s2 = train_medusa(target, [out], tmp_path / "run", CFG, progress=False)
        assert s2["steps"] == 100 and all(torch.equal(a, b) for a, b in zip(again.parameters(), trained.parameters()))
        stopped = MedusaTrainConfig(**{**CFG.__dict__, "time_limit_s": 0.0})
        _, s3 = train_medusa(target, [out], tmp_path / "run2", stopped, progress=False)
        assert s3["steps"] == 0
        resumed, _ = train_medusa(target, [out], tmp_path / "run2", CFG, progress=False)
    assert all(torch.allclose(a, b) for a, b in zip(resumed.parameters(), trained.parameters()))
    with pytest.raises(ValueError, match="another configuration"):
        train_medusa(target, [out], tmp_path / "run", MedusaTrainConfig(**{**CFG.__dict__, "lr": 1e-3}),
                     progress=False)


def test_cli_trains_exports_and_evaluates(tmp_path, target, corpus, capsys):  # noqa: F811
    """``python -m treespec.distill medusa`` on a saved tiny target: trains, evaluates, exports a loadable file."""
    from treespec.distill.cli import main

    target.save_pretrained(tmp_path / "t")
    out, _ = corpus
    main(["medusa", "--target", str(tmp_path / "t"), "--dtype", "float32", "--corpus", str(out), "--run-dir",
          str(tmp_path / "r"), "--steps", "3", "--batch-size", "8", "--vocab-size", "32", "--num-heads", "2",
          "--export", str(tmp_path / "m.safetensors"), "--no-progress", "--evaluate", str(out)])
    summary = __import__("json").loads(capsys.readouterr().out)
    assert summary["steps"] == 3 and len(summary["evaluation"]["top1_agreement_subset"]) == 2
    heads = MedusaHeads.load(tmp_path / "m.safetensors", target)
    assert heads.cfg.num_heads == 2 and heads.vocab_ids.numel() == 32
    assert heads.extra["summary"]["steps"] == 3
