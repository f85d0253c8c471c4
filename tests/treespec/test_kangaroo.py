"""Kangaroo's adapter (:mod:`treespec.drafting.kangaroo`, :mod:`treespec.distill.kangaroo`).

1. Closed form: the identity block (``o`` = 0) with the target's final norm drafts the early exit's logits.
2. Against a slow reference: every node's draft logits in :class:`KangarooRunner`, over random
   branching trees and several rounds of commits (with the target's cache shared and without), equal
   a plain causal pass of the target over the node's root path (its residual stream after layer
   ``L - 1``, the final norm, the adapter's causal forward, the LM-head rows). A twin runner that
   forgets the tree mask (every node sees every node) fails it.
3. KV sharing: inside the engine the early exit feeds no committed token and the adapter none either
   (its committed entries come from the target's features); the target's cache is untouched.
4. Greedy output of every tree builder drafting with the adapter equals plain greedy decoding (fp32).
5. Output law at T = 1 (vocabulary-6 Llama, 4 layers, exit after 1, an adapter with random weights
   on a subset of 4 tokens, so q = 0 on two): the first three generated tokens follow the exact
   target law; seeds 0..N-1, N = 400, G test with cells of expected count < 5 pooled, alpha = 1e-3.
   The twin (draft probabilities replaced by a uniform q the children were not drawn from) must fail.
   Power (stats_helpers): at N = 400, alpha = 1e-3, power 0.9 and df 10 it detects KL >= 0.044 nats.
6. Files: save / load through the head-file reader, the wrong target refused in one line.
7. Training on a corpus with the exit layer's features lowers the loss and raises agreement over the
   untrained adapter; a run resumes exactly; another configuration and a corpus without the layer
   are refused.
"""

import pytest
import torch

from treespec.distill.corpus import CorpusOptions, build_corpus
from treespec.distill.inputs import DistillInputError
from treespec.distill.kangaroo import AdapterTrainConfig, StatePool, adapter_losses, train_adapter
from treespec.drafting.base import DraftState
from treespec.drafting.head_files import head_class_of, load_head
from treespec.drafting.kangaroo import KangarooAdapter, KangarooRunner, final_norm_gain, new_adapter
from treespec.drafters import build_tree_drafter
from treespec.generate import GenerationConfig, generate
from treespec.models.early_exit import SharedCacheRunner, early_exit_model
from treespec.models.features import join_features
from treespec.models.runner import ModelRunner
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

from .test_distill import prompts
from .test_end_to_end_stats import ALPHA, UniformQ, exact_law, g_test, sample_counts
from .trees_common import random_tree

N = 400
V = 64


def _random_adapter(target, vocab_ids, exit_layers=2, seed=0, scale=0.6):
    adapter = new_adapter(target, vocab_ids, exit_layers, num_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5 + (p.dim() == 1))
    return adapter.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_model("gemma3", V, seed=0, num_layers=4, logit_scale=8.0)


@pytest.fixture(scope="module")
def adapter(target):
    return _random_adapter(target, torch.arange(0, V, 2))  # q = 0 on every odd token


