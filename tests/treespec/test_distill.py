"""Distillation end to end on a tiny random target: corpus -> training -> save/load -> generation.

Target: tiny random Gemma-3 (vocabulary 128, hidden 32, sliding window 8). Prompts: a dozen rows of
the train prompt file, tokenised in-test as UTF-8 bytes mod 127 plus 1 (id 0 is a BOS). The head
is trained for a few dozen steps; it need not be good, only exercised: greedy output must equal
plain greedy decoding (fp32), the T=1 output law must equal the target's (G test, seed i for
i in range(N), N = 600, alpha = 1e-3, same helpers as test_end_to_end_stats), resuming from a
checkpoint must continue exactly, and q must be exactly 0 outside the vocabulary subset.
Power (stats_helpers): at N = 600, alpha = 1e-3, power 0.9 and df 10 it detects KL >= 0.029 nats,
i.e. any total-variation shift >= 0.12.
"""

import json

import pytest
import torch

from treespec.distill.corpus import CorpusOptions, build_corpus, check_not_eval, load_manifest, shared_dir
from treespec.distill.train import TrainConfig, train
from treespec.drafting.base import DraftState
from treespec.drafting.compose import FirstOf
from treespec.drafting.head import EagleHead
from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

from .test_end_to_end_stats import g_test

V = 128
TRAIN = shared_dir() / "data" / "train" / "train_prompts.jsonl"
#: prompts where the shared train set is absent: twelve different texts, so that shards differ in their tokens
FALLBACK = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
            "Translate to French: good morning", "What is 12 times 7? Think step by step.",
            "Summarise: rain fell all week and the river rose.", "SELECT name FROM users WHERE age > 30;",
            "Write a haiku about winter light.", "List three prime numbers: 2, 3, 5",
            "Q: Who wrote Hamlet? A: Shakespeare", "for i in range(10): print(i * i)",
            "Explain why the sky is blue, briefly.", "Zebras, yaks and quokkas queue quietly."]


def tokenize(text: str, max_len: int = 48) -> list[int]:
    return [0] + [1 + b % (V - 1) for b in text.encode()][: max_len - 1]


def prompts() -> list[list[int]]:
    if TRAIN.exists():
        rows = [json.loads(line) for line in TRAIN.read_text(encoding="utf-8").split("\n")[:12] if line.strip()]
        return [tokenize(r["prompt"]) for r in rows]
    return [tokenize(t) for t in FALLBACK]


CFG = TrainConfig(steps=30, batch_size=4, seq_len=32, lr=3e-3, warmup=5, vocab_size=96, num_heads=4,
                  intermediate_size=64, ckpt_every=10, steps_per_shard=5, soft="topk")


@pytest.fixture(scope="module")
def target():
    return tiny_model("gemma3", V, seed=0, logit_scale=6.0)


