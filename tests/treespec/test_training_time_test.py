"""The training-time test: training the head at tree depths > 1 (:meth:`EagleHead.unroll`).

Tiny random Gemma-3 target and corpus of test_distill. What is checked:

1. the unrolled pass on a right-padded batch of windows equals the pass on each window alone (the
   padding never reaches a real entry), at every depth;
2. ``compute_losses`` at ``depths = 3`` equals a slow reference built entry by entry (each window
   alone, each depth's soft loss a plain cross-entropy over the entries that have a root inside the
   window, weights ``0.8 ** (k - 1)`` normalised), with top-k and with subset labels (computed once
   and shared by every depth), and differs from broken references that keep the rootless entries or
   read the subset labels one entry off; the same for the total-variation loss and the weighted total;
   bf16 logits stay within rounding of float32;
3. training at depths 1..3 lowers the depth-3 loss below what training at depth 1 alone reaches
   from the same start and steps (the point of the training-time test). That ``unroll`` is what the
   runner computes in a tree is tested in test_head_runner (``head_depth_logits`` uses it).
"""

from contextlib import nullcontext

import pytest
import torch

from treespec.distill.train import ShardSampler, TrainConfig, autocast_for, compute_losses

from .test_distill import CFG, corpus, target, trained  # noqa: F401


def _batch(corpus_dir, depths: int = 3):
    """A sampled batch of 4 windows, rows 1..3 cut shorter, their padding filled with garbage."""
    cfg = TrainConfig(**{**CFG.__dict__, "depths": depths, "seq_len": 24, "batch_size": 4})
    batch = ShardSampler(corpus_dir, cfg).batch(3)
    g = torch.Generator().manual_seed(0)
    for b in range(1, 4):
        t = batch["mask"].shape[1] - 5 * b
        batch["mask"][b, t:] = False
        batch["hidden_in"][b, t:] = torch.randn(batch["hidden_in"][b, t:].shape, generator=g) * 9
        batch["tokens"][b, t:] = torch.randint(0, 128, batch["tokens"][b, t:].shape, generator=g)
    return cfg, batch


def test_unroll_of_padded_windows_equals_each_window_alone(corpus, trained):  # noqa: F811
    _, head, _ = trained
    _, batch = _batch(corpus[0])
    with torch.no_grad():
        full = head.unroll(batch["hidden_in"], batch["tokens"], batch["positions"], 3)
        for b in range(batch["mask"].shape[0]):
            t = int(batch["mask"][b].sum())
            alone = head.unroll(batch["hidden_in"][b:b + 1, :t], batch["tokens"][b:b + 1, :t],
                                batch["positions"][b:b + 1, :t], 3)
            for k in range(3):
                assert torch.allclose(full[k][b, k:t], alone[k][0, k:], atol=1e-5), (b, k)


def _reference_losses(head, batch, cfg, keep_rootless: bool = False, label_shift: int = 0) -> dict[str, float]:
    """The depth-weighted soft, hard and feature losses, one window and one entry at a time (labels of ``cfg.soft``: the
    stored top-k, or the target's distribution on the subset from the stored ``h_j``). Broken twins:
    ``keep_rootless`` keeps entries without a root in the window; ``label_shift`` reads entry ``j``'s
    subset label at ``j - label_shift``."""
    weights = [cfg.depth_decay ** k for k in range(cfg.depths)]
    total = {"soft": 0.0, "hard": 0.0, "feat": 0.0, "tv": 0.0}
    sub_index = {int(t): i for i, t in enumerate(head.vocab_ids)}
    for k in range(1, cfg.depths + 1):
        soft, hard, tv, err, ref = [], [], [], 0.0, 0.0
        for b in range(batch["mask"].shape[0]):
            t = int(batch["mask"][b].sum())
            feats = head.unroll(batch["hidden_in"][b:b + 1, :t], batch["tokens"][b:b + 1, :t],
                                batch["positions"][b:b + 1, :t], k)[k - 1][0]  # [t, H]
            for j in range(0 if keep_rootless else k - 1, t):
                logq = torch.log_softmax(head.logits(feats[j]), dim=-1)
                if cfg.soft == "subset":
                    w = torch.softmax(head.logits(batch["hidden_out"][b, max(j - label_shift, 0)]), dim=-1)
                else:
                    ids, logp = batch["topk_ids"][b, j], batch["topk_logp"][b, j]
                    w = torch.zeros(head.cfg.target_vocab_size)
                    w.index_add_(0, ids, logp.exp())
                    w = w[head.vocab_ids]
                    w = w / w.sum()
                soft.append(-(w * logq).sum())
                tv.append(1.0 - torch.minimum(w, logq.exp()).sum())
                nxt = int(batch["next"][b, j])
                if nxt in sub_index:  # a next token inside the subset (-1: none)
                    hard.append(-logq[sub_index[nxt]])
                err += float((feats[j] - batch["hidden_out"][b, j]).pow(2).sum())
                ref += float(batch["hidden_out"][b, j].pow(2).sum())
        total["soft"] += weights[k - 1] * float(torch.stack(soft).mean())
        total["hard"] += weights[k - 1] * (float(torch.stack(hard).mean()) if hard else 0.0)
        total["feat"] += weights[k - 1] * err / ref
        total["tv"] += weights[k - 1] * float(torch.stack(tv).mean())
    out = {name: v / sum(weights) for name, v in total.items()}
    out["total"] = sum(getattr(cfg, f"w_{name}") * out[name] for name in ("soft", "hard", "feat", "tv"))
    return out


