"""The draft head in EAGLE-3's layout (:mod:`treespec.drafting.eagle3`) and its ``speculators`` export.

1. Mechanics against a slow reference written from the layout (``reference_logits``: one token at a time,
   plain loops, the weights read by their engine names; what ``speculators``' ``Eagle3DraftModel`` computes):
   the runner inside branching trees fed level by level, across a commit and a second round, equals the
   reference on each node's root path (float32, atol 1e-4). Its twin, a head that feeds children the output
   after the final norm (the EAGLE head's rule), fails it at depth >= 2. Greedy generation with the head
   (chain and tree, alone and after n-gram lookup) equals plain greedy decoding.
2. The export: the files and tensors of a ``speculators`` checkpoint (names and shapes listed here from the
   layout, not from the writer), ``d2t`` / ``t2d`` naming the head's subset, a checkpoint read back computing
   the same logits, and one-line refusals (checkpoints treespec cannot compute, another target's LM head, a
   folder that is not a checkpoint). The forward equality with ``speculators`` itself needs that package's own
   environment: ``benchmarks/speculators_check.py`` (results under ``benchmarks/results/serving``).
3. Training: ``TrainConfig(layout="eagle3")`` trains on a corpus of fused layers, lowers its loss, writes an
   EAGLE-3 head file that ``load_head`` reads back, and ``distill export --format speculators`` writes it.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from treespec.distill.cli import main as distill_main
from treespec.distill.corpus import CorpusOptions, build_corpus
from treespec.distill.inputs import DistillInputError
from treespec.distill.train import TrainConfig, export_speculators, train
from treespec.drafters import build_drafter
from treespec.drafting.base import DraftState
from treespec.drafting.compose import FirstOf
from treespec.drafting.eagle3 import Eagle3Head, default_feature_layers, new_eagle3_head
from treespec.drafting.eagle3_export import load_speculators, read_speculators, save_speculators
from treespec.drafting.head_files import is_speculators_checkpoint, load_head
from treespec.drafting.head_runner import HeadRunner
from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.features import model_features
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.tree import TokenTree
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

V = 64
LAYERS = (0, 1, 2)  # of 4 decoder layers: EAGLE-3 ids 1, 2, 3


@pytest.fixture(scope="module")
def target():
    return tiny_model("gemma3", V, seed=0, num_layers=4, logit_scale=6.0)


def _perturbed_head(target, seed=3, cls=Eagle3Head) -> Eagle3Head:
    """A new head whose norm gains all differ from 1 (so a swapped, dropped or misplaced norm shows)."""
    head = new_eagle3_head(target, torch.arange(4, 60), feature_layers=LAYERS, num_heads=4, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.mul_(8.0)  # beyond the small initial scale: the layer's output matters
    if cls is not Eagle3Head:
        twin = cls(head.cfg, head.vocab_ids)
        twin.load_state_dict(head.state_dict())
        return twin.attach(target)
    return head


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean() + eps) * w


def _rotate(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.cat([pos * inv, pos * inv])
    half = torch.cat([-x[d // 2:], x[: d // 2]])
    return x * ang.cos() + half * ang.sin()


def reference_logits(head: Eagle3Head, target, seq: list[int], depth: int) -> torch.Tensor:
    """The head's logits ``[V]`` (-inf outside its subset) at the last token of ``seq`` as a depth-``depth`` node
    (its root ``depth`` tokens back), one entry at a time: entry ``j`` (position ``j >= 1``) reads
    ``g_j = fc(aux_{j-1})`` up to the root and the previous entry's output before the final norm after it, and
    attends causally to every earlier entry of the path."""
    sd = {k: v.detach().float() for k, v in head.state_dict().items()}
    cfg = head.cfg
    h, nh, hd, eps = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rms_eps
    aux = model_features(target, torch.tensor([seq]), layers=LAYERS)[0, :, : len(LAYERS) * h].float()
    table = target.get_input_embeddings().weight.float()  # the table itself, no Gemma scale
    root = len(seq) - 1 - depth
    keys, values, prev = [], [], None
    for j in range(1, len(seq)):
        g = aux[j - 1] @ sd["fc.weight"].T if j <= root else prev
        z = torch.cat([_rms(table[seq[j]], sd["layers.0.input_layernorm.weight"], eps),
                       _rms(g, sd["layers.0.hidden_norm.weight"], eps)])
        q, k, v = (z @ sd[f"layers.0.self_attn.{n}_proj.weight"].T for n in "qkv")
        q, k, v = (t.view(nh, hd) for t in (q, k, v))
        q = torch.stack([_rotate(q[i], float(j), cfg.rope_theta) for i in range(nh)])
        keys.append(torch.stack([_rotate(k[i], float(j), cfg.rope_theta) for i in range(nh)]))
        values.append(v)
        kk, vv = torch.stack(keys, 1), torch.stack(values, 1)  # [nh, j, hd]
        w = torch.softmax((kk @ q[:, :, None]).squeeze(-1) / math.sqrt(hd), dim=-1)  # [nh, j]
        att = (w[:, :, None] * vv).sum(1).reshape(-1)
        x = g + att @ sd["layers.0.self_attn.o_proj.weight"].T
        m = _rms(x, sd["layers.0.post_attention_layernorm.weight"], eps)
        x = x + (F.silu(m @ sd["layers.0.mlp.gate_proj.weight"].T) * (m @ sd["layers.0.mlp.up_proj.weight"].T)) \
            @ sd["layers.0.mlp.down_proj.weight"].T
        prev = x
    out = torch.full((cfg.target_vocab_size,), float("-inf"))
    out[head.vocab_ids] = _rms(prev, sd["norm.weight"], eps) @ head.lm_rows.float().T
    return out


def _runner_matches_reference(head, target) -> bool:
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(2, V, (40,), generator=gen).tolist()
    prefix, root1 = text[:12], text[12]
    runner, ok = HeadRunner(head), True

    def feats(ids):
        return model_features(target, torch.tensor([ids]), layers=LAYERS)[0]

    def check(out, tree, prefix_now, nodes):
        good = True
        for row, u in enumerate(nodes):
            path = [int(tree.tokens[a]) for a in tree.root_path(u)]
            ref = reference_logits(head, target, prefix_now + path, len(path) - 1)
            good &= bool(torch.allclose(out[row], ref, atol=1e-4))
        return good

    tree1 = TokenTree.from_lists([-1, 0, 0, 1, 1, 2, 3], [root1, 7, 11, 13, 17, 19, 23], "iid")
    runner.observe(DraftState(prefix + [root1], 4, feats(prefix)))
    for level, chain in (([0], torch.tensor(prefix)), ([1, 2], None), ([3, 4, 5], None), ([6], None)):
        ok &= check(runner.forward(tree1, torch.tensor(level), chain)["logits"], tree1, prefix, level)
    runner.commit([0, 1, 3])
    committed = prefix + [root1, 7, 13]
    root2 = text[13]
    runner.observe(DraftState(committed + [root2], 4, feats(committed)[len(prefix):]))
    tree2 = TokenTree.from_lists([-1, 0, 0, 1, 2, 2], [root2, 29, 31, 37, 41, 43], "without_replacement")
    chain2 = torch.tensor(committed[runner.length:])
    for level, chain in (([0], chain2), ([1, 2], None), ([3, 4, 5], None)):
        ok &= check(runner.forward(tree2, torch.tensor(level), chain)["logits"], tree2, committed, level)
    return ok


class FeedsAfterNorm(Eagle3Head):
    """Twin: children read their parent's output after the final norm."""

    FEEDS_PRE_NORM = False


