"""The exact categorical sampler every draw goes through (treespec.sampling.draw).

- G tests (stats; seed 0, N = 200,000 draws over a 300-token vocabulary with blocks of 16, so the
  last block is padded; alpha = 1e-3; cells expected < 5 pooled): one draw per row of many rows, and
  many draws from one unnormalised row, both match p / sum(p); a zero-probability token is never
  drawn. Power (stats_helpers): at N = 200,000, alpha = 1e-3, power 0.9 and df <= 299 the test
  detects KL >= 3.1e-4 nats, i.e. any total-variation shift >= 0.0125.
- Broken twins fail the same test: a sampler at a wrong temperature (TV ~0.03), and a two-stage
  sampler whose token stage reuses the block stage's uniform (the stages must be independent).
- Edge cases, deterministic: point masses (first token, last token of a padded block, a block's
  last token behind a huge block), leading dimensions kept, invalid ``num_draws`` refused.
"""

from __future__ import annotations

import pytest
import torch
from stats_helpers import g_test

from treespec.sampling import draw

N, V, ALPHA, BLOCK = 200_000, 300, 1e-3, 16


def _law() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 2.0
    logits[5] = -float("inf")  # a zero-probability token must never be drawn
    return torch.softmax(logits, -1)


def _counts(sample) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, dtype=torch.long)
    for _ in range(N // 50_000):
        counts += torch.bincount(sample(g).flatten(), minlength=V)
    return counts


@pytest.mark.stats
def test_one_draw_per_row_is_exact():
    p = _law()
    counts = _counts(lambda g: draw(p.expand(50_000, V).contiguous(), g, block=BLOCK))
    assert int(counts[5]) == 0 and int(counts.sum()) == N
    assert g_test(counts.numpy(), p.double().numpy()) > ALPHA


@pytest.mark.stats
def test_many_draws_from_an_unnormalised_row_are_exact():
    p = _law()
    counts = _counts(lambda g: draw(p * 7.3, g, num_draws=50_000, block=BLOCK))
    assert int(counts[5]) == 0 and int(counts.sum()) == N
    assert g_test(counts.numpy(), p.double().numpy()) > ALPHA


@pytest.mark.stats
def test_g_test_catches_a_wrong_temperature():
    p = _law()
    wrong = torch.softmax(p.log() / 0.9, -1)  # TV about 0.03
    counts = _counts(lambda g: draw(wrong.expand(50_000, V).contiguous(), g, block=BLOCK))
    assert g_test(counts.numpy(), p.double().numpy()) < ALPHA


def _correlated_stages(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Broken twin: the token stage reuses the block stage's uniform instead of a fresh one."""
    rows = probs.shape[0]
    blocks = torch.nn.functional.pad(probs, (0, (-V) % BLOCK)).view(rows, -1, BLOCK)
    cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)
    u = torch.rand(rows, 1, generator=g, dtype=torch.float64)
    kb = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=cdf.shape[1] - 1)
    inner = blocks.gather(1, kb[:, :, None].expand(rows, 1, BLOCK)).double().cumsum(-1)
    return kb * BLOCK + torch.searchsorted(inner, u[:, :, None] * inner[..., -1:], right=True).squeeze(-1)


@pytest.mark.stats
def test_g_test_catches_correlated_stages():
    p = _law()
    counts = _counts(lambda g: _correlated_stages(p.expand(50_000, V).contiguous(), g))
    assert g_test(counts.numpy(), p.double().numpy()) < ALPHA