@pytest.fixture(scope="module")
def corpus(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    with torch.enable_grad():
        man = build_corpus(target, prompts(), out, CorpusOptions(topk=8, shard_positions=150, batch_size=2,
                                                                continuation="sample", new_tokens=8),
                           progress=False)
    return out, man


@pytest.fixture(scope="module")
def trained(target, corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    with torch.enable_grad():
        head, summary = train(target, corpus[0], run, CFG, progress=False, log=lambda *_: None)
    return run, head, summary


def test_corpus_shards_and_resume(target, corpus, tmp_path):
    out, man = corpus
    assert man["complete"] and len(man["shards"]) >= 2
    assert man["positions"] == sum(s["positions"] for s in man["shards"])
    # an interrupted build (only the first shard on disk) resumes to the identical corpus
    partial = tmp_path / "partial"
    partial.mkdir()
    first = man["shards"][0]
    (partial / first["file"]).write_bytes((out / first["file"]).read_bytes())
    m = dict(load_manifest(out), shards=[first], positions=first["positions"],
             sequences_done=first["sequences"], complete=False)
    (partial / "manifest.json").write_text(json.dumps(m))
    resumed = build_corpus(target, prompts(), partial, CorpusOptions(**man["options"]), progress=False)
    assert [s["positions"] for s in resumed["shards"]] == [s["positions"] for s in man["shards"]]
    with pytest.raises(ValueError):
        build_corpus(target, prompts()[:3], partial, CorpusOptions(**man["options"]), progress=False)
    with pytest.raises(ValueError):
        check_not_eval("../shared/data/eval/spec_bench.prompts.jsonl")


def test_training_learns_and_saves(target, corpus, trained, tmp_path):
    run, head, summary = trained
    assert summary["step"] == CFG.steps
    # learns: the same run stopped after one step reports the untrained head's loss (its EMA is the
    # first batch's loss); after CFG.steps the loss EMA must be clearly below it
    with torch.enable_grad():
        _, first = train(target, corpus[0], tmp_path / "one", TrainConfig(**{**CFG.__dict__, "steps": 1}),
                         progress=False, log=lambda *_: None)
    assert summary["ema"]["total"] < 0.8 * first["ema"]["total"], (summary["ema"], first["ema"])
    loaded = EagleHead.load(run / "head.safetensors", target)
    assert torch.equal(loaded.vocab_ids, head.vocab_ids)
    x = torch.randn(1, 5, 32)
    toks = torch.randint(0, V, (1, 5))
    pos = torch.arange(1, 6)[None]
    assert torch.allclose(loaded(x, toks, pos), head(x, toks, pos))


def test_resume_from_checkpoint_continues_exactly(target, corpus, trained, tmp_path):
    run, head, _ = trained
    assert sorted(p.name for p in run.glob("ckpt-*.pt")) == ["ckpt-20.pt", "ckpt-30.pt"]  # keep_ckpts = 2
    # a run interrupted after its step-20 checkpoint, resumed to step 30, equals the uninterrupted run
    (tmp_path / "ckpt-20.pt").write_bytes((run / "ckpt-20.pt").read_bytes())
    logs = []
    with torch.enable_grad():
        resumed, summary = train(target, corpus[0], tmp_path, CFG, progress=False, log=logs.append)
    assert "resuming" in logs[0] and summary["step"] == CFG.steps
    assert summary["positions_this_run"] > 0
    for (k, a), b in zip(head.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


def test_a_run_from_before_logits_amp_keeps_float32_products(target, corpus, trained, tmp_path):
    """A checkpoint whose training config predates ``logits_amp`` resumes with float32 subset products (said in
    the log, recorded in its next checkpoint); one that has the field keeps what it recorded."""
    run, _, _ = trained
    state = torch.load(run / "ckpt-20.pt", weights_only=False)
    del state["train_config"]["logits_amp"]
    torch.save(state, tmp_path / "ckpt-20.pt")
    logs = []
    with torch.enable_grad():
        train(target, corpus[0], tmp_path, TrainConfig(**{**CFG.__dict__, "steps": 21, "ckpt_every": 1}),
              progress=False, log=logs.append)
    assert any("before logits_amp" in line for line in logs), logs
    assert torch.load(tmp_path / "ckpt-21.pt", weights_only=False)["train_config"]["logits_amp"] is False


def test_restricted_vocabulary_is_exact(target, trained):
    _, head, _ = trained
    assert head.vocab_ids.numel() < V
    drafter = ShapeDrafter(head, TreeShape.widths((3, 2)), "iid")
    prompt = prompts()[0][:10]
    drafter.begin(prompt)
    hidden = target.base_model(input_ids=torch.tensor([prompt[:-1]])).last_hidden_state[0]
    draft = drafter.propose(DraftState(prompt, 4, hidden), SamplingConfig(1.0), torch.Generator().manual_seed(0))
    q = draft.draft_probs
    assert q.shape == (draft.tree.num_nodes, V)
    internal = q[: 1 + 3]  # the root and its 3 children have children
    outside = torch.ones(V, dtype=torch.bool)
    outside[head.vocab_ids] = False
    assert torch.all(q[:, outside] == 0)
    assert torch.allclose(internal.sum(-1), torch.ones(4), atol=1e-6)
    assert torch.isin(draft.tree.tokens[1:], head.vocab_ids).all()


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 2, 1)])
def test_greedy_generation_identical_to_plain(target, trained, shape):
    _, head, _ = trained
    cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)
    for prompt in [prompts()[1][:12], [5], prompts()[2][:3]]:
        plain = generate(target, prompt, None, cfg).token_ids
        out = generate(target, prompt, ShapeDrafter(head, TreeShape.widths(shape), "iid"), cfg)
        assert out.token_ids == plain


@pytest.mark.parametrize("min_confidence", [0.0, 0.2])
def test_lookup_then_head_greedy_identical_to_plain(target, trained, min_confidence):
    """N-gram trees where the context repeats, head trees (confidence-pruned or not) elsewhere."""
    _, head, _ = trained
    cfg = GenerationConfig(max_new_tokens=48, sampling=SamplingConfig(0.0), stop_on_eos=False)
    used = [0, 0]  # trees proposed by the n-gram drafter, by the head
    for prompt in [prompts()[1][:12] * 2, [5], prompts()[2][:6]]:
        plain = generate(target, prompt, None, cfg).token_ids
        drafter = FirstOf(NgramDrafter(NgramConfig(depth=6, branches=1, adaptive=True)),
                          ShapeDrafter(head, TreeShape.widths((2, 1, 1)), "iid", min_confidence=min_confidence))
        assert generate(target, prompt, drafter, cfg).token_ids == plain
        used = [u + c for u, c in zip(used, drafter.counts)]
    assert min(used) > 0, used