def test_runner_equals_the_layout_reference_and_its_twin_does_not(target):
    assert _runner_matches_reference(_perturbed_head(target), target)
    assert not _runner_matches_reference(_perturbed_head(target, cls=FeedsAfterNorm), target), "the twin passed"


def test_greedy_with_the_head_equals_plain(target):
    head = _perturbed_head(target)
    cfg = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(0.0), stop_on_eos=False)
    gen = torch.Generator().manual_seed(2)
    for prompt in [torch.randint(2, V, (n,), generator=gen).tolist() for n in (9, 17)] + [[5]]:
        plain = generate(target, prompt, None, cfg).token_ids
        for drafter in (ShapeDrafter(head, TreeShape.widths((2, 1, 1))),
                        FirstOf(NgramDrafter(NgramConfig(depth=3)), ShapeDrafter(head, TreeShape.chain(3)))):
            assert generate(target, prompt, drafter, cfg).token_ids == plain


def test_default_layers_are_the_engines():
    assert default_feature_layers(18) == (1, 8, 14)  # ids [2, 9, 15] on Gemma-3-270M
    assert default_feature_layers(32) == (1, 15, 28)  # ids [2, 16, 29], the engines' default on Llama-3-8B
    with pytest.raises(ValueError, match="name them"):
        default_feature_layers(4)


