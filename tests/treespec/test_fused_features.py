"""Fused target features (low / middle layers + the last hidden state, EAGLE-3 arXiv 2503.01840).

1. Runners: the features of a chain + tree forward (``ModelRunner`` on every tiny architecture, the
   fast Gemma runner) equal, row by row, a forward-hook reference on one causal pass per root path:
   the asked decoder layers' outputs, then the last hidden state (fp32, atol 1e-5). Its twin (the
   Hugging Face ``hidden_states`` read one entry too early, the off-by-one the layout rules out)
   differs from the same reference. Layers the target does not have are refused by name.
2. Head: a new fused head computes what the unfused head of the same seed computes (``fuse``
   starts as the projection onto the last hidden state); after training moved ``fuse`` away from
   that start, the runner inside a tree equals the per-depth emulation used for calibration and
   training; greedy generation with the fused head equals plain decoding (fp32), also composed with
   n-gram lookup; a runner handed the wrong feature width is refused by name.
3. Corpus and training: shards store the layers' outputs (equal to the hook reference); the sampler
   builds the head's input from the stored columns in the head's order; a corpus without them is
   refused before training; a fused head trains and its file round-trips.
"""

import json

import pytest
import torch

from treespec.distill.corpus import CorpusOptions, build_corpus
from treespec.distill.inputs import DistillInputError
from treespec.distill.train import ShardSampler, TrainConfig, train
from treespec.drafting.base import DraftState
from treespec.drafting.compose import FirstOf
from treespec.drafting.head import EagleHead, new_head
from treespec.drafting.head_runner import HeadRunner, head_depth_logits
from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.fast import FastGemmaRunner
from treespec.models.features import check_feature_layers, model_features
from treespec.models import runner as runner_module
from treespec.models.runner import ModelRunner
from treespec.models.tiny import ARCHITECTURES, tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

ATOL = 1e-5
V = 64
LAYERS = (0, 2)  # of 4 decoder layers: a low and a middle one (layer 3's output is the last hidden state)


def _decoder_layers(model):
    base = model.base_model
    return base.h if hasattr(base, "h") else base.layers


def hooked_features(model, ids: torch.Tensor, layers) -> torch.Tensor:
    """Slow reference: one causal pass over ``ids`` ``[L]``, the layers' outputs caught by forward hooks."""
    caught = {}
    hooks = [_decoder_layers(model)[i].register_forward_hook(
        lambda mod, args, out, i=i: caught.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layers]
    try:
        last = model.base_model(input_ids=ids[None]).last_hidden_state[0]
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([caught[i].reshape(last.shape) for i in layers] + [last], dim=-1)  # [L, (k + 1) H]


def _random_tree(num_nodes, root, gen):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    return TokenTree.from_lists(parents, [root] + torch.randint(0, V, (num_nodes - 1,), generator=gen).tolist())


def _runner_matches_hooks(model, runner, seed=0) -> bool:
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, V, (21,), generator=gen)  # longer than the tiny Gemma-3's sliding window of 8
    chain_feats = runner.forward(None, None, seq[:-1], need_logits=False, need_hidden=True,
                                 feature_layers=LAYERS)["hidden"]
    ok = torch.allclose(chain_feats, hooked_features(model, seq[:-1], LAYERS), atol=ATOL, rtol=0)
    tree = _random_tree(10, int(seq[-1]), gen)
    feats = runner.forward(tree, torch.arange(tree.num_nodes), need_hidden=True, feature_layers=LAYERS)["hidden"]
    for node in range(tree.num_nodes):
        path = torch.cat([seq[:-1], tree.tokens[tree.root_path(node)]])
        ok &= torch.allclose(feats[node], hooked_features(model, path, LAYERS)[-1], atol=ATOL, rtol=0)
    return bool(ok)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_runner_features_equal_per_path_hooked_passes(arch, monkeypatch):
    model = tiny_model(arch, V, seed=1, num_layers=4)
    assert _runner_matches_hooks(model, ModelRunner(model))
    # without layers: the last hidden state alone, as before
    seq = torch.arange(2, 9)
    plain = ModelRunner(model).forward(None, None, seq, need_logits=False, need_hidden=True)["hidden"]
    torch.testing.assert_close(plain, hooked_features(model, seq, ()), atol=ATOL, rtol=0)
    # broken twin: hidden_states[i] (the input of layer i) read as layer i's output
    monkeypatch.setattr(runner_module, "hf_layer_outputs", lambda out: tuple(out.hidden_states[:-2]))
    assert not _runner_matches_hooks(model, ModelRunner(model)), "the off-by-one twin passed"


