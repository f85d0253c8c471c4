"""The llama.cpp target runner (:class:`treespec.models.llama_cpp.LlamaCppRunner`) on tiny GGUFs written in-process.

Its fast path (one decode for a whole tree, paths as sequence ids) is checked against the slow, obvious
reference: a causal pass over each node's root path in a fresh cache. Then the cache after a commit
against a fresh prefill, greedy identity with the runner's own plain decoding, and (marked ``stats``)
the exact-law G tests of ``test_end_to_end_stats`` on this backend, with their broken-verifier twin.
"""

import math

import pytest
import torch

from treespec.models.llama_cpp import llama_cpp_available

if llama_cpp_available() is not None:  # the runner's tests need the native library
    pytest.skip(llama_cpp_available(), allow_module_level=True)

from treespec.drafting.ngram import NgramConfig, NgramDrafter  # noqa: E402
from treespec.generate import GenerationConfig, generate  # noqa: E402
from treespec.models.llama_cpp import LlamaCppRunner  # noqa: E402
from treespec.models.tiny import GGUF_ARCHITECTURES, tiny_gguf  # noqa: E402
from treespec.sampling import SamplingConfig  # noqa: E402
from treespec.tree import TokenTree  # noqa: E402

#: about three times llama.cpp's own noise between one batched pass and token-by-token passes over the
#: same 13 tokens of these tiny float32 models (max |dlogit| 0.003 llama, 0.010 gemma3, on logits of
#: standard deviation ~16; the cache holds keys and values in float16, so batching rounds differently)
ATOL = 0.03

# a tree with two branches at the root and a second branching below: 8 nodes, 4 leaves
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


@pytest.fixture(scope="module", params=GGUF_ARCHITECTURES)
def runner(request, tmp_path_factory):
    path = tiny_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", request.param, vocab_size=48,
                     seed=1, logit_scale=4.0)
    r = LlamaCppRunner(path, context=256, threads=1)
    yield r
    r.close()


def causal_logits(runner: LlamaCppRunner, ids: list[int]) -> torch.Tensor:
    """``[len(ids), V]``: one causal prefill of ``ids`` in a fresh cache, logits of every position."""
    runner.reset()
    return runner.forward(None, None, torch.tensor(ids))["logits"]


def tree_of(prefix_len: int, seed: int, vocab: int) -> TokenTree:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, vocab, (len(PARENTS),), generator=g)
    return TokenTree(torch.tensor(PARENTS), tokens)


@pytest.mark.parametrize("prefix_len", [3, 9])  # 9 > the gemma3 model's 4-token window: sliding layers matter
def test_tree_pass_equals_per_path_causal_passes(runner, prefix_len):
    prefix = [1] + [3 + (7 * i) % 40 for i in range(prefix_len - 1)]
    tree = tree_of(prefix_len, prefix_len, runner.vocab_size)
    runner.reset()
    runner.forward(None, None, torch.tensor(prefix), need_logits=False)
    out = runner.forward(tree, torch.arange(tree.num_nodes), need_hidden=True)
    assert out["logits"].shape == (tree.num_nodes, runner.vocab_size)
    assert out["hidden"].shape == (tree.num_nodes, runner.hidden_size)
    for node in range(tree.num_nodes):
        path = tree.root_path(node)
        ref = causal_logits(runner, prefix + tree.tokens[path].tolist())[-1]
        torch.testing.assert_close(out["logits"][node], ref, atol=ATOL, rtol=0)


def test_hidden_capture_equals_embeddings_output(runner):
    """``capture_hidden`` reads ``result_norm`` from the running graph (fixed offsets into ggml's tensor struct):
    the same hidden states as llama.cpp's embeddings output, the same logits, and a prefill without logits."""
    capture = LlamaCppRunner(runner.path, context=256, threads=1, capture_hidden=True)
    prefix = torch.tensor([1, 6, 7, 8, 9, 10])
    tree = tree_of(6, 2, runner.vocab_size)
    outs = []
    for r in (runner, capture):
        r.reset()
        pre = r.forward(None, None, prefix, need_logits=False, need_hidden=True)
        out = r.forward(tree, torch.arange(tree.num_nodes), need_hidden=True)
        r.commit([0])
        outs.append((pre["hidden"], out["hidden"], out["logits"]))
    capture.close()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert outs[1][0].shape == (len(prefix), runner.hidden_size)