@pytest.mark.parametrize("soft,broken", [("topk", None), ("topk", "rootless"), ("subset", None),
                                         ("subset", "rootless"), ("subset", "shifted labels")])
def test_depth_losses_equal_a_slow_reference(corpus, trained, soft, broken):  # noqa: F811
    """The batched losses (labels computed once and shared by every depth): soft, hard and feature losses equal
    the entry-by-entry reference in float32; each broken reference differs from them."""
    _, head, _ = trained
    cfg, batch = _batch(corpus[0])
    cfg = TrainConfig(**{**cfg.__dict__, "soft": soft, "amp": "off", "w_tv": 0.5})
    sub_index = torch.full((head.cfg.target_vocab_size,), -1, dtype=torch.long)
    sub_index[head.vocab_ids] = torch.arange(head.vocab_ids.numel())
    with torch.no_grad():
        fast = {k: float(v) for k, v in compute_losses(head, batch, cfg, sub_index).items()}
        ref = _reference_losses(head, batch, cfg, keep_rootless=broken == "rootless",
                                label_shift=int(broken == "shifted labels"))
    if broken:
        assert abs(fast["soft"] - ref["soft"]) > 1e-4, f"the reference with {broken} must differ"
    else:
        for name in ("soft", "hard", "feat", "tv", "total"):
            assert abs(fast[name] - ref[name]) < 1e-4 * max(1.0, abs(ref[name])), (name, fast[name], ref[name])


def test_bf16_logits_stay_close_to_float32(corpus, trained):  # noqa: F811
    """With ``amp="bf16"`` the subset logits run under bf16 autocast (``logits_amp``, the default): the losses
    stay within bf16 rounding of the float32 ones, and ``logits_amp=False`` keeps those logits in float32."""
    _, head, _ = trained
    cfg, batch = _batch(corpus[0])
    sub_index = torch.full((head.cfg.target_vocab_size,), -1, dtype=torch.long)
    sub_index[head.vocab_ids] = torch.arange(head.vocab_ids.numel())
    out = {}
    for name, amp, logits_amp in (("fp32", "off", True), ("bf16", "bf16", True), ("bf16 head, fp32 logits", "bf16", False)):
        run_cfg = TrainConfig(**{**cfg.__dict__, "soft": "subset", "amp": amp, "logits_amp": logits_amp})
        with torch.no_grad():
            out[name] = float(compute_losses(head, batch, run_cfg, sub_index, autocast_for(torch.device("cpu"), amp)[0])["soft"])
    print(out)
    assert out["bf16"] != out["bf16 head, fp32 logits"]  # the option changes what runs
    for name in ("bf16", "bf16 head, fp32 logits"):
        assert abs(out[name] - out["fp32"]) < 1e-3 * abs(out["fp32"]), out


def _depth3_soft(head, batch, cfg, sub_index) -> float:
    from treespec.distill.train import _depth_losses, _soft_labels

    with torch.no_grad():
        feats = head.unroll(batch["hidden_in"], batch["tokens"], batch["positions"], 3)
        m = batch["mask"]
        keep = torch.arange(m.shape[1]).expand_as(m)[m] >= 2
        target_h = batch["hidden_out"][m]
        soft, top1 = _soft_labels(head, batch, m, cfg, sub_index, target_h, nullcontext())
        hard = torch.full(top1.shape, -1)
        return float(_depth_losses(head, feats[2][m], keep, target_h, soft, hard, top1)["soft"])


def test_training_deeper_levels_lowers_the_deep_loss(corpus, trained):  # noqa: F811
    """From the same head, 60 Adam steps on one fixed batch: with ``depths = 3`` the depth-3 loss ends
    below what training the depth-1 loss alone reaches (and below its start); depth-1 training does
    not target it (its depth-3 loss may even rise). Deterministic: fixed batch, seed 0."""
    import copy

    _, head, _ = trained
    start = copy.deepcopy(head)
    cfg, batch = _batch(corpus[0])
    sub_index = torch.full((head.cfg.target_vocab_size,), -1, dtype=torch.long)
    sub_index[head.vocab_ids] = torch.arange(head.vocab_ids.numel())
    before = _depth3_soft(start, batch, cfg, sub_index)
    after = {}
    for depths in (1, 3):
        h = copy.deepcopy(start).train()
        run_cfg = TrainConfig(**{**cfg.__dict__, "depths": depths})
        opt = torch.optim.Adam(h.parameters(), lr=3e-3)
        torch.manual_seed(0)
        with torch.enable_grad():
            for _ in range(60):
                opt.zero_grad()
                compute_losses(h, batch, run_cfg, sub_index)["total"].backward()
                opt.step()
        after[depths] = _depth3_soft(h.eval(), batch, cfg, sub_index)
    print(f"depth-3 soft loss: start {before:.4f}, after depth-1 training {after[1]:.4f}, "
          f"after depths 1-3 {after[3]:.4f}")
    assert after[3] < before and after[3] < after[1] - 0.05, (before, after)


