"""The trained draft head behind every tree builder (:class:`treespec.drafting.head_runner.HeadRunner`).

1. Greedy output of every builder drafting with the head equals plain greedy decoding (fp32).
2. Output law at T = 1 (head of test_distill's ``_small_head`` on the vocabulary-6 Llama, vocabulary
   subset of 4 tokens so q = 0 on two tokens): the first three generated tokens follow the exact target
   law for DySpec trees without replacement and a Sequoia shape drawn i.i.d.; seeds 0..N-1, N = 400,
   G test with cells of expected count < 5 pooled, alpha = 1e-3. The twin (draft probabilities
   replaced by a uniform q the children were not drawn from) must fail the same test; so must the twin
   of the head in bf16 with packed weights (``SubsetHead.for_inference``, the CLI's drafting path). Power (stats_helpers): at N = 400, alpha = 1e-3, power 0.9 and df 10 it detects KL >= 0.044 nats,
   i.e. any total-variation shift >= 0.15.
"""

import pytest
import torch

from treespec.calibration import measure_acceptance_vector
from treespec.drafting.base import DraftState
from treespec.drafting.head_runner import HeadRunner, head_depth_logits
from treespec.drafting.ngram import NgramConfig
from treespec.generate import GenerationConfig, generate
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree
from treespec.trees.dyspec import DySpecDrafter
from treespec.trees.eagle2 import Eagle2Drafter
from treespec.trees.grow import ShapeDrafter
from treespec.trees.merged import MergedDrafter
from treespec.trees.sequoia import SequoiaDP
from treespec.trees.shape import TreeShape

from .test_distill import _small_head, corpus, prompts, target, trained  # noqa: F401
from .test_end_to_end_stats import ALPHA, UniformQ, exact_law, g_test, sample_counts

N = 400


BUILDERS = {
    "chain": lambda h: ShapeDrafter(h, TreeShape.chain(4)),
    "sequoia": lambda h: ShapeDrafter(h, SequoiaDP([0.5, 0.2, 0.1], 10, 4).shape(10, 4)),
    "dyspec_heap": lambda h: DySpecDrafter(h, 8, 4),
    "dyspec_threshold": lambda h: DySpecDrafter(h, 8, 4, variant="threshold"),
    "eagle2": lambda h: Eagle2Drafter(h, 8, top_k=3, depth=3),
    "merged": lambda h: MergedDrafter(Eagle2Drafter(h, 6, top_k=2, depth=3), NgramConfig(depth=3, max_nodes=3)),
}


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_every_builder_with_the_head_is_greedy_exact(target, trained, builder):  # noqa: F811
    _, head, _ = trained
    cfg = GenerationConfig(max_new_tokens=32, sampling=SamplingConfig(0.0), stop_on_eos=False)
    accepted = 0
    for prompt in [prompts()[1][:12] * 2, [5], prompts()[2][:6]]:
        plain = generate(target, prompt, None, cfg).token_ids
        out = generate(target, prompt, BUILDERS[builder](head), cfg)
        assert out.token_ids == plain
        accepted += sum(s.accepted for s in out.steps)
    assert accepted > 0  # the head's drafts were used, not only bonus tokens