# ---------------------------------------------------------------------------------------------- export
LAYOUT = {  # the speculators EAGLE-3 checkpoint, for this head: H = 32, 4 heads of 8, I = 128, |S| = 56, V = 64
    "fc.weight": (32, 96), "layers.0.input_layernorm.weight": (32,), "layers.0.hidden_norm.weight": (32,),
    "layers.0.self_attn.q_proj.weight": (32, 64), "layers.0.self_attn.k_proj.weight": (32, 64),
    "layers.0.self_attn.v_proj.weight": (32, 64), "layers.0.self_attn.o_proj.weight": (32, 32),
    "layers.0.post_attention_layernorm.weight": (32,), "layers.0.mlp.gate_proj.weight": (128, 32),
    "layers.0.mlp.up_proj.weight": (128, 32), "layers.0.mlp.down_proj.weight": (32, 128), "norm.weight": (32,),
    "lm_head.weight": (56, 32), "d2t": (56,), "t2d": (64,), "embed_tokens.weight": (64, 32)}


def test_export_writes_the_speculators_layout_and_reads_back(target, tmp_path):
    from safetensors import safe_open

    head = _perturbed_head(target)
    assert (head.cfg.hidden_size, head.cfg.intermediate_size) == (32, 128)
    save_speculators(head, tmp_path / "ckpt", verifier="some/verifier", verifier_architectures=["Gemma3ForCausalLM"],
                     dtype=torch.float32)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    conf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert conf["speculators_model_type"] == "eagle3" and conf["architectures"] == ["Eagle3Speculator"]
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and conf["draft_vocab_size"] == 56
    layer = conf["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["num_attention_heads"],
            layer["num_key_value_heads"], layer["head_dim"], layer["vocab_size"]) == ("llama", 1, 4, 4, 8, 64)
    assert conf["speculators_config"]["verifier"] == {"name_or_path": "some/verifier",
                                                     "architectures": ["Gemma3ForCausalLM"]}
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as fh:
        shapes = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        d2t, t2d = fh.get_tensor("d2t"), fh.get_tensor("t2d")
    assert shapes == LAYOUT
    assert torch.equal(d2t + torch.arange(56), head.vocab_ids)  # target id = draft index + d2t
    assert t2d.dtype == torch.bool and torch.equal(torch.nonzero(t2d).flatten(), head.vocab_ids)
    loaded = load_speculators(tmp_path / "ckpt", target)
    assert is_speculators_checkpoint(tmp_path / "ckpt") and isinstance(load_head(tmp_path / "ckpt", target), Eagle3Head)
    ids = torch.randint(2, V, (1, 15), generator=torch.Generator().manual_seed(4))
    f = model_features(target, ids, layers=LAYERS)
    pos = torch.arange(1, 15)[None]
    for a, b in zip(loaded.unroll(f[:, :-1], ids[:, 1:], pos, 3), head.unroll(f[:, :-1], ids[:, 1:], pos, 3)):
        torch.testing.assert_close(loaded.logits(a), head.logits(b))
    # a second export replaces the first whole; a folder that is not a checkpoint is never overwritten
    save_speculators(head, tmp_path / "ckpt", verifier="v", embed=False)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as fh:
        assert "embed_tokens.weight" not in fh.keys()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not an EAGLE-3 checkpoint folder"):
        save_speculators(head, tmp_path / "other", verifier="v")
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep"