def test_depth_metrics_equal_the_full_vocabulary_reference(target, trained):  # noqa: F811
    """``depth_metrics`` (subset softmax, per-depth slices) equals the same quantities read off
    ``head_depth_logits`` (full-vocabulary logits, tested against the runner), depth by depth."""
    from treespec.distill.evaluate import depth_metrics
    from treespec.drafting.head_runner import head_depth_logits

    from .test_distill import prompts

    _, head, _ = trained
    ps = [p[:20] for p in prompts()[:3]]
    gens = [p[20:28] for p in prompts()[:3]]
    got = depth_metrics(target, head, ps, gens, depths=4)
    agree, accept, count = [0.0] * 4, [0.0] * 4, [0] * 4
    with torch.no_grad():
        for p, g in zip(ps, gens):
            t_logits, per_depth = head_depth_logits(head, target, torch.tensor([p + g]), 4)
            for k in range(4):
                rows = range(len(p) - 2, len(p) + len(g) - 2)  # row i predicts position i + 2
                for i in rows:
                    if torch.isnan(per_depth[k][i]).any():
                        continue
                    pt, q = torch.softmax(t_logits[i], -1), torch.softmax(per_depth[k][i], -1)
                    agree[k] += float(pt.argmax() == q.argmax())
                    accept[k] += float(torch.minimum(pt, q).sum())
                    count[k] += 1
    assert got["positions_by_depth"] == count
    for k in range(4):
        assert abs(got["top1_agreement_by_depth"][k] - agree[k] / count[k]) < 1e-9
        assert abs(got["sum_min_pq_by_depth"][k] - accept[k] / count[k]) < 1e-5


def test_depth_metrics_by_group_equal_separate_calls(target, trained):  # noqa: F811
    """``groups`` splits the totals: each label's metrics equal ``depth_metrics`` on that label's prompts
    alone, and the totals stay those of the ungrouped call."""
    from treespec.distill.evaluate import depth_metrics

    from .test_distill import prompts

    _, head, _ = trained
    ps = [p[:20] for p in prompts()[:4]]
    gens = [p[20:26 + i] for i, p in enumerate(prompts()[:4])]  # unequal lengths: unequal weights
    labels = ["a", "b", "a", "b"]
    got = depth_metrics(target, head, ps, gens, depths=3, groups=labels)
    whole = depth_metrics(target, head, ps, gens, depths=3)
    assert got["positions_by_depth"] == whole["positions_by_depth"]
    for k in range(3):
        assert abs(got["top1_agreement_by_depth"][k] - whole["top1_agreement_by_depth"][k]) < 1e-9
        assert abs(got["sum_min_pq_by_depth"][k] - whole["sum_min_pq_by_depth"][k]) < 1e-6
    assert sorted(got["by_group"]) == ["a", "b"]
    for label in ("a", "b"):
        idx = [i for i, g in enumerate(labels) if g == label]
        alone = depth_metrics(target, head, [ps[i] for i in idx], [gens[i] for i in idx], depths=3)
        part = got["by_group"][label]
        assert part["positions_by_depth"] == alone["positions_by_depth"]
        for k in range(3):
            assert abs(part["top1_agreement_by_depth"][k] - alone["top1_agreement_by_depth"][k]) < 1e-9
            assert abs(part["sum_min_pq_by_depth"][k] - alone["sum_min_pq_by_depth"][k]) < 1e-6
    with pytest.raises(ValueError, match="groups"):
        depth_metrics(target, head, ps, gens, depths=1, groups=labels[:3])


def test_tv_loss_reaches_the_head_parameters(corpus, trained):  # noqa: F811
    """With w_tv > 0 the total's gradient on the head's parameters is the one without it plus w_tv times the TV
    loss' own gradient (a detached TV term would leave it unchanged)."""
    _, head, _ = trained
    cfg, batch = _batch(corpus[0])
    sub_index = torch.full((head.cfg.target_vocab_size,), -1, dtype=torch.long)
    sub_index[head.vocab_ids] = torch.arange(head.vocab_ids.numel())
    params = [p for p in head.parameters() if p.requires_grad]

    def grads(w_tv: float, key: str = "total") -> torch.Tensor:
        run_cfg = TrainConfig(**{**cfg.__dict__, "soft": "subset", "amp": "off", "feature_noise": 0.0, "w_tv": w_tv})
        with torch.enable_grad():
            loss = compute_losses(head, batch, run_cfg, sub_index)[key]
            g = torch.autograd.grad(loss, params, allow_unused=True)
        return torch.cat([(x if x is not None else torch.zeros_like(p)).flatten() for x, p in zip(g, params)])

    plain, with_tv, tv_only = grads(0.0), grads(2.0), grads(2.0, "tv")
    assert tv_only.abs().max() > 0
    assert torch.allclose(with_tv, plain + 2.0 * tv_only, rtol=1e-4, atol=1e-7)
