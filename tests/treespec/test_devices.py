"""The engine on every device present: the exactness checks of the tree pass, the cache, greedy identity and the
sampled law, parametrised over ``cpu`` and ``cuda`` (a CUDA case skips cleanly where torch sees no GPU; the
device check, ``benchmarks/device_check.py``, runs this file on a GPU machine). Beside them, the device plumbing:
``--device`` words, the torch requirement, and the private CPU ops that a torch of the range may lack.

Tolerances: float32 throughout; logits within 1e-4 of a per-path causal forward (CPU reductions differ by about
1e-7; a GPU's float32 GEMMs by about 1e-6). The G test: seeds ``0..N-1``, N = 1200, alpha = 1e-3, over the
V^2 = 36 two-token cells (expected counts below 5 pooled), with a twin that hands the verifier a wrong draft law
and must be rejected at the same level.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from treespec.drafting.base import Draft
from trees_common import random_tree
from treespec.drafting.ngram import NgramConfig, NgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.runner import ModelRunner
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig, logits_to_probs
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                            reason="no CUDA device in this torch / machine")),
]
ATOL = 1e-4
GREEDY = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(0.0), stop_on_eos=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tree_pass_equals_per_path_forwards(device, arch):
    """ONE tree pass on ``device``: each node's logits equal a causal forward of its root path (the Gemma-3 prefix
    of 21 tokens crosses its sliding window of 8)."""
    model = tiny_model(arch, vocab_size=64, seed=0).to(device)
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(0, 64, (21,), generator=gen).to(device)
    runner = ModelRunner(model)
    runner.forward(None, None, seq[:-1])
    tree = random_tree(12, int(seq[-1]), 64, gen, device)
    logits = runner.forward(tree, torch.arange(tree.num_nodes, device=device))["logits"]  # [12, V]
    assert logits.device.type == torch.device(device).type
    for node in range(tree.num_nodes):
        path_ids = torch.cat([seq[:-1], tree.tokens[tree.root_path(node)]])
        reference = model(path_ids[None]).logits[0, -1].float()
        torch.testing.assert_close(logits[node], reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_committed_cache_equals_fresh_prefill(device):
    """30 random trees, each committed along a random path: the cache then equals a fresh prefill's."""
    model = tiny_model("gemma3", vocab_size=64, seed=1).to(device)
    gen = torch.Generator().manual_seed(11)
    runner = ModelRunner(model)
    seq = torch.randint(0, 64, (5,), generator=gen).tolist()
    runner.forward(None, None, torch.tensor(seq[:-1], device=device))
    for _ in range(30):
        tree = random_tree(int(torch.randint(1, 8, (1,), generator=gen)), seq[-1], 64, gen, device)
        runner.forward(tree, torch.arange(tree.num_nodes, device=device))
        path = tree.root_path(int(torch.randint(0, tree.num_nodes, (1,), generator=gen)))
        runner.commit(path)
        seq.extend(tree.tokens[path[1:]].tolist())
        seq.append(int(torch.randint(0, 64, (1,), generator=gen)))
    fresh = ModelRunner(model)
    fresh.forward(None, None, torch.tensor(seq[:-1], device=device))
    for mine, ref in zip(runner.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(mine.values, ref.values, atol=ATOL, rtol=0)


def _head(model):
    """A random EAGLE-style head for ``model`` (made on the CPU, moved to the target's device by ``new_head``)."""
    from treespec.drafting.head import new_head

    return new_head(model, torch.arange(model.config.vocab_size), num_heads=2, seed=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft", ["chain4", "tree221", "ngram", "head_chain", "head_dyspec"])
def test_greedy_output_identical_to_plain(device, draft):
    """Temperature 0 on ``device``: tree speculation gives plain decoding's tokens, and plain decoding gives Hugging
    Face ``generate``'s; drafts from a model, n-gram lookup and a head (a chain, and a DySpec tree)."""
    from treespec.drafters import build_tree_drafter

    model = tiny_model("gemma3", 64, seed=0, logit_scale=8).to(device)
    drafts = {
        "head_chain": lambda: ShapeDrafter(_head(model), TreeShape.chain(3), "iid"),
        "head_dyspec": lambda: build_tree_drafter("dyspec", _head(model), 8, vocab=64, max_depth=4),
        "chain4": lambda: ShapeDrafter(tiny_model("gemma3", 64, seed=1, logit_scale=8).to(device),
                                       TreeShape.chain(4), "iid"),
        "tree221": lambda: ShapeDrafter(tiny_model("gemma3", 64, seed=1, logit_scale=8).to(device),
                                        TreeShape.widths((2, 2, 1)), "iid"),
        "ngram": lambda: NgramDrafter(NgramConfig(depth=5, branches=3)),
    }
    prompt = [3, 4, 5, 6, 7, 3, 4, 5]
    plain = generate(model, prompt, None, GREEDY).token_ids
    ids = torch.tensor([prompt], device=device)
    hf = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                        attention_mask=torch.ones_like(ids))[0, len(prompt):].tolist()
    assert plain == hf
    drafter = drafts[draft]()
    assert generate(model, prompt, drafter, GREEDY).token_ids == plain
    runner = getattr(drafter, "runner", None)
    if runner is not None:  # the draft computes where the target does
        assert torch.device(runner.device).type == torch.device(device).type


V = 6
PROMPT = [1, 2, 3]
N = 1200
ALPHA = 1e-3


def _exact_two_token_law(model, sampling: SamplingConfig, device: str) -> dict[tuple[int, int], float]:
    """P(x1, x2 | prompt) of the target, from one batched forward over every first token."""
    ids = torch.tensor([PROMPT + [a] for a in range(V)], device=device)  # [V, len + 1]
    probs = logits_to_probs(model(ids).logits[:, -2:].float(), sampling).double().cpu()  # [V, 2, V]
    return {(a, b): float(probs[a, 0, a] * probs[a, 1, b]) for a, b in itertools.product(range(V), repeat=2)}


class _WrongLaw(ShapeDrafter):
    """The broken twin: drafts from the model, but tells the verifier its drafts came from the uniform law."""

    def propose(self, state, sampling, generator):
        draft = super().propose(state, sampling, generator)
        if draft.draft_probs is None:  # nothing drafted (the last token)
            return draft
        return Draft(draft.tree, torch.full_like(draft.draft_probs, 1.0 / draft.draft_probs.shape[-1]))


def _counts(target, make_drafter, sampling: SamplingConfig) -> dict[tuple[int, int], int]:
    counts: dict[tuple[int, int], int] = {}
    for seed in range(N):
        out = generate(target, PROMPT, make_drafter(), GenerationConfig(max_new_tokens=2, sampling=sampling,
                                                                        stop_on_eos=False, seed=seed))
        key = tuple(out.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.stats
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("broken", [False, True], ids=["rrs", "wrong_draft_law_twin"])
def test_sampled_law_is_the_targets(device, broken):
    """T = 1, trees of widths (3, 2) verified by recursive rejection sampling on ``device``: the law of the first two
    tokens is the target's (G test); the twin's is not."""
    from stats_helpers import g_test_law  # its p-value runs without scipy too (the device check's machines)

    sampling = SamplingConfig(1.0)
    target = tiny_model("llama", V, seed=0, logit_scale=6.0).to(device)
    draft_model = tiny_model("llama", V, seed=5, logit_scale=6.0).to(device)
    kind = _WrongLaw if broken else ShapeDrafter
    counts = _counts(target, lambda: kind(draft_model, TreeShape.widths((3, 2)), "iid"), sampling)
    p = g_test_law(counts, _exact_two_token_law(target, sampling, device), N)
    if broken:
        assert p < ALPHA, f"the broken twin passed (p = {p:.3g})"
    else:
        assert p > ALPHA, f"p = {p:.3g}"


def test_g_test_p_value_without_scipy_equals_scipys(monkeypatch):
    """The G test's chi-square tail from torch (where scipy is absent) is scipy's."""
    import sys

    import stats_helpers

    pytest.importorskip("scipy")
    cases = [(0.5, 1), (3.2, 4), (35.0, 10), (80.0, 20), (200.0, 35)]
    with_scipy = [stats_helpers.chi2_sf(g, df) for g, df in cases]
    monkeypatch.setitem(sys.modules, "scipy", None)
    without = [stats_helpers.chi2_sf(g, df) for g, df in cases]
    assert without == pytest.approx(with_scipy, rel=1e-9, abs=1e-300)


# ---------------------------------------------------------------------- the device plumbing
def test_device_words(monkeypatch):
    """``--device`` words: auto follows what torch sees; a device this machine lacks or a word that names none is
    refused in one line naming it."""
    from treespec.models.loading import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device(None) == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'cuda'.*sees no CUDA device"):
        resolve_device("cuda")
    for word in ("gpu", "cpu:0", "cuda:x", "cuda:-1", ""):
        with pytest.raises(ValueError, match="unknown device"):
            resolve_device(word)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda:0")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match="2 CUDA device"):
        resolve_device("cuda:2")


def test_cli_refuses_a_device_it_cannot_use(monkeypatch, capsys):
    """Exit 2 and one line, before any model loads: CUDA where there is none, a bad word, int4 (a CPU kernel) on a
    GPU, and a GPU for a GGUF target (llama.cpp computes on the CPU here)."""
    from treespec.cli import main as cli_main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, message in ((["--device", "cuda"], "sees no CUDA device"), (["--device", "tpu"], "unknown device")):
        assert cli_main(["generate", "hi", "--target", "unused", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli_main(["generate", "hi", "--device", "cuda", "--quantize", "int4", "--dtype", "bfloat16"]) == 2
    assert "int4 CPU kernel" in capsys.readouterr().err
    assert cli_main(["generate", "hi", "--device", "cuda", "--quantize", "int8-head", "--dtype", "float32"]) == 2
    assert "int8 CPU kernel" in capsys.readouterr().err
    assert cli_main(["generate", "hi", "--target", "embedded-gguf", "--device", "cuda"]) == 2
    assert "--device applies to PyTorch targets" in capsys.readouterr().err


def test_torch_requirement_keeps_a_users_cuda_build():
    """pyproject's torch requirement is a range that a CUDA build of any release in it satisfies (pip then keeps
    the installed torch), and that rejects releases below transformers' floor."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    (torch_req,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    for version in ("2.6.0+cu124", "2.9.1+cu128", "2.13.0", "2.13.0+cpu", "2.13.0+cu130", "2.14.0+cu130"):
        assert torch_req.specifier.contains(version), version
    assert not torch_req.specifier.contains("2.5.1+cu121")


def test_missing_private_cpu_ops_are_detected(monkeypatch):
    """A torch of the range without the int4 kernel: quantising is refused by name, and the shipped head's int4
    default falls back to its own weights; without oneDNN's packing op the plain bf16 product runs."""
    from treespec.models.fast import packed, quant

    assert quant.int4_kernel_missing() is None  # this torch has it
    monkeypatch.setattr(quant, "INT4_OPS", (*quant.INT4_OPS, "_no_such_int4_op"))
    assert "_no_such_int4_op" in quant.int4_kernel_missing()
    with pytest.raises(ValueError, match="cannot quantise to int4: torch .* has no _no_such_int4_op"):
        quant.quantize_int4(torch.zeros(16, 32, dtype=torch.bfloat16))

    def missing(_w):
        raise AttributeError("'_OpNamespace' 'mkldnn' object has no attribute '_reorder_linear_weight'")

    packed.bf16_packing_supported.cache_clear()
    monkeypatch.setattr(packed, "pack_weight", missing)
    try:
        assert packed.bf16_packing_supported() is False
        assert packed.prepack_default(torch.bfloat16, "cpu") is False
    finally:
        packed.bf16_packing_supported.cache_clear()


def test_head_files_load_on_the_targets_device(tmp_path):
    """A head file loads where its target computes (a GPU target's head on the GPU), unless told otherwise."""
    from treespec.drafting.head import EagleHead

    model = tiny_model("llama", 64, seed=0)
    path = tmp_path / "head.safetensors"
    _head(model).save(path)
    assert EagleHead.load(path, model).lm_rows.device == torch.device("cpu")
    meta = EagleHead.load(path, None, device="meta")
    assert next(meta.parameters()).device == torch.device("meta")
    if torch.cuda.is_available():
        loaded = EagleHead.load(path, model.to("cuda"))
        assert {p.device.type for p in loaded.parameters()} == {"cuda"} and loaded.lm_rows.device.type == "cuda"


def test_ngram_trees_are_built_on_the_targets_device():
    """A drafter without a model of its own builds its tree where the target runner's inputs live."""
    from treespec.drafting.base import DraftState, tree_device

    runner = ModelRunner(tiny_model("llama", 64, seed=0))
    state = DraftState([1, 2, 3, 1, 2], 4, None, runner)
    assert tree_device(state, None) == runner.device
    assert tree_device(DraftState([1], 4), None) == torch.device("cpu")
    assert tree_device(state, "meta") == torch.device("meta")
    draft = NgramDrafter(NgramConfig(depth=3, branches=1)).propose(state, SamplingConfig(0.0), None)
    assert draft.tree.tokens.device == runner.device