def test_point_masses_and_shapes():
    g = torch.Generator().manual_seed(1)
    for token in (0, V - 1, 15, 31):
        p = torch.zeros(V)
        p[token] = 1.0
        assert set(draw(p, g, num_draws=200, block=BLOCK).tolist()) == {token}
    # a block's last token right behind a block holding almost all the mass: never confused
    p = torch.zeros(V)
    p[0], p[31] = 1.0, 1e-30
    assert set(draw(p, g, num_draws=500, block=BLOCK).tolist()) == {0}
    p = torch.zeros(V)
    p[16], p[31] = 1.0, 1e-30  # same block: the tiny token is not the one the rounding lands on
    assert set(draw(p, g, num_draws=500, block=BLOCK).tolist()) == {16}
    batch = torch.softmax(torch.randn(2, 3, V, generator=g), -1)
    out = draw(batch, g, num_draws=4, block=BLOCK)
    assert out.shape == (2, 3, 4) and out.dtype == torch.long and int(out.max()) < V
    with pytest.raises(ValueError, match="num_draws"):
        draw(batch, g, num_draws=0)


def _last_argmax(scores: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """A broken twin of ``first_argmax``: the LAST maximal index (ties to the highest id)."""
    n = scores.shape[dim]
    return (n - 1) - scores.flip(dim).argmax(dim=dim, keepdim=keepdim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_first_argmax_equals_argmax_on_ties(dtype):
    """``first_argmax`` (numpy's ``argmax`` in float32 / float64 on the CPU, ``torch.max(dim)`` otherwise) is
    ``argmax``: first maximal index on ties (ties to the lowest token id, which greedy decoding relies on), along
    either dim, with keepdim, on a full-vocabulary row and on one row alone; a row with NaN gives NaN's index in
    both. The last-index twin fails the tie check."""
    from treespec.sampling import first_argmax

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 262_144, generator=gen).to(dtype)
    x[:, 7] = x[:, 200_000] = 40.0  # two maximal entries per row
    x[2, 7] = x[2, 200_000] = float("-inf")
    x[3, :] = 1.0  # all equal: index 0
    x[4, 99] = float("nan")
    for fn, ok in ((first_argmax, True), (_last_argmax, False)):
        same = torch.equal(fn(x), x.argmax(dim=-1)) and torch.equal(fn(x.T, dim=0, keepdim=True),
                                                                     x.T.argmax(dim=0, keepdim=True))
        assert same is ok
    assert first_argmax(x).tolist()[:5] == [7, 7, int(x[2].float().argmax()), 0, 99]
    one = first_argmax(x[0])
    assert one.dtype == torch.int64 and one.shape == () and int(one) == 7
    assert first_argmax(x).dtype == torch.int64


# ------------------------------------------------------------------------------ the nucleus without a sort
def _nucleus_cases(seed: int = 0, n: int = 200):
    """(probs, top_p): random sizes and temperatures, a third with tied values (quantised logits), some top_p
    near 1 and near 0, and peaked rows as language models give."""
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        vocab = int(torch.randint(2, 2000, (1,), generator=g))
        logits = torch.randn(int(torch.randint(1, 4, (1,), generator=g)), vocab, generator=g) * float(
            torch.rand(1, generator=g) * 15)
        if i % 3 == 0:
            logits = (logits * 2).round() / 2
        top_p = [float(torch.rand(1, generator=g)), 0.999, 1e-6, 0.5][i % 4]
        yield torch.softmax(logits, dim=-1), top_p


def test_top_p_mask_equals_the_sorting_reference():
    from treespec.sampling import top_p_mask, top_p_mask_reference

    for probs, top_p in _nucleus_cases():
        assert torch.equal(top_p_mask(probs, top_p), top_p_mask_reference(probs, top_p)), (probs.shape, top_p)


def test_top_p_mask_equals_the_reference_off_its_usual_input():
    """float64 and bf16 rows, rows that do not sum to one, and rows with a negative or NaN entry (which the fast
    path hands to the reference: with them a later token can come back under ``top_p``, or NaN sorts first)."""
    from treespec.sampling import top_p_mask, top_p_mask_reference

    for probs, top_p in _nucleus_cases(seed=1, n=60):
        for variant in (probs.double(), probs.bfloat16(), probs * 1.3, probs * 0.7):
            assert torch.equal(top_p_mask(variant, top_p), top_p_mask_reference(variant, top_p))
    negative = torch.tensor([[0.97, -0.5, -0.5, 0.0]])
    with_nan = torch.tensor([[0.97, 0.03, float("nan")] + [0.0] * 100])
    for row in (negative, with_nan):
        assert torch.equal(top_p_mask(row, 0.95), top_p_mask_reference(row, 0.95))
    assert top_p_mask(negative, 0.95)[0].nonzero().flatten().tolist() == [0, 2]


def test_top_p_mask_on_a_full_vocabulary_row_with_ties_at_the_cut():
    """262,144 entries, the nucleus cut inside a run of equal values: the lowest ids of the run are kept."""
    from treespec.sampling import top_p_mask, top_p_mask_reference

    probs = torch.full((2, 262144), 1e-9)
    probs[:, 1000:1010] = 0.1 - 1e-9 * 262144 / 10  # ten equal tokens hold almost all the mass
    probs = probs / probs.sum(dim=-1, keepdim=True)
    mask = top_p_mask(probs, 0.35)
    assert torch.equal(mask, top_p_mask_reference(probs, 0.35))
    assert mask[0].nonzero().flatten().tolist() == [1000, 1001, 1002, 1003]


def _tail_row(head: list[float], tail_prob: float, tail: int, vocab: int = 262144) -> torch.Tensor:
    """``[vocab]``: the ``head`` probabilities, then ``tail`` tokens of ``tail_prob`` each, the rest zero."""
    row = torch.zeros(vocab)
    row[:len(head)] = torch.tensor(head)
    row[len(head):len(head) + tail] = tail_prob
    return row


@pytest.mark.parametrize("case, threshold", [
    ("peaked", 1e-4), ("tail above 1e-6", 1e-6), ("tail above 1e-8", 1e-8), ("tail below every threshold", None)])
def test_top_p_mask_at_each_threshold_and_past_the_last(monkeypatch, case, threshold):
    """Full-vocabulary rows whose nucleus reaches down to each of :data:`TOP_P_THRESHOLDS`, and one that reaches
    below the last, where the sorting reference decides (its calls counted): equal to the reference."""
    from treespec import sampling

    assert sampling.TOP_P_THRESHOLDS == (1e-4, 1e-6, 1e-8)
    rows = {"peaked": (_tail_row([0.5, 0.3, 0.1], 1e-3, 100), 0.95),
            "tail above 1e-6": (_tail_row([0.5, 0.4], 5e-5, 2000), 0.95),
            "tail above 1e-8": (_tail_row([0.5, 0.4], 5e-7, 200_000), 0.95),
            "tail below every threshold": (_tail_row([1.0 - 262_000 * 1e-9], 1e-9, 262_000), 1.0 - 1e-5)}
    row, top_p = rows[case]
    probs = (row / row.sum())[None]
    calls = []
    reference = sampling.top_p_mask_reference
    monkeypatch.setattr(sampling, "top_p_mask_reference", lambda p, t: calls.append(1) or reference(p, t))
    got = sampling.top_p_mask(probs, top_p)
    assert torch.equal(got, reference(probs, top_p))
    assert (len(calls) == 1) == (threshold is None)
    if threshold is not None:  # the nucleus reaches the threshold's band: a larger threshold would not have held it
        kept = probs[got]
        assert float(kept.min()) >= threshold and float(kept.min()) < {1e-4: 1, 1e-6: 1e-4, 1e-8: 1e-6}[threshold]


def test_a_tie_break_by_highest_id_fails_the_comparison(monkeypatch):
    """The twin: a fast filter that keeps the highest ids among tied tokens differs from the reference."""
    from treespec import sampling

    def highest_ids(probs, top_p):
        return sampling.top_p_mask(probs.flip(-1), top_p).flip(-1)

    assert any(not torch.equal(highest_ids(p, t), sampling.top_p_mask_reference(p, t)) for p, t in _nucleus_cases())