def test_adaptive_length_expands_only_confident_sampled_children(target, trained):  # noqa: F811
    """T = 1: all drawn children stay (their law is intact); children below the threshold get none;
    the recorded q rows are those of the expanded nodes."""
    _, head, _ = trained
    prompt = prompts()[0][:10]
    hidden = target.base_model(input_ids=torch.tensor([prompt[:-1]])).last_hidden_state[0]
    probe = ShapeDrafter(head, TreeShape.widths((1,)), "iid")
    probe.begin(prompt)
    q_root = probe.propose(DraftState(prompt, 8, hidden), SamplingConfig(1.0), torch.Generator()).draft_probs[0]
    threshold = float(q_root.topk(3).values[-1])  # some drawn children reach it, some do not
    sizes = set()
    for seed in range(20):
        drafter = ShapeDrafter(head, TreeShape.widths((3, 2)), "iid", min_confidence=threshold)
        drafter.begin(prompt)
        d = drafter.propose(DraftState(prompt, 8, hidden), SamplingConfig(1.0), torch.Generator().manual_seed(seed))
        tree, q = d.tree, d.draft_probs
        depth1 = (tree.parents == 0).nonzero().flatten()
        assert depth1.numel() == 3  # never pruned
        conf = q[0, tree.tokens[depth1]]
        for node, c in zip(depth1.tolist(), conf.tolist()):
            kids = int((tree.parents == node).sum())
            assert kids == (2 if c >= threshold else 0)
            assert (q[node].sum() > 0.99) == (kids > 0)
        sizes.add(tree.num_nodes)
    assert len(sizes) > 1  # the threshold did change tree sizes


def test_runner_rejects_missing_hidden_states_and_skipped_levels(trained):
    _, head, _ = trained
    runner = HeadRunner(head)
    with pytest.raises(ValueError, match="target_hidden"):
        runner.observe(DraftState([1, 2, 3], 4, None))
    runner.observe(DraftState([1, 2, 3], 4, torch.zeros(2, head.cfg.hidden_size)))
    tree = TokenTree.from_lists([-1, 0, 1], [3, 4, 5], "deterministic")
    with pytest.raises(RuntimeError, match="level by level"):
        runner.forward(tree, torch.tensor([0, 1, 2]), torch.tensor([1, 2]))


def test_depth_logits_match_the_runner_along_a_path(target, trained):  # noqa: F811
    """The parallel per-depth emulation used for calibration equals what the runner computes in a
    tree whose path follows the sequence (root at position r, nodes at depths 1..4 fed level by level)."""
    _, head, _ = trained
    ids = torch.tensor([prompts()[0][:16]])
    depths, r = 5, 8
    t_logits, per_depth = head_depth_logits(head, target, ids, depths)
    assert t_logits.shape == per_depth[0].shape == (15, target.config.vocab_size)
    assert torch.isnan(per_depth[2][:2]).all() and not torch.isnan(per_depth[2][2:]).any()
    runner = HeadRunner(head)
    hidden = target.base_model(input_ids=ids[:, :r]).last_hidden_state[0]  # positions 0..r-1
    runner.observe(DraftState(ids[0, : r + 1].tolist(), depths, hidden))
    path = ids[0, r: r + depths].tolist()
    tree = TokenTree.from_lists(list(range(-1, depths - 1)), path, "deterministic")
    for depth in range(depths):  # node at depth t sits at position r + t, entry (r + t) - 1, level t + 1
        out = runner.forward(tree, torch.tensor([depth]), ids[0, :r] if depth == 0 else None)["logits"][0]
        ref = per_depth[depth][r + depth - 1]
        assert torch.allclose(out, ref, atol=1e-4), depth


def _path_reference(head, target, prefix: list[int], tree: TokenTree, node: int) -> torch.Tensor:
    """The slow reference of one node's logits: no cache, no tree mask. The node's logits are the head's
    depth-(d + 1) logits at the end of ``prefix`` + the node's root path (:func:`head_depth_logits`, one
    parallel pass per depth over that sequence alone); d = the node's depth."""
    path = [int(tree.tokens[u]) for u in tree.root_path(node)]
    d = len(path) - 1
    _, per_depth = head_depth_logits(head, target, torch.tensor([prefix + path]), d + 1)
    return per_depth[d][len(prefix) + d - 1]