def _state(tokens, runner, target, layer):
    """The engine's DraftState at the start of a proposal: the target's features of the committed tokens."""
    hidden = None
    if len(tokens) > 1:
        out = target.base_model(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        states = out.hidden_states
        hidden = join_features(states[1:-1], out.last_hidden_state, (layer,))[0]
    return DraftState(tokens, 8, hidden, runner)


def _reference_logits(target, adapter, path):
    """q's logits after ``path`` (token ids from position 0), from a plain causal pass: ``[V]``."""
    ids = torch.tensor([path])
    states = target.base_model(ids, output_hidden_states=True).hidden_states
    resid = states[adapter.cfg.exit_layers]  # after layer L - 1 (entry 0 is the embedding)
    with torch.no_grad():
        out = adapter(resid, torch.arange(len(path))[None])[0, -1]
        full = torch.full((V,), float("-inf"))
        full[adapter.vocab_ids] = adapter.logits(out)
    return full


def test_identity_block_with_the_final_norm_is_the_early_exit(target):
    """With ``o`` = 0 (as :func:`new_adapter` makes it) and ``out_norm`` set to the target's final norm, the
    adapter's logits through its runner are the early exit's on the subset: the wiring of the early layers, the
    shared residual stream and the LM-head rows."""
    adapter = new_adapter(target, torch.arange(0, V, 2), 2, num_heads=2, head_dim=8)
    with torch.no_grad():
        adapter.out_norm.weight.copy_(final_norm_gain(target))
    runner = adapter.as_runner()
    prompt = list(range(5, 25))
    runner.observe(_state(prompt, None, target, 1))
    tree = random_tree(6, prompt[-1], V, torch.Generator().manual_seed(0))
    got = runner.forward(tree, torch.arange(6), torch.tensor(prompt[:-1]))["logits"]  # [6, V] (own early cache)
    early = early_exit_model(target, 2)
    for node in range(6):
        path = prompt[:-1] + [int(tree.tokens[i]) for i in tree.root_path(node)]
        want = early(torch.tensor([path])).logits[0, -1]
        torch.testing.assert_close(got[node, adapter.vocab_ids], want[adapter.vocab_ids], atol=1e-5, rtol=0)
        assert bool(torch.isinf(got[node, 1::2]).all())


class _NoTreeMask(KangarooRunner):
    """Twin: every tree node sees every node fed so far (as if the tree were one sequence)."""

    def forward(self, tree, nodes, chain=None, **kw):
        book = self.book
        real = book.visible_keys

        def everything(*args):
            seen = real(*args)
            seen[:, book.length:] = True
            return seen

        book.visible_keys = everything
        try:
            return super().forward(tree, nodes, chain, **kw)
        finally:
            del book.visible_keys


@pytest.mark.parametrize("mode", ["shared", "own cache", "no features"])
@pytest.mark.parametrize("twin", [False, True])
def test_runner_equals_the_per_path_reference_across_rounds(target, adapter, mode, twin):
    """``shared``: the engine's way (the target's cache and features); ``own cache``: features, no target runner;
    ``no features``: a target runner but no features (the early exit then keeps its own cache, and the adapter
    builds its committed entries from the early layers' states; features come back in round 3)."""
    runner = (_NoTreeMask if twin else KangarooRunner)(adapter)
    gen = torch.Generator().manual_seed(1)
    tokens = list(range(3, 15))
    trunner = ModelRunner(target)
    trunner.forward(None, None, torch.tensor(tokens[:-1]), need_logits=False)
    worst = 0.0
    for round_ in range(4):
        state = _state(tokens, None if mode == "own cache" else trunner, target, 1)
        if mode == "no features" and round_ < 3:
            state = DraftState(state.tokens, state.max_depth, None, trunner)
        runner.observe(state)
        assert runner.early.sharing is (mode == "shared" or (mode == "no features" and round_ == 3))
        tree = random_tree(7, tokens[-1], V, gen)
        chain = None if runner.length == len(tokens) - 1 else torch.tensor(tokens[runner.length:-1])
        by_level = {}
        for depth in range(int(tree.max_depth) + 1):  # level by level, as the builders feed a tree
            level = torch.nonzero(tree.depths == depth).flatten()
            by_level.update(zip(level.tolist(), runner.forward(tree, level, chain)["logits"]))
            chain = None
        for node, logits in by_level.items():
            path = tokens[:-1] + [int(tree.tokens[i]) for i in tree.root_path(node)]
            worst = max(worst, float((logits - _reference_logits(target, adapter, path))[adapter.vocab_ids]
                                     .abs().max()))
        kept = tree.root_path(int(torch.randint(7, (1,), generator=gen)))  # an accepted path, then a bonus token
        runner.commit(kept)
        tokens = tokens + [int(tree.tokens[i]) for i in kept[1:]] + [int(torch.randint(V, (1,), generator=gen))]
        trunner.forward(None, None, torch.tensor(tokens[trunner.length:-1]), need_logits=False)
    if twin:
        assert worst > 1e-3, "the twin without a tree mask matched the reference"
    else:
        assert worst < 1e-4


def test_engine_shares_both_caches(target, adapter):
    drafter = ShapeDrafter(adapter, TreeShape.widths((2, 2, 1)), "without_replacement")
    runner = drafter.runner
    assert isinstance(runner, KangarooRunner) and isinstance(runner.early, SharedCacheRunner)
    assert drafter.feature_layers == (1,)
    chains = []
    forward = runner.early.forward

    def counting(tree, nodes, chain=None, **kw):
        chains.append(0 if chain is None else chain.numel())
        return forward(tree, nodes, chain, **kw)

    runner.early.forward = counting
    prompt = list(range(3, 40))
    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(0.0), stop_on_eos=False)
    out = generate(target, prompt, drafter, cfg)
    assert out.token_ids == generate(target, prompt, None, cfg).token_ids
    assert chains and sum(chains) == 0 and runner.early.sharing  # no prefill, no catch-up of the early layers
    assert runner.book.length == len(prompt) + len(out.token_ids) - 2  # adapter entries: every committed position
    assert sum(s.accepted for s in out.steps) > 0