def test_head_then_lookup_greedy_identical_to_plain(target, trained):
    """The other order: a head whose confidence threshold prunes its trees to the root (after the root
    went through its cache) hands the step to lookup, and is told only its root was accepted."""
    _, head, _ = trained
    cfg = GenerationConfig(max_new_tokens=48, sampling=SamplingConfig(0.0), stop_on_eos=False)
    used = [0, 0]
    for prompt in [prompts()[1][:12] * 2, prompts()[2][:6]]:
        plain = generate(target, prompt, None, cfg).token_ids
        drafter = FirstOf(ShapeDrafter(head, TreeShape.widths((2, 1)), "iid", min_confidence=0.9),
                          NgramDrafter(NgramConfig(depth=6, branches=1)))
        assert generate(target, prompt, drafter, cfg).token_ids == plain
        used = [u + c for u, c in zip(used, drafter.counts)]
    assert used[1] > 0, used  # lookup drafted where the head had nothing confident


def test_confidence_pruning_keeps_only_confident_children(target, trained):
    _, head, _ = trained
    prompt = prompts()[0][:10]
    hidden = target.model(torch.tensor([prompt[:-1]]), output_hidden_states=True).last_hidden_state[0].detach()
    for threshold in (0.0, 0.3, 0.9):
        drafter = ShapeDrafter(head, TreeShape.widths((4, 2)), "iid", min_confidence=threshold)
        drafter.begin(prompt)
        draft = drafter.propose(DraftState(prompt, 8, hidden), SamplingConfig(0.0), None)
        assert draft.tree.law == "deterministic"
        parents = draft.tree.parents.tolist()
        if threshold == 0.0:
            assert draft.tree.num_nodes == 1 + 4 + 8
            full = draft.tree
            continue
        # the confidences of one node's children sum to <= 1, so at most floor(1 / threshold) of
        # them can be >= threshold: with pruning off, (4, 2) keeps 4 children at the root
        per_node = [parents[1:].count(i) for i in range(draft.tree.num_nodes)]
        assert max(per_node) <= int(1 / threshold), (threshold, per_node)
        # and what is kept is a subtree of the unpruned top-k tree (same tokens on the same paths)
        def token_paths(tree):
            par, tok, out = tree.parents.tolist(), tree.tokens.tolist(), set()
            for i in range(1, tree.num_nodes):
                path, j = [], i
                while j > 0:
                    path.append(tok[j]); j = par[j]
                out.add(tuple(reversed(path)))
            return out
        assert token_paths(draft.tree) <= token_paths(full)
    with pytest.raises(ValueError, match="min_confidence"):
        ShapeDrafter(head, TreeShape.widths((1,)), "iid", min_confidence=1.0)


def _small_head(tmp_path):
    small = tiny_model("llama", 6, seed=0, logit_scale=6.0)
    seqs = [[1 + b % 5 for b in p] for p in prompts()]
    with torch.enable_grad():
        build_corpus(small, seqs, tmp_path / "c", CorpusOptions(topk=0, shard_positions=10**6), progress=False)
        head, _ = train(small, tmp_path / "c", tmp_path / "r",
                        TrainConfig(**{**CFG.__dict__, "steps": 15, "vocab_size": 4, "soft": "subset"}), progress=False,
                        log=lambda *_: None)
    return small, head


class _WrongLawLookup(FirstOf):
    """Deliberately broken: n-gram trees passed off as i.i.d. draws from a uniform q (they are not)."""

    def propose(self, state, sampling, generator):
        from treespec.drafting.base import Draft
        from treespec.tree import TokenTree

        draft = super().propose(state, sampling, generator)
        if self.last != 0:
            return draft
        tree = draft.tree
        q = torch.full((tree.num_nodes, 6), 1 / 6)
        return Draft(TokenTree(tree.parents, tree.tokens, "iid"), q)