@pytest.mark.parametrize("capture_hidden, even_outputs", [(False, False), (False, True), (True, False), (True, True)])
def test_rows_pass_returns_the_rows_of_the_full_pass(runner, capture_hidden, even_outputs, monkeypatch):
    """``rows`` (the verified nodes, 5 of 8): llama.cpp outputs those tokens alone (with ``even_outputs``, one more
    whose row is dropped), with the logits and hidden states the full pass gives them; in both ways of reading
    hidden states (embeddings output, graph capture)."""
    r = LlamaCppRunner(runner.path, context=256, threads=1, capture_hidden=capture_hidden, even_outputs=even_outputs)
    prefix = torch.tensor([1, 6, 7, 8, 9, 10])
    tree = tree_of(6, 4, runner.vocab_size)
    rows = tree.verified_nodes
    assert rows.numel() == 5
    fill, flagged = LlamaCppRunner._fill, []

    def spy(self, tokens, positions, seq_ids, outputs):
        flagged.append(sum(outputs) if isinstance(outputs, list) else len(tokens) * bool(outputs))
        return fill(self, tokens, positions, seq_ids, outputs)

    monkeypatch.setattr(LlamaCppRunner, "_fill", spy)
    outs = []
    for picked in (None, rows):
        r.reset()
        r.forward(None, None, prefix, need_logits=False)
        outs.append(r.forward(tree, torch.arange(tree.num_nodes), need_hidden=True, rows=picked))
        r.commit([0])
    r.close()
    assert flagged[-1] == (6 if even_outputs else 5)
    full, part = outs
    assert part["logits"].shape == (rows.numel(), runner.vocab_size) and rows.numel() < tree.num_nodes
    torch.testing.assert_close(part["logits"], full["logits"][rows], atol=ATOL, rtol=0)
    torch.testing.assert_close(part["hidden"], full["hidden"][rows], atol=1e-3, rtol=0)


def test_rows_are_checked(runner):
    runner.reset()
    runner.forward(None, None, torch.tensor([1, 5, 6]), need_logits=False)
    tree = tree_of(3, 1, runner.vocab_size)
    for bad in ([2, 1], [0, 0], [0, tree.num_nodes]):
        with pytest.raises(ValueError, match="rows must be ascending"):
            runner.forward(tree, torch.arange(tree.num_nodes), rows=torch.tensor(bad))
    assert runner.slots == [] and runner.cache_length == 3  # refused before any decode


def test_broken_tree_encoding_is_caught(runner, monkeypatch):
    """The twin: a tree pass whose nodes carry every path id (so each sees its cousins) must fail the
    comparison above."""
    prefix = [1, 5, 9, 13]
    tree = tree_of(4, 0, runner.vocab_size)
    fill = LlamaCppRunner._fill

    def leaky(self, tokens, positions, seq_ids, outputs):
        if len(tokens) == tree.num_nodes and len(seq_ids[0]) > 1:
            seq_ids = [seq_ids[0]] * len(seq_ids)
        return fill(self, tokens, positions, seq_ids, outputs)

    monkeypatch.setattr(LlamaCppRunner, "_fill", leaky)
    runner.reset()
    runner.forward(None, None, torch.tensor(prefix), need_logits=False)
    out = runner.forward(tree, torch.arange(tree.num_nodes))
    runner.commit([0])
    monkeypatch.undo()
    worst = max(float((out["logits"][j] - causal_logits(runner, prefix + tree.tokens[tree.root_path(j)].tolist())[-1])
                      .abs().max()) for j in range(tree.num_nodes))
    print(f"broken encoding: max |dlogit| {worst:.3f}")
    assert worst > 10 * ATOL


@pytest.mark.parametrize("kept", [[0], [0, 1], [0, 1, 3, 6], [0, 2, 5, 7]])
def test_cache_after_commit_equals_fresh_prefill(runner, kept):
    prefix = [1, 4, 8, 15, 16, 23, 42 % runner.vocab_size]
    tree = tree_of(len(prefix), 3, runner.vocab_size)
    runner.reset()
    runner.forward(None, None, torch.tensor(prefix), need_logits=False)
    runner.forward(tree, torch.arange(tree.num_nodes))
    runner.commit(kept)
    assert runner.length == len(prefix) + len(kept) == runner.cache_length
    nxt = torch.tensor([7, 11])  # the next step's tokens, as a chain
    after = runner.forward(None, None, nxt)["logits"]
    committed = prefix + tree.tokens[kept].tolist()
    ref = causal_logits(runner, committed + nxt.tolist())[-2:]
    torch.testing.assert_close(after, ref, atol=ATOL, rtol=0)


def test_commit_refuses_a_non_path(runner):
    runner.reset()
    runner.forward(None, None, torch.tensor([1, 5, 6]), need_logits=False)
    tree = tree_of(3, 1, runner.vocab_size)
    runner.forward(tree, torch.arange(tree.num_nodes))
    with pytest.raises(ValueError, match="root path"):
        runner.commit([0, 2, 3])  # 3 is a child of 1, not of 2
    runner.commit([0])