def _edit(folder, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    if config:
        conf = json.loads((folder / "config.json").read_text())
        config(conf)
        (folder / "config.json").write_text(json.dumps(conf))
    if tensors:
        t = load_file(str(folder / "model.safetensors"))
        tensors(t)
        save_file(t, str(folder / "model.safetensors"))


@pytest.mark.parametrize("change,match", [
    (dict(config=lambda c: c.update(norm_output=True)), "norm_output is set"),
    (dict(config=lambda c: c["transformer_layer_config"].update(num_key_value_heads=2)), "grouped-query"),
    (dict(config=lambda c: c.update(speculators_model_type="mtp")), "not a speculators EAGLE-3"),
    (dict(config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 2])), "layers >= 1"),
    (dict(config=lambda c: c["transformer_layer_config"].update(rope_scaling={"rope_type": "llama3"})),
     "rope_scaling"),
    (dict(tensors=lambda t: t["t2d"].__setitem__(3, True)), "t2d and d2t name different"),
    (dict(config=lambda c: c.update(draft_vocab_size=50)), "draft_vocab_size 50 does not match"),
    (dict(config=lambda c: c["transformer_layer_config"].update(model_type="qwen3")), "only llama"),
    (dict(config=lambda c: c["transformer_layer_config"].update(rope_parameters="x")), "must be JSON objects"),
    (dict(tensors=lambda t: t["lm_head.weight"].mul_(2)), "lm_head.weight is not this target's own"),
    (dict(tensors=lambda t: t["embed_tokens.weight"].add_(0.5)), "embed_tokens.weight is not this target's own"),
    (dict(tensors=lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :64].contiguous())), "do not match"),
])
def test_checkpoints_treespec_cannot_compute_are_refused(target, tmp_path, change, match):
    save_speculators(_perturbed_head(target), tmp_path / "ckpt", verifier="v", dtype=torch.float32)
    _edit(tmp_path / "ckpt", **change)
    with pytest.raises(ValueError, match=match):
        load_speculators(tmp_path / "ckpt", target)