@pytest.mark.parametrize("prefix_len", [9, 70])  # 70: the first buffer holds 70 entries, the first level outgrows it
def test_runner_equals_the_per_path_reference_on_branching_trees_across_rounds(target, trained, prefix_len):  # noqa: F811
    """Branching trees fed in uneven levels, a commit, and a second round that starts with a chain of the
    accepted tokens: every node's logits equal :func:`_path_reference` (float32 head, atol 1e-4). A runner
    whose tree mask let a node see its siblings, or whose commit kept a dropped entry, fails it."""
    from treespec.models.features import model_features

    _, head, _ = trained
    text = [t for p in prompts() for t in p]
    prefix, root1 = text[:prefix_len], text[prefix_len]
    layers = head.cfg.feature_layers
    runner = HeadRunner(head)

    def features(ids: list[int]) -> torch.Tensor:
        return model_features(target, torch.tensor([ids]), layers=layers)[0]  # [len, F]

    # round 1: root at position prefix_len; nodes fed as [0], [1, 2], [3, 4, 5], [6]
    tree1 = TokenTree.from_lists([-1, 0, 0, 1, 1, 2, 3], [root1, 7, 11, 13, 17, 19, 23], "iid")
    runner.observe(DraftState(prefix + [root1], 4, features(prefix)))
    for level, chain in (([0], torch.tensor(prefix)), ([1, 2], None), ([3, 4, 5], None), ([6], None)):
        out = runner.forward(tree1, torch.tensor(level), chain)["logits"]  # [len(level), V]
        for row, u in enumerate(level):
            assert torch.allclose(out[row], _path_reference(head, target, prefix, tree1, u), atol=1e-4), (1, u)
    # the target accepts 0 -> 1 -> 3 and emits a bonus token: the next root sits 3 positions further
    runner.commit([0, 1, 3])
    committed = prefix + [root1, 7, 13]
    root2 = text[prefix_len + 1]
    new_hidden = features(committed)[prefix_len:]  # the states at the 3 newly committed positions
    runner.observe(DraftState(committed + [root2], 4, new_hidden))
    tree2 = TokenTree.from_lists([-1, 0, 0, 1, 2, 2], [root2, 29, 31, 37, 41, 43], "without_replacement")
    chain2 = torch.tensor(committed[runner.length:])
    assert chain2.tolist() == [7, 13]  # the root of round 1 was kept, its drafted nodes were not
    for level, chain in (([0], chain2), ([1, 2], None), ([3, 4, 5], None)):
        out = runner.forward(tree2, torch.tensor(level), chain, need_logits="subset")
        for row, u in enumerate(level):
            ref = _path_reference(head, target, committed, tree2, u)[head.vocab_ids]
            assert torch.allclose(out["logits"][row], ref, atol=1e-4), (2, u)


def test_depth_calibration_and_depth_aware_sequoia(target, trained):  # noqa: F811
    _, head, _ = trained
    vec = measure_acceptance_vector(target, head, [p[:24] for p in prompts()[:4]], SamplingConfig(0.0),
                                    width=4, depths=3)
    assert len(vec.by_depth) == 3 and vec.acc == vec.by_depth[0]
    assert all(0.0 <= sum(row) <= 1.0 + 1e-9 for row in vec.by_depth)
    shape = SequoiaDP(vec, 6, 3).shape(6, 3)
    assert shape.num_drafted <= 6
    # depth 1 is the classic measurement; a draft equal to the target accepts rank 0 at every depth
    one = measure_acceptance_vector(target, head, [p[:24] for p in prompts()[:4]], SamplingConfig(0.0), width=4)
    assert one.acc == pytest.approx(vec.acc, abs=1e-12)
    same = measure_acceptance_vector(target, target, [p[:24] for p in prompts()[:4]], SamplingConfig(0.0),
                                     width=3, depths=3, min_weight=1.0)
    for row in same.by_depth:
        assert row == pytest.approx([1.0, 0.0, 0.0])