def test_refusals_name_the_problem(runner, tmp_path):
    runner.reset()
    with pytest.raises(ValueError, match="vocabulary"):
        runner.forward(None, None, torch.tensor([1, runner.vocab_size]))
    wide = TokenTree(torch.tensor([-1] + [0] * 70), torch.full((71,), 5))
    runner.reset()
    with pytest.raises(ValueError, match="leaves"):
        runner.forward(wide, torch.arange(71))
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF"):
        LlamaCppRunner(bad)
    with pytest.raises(FileNotFoundError):
        LlamaCppRunner(tmp_path / "missing.gguf")


def test_extra_buffers_follow_the_cpu_unless_asked(runner, monkeypatch):
    """The runner loads with llama.cpp's extra buffer types where :func:`default_extra_buffers` allows them (off on
    an AMX CPU, where llama.cpp's AMX product crashed on batched decodes), or as asked; these float32 tensors are
    never repacked, so the logits do not change."""
    from treespec.models import llama_cpp

    ids = torch.tensor([1, 5, 9, 5, 9, 12])
    runner.reset()
    reference = runner.forward(None, None, ids)["logits"]
    assert runner.extra_buffers is llama_cpp.default_extra_buffers()
    for default in (True, False):
        monkeypatch.setattr(llama_cpp, "default_extra_buffers", lambda: default)
        for asked in (None, True, False):
            other = LlamaCppRunner(runner.path, context=64, threads=1, extra_buffers=asked)
            try:
                assert other.extra_buffers is (default if asked is None else asked)
                assert torch.allclose(other.forward(None, None, ids)["logits"], reference, atol=ATOL)
            finally:
                other.close()


@pytest.mark.gemma
def test_batched_decode_of_the_embedded_gguf_runs():
    """A decode of eight tokens and a tree pass on the embedded Q4_K_M GGUF (the tensor types llama.cpp's repacked
    kernels take) with the runner's default model parameters, in a child process, so that a crash inside
    llama.cpp fails this test instead of ending the test run. On an Intel Xeon with AMX this process died with
    a segmentation fault (return code -11) before :func:`~treespec.models.llama_cpp.default_extra_buffers`."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from treespec.models.llama_cpp import LlamaCppRunner\n"
            "from treespec.models.loading import embedded_gguf\n"
            "from treespec.tree import TokenTree\n"
            "r = LlamaCppRunner(embedded_gguf(), context=64, threads=1)\n"
            "out = r.forward(None, None, torch.arange(1000, 1008))\n"
            "tree = TokenTree(torch.tensor([-1, 0, 0, 1]), torch.tensor([7, 8, 9, 10]))\n"
            "rows = r.forward(tree, torch.arange(4))['logits']\n"
            "r.commit([0, 1])\n"
            "assert out['logits'].shape == (8, r.vocab_size) and rows.shape == (4, r.vocab_size)\n"
            "assert torch.isfinite(rows).all() and r.cache_length == 10\n"
            "print('ok', r.extra_buffers)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), (proc.returncode, proc.stderr[-2000:])


def test_greedy_identity_with_own_plain_decoding(runner):
    """n-gram trees (several branches) at T=0 give exactly the runner's own plain greedy output: tiny
    float32 models have no near-ties at the batch noise's scale."""
    prompt = [1, 5, 9, 5, 9, 5, 9, 12]
    cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)
    plain = generate(runner, prompt, None, cfg)
    drafter = NgramDrafter(NgramConfig(min_ngram=1, depth=4, branches=3))
    spec = generate(runner, prompt, drafter, cfg)
    assert spec.token_ids == plain.token_ids
    assert spec.target_calls < plain.target_calls  # the trees were accepted somewhere
    assert math.isclose(plain.tau, 1.0)
    lean = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False, leaf_logits=False)
    spec = generate(runner, prompt, NgramDrafter(NgramConfig(min_ngram=1, depth=4, branches=3)), lean)
    assert spec.token_ids == plain.token_ids  # the target's rows of the verified nodes alone
    assert spec.target_calls < plain.target_calls


# ---------------------------------------------------------------------------------------------- exact law
# The G tests of test_end_to_end_stats on this backend: a tiny GGUF target of 6 tokens (the three special
# ones included: they are ordinary ids to the verifier) and a tiny Hugging Face draft of the same vocabulary.
# The law of the first three generated tokens after PROMPT, over seeds 0..N-1, against the exact law computed
# from the runner's own causal passes; G test on the 216 cells (expected counts < 5 pooled), alpha 1e-3.
# Power as there: at N = 1500 a total-variation shift >= 0.076 is detected with probability 0.9 (df 10).
V6, N, ALPHA = 6, 1500, 1e-3
PROMPT = [1, 3, 4]