@pytest.mark.parametrize("prompt", [[7], [5, 9, 11, 5, 9, 11, 5]])
def test_behind_lookup_and_after_one_token_prompts_it_stays_in_step(target, adapter, prompt):
    """``FirstOf(lookup, adapter)``: on steps where lookup drafts, the adapter proposes nothing and catches up
    later; a one-token prompt has no committed position (the early exit's own cache, then the target's)."""
    from treespec.drafters import LOOKUP
    from treespec.drafting.compose import FirstOf
    from treespec.drafting.ngram import NgramDrafter

    cfg = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(0.0), stop_on_eos=False)
    inner = ShapeDrafter(adapter, TreeShape.widths((2, 1)), "without_replacement")
    out = generate(target, prompt, FirstOf(NgramDrafter(LOOKUP), inner), cfg)
    assert out.token_ids == generate(target, prompt, None, cfg).token_ids
    assert inner.runner.early.sharing and inner.runner.book.length <= len(prompt) + len(out.token_ids) - 1


BUILDERS = ("chain", "specinfer", "sequoia", "dyspec", "eagle2", "merged")


@pytest.mark.parametrize("builder", BUILDERS)
def test_every_builder_with_the_adapter_is_greedy_exact(target, adapter, builder):
    drafter = build_tree_drafter(builder, adapter, 8, vocab=V, acc=[0.6, 0.3, 0.1])
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(0.0), stop_on_eos=False)
    prompt = [5, 9, 11, 5, 9, 11, 5]
    assert generate(target, prompt, drafter, cfg).token_ids == generate(target, prompt, None, cfg).token_ids


LAW_CASES = {
    "iid": lambda a: ShapeDrafter(a, TreeShape.widths((2, 2)), "iid"),
    "confident": lambda a: ShapeDrafter(a, TreeShape.widths((2, 2)), "iid", min_confidence=0.3),
}


@pytest.mark.stats
@pytest.mark.parametrize("case,broken", [(c, False) for c in sorted(LAW_CASES)] + [("iid", True)])
def test_output_law_at_t1_with_the_adapter(case, broken):
    target = tiny_model("llama", 6, seed=0, num_layers=4, logit_scale=12.0)
    adapter = _random_adapter(target, torch.tensor([0, 2, 3, 5]), exit_layers=1, seed=2, scale=2.0)
    sampling = SamplingConfig(1.0)
    wrap = UniformQ if broken else (lambda d: d)
    counts = sample_counts(target, lambda: wrap(LAW_CASES[case](adapter)), "rrs", sampling, n=N)
    p_value = g_test(counts, exact_law(target, sampling), N)
    if broken:
        assert p_value < ALPHA, f"the broken twin passed (G-test p = {p_value:.2e})"
    else:
        assert p_value > ALPHA, f"{case}: output law differs from the target's (G-test p = {p_value:.2e})"


def test_save_load_and_wrong_target(tmp_path, target, adapter):
    path = tmp_path / "k.safetensors"
    adapter.save(path)
    assert head_class_of(path) is KangarooAdapter
    back = load_head(path, target)
    x = torch.randn(1, 5, adapter.cfg.hidden_size)
    pos = torch.arange(5)[None]
    assert torch.equal(back(x, pos), adapter(x, pos)) and torch.equal(back.vocab_ids, adapter.vocab_ids)
    with pytest.raises(ValueError, match="needs a target of more than 2 decoder layers"):
        KangarooAdapter.load(path, tiny_model("gemma3", V, seed=0, num_layers=2))
    with pytest.raises(ValueError, match="attach"):
        KangarooRunner(KangarooAdapter(adapter.cfg, adapter.vocab_ids))
    with pytest.raises(ValueError, match="exit_layers"):
        type(adapter.cfg)(hidden_size=8, target_vocab_size=8, exit_layers=0)



