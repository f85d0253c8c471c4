"""A long committed chain (a prompt) is prefilled in pieces of ``runner.prefill_chunk`` tokens: the same
function as one call, with masks of ``[chunk, keys]`` instead of ``[prompt, prompt]``.

On tiny in-process models (Gemma-3 with a sliding window of 8 through the eager and the fast runner,
Llama and GPT-2 through the eager one): logits, hidden states (fused feature layers too), the rows
selected by ``rows`` and a tree pass after the prefill equal those of an unchunked runner (float32,
atol 1e-5), also a chain fed together with tree nodes; greedy generation gives the same tokens. The
memory bound: a 480-token prompt with 16-token pieces builds no mask wider than 16 rows and allocates
no tensor of 100k elements or more; the unchunked twin (the behaviour before) breaks both bounds.
"""

from __future__ import annotations

import pytest
import torch

from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.fast import FastGemmaRunner
from treespec.models.runner import PREFILL_CHUNK, ModelRunner, chain_pieces
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree

from tests.treespec.test_cli_robustness import _LargestAllocation

ATOL = 1e-5
V = 64
UNCHUNKED = 1 << 30  # a chunk no prompt reaches: one call, as before chunking
GREEDY = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(0.0), stop_on_eos=False)
RUNNERS = {  # name -> (runner class, tiny architecture)
    "fast-gemma3": (FastGemmaRunner, "gemma3"),
    "eager-gemma3": (ModelRunner, "gemma3"),
    "eager-llama": (ModelRunner, "llama"),
    "eager-gpt2": (ModelRunner, "gpt2"),
}


def make_runner(name: str, chunk: int, seed: int = 0) -> ModelRunner:
    cls, arch = RUNNERS[name]
    runner = cls(tiny_model(arch, V, seed=seed, num_layers=4, logit_scale=8.0))
    runner.prefill_chunk = chunk
    return runner


def random_tree(num_nodes: int, root: int, gen: torch.Generator) -> TokenTree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    tokens = [root] + torch.randint(0, V, (num_nodes - 1,), generator=gen).tolist()
    return TokenTree.from_lists(parents, tokens)


def prefill_then_tree(runner: ModelRunner, prompt_len: int, seed: int) -> list[torch.Tensor]:
    """Logits and fused hidden states of a prefill, then of a tree pass after it."""
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (prompt_len,), generator=gen)
    out = runner.forward(None, None, seq[:-1], need_hidden=True, feature_layers=(1,))
    tree = random_tree(9, int(seq[-1]), gen)
    after = runner.forward(tree, torch.arange(tree.num_nodes), need_hidden=True, feature_layers=(1,))
    return [out["logits"], out["hidden"], after["logits"], after["hidden"]]


def test_chain_pieces_cover_the_chain_once():
    chain, nodes = torch.arange(10), torch.arange(3)
    calls = chain_pieces(chain, nodes, torch.tensor([0, 3, 4, 9, 10, 12]), 4)
    assert [c.tolist() for c, _, _ in calls] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [n is nodes for _, n, _ in calls] == [False, False, True]
    assert [r.tolist() for _, _, r in calls] == [[0, 3], [0], [1, 2, 4]]
    assert chain_pieces(chain, nodes, None, 10) == [(chain, nodes, None)]  # short enough: one call, as given
    assert chain_pieces(None, nodes, None, 4) == [(None, nodes, None)]
    with pytest.raises(ValueError, match="prefill chunk"):
        chain_pieces(chain, nodes, None, 0)
    assert PREFILL_CHUNK >= 64  # pieces large enough to keep a prefill's products efficient


@pytest.mark.parametrize("name", sorted(RUNNERS))
@pytest.mark.parametrize("prompt_len, chunk", [(46, 8), (30, 7), (9, 8)])  # 45 = 5 x 8 + 5; 8 = one full piece
def test_chunked_prefill_equals_one_call(name, prompt_len, chunk):
    mine = prefill_then_tree(make_runner(name, chunk), prompt_len, prompt_len)
    ref = prefill_then_tree(make_runner(name, UNCHUNKED), prompt_len, prompt_len)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["fast-gemma3", "eager-llama"])