def test_a_folder_without_a_checkpoint_is_refused(target, tmp_path):
    with pytest.raises(ValueError, match="not an EAGLE-3 checkpoint folder"):
        read_speculators(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not readable JSON"):
        read_speculators(tmp_path)
    save_speculators(_perturbed_head(target), tmp_path / "ckpt", verifier="v")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_head(tmp_path / "ckpt", target)


def test_the_cli_draft_reads_a_checkpoint_folder(target, tmp_path):
    head = _perturbed_head(target)
    save_speculators(head, tmp_path / "ckpt", verifier="v", dtype=torch.float32)
    head.save(tmp_path / "head.safetensors")
    for name in (str(tmp_path / "ckpt"), str(tmp_path / "head.safetensors")):
        drafter = build_drafter(name, target)
        assert isinstance(drafter.runner.head, Eagle3Head)


# ---------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def eagle3_run(target, tmp_path_factory):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, V, (n,), generator=gen).tolist() for n in (30, 41, 25, 36, 44, 28)]
    corpus = tmp_path_factory.mktemp("corpus")
    build_corpus(target, prompts, corpus, CorpusOptions(topk=0, shard_positions=80, batch_size=2,
                                                       feature_layers=LAYERS), progress=False)
    run = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(steps=40, batch_size=4, seq_len=16, lr=3e-3, warmup=5, vocab_size=48, num_heads=4,
                      intermediate_size=64, ckpt_every=20, steps_per_shard=5, depths=2, layout="eagle3",
                      feature_layers=LAYERS)
    with torch.enable_grad():
        head, summary = train(target, corpus, run, cfg, progress=False, log=lambda *_: None)
    return corpus, run, head, summary, cfg


def test_training_the_layout_lowers_its_loss_and_writes_its_files(target, eagle3_run, tmp_path):
    from treespec.distill.train import ShardSampler, compute_losses, _subset_index

    corpus, run, head, summary, cfg = eagle3_run
    assert isinstance(head, Eagle3Head) and summary["step"] == cfg.steps
    fresh = new_eagle3_head(target, head.vocab_ids, feature_layers=LAYERS, num_heads=4, intermediate_size=64,
                            seed=cfg.seed)
    batch = ShardSampler(corpus, cfg, LAYERS).batch(7)
    sub = _subset_index(head, V, torch.device("cpu"))
    with torch.no_grad():
        after, before = compute_losses(head, batch, cfg, sub)["soft"], compute_losses(fresh, batch, cfg, sub)["soft"]
    assert after < 0.95 * before  # measured 3.76 against 4.16
    loaded = load_head(run / "head.safetensors", target)
    assert isinstance(loaded, Eagle3Head) and loaded.cfg == head.cfg
    written = export_speculators(run, tmp_path / "ckpt", lambda: target, verifier="v", dtype=torch.float32)
    assert written["step"] == cfg.steps and written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    ids = torch.randint(2, V, (1, 12), generator=torch.Generator().manual_seed(6))
    f = model_features(target, ids, layers=LAYERS)
    pos = torch.arange(1, 12)[None]
    exported = load_speculators(tmp_path / "ckpt", target)
    torch.testing.assert_close(exported.logits(exported(f[:, :-1], ids[:, 1:], pos)),
                               head.logits(head(f[:, :-1], ids[:, 1:], pos)), atol=1e-5, rtol=1e-5)


def test_runs_of_another_layout_and_bad_exports_are_refused(target, eagle3_run, tmp_path):
    corpus, run, _, _, cfg = eagle3_run
    from dataclasses import replace

    with pytest.raises(DistillInputError, match="layout eagle3"):
        train(target, corpus, run, replace(cfg, layout="eagle", steps=cfg.steps + 1), progress=False,
              log=lambda *_: None)
    with pytest.raises(DistillInputError, match="layout must be one of"):
        TrainConfig(layout="medusa")
    for argv in (["--out", str(tmp_path / "x"), "--format", "speculators"],  # no --verifier
                 ["--out", str(tmp_path / "x.safetensors"), "--verifier", "v"]):  # --verifier, treespec's format
        with pytest.raises(SystemExit) as stop:
            distill_main(["export", "--run-dir", str(run), *argv])
        assert stop.value.code == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.safetensors").exists()


def test_the_export_is_readable_as_other_files_are(target, tmp_path):
    import os
    import stat

    save_speculators(_perturbed_head(target), tmp_path / "ckpt", verifier="v", dtype=torch.float32)
    mask = os.umask(0)
    os.umask(mask)
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE((tmp_path / "ckpt" / name).stat().st_mode) == 0o666 & ~mask, name
    assert stat.S_IMODE((tmp_path / "ckpt").stat().st_mode) == 0o777 & ~mask


def test_a_killed_export_is_recovered_and_other_model_folders_are_kept(target, tmp_path):
    import shutil
    import subprocess

    head = _perturbed_head(target)
    save_speculators(head, tmp_path / "ckpt", verifier="first", dtype=torch.float32)
    # a writer killed between its two moves: the old export aside, a half-built one beside it, no ckpt
    dead = subprocess.Popen(["true"])
    dead.wait()
    shutil.move(tmp_path / "ckpt", tmp_path / f".ckpt.old{dead.pid}-x")
    (tmp_path / f".ckpt.tmp{dead.pid}-y").mkdir()
    save_speculators(head, tmp_path / "other", verifier="v")  # another destination leaves them alone
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match="speculative_tokens"):
        _edit_and_save(head, tmp_path)  # the next writer of ckpt first puts the old export back ...
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["speculators_config"]["verifier"][
        "name_or_path"] == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "other"]  # ... and removes the half-built one
    # a folder holding the same two file names that is not an EAGLE-3 checkpoint is never replaced
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(FileExistsError, match="not an EAGLE-3 checkpoint folder"):
        save_speculators(head, tmp_path / "hf", verifier="v")
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == b"weights"


def _edit_and_save(head, tmp_path):
    """A writer of ``ckpt`` that fails after the recovery (bad speculative_tokens): recovery happened first."""
    save_speculators(head, tmp_path / "ckpt", verifier="v", speculative_tokens=0)


def test_the_command_line_takes_lookup_with_a_checkpoint_folder(target, tmp_path):
    from treespec.cli import CliInputError, _check_args, build_parser

    save_speculators(_perturbed_head(target), tmp_path / "ckpt", verifier="v", dtype=torch.float32)
    (tmp_path / "empty").mkdir()
    parse = build_parser().parse_args
    _check_args(parse(["generate", "hello", "--draft", f"lookup+{tmp_path / 'ckpt'}"]))  # accepted: a head folder
    with pytest.raises(CliInputError, match="no head file"):
        _check_args(parse(["generate", "hello", "--draft", f"lookup+{tmp_path / 'empty'}"]))
