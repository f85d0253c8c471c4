"""``draw_children`` draws ordered child tuples with exactly each law's probabilities.

G test of the empirical ordered-tuple frequencies against the independent enumerators of
``test_verifiers.py``: 20,000 nodes drawn in one vectorised call per (law, q, n), seed stated per
test, categories with expected count < 5 merged, alpha = 1e-3. Power (stats_helpers): at N = 20,000,
power 0.9 and df 20 it detects KL >= 0.0011 nats, i.e. any total-variation shift >= 0.023.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_verifiers import ENUMERATORS, g_test  # noqa: E402  (independent enumerators)

from treespec.drafting.laws import draw_children  # noqa: E402
from treespec.tree import DRAFT_LAWS  # noqa: E402

DT = torch.float64
ALPHA = 1e-3
N = 20_000

QS = {
    "generic": [0.4, 0.1, 0.3, 0.2],
    "zeros": [0.5, 0.0, 0.3, 0.2],
    "sparse": [0.0, 0.9, 0.0, 0.1],  # support 2 < n = 3: truncation / uniform fallbacks
    "ties": [0.3, 0.3, 0.2, 0.2],
}


def _tuple_counts(tokens, valid, vocab=4):
    """Ordered-tuple counts; invalid slots (always trailing) are dropped from the tuple."""
    base = vocab + 1
    digits = torch.where(valid, tokens, torch.full_like(tokens, vocab))  # sentinel = vocab
    weights = base ** torch.arange(tokens.shape[1])
    codes, counts = torch.unique((digits * weights).sum(dim=1), return_counts=True)
    out = Counter()
    for code, count in zip(codes.tolist(), counts.tolist()):
        t = []
        for _ in range(tokens.shape[1]):
            code, d = divmod(code, base)
            if d != vocab:
                t.append(d)
        out[tuple(t)] += count
    return out


def _check(law, q, n, drafts):
    expected = dict(ENUMERATORS[law](q, n))
    counts = _tuple_counts(drafts.tokens, drafts.valid)
    keys = sorted(set(expected) | set(counts))
    return g_test([counts.get(k, 0) for k in keys], [expected.get(k, 0.0) for k in keys])


@pytest.mark.stats
@pytest.mark.parametrize("law", DRAFT_LAWS)
@pytest.mark.parametrize("qname", list(QS))
def test_draw_children_matches_exact_tuple_law(law, qname):
    q = QS[qname]
    for n in (1, 2, 3):
        if law == "spechub" and n > 2:
            continue
        g = torch.Generator().manual_seed(1000 + 10 * n + DRAFT_LAWS.index(law))
        drafts = draw_children(torch.tensor([q], dtype=DT).expand(N, -1), n, law, g)
        assert drafts.tokens.shape == (N, n) and drafts.tokens.dtype == torch.long
        pval = _check(law, q, n, drafts)
        assert pval > ALPHA, (law, qname, n, pval)


@pytest.mark.stats
@pytest.mark.parametrize("law", DRAFT_LAWS)
def test_mixed_counts_in_one_call(law):
    # per-node counts as a tensor: rows with 0..max children, each row follows its own law
    q = QS["generic"]
    max_n = 2 if law == "spechub" else 3
    counts = torch.arange(N) % (max_n + 1)
    g = torch.Generator().manual_seed(77)
    drafts = draw_children(torch.tensor([q], dtype=DT).expand(N, -1), counts, law, g)
    assert drafts.tokens.shape == (N, max_n)
    assert torch.equal(drafts.valid.sum(dim=1), counts)
    assert bool((drafts.tokens[~drafts.valid] == 0).all())
    for n in range(1, max_n + 1):
        rows = counts == n
        sub = type(drafts)(drafts.tokens[rows][:, :n], drafts.valid[rows][:, :n])
        assert _check(law, q, n, sub) > ALPHA, (law, n)
    same = draw_children(torch.tensor([q], dtype=DT).expand(N, -1), counts, law,
                         torch.Generator().manual_seed(77), max_children=max_n)
    assert torch.equal(same.tokens, drafts.tokens)  # max_children avoids the sync, same draws


def test_different_rows_use_their_own_q():
    g = torch.Generator().manual_seed(5)
    q = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=DT)
    for law in ("iid", "without_replacement", "deterministic", "greedy_draft", "spechub"):
        drafts = draw_children(q, 1, law, g)
        assert drafts.tokens[:, 0].tolist() == [0, 2], law


def test_without_replacement_truncates_at_support():
    g = torch.Generator().manual_seed(6)
    q = torch.tensor([[0.0, 0.6, 0.4, 0.0]], dtype=DT).expand(500, -1)
    drafts = draw_children(q, 4, "without_replacement", g)
    assert bool((drafts.valid.sum(dim=1) == 2).all())
    assert set(map(tuple, drafts.tokens[:, :2].tolist())) == {(1, 2), (2, 1)}


def test_errors():
    q = torch.full((2, 3), 1 / 3, dtype=DT)
    with pytest.raises(ValueError, match="unknown draft law"):
        draw_children(q, 1, "nope")
    with pytest.raises(ValueError, match="vocabulary"):
        draw_children(q, 4, "deterministic")
    with pytest.raises(ValueError, match="vocabulary"):
        draw_children(q, 4, "greedy_draft")
    with pytest.raises(ValueError, match="at most 2"):
        draw_children(q, 3, "spechub")
    with pytest.raises(ValueError, match=r"\[M=2\]"):
        draw_children(q, torch.tensor([1, 2, 3]), "iid")
    with pytest.raises(ValueError, match=">= 0"):
        draw_children(q, -1, "iid")
    with pytest.raises(ValueError, match=r"\[M, V\]"):
        draw_children(q[0], 1, "iid")
    assert draw_children(q, 4, "iid").tokens.shape == (2, 4)  # with replacement: any n
    empty = draw_children(q, 0, "iid")
    assert empty.tokens.shape == (2, 0) and empty.valid.shape == (2, 0)


def test_float32_and_generator_reproducibility():
    q = torch.softmax(torch.randn(64, 50, generator=torch.Generator().manual_seed(0)), dim=1)
    for law in DRAFT_LAWS:
        n = 2
        a = draw_children(q, n, law, torch.Generator().manual_seed(9))
        b = draw_children(q, n, law, torch.Generator().manual_seed(9))
        assert torch.equal(a.tokens, b.tokens), law
        if law in ("without_replacement", "deterministic", "greedy_draft", "spechub"):
            assert bool((a.tokens[:, 0] != a.tokens[:, 1]).all()), law  # distinct children
        if law == "spechub":
            hub = q.argmax(dim=1)
            assert bool(((a.tokens[:, 0] == hub) | (a.tokens[:, 1] == hub)).all())
        if law == "greedy_draft":
            assert torch.equal(a.tokens[:, 0], q.argmax(dim=1))
    assert np.isfinite(q.numpy()).all()


@pytest.mark.stats
def test_law_test_twin_detects_the_wrong_law():
    # i.i.d. draws tested against the without-replacement law (and vice versa) must fail: seed 12.
    q = QS["generic"]
    g = torch.Generator().manual_seed(12)
    iid = draw_children(torch.tensor([q], dtype=DT).expand(N, -1), 2, "iid", g)
    assert _check("without_replacement", q, 2, iid) < 1e-6
    wor = draw_children(torch.tensor([q], dtype=DT).expand(N, -1), 2, "without_replacement", g)
    assert _check("iid", q, 2, wor) < 1e-6
    # SpecHub pairs against i.i.d. pairs
    hub = draw_children(torch.tensor([q], dtype=DT).expand(N, -1), 2, "spechub", g)
    assert _check("iid", q, 2, hub) < 1e-6


def testtop_order_equals_the_stable_sort():
    """Deterministic / greedy-draft children come from ``top_order`` (one topk over an int64 key);
    its reference is the full stable sort (ties by increasing id). 400 seeded cases with ties, -inf,
    -0.0 next to +0.0, zero probabilities and every k from 0 to V."""
    from treespec.drafting.laws import _descending_order, top_order

    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        v = int(torch.randint(2, 300, (1,), generator=g))
        q = torch.randn(3, v, generator=g)
        if trial % 3 == 0:
            q = torch.round(q * 2) / 2  # many ties
        if trial % 5 == 0:
            q[:, ::7] = float("-inf")
        if trial % 4 == 0:
            q[:, ::5] = -0.0
        if trial % 6 == 0:
            q = torch.softmax(q, -1)
            q[:, ::3] = 0.0
        k = int(torch.randint(0, v + 1, (1,), generator=g))
        assert torch.equal(top_order(q, k), _descending_order(q)[:, :k]), (trial, k)