def test_depth_calibration_skips_only_unscored_rows(target, trained):  # noqa: F811
    """With ``score_from``, the rows skipped before the scored region change nothing (T = 0, where no
    children are drawn at random): every depth's row and weight equal the computation over every row.
    Two drafts: the head (its rows predict 2 positions ahead) and the target itself (a causal LM, 1 ahead)
    along its own greedy text, where every depth is reached and so carries weight."""
    _, head, _ = trained
    seqs = []
    with torch.no_grad():
        for p in prompts()[:4]:
            ids = p[:12]
            for _ in range(12):  # the target's own greedy continuation: the draft = target accepts every level
                ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
            seqs.append(ids)
    starts = [10, 14, 3, 20]
    kw = dict(width=4, depths=3, min_weight=1.0, score_from=starts)
    for draft in (head, target):
        fast = measure_acceptance_vector(target, draft, seqs, SamplingConfig(0.0), **kw)
        ref = measure_acceptance_vector(target, draft, seqs, SamplingConfig(0.0), skip_unscored=False, **kw)
        assert fast.meta["depth_weights"] == ref.meta["depth_weights"]
        assert fast.by_depth == ref.by_depth
    assert min(ref.meta["depth_weights"]) > 10  # the target as draft: every depth weighed

LAW_CASES = {
    # adaptive draft length at T = 1: every drawn child kept, only confident ones expanded
    "head_adaptive_iid": (lambda h: ShapeDrafter(h, TreeShape.widths((2, 2, 1)), "iid", min_confidence=0.35), "rrs"),
    "dyspec_wor": (lambda h: DySpecDrafter(h, 5, 3), "rrs_without_replacement"),
    "sequoia_iid": (lambda h: ShapeDrafter(h, TreeShape.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]]), "iid"),
                    "rrs"),
    # the CLI's inference path: the head in bf16 with oneDNN-packed weights drafting for an fp32 target
    "head_bf16_packed_wor": (lambda h: ShapeDrafter(_bf16(h), TreeShape.widths((2, 2, 1)), "without_replacement"),
                             "rrs_without_replacement"),
    # the head's decoder layer on 4-bit weights (for_inference(bf16, "int4"); the 4 x 32 rows stay bf16:
    # the 4-bit kernel takes no output size below 16)
    "head_int4_wor": (lambda h: ShapeDrafter(_int4(h), TreeShape.widths((2, 2, 1)), "without_replacement"),
                      "rrs_without_replacement"),
}


def _bf16(head):
    """``head.for_inference(bf16)`` once (idempotent here: the same head serves every sample)."""
    return head if head._rows_packed is not None or head.lm_rows.dtype == torch.bfloat16 \
        else head.for_inference(torch.bfloat16)


def _int4(head):
    """``head.for_inference(bf16, "int4")`` once."""
    return head if head.inference_weights == "int4" else head.for_inference(torch.bfloat16, quantize="int4")


@pytest.mark.stats
@pytest.mark.parametrize("case,broken", [(c, False) for c in sorted(LAW_CASES)]
                         + [("dyspec_wor", True), ("head_bf16_packed_wor", True), ("head_int4_wor", True)])
def test_output_law_at_t1_with_head_trees(tmp_path, case, broken):
    small, head = _small_head(tmp_path)
    make, verifier = LAW_CASES[case]
    sampling = SamplingConfig(1.0)
    wrap = UniformQ if broken else (lambda d: d)
    counts = sample_counts(small, lambda: wrap(make(head)), verifier, sampling, n=N)
    p_value = g_test(counts, exact_law(small, sampling), N)
    if broken:
        assert p_value < ALPHA, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > ALPHA, f"{case}: output law differs from the target's (G-test p = {p_value:.2e})"


def _top1_agreement(head, low) -> float:
    """How often ``low`` (the head set for inference) and the float32 ``head`` put the same token first, teacher-
    forced along a training prompt with random target features."""
    tokens = torch.tensor(prompts()[1][:16])
    hidden = torch.randn(1, len(tokens), head.cfg.hidden_size)
    pos = torch.arange(len(tokens))[None]
    f32 = head.logits(head(hidden, tokens[None], pos))
    return float((f32.argmax(-1) == low.logits(low(hidden, tokens[None], pos)).argmax(-1)).float().mean())