@pytest.fixture(scope="module")
def law_setup(tmp_path_factory):
    from treespec.models.tiny import tiny_model

    path = tiny_gguf(tmp_path_factory.mktemp("gguf6") / "v6.gguf", "gemma3", vocab_size=V6, seed=3, logit_scale=2.0)
    target = LlamaCppRunner(path, context=64, threads=1)
    draft = tiny_model("llama", V6, seed=5, logit_scale=6.0)
    yield target, draft
    target.close()


def runner_law(runner: LlamaCppRunner, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    from treespec.sampling import logits_to_probs

    law = {}
    for a in range(V6):
        for b in range(V6):
            probs = logits_to_probs(causal_logits(runner, PROMPT + [a, b])[-3:], sampling).double()  # [3, V]
            for c in range(V6):
                law[(a, b, c)] = float(probs[0, a] * probs[1, b] * probs[2, c])
    return law


def law_counts(runner, make_drafter, verifier: str, sampling: SamplingConfig, leaf_logits: bool = True) -> dict:
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(N):
        cfg = GenerationConfig(max_new_tokens=3, sampling=sampling, seed=seed, stop_on_eos=False, verifier=verifier,
                               leaf_logits=leaf_logits)
        key = tuple(generate(runner, PROMPT, make_drafter(), cfg).token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


LAW_CASES = {  # case: (per-depth widths, draft law, sampling)
    "rrs": ((3, 2), "iid", SamplingConfig(1.0)),
    "rrs_without_replacement": ((3, 2), "without_replacement", SamplingConfig(0.8, top_p=0.9)),
    "greedy_draft": ((3, 2), "greedy_draft", SamplingConfig(1.0)),
    # the target's rows of the verified nodes alone (GenerationConfig(leaf_logits=False))
    "rrs_no_leaf_rows": ((3, 2), "iid", SamplingConfig(1.0)),
}


@pytest.mark.stats
@pytest.mark.parametrize("case", sorted(LAW_CASES))
def test_first_three_tokens_follow_target_law(law_setup, case):
    from stats_helpers import g_test_law

    from treespec.trees.grow import ShapeDrafter
    from treespec.trees.shape import TreeShape

    target, draft = law_setup
    widths, law, sampling = LAW_CASES[case]
    verifier = case.removesuffix("_no_leaf_rows")
    counts = law_counts(target, lambda: ShapeDrafter(draft, TreeShape.widths(widths), law), verifier, sampling,
                        leaf_logits=not case.endswith("_no_leaf_rows"))
    p_value = g_test_law(counts, runner_law(target, sampling), N)
    assert p_value > ALPHA, f"{case} on llama.cpp: output law differs from the target's (G-test p = {p_value:.2e})"


@pytest.mark.stats
def test_broken_verifier_fails_the_same_test(law_setup, monkeypatch):
    """The twin: RRS that forgets to update its residual after a rejection must be rejected."""
    from stats_helpers import g_test_law
    from test_end_to_end_stats import _broken_rrs_rule

    from treespec import verify as verify_mod
    from treespec.trees.grow import ShapeDrafter
    from treespec.trees.shape import TreeShape
    from treespec.verify.core import verify_tree

    target, draft = law_setup
    monkeypatch.setitem(verify_mod.VERIFIERS, "rrs",
                        lambda tree, tp, dp, g=None: verify_tree(tree, tp, dp, g, _broken_rrs_rule))
    widths, law, sampling = LAW_CASES["rrs"]
    counts = law_counts(target, lambda: ShapeDrafter(draft, TreeShape.widths(widths), law), "rrs", sampling)
    p_value = g_test_law(counts, runner_law(target, sampling), N)
    assert p_value < ALPHA, f"the broken verifier was not detected on llama.cpp (p = {p_value:.3f})"


# ------------------------------------------------------------------------------------------------ the CLI
@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
def test_cli_generates_on_a_gguf_target(arch, tmp_path, capsys):
    """`treespec generate --target x.gguf` runs n-gram drafting on any GGUF llama.cpp loads (both tiny
    architectures, with byte tokens so that llama.cpp tokenizes the text), and --json names the runner."""
    import json

    from treespec.cli import main

    path = tiny_gguf(tmp_path / f"{arch}.gguf", arch, vocab_size=300, seed=2, logit_scale=4.0)
    code = main(["generate", "abab abab abab", "--target", str(path), "--max-new-tokens", "12", "--draft", "ngram",
                 "--no-stop", "--json", "--threads", "1"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    stats = out["statistics"]
    assert stats["runner"] == "llama.cpp" and stats["method"] == "NgramDrafter"
    assert len(out["token_ids"]) == 12


def test_cli_leaf_logits_keeps_the_greedy_output(tmp_path, capsys, monkeypatch):
    """``--leaf-logits off`` / ``on`` / ``auto`` give the same greedy tokens; the option reaches the engine (a
    spy on the runner's ``rows``), ``auto`` follows :data:`treespec.drafters.DEFAULT_LEAF_LOGITS`."""
    import json

    from treespec import drafters
    from treespec.cli import main

    path = tiny_gguf(tmp_path / "llama.gguf", "llama", vocab_size=300, seed=2, logit_scale=4.0)
    forward, asked = LlamaCppRunner.forward, []

    def spy(self, tree, nodes, chain=None, **kw):
        if tree is not None:
            asked.append(kw.get("rows") is not None)
        return forward(self, tree, nodes, chain, **kw)

    monkeypatch.setattr(LlamaCppRunner, "forward", spy)
    outs = {}
    for value in ("on", "off", "auto"):
        asked.clear()
        assert main(["generate", "abab abab abab", "--target", str(path), "--max-new-tokens", "12", "--draft",
                     "ngram", "--no-stop", "--json", "--threads", "1", "--leaf-logits", value]) == 0
        outs[value] = json.loads(capsys.readouterr().out)["token_ids"]
        expected = {"on": True, "off": False, "auto": drafters.default_leaf_logits(str(path), "ngram")}[value]
        assert any(asked) != expected, value  # rows asked for on some pass exactly when leaf logits are off
    assert outs["on"] == outs["off"] == outs["auto"]


@pytest.mark.parametrize("argv, message", [
    (["--target", "missing.gguf"], "no GGUF file"),
    (["--quantize", "int4"], "--quantize applies to PyTorch targets"),
    (["--exact"], "--exact applies to PyTorch targets"),
    (["--draft", "head"], "reads the hidden states of the embedded"),
    (["--draft", "early-exit:4"], "needs a PyTorch target"),
])
def test_cli_refuses_what_a_gguf_target_cannot_do(runner, capsys, argv, message):
    from treespec.cli import main

    if argv[0] != "--target":
        argv = ["--target", str(runner.path), *argv]
    assert main(["generate", "hello", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_failed_tree_pass_leaves_the_prefix_alone(runner, monkeypatch):
    """A tree decode that fails (here: llama_decode returns an error) drops its path ids: the next pass sees the
    committed prefix only, as a fresh prefill would."""
    prefix = [1, 4, 9, 16]
    tree = tree_of(4, 5, runner.vocab_size)
    runner.reset()
    runner.forward(None, None, torch.tensor(prefix), need_logits=False)
    real = runner._ll.llama_decode
    monkeypatch.setattr(runner._ll, "llama_decode", lambda ctx, batch: 1)
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        runner.forward(tree, torch.arange(tree.num_nodes))
    monkeypatch.setattr(runner._ll, "llama_decode", real)
    assert runner.slots == [] and runner.tree is None and runner.length == len(prefix)
    out = runner.forward(tree, torch.arange(tree.num_nodes))["logits"]
    runner.commit([0])
    ref = causal_logits(runner, prefix + tree.tokens[tree.root_path(7)].tolist())[-1]
    torch.testing.assert_close(out[7], ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("argv, message", [
    (["--draft", "ngram:8,64"], "leaves"),
    (["--draft", "head", "--tree", "8,8"], "reads the hidden states"),
])
def test_cli_checks_tree_limits_of_a_gguf_target(runner, capsys, argv, message):
    from treespec.cli import main

    assert main(["generate", "hello", "--target", str(runner.path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_options_that_ask_for_speculation_are_followed_on_gguf():
    """--tree / --law / --min-confidence on a GGUF target pick a drafter that follows them, never plain decoding."""
    import torch as _torch

    from treespec.cli import _resolved_draft, build_parser

    def resolved(*argv):
        return _resolved_draft(build_parser().parse_args(["generate", "x", "--target", "embedded-gguf", *argv]),
                               _torch.float32)

    assert resolved() == "none"  # the measured default in float32
    assert resolved("--tree", "8,4") == "head"  # --tree shapes a head: the shipped one fits the embedded GGUF
    assert resolved("--temperature", "1", "--law", "iid") == "head"
    assert resolved("--temperature", "1", "--min-confidence", "0.3") == "head"