def test_fast_runner_features_equal_per_path_hooked_passes():
    model = tiny_model("gemma3", V, seed=2, num_layers=4)
    assert _runner_matches_hooks(model, FastGemmaRunner(model, prepack=False))


@pytest.mark.parametrize("layers,match", [((3,), r"\[0, 2\]"), ((2, 1), "strictly increasing"), ((-1,), r"\[0, 2\]")])
def test_layers_the_target_lacks_are_refused(layers, match):
    model = tiny_model("llama", V, seed=0, num_layers=4)
    with pytest.raises(ValueError, match=match):
        ModelRunner(model).forward(None, None, torch.arange(3), need_hidden=True, feature_layers=layers)
    with pytest.raises(ValueError, match=match):
        check_feature_layers(layers, 4)


# ---------------------------------------------------------------------------------------------- head
@pytest.fixture(scope="module")
def target():
    return tiny_model("gemma3", V, seed=0, num_layers=4, logit_scale=6.0)


def _prompts():
    g = torch.Generator().manual_seed(5)
    base = [torch.randint(2, V, (n,), generator=g).tolist() for n in (14, 20, 9, 17, 24, 12)]
    return [p + p[: len(p) // 2] for p in base]  # some repetition, so n-gram lookup has something to find


@pytest.fixture(scope="module")
def fused_corpus(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("fused-corpus")
    man = build_corpus(target, _prompts(), out, CorpusOptions(topk=0, shard_positions=60, batch_size=2,
                                                             feature_layers=(0, 1, 2)), progress=False)
    return out, man


CFG = TrainConfig(steps=25, batch_size=4, seq_len=16, lr=3e-3, warmup=5, vocab_size=48, num_heads=4,
                  intermediate_size=64, ckpt_every=10, steps_per_shard=5, depths=2, feature_layers=LAYERS)


@pytest.fixture(scope="module")
def fused_head(target, fused_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("fused-run")
    with torch.enable_grad():
        head, summary = train(target, fused_corpus[0], run, CFG, progress=False, log=lambda *_: None)
    return run, head, summary


def test_new_fused_head_starts_as_the_unfused_head(target):
    ids = torch.tensor([_prompts()[1]])
    plain = new_head(target, torch.arange(40), num_heads=4, seed=3)
    fused = new_head(target, torch.arange(40), num_heads=4, seed=3, feature_layers=LAYERS)
    assert fused.num_trained_parameters > plain.num_trained_parameters
    f = model_features(target, ids, layers=LAYERS)[0]  # [L, 3H]
    pos = torch.arange(1, ids.shape[1])[None]
    a = plain.unroll(plain.last_hidden(f)[None, :-1], ids[:, 1:], pos, 2)
    b = fused.unroll(f[None, :-1], ids[:, 1:], pos, 2)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_corpus_stores_the_layers_and_the_sampler_reads_the_heads_columns(target, fused_corpus):
    from safetensors.torch import load_file

    out, man = fused_corpus
    assert man["options"]["feature_layers"] == [0, 1, 2]
    H = target.config.hidden_size
    checked = 0
    for entry in man["shards"]:  # every sequence of every shard (batched, right-padded) = its own hooked pass
        shard = load_file(str(out / entry["file"]))
        assert shard["features"].shape == (shard["hidden"].shape[0], 3 * H)
        off = shard["offsets"].tolist()
        for a, b in zip(off, off[1:]):
            ref = hooked_features(target, shard["tokens"][a:b].long(), (0, 1, 2))
            stored = torch.cat([shard["features"][a:b], shard["hidden"][a:b]], -1).float()
            torch.testing.assert_close(stored, ref.to(torch.bfloat16).float(), atol=1e-5, rtol=2 ** -7)  # 1 bf16 ulp
            checked += 1
    assert checked == len(_prompts())
    # the head reads layers (0, 2): columns 0 and 2 of the stored three, then the last hidden state
    sampler = ShardSampler(out, CFG, LAYERS)
    b = sampler.batch(1)
    sh = sampler._shard(sampler._loaded[0])
    t = int(b["mask"][0].sum())
    # the window's first row, found in the shard by its last hidden state and its next token
    match = (sh["hidden"].float() == b["hidden_in"][0, 0, -H:]).all(-1)
    match[:-1] &= sh["tokens"][1:].long() == b["tokens"][0, 0]
    start = int(torch.nonzero(match)[0])
    want = torch.cat([sh["features"][start:start + t].unflatten(1, (3, H))[:, [0, 2]].flatten(1),
                      sh["hidden"][start:start + t]], -1).float()
    torch.testing.assert_close(b["hidden_in"][0, :t], want, atol=0, rtol=0)


def test_a_corpus_without_the_layers_is_refused(target, tmp_path):
    plain = tmp_path / "plain"
    build_corpus(target, _prompts()[:2], plain, CorpusOptions(topk=0, shard_positions=10**6), progress=False)
    with pytest.raises(DistillInputError, match=r"reads target layers \[0, 2\].*stores \[\]"):
        train(target, plain, tmp_path / "run", CFG, progress=False, log=lambda *_: None)
    assert not (tmp_path / "run" / "head.safetensors").exists()
    with pytest.raises(DistillInputError, match="feature layers must lie in"):
        build_corpus(target, _prompts()[:2], tmp_path / "bad", CorpusOptions(feature_layers=(3,)), progress=False)
    assert not (tmp_path / "bad").exists()


def test_fused_runner_equals_the_per_depth_emulation(target, fused_head):
    _, head, _ = fused_head
    assert not torch.allclose(head.fuse.weight[:, :-target.config.hidden_size], torch.zeros(1))  # trained away
    ids = torch.tensor([_prompts()[4][:20]])
    depths, r = 4, 9
    _, per_depth = head_depth_logits(head, target, ids, depths)
    runner = HeadRunner(head)
    feats = model_features(target, ids[:, :r], layers=LAYERS)[0]  # positions 0..r-1
    runner.observe(DraftState(ids[0, : r + 1].tolist(), depths, feats))
    tree = TokenTree.from_lists(list(range(-1, depths - 1)), ids[0, r: r + depths].tolist(), "deterministic")
    for depth in range(depths):
        out = runner.forward(tree, torch.tensor([depth]), ids[0, :r] if depth == 0 else None)["logits"][0]
        assert torch.allclose(out, per_depth[depth][r + depth - 1], atol=1e-4), depth
    with pytest.raises(ValueError, match="width"):
        HeadRunner(head).observe(DraftState(ids[0, : r + 1].tolist(), 2, head.last_hidden(feats)))


def test_greedy_with_the_fused_head_equals_plain(target, fused_head):
    _, head, _ = fused_head
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(0.0), stop_on_eos=False)
    accepted = 0
    for prompt in _prompts()[:3] + [[7]]:
        plain = generate(target, prompt, None, cfg).token_ids
        for drafter in (ShapeDrafter(head, TreeShape.widths((2, 1, 1))),
                        FirstOf(NgramDrafter(NgramConfig(depth=3)), ShapeDrafter(head, TreeShape.chain(3)))):
            out = generate(target, prompt, drafter, cfg)
            assert out.token_ids == plain
            accepted += sum(s.accepted for s in out.steps)
    assert accepted > 0


def test_fused_head_file_round_trip(target, fused_head, tmp_path):
    run, head, summary = fused_head
    assert summary["step"] == CFG.steps
    loaded = EagleHead.load(run / "head.safetensors", target)
    assert loaded.cfg.feature_layers == LAYERS
    ids = torch.tensor([_prompts()[0]])
    f = model_features(target, ids, layers=LAYERS)
    pos = torch.arange(1, ids.shape[1])[None]
    torch.testing.assert_close(loaded(f[:, :-1], ids[:, 1:], pos), head(f[:, :-1], ids[:, 1:], pos))
    meta = json.loads(__import__("safetensors").safe_open(str(run / "head.safetensors"), "pt").metadata()["config"])
    assert meta["feature_layers"] == list(LAYERS)


def test_unfused_drafters_take_the_last_hidden_state_beside_a_fused_head(target, fused_head, tmp_path):
    """FirstOf(fused head, unfused head) and the online head over an unfused head read their columns;
    two heads reading different layers are refused when composed."""
    from treespec.drafting.online_head import OnlineHeadConfig, OnlineHeadDrafter
    from treespec.trees.merged import MergedDrafter
    from treespec.trees.eagle2 import Eagle2Drafter

    _, head, _ = fused_head
    plain = new_head(target, head.vocab_ids, num_heads=4, seed=1)
    cfg = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(0.0), stop_on_eos=False)
    prompt = _prompts()[2]
    want = generate(target, prompt, None, cfg).token_ids
    both = FirstOf(ShapeDrafter(head, TreeShape.chain(2)), ShapeDrafter(plain, TreeShape.chain(2)))
    assert both.feature_layers == LAYERS
    assert generate(target, prompt, both, cfg).token_ids == want
    merged = MergedDrafter(Eagle2Drafter(head, 6, top_k=2, depth=2), NgramConfig(depth=2, max_nodes=2))
    assert merged.feature_layers == LAYERS and generate(target, prompt, merged, cfg).token_ids == want
    online = OnlineHeadDrafter(ShapeDrafter(head, TreeShape.chain(2)), OnlineHeadConfig(update_every=4))
    assert online.feature_layers == LAYERS and generate(target, prompt, online, cfg).token_ids == want
    assert online.updates > 0
    other = new_head(target, head.vocab_ids, num_heads=4, seed=1, feature_layers=(1,))
    with pytest.raises(ValueError, match="different target layers"):
        FirstOf(ShapeDrafter(head, TreeShape.chain(2)), ShapeDrafter(other, TreeShape.chain(2)))


def test_medusa_reads_the_last_hidden_state_of_fused_features(target):
    from treespec.drafting.medusa import new_medusa_heads

    heads = new_medusa_heads(target, torch.arange(V), num_heads=2)
    with torch.no_grad():  # untrained heads are the identity: make them differ so the twin can fail
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    feats = model_features(target, torch.tensor([_prompts()[0]]), layers=LAYERS)[0]
    a, b = heads.as_runner(), heads.as_runner()
    tokens = _prompts()[0] + [5]
    a.observe(DraftState(tokens, 2, feats))
    b.observe(DraftState(tokens, 2, feats[:, -target.config.hidden_size:]))
    assert torch.equal(a.depth_logits, b.depth_logits)
    c = heads.as_runner()
    c.observe(DraftState(tokens, 2, feats[:, :target.config.hidden_size]))  # twin: the first slice
    assert not torch.equal(a.depth_logits, c.depth_logits)


def test_bad_layers_and_mismatched_runs_are_refused(target, fused_head, fused_corpus, tmp_path):
    _, head, _ = fused_head
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        FastGemmaRunner(target, prepack=False).forward(None, None, torch.arange(3), need_hidden=True,
                                                      feature_layers=(3,))
    small = tiny_model("gemma3", V, seed=0, num_layers=2)
    with pytest.raises(ValueError, match="EAGLE head built for another target"):
        new_head(small, torch.arange(10), num_heads=4, feature_layers=(2,))
    # a head file naming bad layers is refused with the file's name
    path = tmp_path / "bad.safetensors"
    head.save(path)
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    cfg = json.loads(meta["config"])
    cfg["feature_layers"] = 5
    save_file(load_file(str(path)), str(path), metadata={**meta, "config": json.dumps(cfg)})
    with pytest.raises(ValueError, match="feature layers must be a list"):
        EagleHead.load(path, target)
    # a run asking for other layers than its initial head reads
    with pytest.raises(DistillInputError, match=r"feature-layers \[1\].*reads \[0, 2\]"):
        train(target, fused_corpus[0], tmp_path / "r", TrainConfig(**{**CFG.__dict__, "feature_layers": (1,)}),
              init_head=fused_head[0] / "head.safetensors", progress=False, log=lambda *_: None)


def test_unfused_files_and_corpora_keep_their_old_form(target, tmp_path):
    """An unfused head file stores no feature_layers key; an unfused corpus keeps the fingerprint of
    the options as they were before the option existed."""
    import hashlib

    from safetensors import safe_open

    from treespec.distill.corpus import _fingerprint

    plain = new_head(target, torch.arange(20), num_heads=4)
    plain.save(tmp_path / "h.safetensors")
    with safe_open(str(tmp_path / "h.safetensors"), "pt") as fh:
        assert "feature_layers" not in json.loads(fh.metadata()["config"])
    seqs = [[1, 2, 3], [4, 5]]
    old = {"topk": 32, "shard_positions": 100_000, "batch_size": 4, "logits_chunk": 256, "continuation": "none",
           "new_tokens": 64, "seed": 0}
    h = hashlib.sha256(json.dumps(old, sort_keys=True).encode())
    for s in seqs:
        h.update(len(s).to_bytes(4, "little"))
        h.update(torch.tensor(s, dtype=torch.int32).numpy().tobytes())
    assert _fingerprint(seqs, CorpusOptions()) == h.hexdigest()
    assert _fingerprint(seqs, CorpusOptions(feature_layers=(0,))) != h.hexdigest()