def test_chain_with_tree_nodes_and_rows(name):
    """A draft model's first pass feeds the pending chain and tree nodes in one call; ``rows`` pick rows
    across pieces (chain rows and node rows alike)."""
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(0, V, (40,), generator=gen)
    tree = random_tree(7, int(seq[-1]), gen)
    rows = torch.tensor([0, 5, 16, 17, 38, 39, 41, 45])  # chain rows 0..38, node rows 39..45
    outs = []
    for chunk in (6, UNCHUNKED):
        runner = make_runner(name, chunk)
        full = runner.forward(tree, torch.arange(4), seq[:-1], need_hidden=True)
        rest = runner.forward(tree, torch.arange(4, 7))["logits"]
        runner.reset()
        picked = runner.forward(tree, torch.arange(7), seq[:-1], need_hidden=True, rows=rows)
        assert runner.length == 39 and runner.slots == list(range(7))
        outs.append([full["logits"], full["hidden"], rest, picked["logits"], picked["hidden"]])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    both = torch.cat([outs[1][0], outs[1][2]])  # [39 + 7, V]
    torch.testing.assert_close(outs[0][3], both[rows], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_greedy_generation_is_the_same(name):
    prompt = torch.randint(0, V, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = generate(make_runner(name, UNCHUNKED), prompt, None, GREEDY).token_ids
    assert generate(make_runner(name, 5), prompt, None, GREEDY).token_ids == plain
    drafter = NgramDrafter(NgramConfig(depth=4, branches=2))
    assert generate(make_runner(name, 5), prompt, drafter, GREEDY).token_ids == plain


def prefill_footprint(runner: ModelRunner, prompt_len: int) -> tuple[int, int]:
    """(most query rows of any mask the runner builds, elements of the largest tensor allocated) over the
    prefill of a ``prompt_len``-token prompt (the rows of a mask are its queries: ``[Q, keys]``)."""
    rows = []
    build = runner._masks

    def recording(visible, q_pos, k_pos):
        rows.append(visible.shape[0])
        assert visible.shape[1] == runner.cache_length + visible.shape[0]  # [Q, keys so far]
        return build(visible, q_pos, k_pos)

    runner._masks = recording
    prompt = torch.randint(0, V, (prompt_len,), generator=torch.Generator().manual_seed(2))
    mode = _LargestAllocation()
    with mode:
        runner.forward(None, None, prompt[:-1], need_logits=False)
    assert runner.length == prompt_len - 1
    return max(rows), mode.largest


@pytest.mark.parametrize("name", ["fast-gemma3", "eager-gemma3"])
def test_long_prompt_memory_is_bounded(name):
    """480 tokens in 16-token pieces: masks of at most 16 x 480 (x 2 query heads per KV head in the fast
    runner: 15k elements), no tensor of 100k elements (one unchunked mask: 230k to 460k elements)."""
    chunk = 16
    rows, largest = prefill_footprint(make_runner(name, chunk), 480)
    assert rows <= chunk
    assert largest < 100_000, largest


@pytest.mark.parametrize("name", ["fast-gemma3", "eager-gemma3"])
def test_unchunked_twin_breaks_the_bound(name):
    """Positive control: the behaviour before chunking (one call for the whole prompt) fails both checks."""
    rows, largest = prefill_footprint(make_runner(name, UNCHUNKED), 480)
    assert rows == 479 and largest >= 479 * 479


def test_a_draft_model_computes_no_lm_head_rows_for_the_prompt(monkeypatch):
    """A draft causal LM's first proposal carries the whole prompt as a chain: its LM head runs on the tree
    nodes' rows alone (``rows``), not on every prompt token (262,144-entry rows on the embedded vocabulary).
    The twin (a draft runner that drops ``rows``) computes a row per prompt token."""
    from treespec.trees.grow import ShapeDrafter
    from treespec.trees.shape import TreeShape

    target, draft = tiny_model("llama", V, seed=0), tiny_model("llama", V, seed=1)
    prompt = [int(t) for t in torch.randint(3, V, (200,), generator=torch.Generator().manual_seed(0))]
    widest = []
    head = ModelRunner.logits

    def spy(self, hidden):
        if self.model is draft:
            widest.append(hidden.shape[0])
        return head(self, hidden)

    monkeypatch.setattr(ModelRunner, "logits", spy)
    cfg = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(0.0), stop_on_eos=False)
    generate(target, prompt, ShapeDrafter(draft, TreeShape.widths((2, 2)), "deterministic"), cfg)
    assert max(widest) <= 4

    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, *a, rows=None, **kw: forward(self, *a, **kw))
    widest.clear()
    generate(target, prompt, ShapeDrafter(draft, TreeShape.widths((2, 2)), "deterministic"), cfg)
    assert max(widest) >= len(prompt) - 1
