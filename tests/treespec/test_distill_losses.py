"""The fused, chunked distillation losses (treespec.distill.losses) against their composite reference:
values, gradients and top-1 in float32 (tight) and with bf16 logits (bf16 rounding), chunk sizes that do
and do not divide the rows, rows without a hard label, and a batch without any. A broken twin (the hard
gradient without its one-hot term) fails the same comparison."""

import pytest
import torch

from treespec.distill import losses as L


def _case(rows=300, cols=257, seed=0, dtype=torch.float32, no_hard=False, keep=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    soft = torch.softmax(torch.randn(rows, cols, generator=g) * 2, dim=-1)
    hard = torch.randint(0, cols, (rows,), generator=g)
    hard[torch.rand(rows, generator=g) < 0.2] = -1
    if no_hard:
        hard[:] = -1
    return logits, soft, hard, (torch.rand(rows, generator=g) < 0.7) if keep else None


def _run(fn, logits, soft, hard, keep, w=(1.0, 0.1)):
    z = logits.clone().requires_grad_(True)
    with torch.enable_grad():  # tests run under no_grad (conftest)
        s, h, top1 = fn(z, soft, hard, keep)
        (w[0] * s + w[1] * h).backward()
    return s.detach(), h.detach(), top1, z.grad


@pytest.mark.parametrize("chunk", [1, 7, 128, 1000])
@pytest.mark.parametrize("no_hard", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_fused_losses_equal_the_composite_reference_fp32(chunk, no_hard, keep):
    """Kept rows: the reference drops the others; the fused loss gives them no weight and no gradient."""
    case = _case(no_hard=no_hard, keep=keep)
    fused = _run(lambda z, s, h, k: L.subset_distill_losses(z, s, h, k, chunk=chunk), *case)
    ref = _run(L.subset_distill_losses_reference, *case)
    for a, b in zip(fused, ref):
        if a.dtype == torch.long:
            assert torch.equal(a, b)
        else:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()


def test_fused_losses_with_bf16_logits():
    """bf16 logits: values as the float32 composite of the same (rounded) logits; the gradient comes back in
    bf16, within bf16 rounding of the reference's."""
    logits, soft, hard, keep = _case(dtype=torch.bfloat16, keep=True)
    fused = _run(L.subset_distill_losses, logits, soft, hard, keep)
    ref = _run(L.subset_distill_losses_reference, logits.float(), soft, hard, keep)
    assert fused[3].dtype == torch.bfloat16
    assert torch.allclose(fused[0], ref[0], rtol=1e-5) and torch.allclose(fused[1], ref[1], rtol=1e-5)
    assert torch.equal(fused[2], ref[2])
    assert torch.allclose(fused[3].float(), ref[3], rtol=1e-2, atol=1e-6)


class _BrokenHardGradient(L._SubsetDistill):
    @staticmethod
    def backward(ctx, g_soft, g_hard, _g):
        logits, soft, hard, valid, lse, keep, n_hard, n_keep = ctx.saved_tensors
        q = torch.exp(logits.float() - lse[:, None])
        w = soft.float()
        c_soft = g_soft / n_keep * keep.float()[:, None]
        g = q * (c_soft * w.sum(-1, keepdim=True) + g_hard / n_hard * valid.float()[:, None]) - c_soft * w
        return g.to(logits.dtype), None, None, None, None  # the one-hot term of the hard gradient is missing


def test_a_broken_gradient_fails_the_comparison():
    case = _case(keep=True)
    broken = _run(lambda z, s, h, k: _BrokenHardGradient.apply(z, s, h, k, 128), *case)
    ref = _run(L.subset_distill_losses_reference, *case)
    assert torch.allclose(broken[0], ref[0], rtol=1e-5)  # the values agree ...
    assert not torch.allclose(broken[3], ref[3], rtol=1e-5, atol=1e-7)  # ... and the comparison of gradients catches it


def test_bad_shapes_are_named():
    logits, soft, hard, _ = _case()
    with pytest.raises(ValueError, match="expected logits and soft"):
        L.subset_distill_losses(logits, soft[:, :5], hard)


def _run_tv(fn, logits, soft, keep):
    z = logits.clone().requires_grad_(True)
    with torch.enable_grad():
        loss = fn(z, soft, keep)
        (2.0 * loss).backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("chunk", [1, 7, 128, 1000])
@pytest.mark.parametrize("keep", [False, True])
def test_tv_loss_equals_the_composite_reference(chunk, keep):
    """Value and gradient (a scaled upstream gradient) of the chunked TV loss against autograd through
    softmax and minimum, float32, kept rows only."""
    logits, soft, _, keep_rows = _case(keep=keep)
    fused = _run_tv(lambda z, s, k: L.subset_tv_loss(z, s, k, chunk=chunk), logits, soft, keep_rows)
    ref = _run_tv(L.subset_tv_loss_reference, logits, soft, keep_rows)
    assert torch.allclose(fused[0], ref[0], rtol=1e-5, atol=1e-7)
    assert torch.allclose(fused[1], ref[1], rtol=1e-5, atol=1e-8), (fused[1] - ref[1]).abs().max()
    if keep:
        assert fused[1][~keep_rows].abs().max() == 0  # rows left out get no gradient


def test_tv_loss_is_one_minus_the_acceptance():
    """Closed forms: q = w gives 0; disjoint supports give 1; with bf16 logits the gradient comes back in bf16."""
    w = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    assert float(L.subset_tv_loss(torch.log(torch.tensor([[0.5, 0.5, 1e-30], [1e-30, 1e-30, 1.0]])), w)) < 1e-6
    assert abs(float(L.subset_tv_loss(torch.tensor([[0.0, 0.0, 60.0], [60.0, 0.0, 0.0]]), w)) - 1.0) < 1e-6
    logits, soft, _, keep = _case(dtype=torch.bfloat16, keep=True)
    fused = _run_tv(L.subset_tv_loss, logits, soft, keep)
    ref = _run_tv(L.subset_tv_loss_reference, logits.float(), soft, keep)
    assert fused[1].dtype == torch.bfloat16 and torch.allclose(fused[0], ref[0], rtol=1e-5)
    assert torch.allclose(fused[1].float(), ref[1], rtol=1e-2, atol=1e-6)


class _BrokenTVGradient(L._SubsetTV):
    @staticmethod
    def backward(ctx, g_tv):
        logits, soft, keep, lse, n_keep = ctx.saved_tensors
        q = torch.exp(logits.float() - lse[:, None])
        under = q * (q < soft.float())
        return (g_tv / n_keep * keep.float()[:, None] * -under).to(logits.dtype), None, None, None  # no q * sum(u)


def test_a_broken_tv_gradient_fails_the_comparison():
    logits, soft, _, keep = _case(keep=True)
    broken = _run_tv(lambda z, s, k: _BrokenTVGradient.apply(z, s, k, 128), logits, soft, keep)
    ref = _run_tv(L.subset_tv_loss_reference, logits, soft, keep)
    assert torch.allclose(broken[0], ref[0], rtol=1e-5)
    assert not torch.allclose(broken[1], ref[1], rtol=1e-5, atol=1e-8)


def test_tv_loss_bad_shapes_are_named():
    logits, soft, _, _ = _case()
    with pytest.raises(ValueError, match="expected logits and soft"):
        L.subset_tv_loss(logits, soft[:, :5])