@pytest.mark.stats
@pytest.mark.parametrize("broken", [False, True])
def test_lookup_then_head_law_at_t1(tmp_path, broken):
    """Mixed drafting at T=1 (n-gram trees verified as deterministic candidates, head trees drawn
    i.i.d. and verified by RRS, the verifier switched per step): the law of the first three tokens
    after the prompt [1, 2, 3, 1, 2] equals the exact target law. Seeds 0..N-1, N = 600, G test with
    cells of expected count < 5 pooled, alpha = 1e-3. Twin (broken=True): n-gram trees mislabelled as
    i.i.d. from a uniform q must fail it."""
    from .test_end_to_end_stats import exact_law, g_test

    small, head = _small_head(tmp_path)
    prompt = [1, 2, 3, 1, 2]
    cls = _WrongLawLookup if broken else FirstOf
    n, counts, used = 600, {}, [0, 0]
    for seed in range(n):
        drafter = cls(NgramDrafter(NgramConfig(depth=3, branches=2)),
                      ShapeDrafter(head, TreeShape.widths((2, 2)), "iid"))
        out = generate(small, prompt, drafter,
                       GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(1.0), seed=seed, stop_on_eos=False))
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        used = [u + c for u, c in zip(used, drafter.counts)]
    assert min(used) > 0, used
    p_value = g_test(counts, exact_law(small, SamplingConfig(1.0), prompt), n)
    if broken:
        assert p_value < 1e-3, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > 1e-3, f"output law differs from the target's (G-test p = {p_value:.2e})"


@pytest.mark.stats
def test_output_law_at_t1_is_the_targets(tmp_path):
    """A head distilled end to end on the vocabulary-6 llama of test_end_to_end_stats, with a
    vocabulary subset of 4 of the 6 tokens: the law of the first three generated tokens at T=1
    (tree (3, 2) drafted iid, RRS) equals the exact target law. Seeds 0..N-1, N = 600, G test
    with cells of expected count < 5 pooled, alpha = 1e-3."""
    from .test_end_to_end_stats import PROMPT, exact_law

    small, head = _small_head(tmp_path)  # no stored soft labels (topk=0): taken from the hidden states
    assert head.vocab_ids.numel() == 4
    n, counts = 600, {}
    for seed in range(n):
        out = generate(small, PROMPT, ShapeDrafter(head, TreeShape.widths((3, 2)), "iid"),
                       GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(1.0), seed=seed, stop_on_eos=False))
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    p_value = g_test(counts, exact_law(small, SamplingConfig(1.0)), n)
    assert p_value > 1e-3, f"output law differs from the target's (G-test p = {p_value:.2e})"


def test_training_on_several_corpora(target, corpus, tmp_path):
    with torch.enable_grad():
        _, summary = train(target, [corpus[0], corpus[0]], tmp_path, TrainConfig(**{**CFG.__dict__, "steps": 3}),
                           progress=False, log=lambda *_: None)
    assert summary["step"] == 3 and (tmp_path / "head.safetensors").exists()


def test_max_shards_pins_the_first_shards(target, corpus, tmp_path):
    """``max_shards`` trains on the first N shards of a corpus only: the sampler and the vocabulary
    see exactly those (a corpus still growing gives every run the same data); asking for more shards
    than are finished is refused by name."""
    from treespec.distill.train import DistillInputError, ShardSampler, choose_vocab, corpus_shards

    out, man = corpus
    assert len(man["shards"]) >= 3
    cfg = TrainConfig(**{**CFG.__dict__, "steps": 2, "max_shards": 2})
    assert [sh["file"] for _, sh in ShardSampler(out, cfg).shards] == [sh["file"] for sh in man["shards"][:2]]
    assert len(corpus_shards([out, out], 2)) == 4
    # a pinned vocabulary counts the pinned shards only (one shard: differs from the whole corpus here)
    assert not torch.equal(choose_vocab(out, 12, max_shards=1), choose_vocab(out, 12))
    with torch.enable_grad():
        _, summary = train(target, out, tmp_path / "run", cfg, progress=False, log=lambda *_: None)
    assert summary["step"] == 2
    # resuming the run on other data is refused (the pinned shards are part of the run's identity)
    with pytest.raises(DistillInputError, match="max_shards=2, this call asks for max_shards=None"):
        train(target, out, tmp_path / "run", TrainConfig(**{**CFG.__dict__, "steps": 3}), progress=False,
              log=lambda *_: None)
    with pytest.raises(DistillInputError, match="fewer than max_shards"):
        corpus_shards(out, len(man["shards"]) + 1)
    with pytest.raises(DistillInputError, match="max-shards must be >= 1"):
        TrainConfig(max_shards=0)
    # one count per corpus: the first 2 shards of the first, 1 of the second; a count per corpus must match them
    assert [sh["file"] for _, sh in corpus_shards([out, out], (2, 1))] == [sh["file"] for sh in man["shards"][:2]] + \
        [man["shards"][0]["file"]]
    assert TrainConfig(max_shards=(2,)).max_shards == 2 and TrainConfig(max_shards=[2, 1]).max_shards == (2, 1)
    with pytest.raises(DistillInputError, match="gives 2 counts for 3 corpora"):
        corpus_shards([out, out, out], (2, 1))
    with pytest.raises(DistillInputError, match="max-shards must be >= 1"):
        TrainConfig(max_shards=(2, 0))