def test_the_tools_of_layer_heads_refuse_an_adapter(tmp_path, target, adapter):
    """``load_layer_head`` (study_real_model, distill acceptance) reads EAGLE and EAGLE-3
    heads and refuses the adapter in one line naming the tool."""
    from treespec.drafting.eagle3 import new_eagle3_head
    from treespec.drafting.head import EagleHead, new_head
    from treespec.drafting.head_files import load_layer_head

    adapter.save(tmp_path / "k.safetensors")
    with pytest.raises(ValueError, match="KangarooAdapter drafts through the target's own early layers; the study "
                                         "takes an EAGLE or EAGLE-3 head") as err:
        load_layer_head(tmp_path / "k.safetensors", target, what="the study")
    assert "\n" not in str(err.value)
    new_head(target, adapter.vocab_ids, num_heads=2).save(tmp_path / "e.safetensors")
    new_eagle3_head(target, adapter.vocab_ids, feature_layers=(0, 1), num_heads=2).save(tmp_path / "e3.safetensors")
    assert type(load_layer_head(tmp_path / "e.safetensors", target)) is EagleHead
    assert type(load_layer_head(tmp_path / "e3.safetensors", target)).__name__ == "Eagle3Head"


@pytest.fixture(scope="module")
def layer_corpus(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("kcorpus")
    seqs = [[t % V for t in p] for p in prompts()]
    build_corpus(target, seqs, out, CorpusOptions(topk=0, shard_positions=150, batch_size=2, continuation="sample",
                                                  new_tokens=8, feature_layers=(1,)), progress=False)
    return out


CFG = AdapterTrainConfig(exit_layers=2, steps=40, batch_size=4, seq_len=32, lr=1e-2, warmup=5, num_heads=2,
                         head_dim=8, ckpt_every=10)


def test_training_improves_agreement_and_resumes(target, layer_corpus, tmp_path):
    vocab = torch.arange(0, V, 2)
    with torch.enable_grad():
        trained, summary = train_adapter(target, [layer_corpus], tmp_path / "run", vocab, CFG, progress=False)
    assert summary["steps"] == 40 and (tmp_path / "run" / "summary.json").exists()
    fresh = new_adapter(target, vocab, 2, num_heads=2, head_dim=8)
    sub_index = torch.full((V,), -1, dtype=torch.long)
    sub_index[vocab] = torch.arange(vocab.numel())
    batch = StatePool([layer_corpus], 1).batch(16, 32, torch.Generator().manual_seed(123))
    with torch.no_grad():
        before, after = (adapter_losses(a, batch, CFG, sub_index) for a in (fresh, trained))
        p = torch.softmax(fresh.logits(batch["hidden"][batch["mask"]]), dim=-1)
        entropy = float(-(p * torch.log(p.clamp(min=1e-30))).sum(-1).mean())  # no adapter's soft loss goes below
    kl_before, kl_after = float(before["soft"]) - entropy, float(after["soft"]) - entropy
    assert kl_after < 0.8 * kl_before and after["agree"] > before["agree"]  # measured: 0.218 -> 0.099, 0.44 -> 0.54
    with torch.enable_grad():  # an interrupted run (stopped before its first step) resumes to the same weights
        stopped = AdapterTrainConfig(**{**CFG.__dict__, "time_limit_s": 0.0})
        _, s2 = train_adapter(target, [layer_corpus], tmp_path / "run2", vocab, stopped, progress=False)
        assert s2["steps"] == 0
        resumed, _ = train_adapter(target, [layer_corpus], tmp_path / "run2", vocab, CFG, progress=False)
    assert all(torch.allclose(a, b) for a, b in zip(resumed.parameters(), trained.parameters()))
    # killed mid-run (after the checkpoint of step 10, at step 16): the resumed run ends where the whole one did
    # (the optimizer's moments, the gain's scaled steps and the random state come back)
    import treespec.distill.kangaroo as module

    real, calls = module.adapter_losses, []

    def dying(*args):
        calls.append(1)
        if len(calls) == 16:
            raise KeyboardInterrupt
        return real(*args)

    with torch.enable_grad():
        module.adapter_losses = dying
        try:
            with pytest.raises(KeyboardInterrupt):
                train_adapter(target, [layer_corpus], tmp_path / "run4", vocab, CFG, progress=False)
        finally:
            module.adapter_losses = real
        assert torch.load(tmp_path / "run4" / "kangaroo-ckpt.pt", weights_only=True)["step"] == 10
        again, _ = train_adapter(target, [layer_corpus], tmp_path / "run4", vocab, CFG, progress=False)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(again.parameters(), trained.parameters()))
    with pytest.raises(DistillInputError, match="another configuration"):
        train_adapter(target, [layer_corpus], tmp_path / "run", vocab,
                      AdapterTrainConfig(**{**CFG.__dict__, "lr": 1e-3}), progress=False)
    with pytest.raises(DistillInputError, match="trained on other corpus shards"):  # the first shard only
        train_adapter(target, [layer_corpus], tmp_path / "run", vocab,
                      AdapterTrainConfig(**{**CFG.__dict__, "max_shards": (1,)}), progress=False)
    assert AdapterTrainConfig(max_shards=(5,)).max_shards == 5 and AdapterTrainConfig(max_shards=[2, 3]).max_shards \
        == (2, 3)
    with pytest.raises(DistillInputError, match="max-shards must be counts >= 1"):
        AdapterTrainConfig(max_shards=(0,))
    with pytest.raises(DistillInputError, match="reads target layer 2"):
        train_adapter(target, [layer_corpus], tmp_path / "run3", vocab,
                      AdapterTrainConfig(**{**CFG.__dict__, "exit_layers": 3}), progress=False)