def test_for_inference_packs_the_head_and_keeps_its_drafts(trained):  # noqa: F811
    """``SubsetHead.for_inference``: float32 changes nothing (same logits bit for bit); bf16 packs every
    bias-free linear layer and the subset rows (the packed product equals ``F.linear`` in bf16) and
    drafts the same top-1 tokens as float32 along a sequence of the training prompts."""
    import copy

    from treespec.models.fast.packed import PackedLinear, prepack_default

    _, head, _ = trained
    x = torch.randn(3, head.cfg.hidden_size)
    same = copy.deepcopy(head).for_inference(torch.float32)
    assert torch.equal(same.logits(x), head.logits(x))
    low = copy.deepcopy(head)
    object.__setattr__(low, "_embed", head._embed)  # the target's embedding, by reference (not a submodule)
    low.for_inference(torch.bfloat16)
    if prepack_default(torch.bfloat16, "cpu"):
        packed = [m for m in low.modules() if isinstance(m, PackedLinear)]
        assert packed and not any(isinstance(m, torch.nn.Linear) for m in low.modules())
        ref = torch.nn.functional.linear(x.bfloat16(), low.lm_rows).float()
        got = low.logits(x)
        cap = head.cfg.softcap
        assert torch.equal(got, torch.tanh(ref / cap) * cap if cap else ref)
    assert _top1_agreement(head, low) >= 0.9
    assert head._embed.weight.dtype == torch.float32  # the target was not touched


def test_for_inference_int4_puts_the_head_on_4_bit_weights(target, trained):  # noqa: F811
    """``for_inference(bf16, quantize="int4")``: every linear layer and the subset rows run on 4-bit weights; the
    rows' product is the product with the de-quantised weight (bf16 tolerance); the head drafts mostly the same
    top-1 tokens as in float32; greedy output with it equals plain decoding (a draft's q never changes what
    the target emits); an unknown mode is refused by name."""
    import copy

    from treespec.models.fast.packed import PackedLinear
    from treespec.models.fast.quant import Int4Linear, dequantize, quantize_codes

    _, head, _ = trained
    low = copy.deepcopy(head)
    object.__setattr__(low, "_embed", head._embed)  # the target's embedding, by reference (not a submodule)
    with pytest.raises(ValueError, match="int8"):
        copy.deepcopy(low).for_inference(torch.bfloat16, quantize="int8")
    with pytest.raises(ValueError, match="bfloat16"):
        copy.deepcopy(low).for_inference(torch.float32, quantize="int4")
    low.for_inference(torch.bfloat16, quantize="int4")
    assert low.inference_weights == "int4" and low._rows_int4 is not None and low._rows_packed is None
    assert low.for_inference(torch.bfloat16, quantize="int4") is low  # the same form again: unchanged
    with pytest.raises(ValueError, match="already set for inference"):
        low.for_inference(torch.bfloat16)  # another form
    assert [m for m in low.modules() if isinstance(m, Int4Linear)]
    assert not any(isinstance(m, (torch.nn.Linear, PackedLinear)) for m in low.modules())
    x = torch.randn(5, head.cfg.hidden_size)
    ref = x.bfloat16().float() @ dequantize(*quantize_codes(head.lm_rows.bfloat16())).t()  # [5, |S|]
    got = low.logits(x)
    cap = head.cfg.softcap
    ref = torch.tanh(ref / cap) * cap if cap else ref
    assert torch.allclose(got, ref, atol=0.05 * float(ref.abs().max()))
    assert _top1_agreement(head, low) >= 0.75
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(0.0), stop_on_eos=False)
    for prompt in (prompts()[1][:12] * 2, prompts()[2][:6]):
        out = generate(target, prompt, ShapeDrafter(low, TreeShape.widths((2, 1, 1))), cfg)
        assert out.token_ids == generate(target, prompt, None, cfg).token_ids
    assert head._embed.weight.dtype == torch.float32 and head.inference_weights == "plain"