def test_cli_trains_evaluates_and_drafts(tmp_path, capsys, monkeypatch):
    """``python -m treespec.distill kangaroo`` on a saved tiny target (2 layers: exit after 1) trains and exports;
    ``evaluate`` measures the file (depth 1 = every depth along the text); ``treespec generate --draft FILE``
    drafts with it on the eager and the fast runner, greedy output equal to ``--plain``."""
    import json

    from treespec.cli import main as cli_main

    from .test_distill_inputs import PROMPTS, last_json, make_model_dir, run_cli, write_prompts

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    model_dir = make_model_dir(tmp_path / "model")
    p = write_prompts(tmp_path / "train.jsonl", PROMPTS)
    common = ["--target", model_dir, "--dtype", "float32", "--no-progress"]
    code, _, err = run_cli(["build-corpus", *common, "--prompts", p, "--out", tmp_path / "c", "--max-len", 40,
                            "--topk", 0, "--shard-positions", 100, "--batch-size", 2, "--feature-layers", "0"],
                           capsys)
    assert code == 0, err
    adapter = tmp_path / "k.safetensors"
    code, out, err = run_cli(["kangaroo", *common, "--corpus", tmp_path / "c", "--run-dir", tmp_path / "r",
                              "--exit-layers", 1, "--steps", 4, "--seq-len", 16, "--num-heads", 2, "--head-dim", 8,
                              "--export", adapter], capsys)
    assert code == 0, err
    assert last_json(out)["steps"] == 4 and head_class_of(adapter) is KangarooAdapter
    code, out, err = run_cli(["kangaroo", *common, "--corpus", tmp_path / "c", "--run-dir", tmp_path / "r2",
                              "--exit-layers", 2, "--steps", 4], capsys)
    assert code == 2 and "needs a target of more than 2 decoder layers" in err.strip().splitlines()[-1]
    code, out, err = run_cli(["evaluate", *common, "--head", adapter, "--prompts", p, "--num-prompts", 2,
                              "--new-tokens", 4, "--depths", 2, "--tau", "--tau-prompts", 1], capsys)
    assert code == 0, err
    m = last_json(out)
    assert m["positions_T0"] > 0 and 0 <= m["top1_agreement_T0"] <= 1 and m["step_cost"]["head_step_s"] > 0
    runs = {}
    for runner in ("eager", "fast", "plain"):
        extra = ["--plain"] if runner == "plain" else ["--draft", str(adapter), "--runner", runner]
        code = cli_main(["generate", "w1 w2 w3 w4 w5 w1 w2", "--target", str(model_dir), "--max-new-tokens", "16",
                         "--no-stop", "--json", "--threads", "1", "--dtype", "float32", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        runs[runner] = json.loads(out)
    assert runs["eager"]["token_ids"] == runs["fast"]["token_ids"] == runs["plain"]["token_ids"]
    code = cli_main(["generate", "w1 w2", "--target", "embedded-gguf", "--draft", str(adapter)])
    err = capsys.readouterr().err
    assert code == 2 and "is a Kangaroo adapter, which reads the target's earlier layers" in err
    from treespec.cli import build_parser, resolve_target

    args = build_parser().parse_args(["generate", "x", "--target", "auto", "--draft", str(adapter)])
    assert resolve_target(args, torch.float32)[0] == "embedded"  # never llama.cpp, whatever is installed
    code, out, err = run_cli(["kangaroo", *common, "--corpus", tmp_path / "c", "--run-dir", tmp_path / "none",
                              "--exit-layers", 1, "--no-train", "--export", tmp_path / "x.safetensors"], capsys)
    assert code == 2 and "holds no Kangaroo adapter run to export" in err.strip().splitlines()[-1]
