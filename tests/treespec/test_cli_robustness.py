"""CLI and configuration robustness: every refused input gives one named error on stderr, exit code 2,
and nothing on stdout. These cases are all decided before any model is loaded (no download)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import save

from treespec.cli import MAX_TREE_NODES, main as cli_main, tree_nodes
from treespec.drafting.head import EagleHead, new_head
from treespec.drafting.medusa import MedusaHeads, new_medusa_heads
from treespec.generate import GenerationConfig
from treespec.models.tiny import tiny_model
from tests.treespec.test_cli_exact import tiny_dir  # noqa: F401  (fixture)
from tests.treespec.test_cli_first_use import stubbed_gguf  # noqa: F401  (fixture)
from treespec.sampling import MIN_TEMPERATURE, SamplingConfig, logits_to_probs


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["generate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(capsys, *argv: str, match: str) -> str:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (code, err)
    assert out == "", out
    assert match in err, err
    assert "Traceback" not in err
    return err


def test_greedy_verifier_at_positive_temperature_is_refused(capsys):
    with pytest.raises(ValueError, match="verifier 'greedy' needs temperature 0"):
        GenerationConfig(sampling=SamplingConfig(1.0), verifier="greedy")
    GenerationConfig(sampling=SamplingConfig(0.0), verifier="greedy")  # fine
    # sampling verifiers at T = 0 stay accepted: target and draft are one-hot, so every such rule
    # accepts exactly the argmax (tested end to end in test_sampling_verifiers_at_t0_equal_greedy)
    GenerationConfig(sampling=SamplingConfig(0.0), verifier="rrs")
    assert_refused(capsys, "hello", "--temperature", "1", "--verifier", "greedy", match="needs temperature 0")


def test_sampling_verifiers_at_t0_equal_greedy():
    from treespec.drafting.ngram import NgramDrafter
    from treespec.generate import generate

    target = tiny_model("llama", 16, seed=1)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain = generate(target, prompt, None, GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(0.0)))
    for verifier in ("deterministic",):
        out = generate(target, prompt, NgramDrafter(),
                       GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(0.0), verifier=verifier))
        assert out.token_ids == plain.token_ids, verifier


def test_tiny_temperature_and_top_p_are_handled():
    with pytest.raises(ValueError, match=f"or >= {MIN_TEMPERATURE}"):
        SamplingConfig(1e-40)
    logits = torch.tensor([[3.0, 1.0, 0.5, -2.0]])
    probs = logits_to_probs(logits, SamplingConfig(1.0, top_p=1e-300))  # 1e-300 is 0 in float32
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    probs = logits_to_probs(logits * 1e4, SamplingConfig(MIN_TEMPERATURE))
    assert bool(torch.isfinite(probs).all())


@pytest.mark.parametrize("argv, match", [
    (["--threads", "-1"], "--threads must be a positive integer"),
    (["--threads", "0"], "--threads must be a positive integer"),
    (["--draft", "ngrams"], "unknown --draft 'ngrams': expected one of auto, lookup+head"),
    (["--draft", "/nonexistent/dir/x.safetensors"], "no head file"),
    (["--draft", "lookup+/nonexistent/h.safetensors"], "no head file"),
    (["--tree", "64,64,64", "--draft", "head", "--temperature", "1", "--min-confidence", "0"],
     f"asks for 266304 draft nodes; the limit is {MAX_TREE_NODES}"),
    (["--exact", "--dtype", "bfloat16"], "--exact needs float32"),
    (["--temperature", "1e-40"], "temperature must be 0 (greedy) or >="),
    (["--threads", "1000000"], "--threads 1000000: this process may run on"),
    (["--seed", "-1"], "seed must be None or an integer in [0, 2**64 - 1]"),
    (["--seed", str(2**64)], "seed must be None or an integer in [0, 2**64 - 1]"),
])
def test_cli_refuses_before_loading(capsys, argv, match):
    start = time.perf_counter()
    assert_refused(capsys, "hello", *argv, match=match)
    assert time.perf_counter() - start < 5  # never a hub lookup


def test_non_utf8_prompt(capsys):
    assert_refused(capsys, "caf\udce9", match="not valid UTF-8")


def test_tree_nodes():
    assert tree_nodes((2, 2, 1)) == 2 + 4 + 4
    assert tree_nodes((64, 64, 64)) == 64 + 64**2 + 64**3


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", 64, seed=0)


def _head_file(tmp_path, target, *, config_edit=None, drop=None, truncate=None, garbage=False):
    head = new_head(target, torch.arange(0, 64, 2))
    path = tmp_path / "h.safetensors"
    head.save(path)
    if garbage:
        path.write_bytes(b"not a safetensors file at all" * 10)
    if truncate:
        path.write_bytes(path.read_bytes()[:truncate])
    if config_edit or drop:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
        config = json.loads(meta["config"])
        config.update(config_edit or {})
        for key in drop or ():
            config.pop(key)
        meta["config"] = json.dumps(config)
        path.write_bytes(save(tensors, metadata=meta))
    return path


@pytest.mark.parametrize("kind, match", [
    ({"garbage": True}, "is not a readable treespec EAGLE head"),
    ({"truncate": 200}, "is not a readable treespec EAGLE head"),
    ({"config_edit": {"bogus": 1}}, "unknown keys ['bogus']"),
    ({"drop": ["hidden_size"]}, "missing keys ['hidden_size']"),
    ({"config_edit": {"intermediate_size": 2_000_000_000}}, "tensors do not match its config"),
    ({"config_edit": {"intermediate_size": 2e9}}, "is not a positive integer"),
])
def test_bad_head_files_are_named_before_allocation(tmp_path, target, kind, match):
    import resource

    path = _head_file(tmp_path, target, **kind)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError) as info:
        EagleHead.load(path, target)
    assert match in str(info.value)
    # intermediate_size = 2e9 in fp32 would be > 8 GB per matrix; allow 200 MB of growth (KB units on Linux)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000


def test_missing_head_file(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="no EAGLE head file"):
        EagleHead.load(tmp_path / "absent.safetensors", target)


def test_bad_medusa_file(tmp_path, target):
    heads = new_medusa_heads(target, torch.arange(0, 64, 2), num_heads=2)
    path = tmp_path / "m.safetensors"
    heads.save(path)
    MedusaHeads.load(path, target)  # the good file loads
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    config = json.loads(meta["config"])
    config["hidden_size"] = 1 << 30
    meta["config"] = json.dumps(config)
    path.write_bytes(save(tensors, metadata=meta))
    with pytest.raises(ValueError, match="tensors do not match its config"):
        MedusaHeads.load(path, target)


@pytest.mark.parametrize("kind", [{"garbage": True}, {"truncate": 200}, {"config_edit": {"bogus": 1}},
                                  {"config_edit": {"intermediate_size": 2_000_000_000}}])
def test_cli_bad_head_file_exit_2(capsys, tmp_path, target, tiny_dir, kind):  # noqa: F811
    path = _head_file(tmp_path, target, **kind)
    assert_refused(capsys, "w1 w2", "--target", tiny_dir, "--draft", str(path), "--max-new-tokens", "2",
                   "--json", match="treespec: error:")


def test_cli_missing_draft_directory(capsys, tiny_dir):  # noqa: F811
    assert_refused(capsys, "w1 w2", "--target", tiny_dir, "--draft", "/no/such/dir/", match="no draft model directory")


def test_nan_head_at_positive_temperature_is_named(target):
    from treespec.trees.grow import ShapeDrafter
    from treespec.trees.shape import TreeShape
    from treespec.generate import generate
    from treespec.sampling import NonFiniteLogitsError

    head = new_head(target, torch.arange(0, 64, 2))
    head.attach(target)
    with torch.no_grad():
        for p in head.parameters():
            p.fill_(float("nan"))
    drafter = ShapeDrafter(head, TreeShape.widths((2, 1)), "iid", min_confidence=0.0)
    with pytest.raises(NonFiniteLogitsError, match="NaN logits"):
        generate(target, [1, 2, 3], drafter, GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(1.0)))


@pytest.mark.parametrize("argv, match", [
    (["--draft", "ngram", "--tree", "8,4"], "n-gram lookup takes its shape in the draft word: --draft ngram:8,4"),
    (["--draft", "ngram", "--tree", "2,2,1"], "--draft ngram:DEPTH,BRANCHES (e.g. ngram:8,4)"),
    (["--draft", "ngram:8,4", "--tree", "1"], "--draft ngram:DEPTH,BRANCHES (e.g. ngram:8,4)"),
    (["--draft", "none", "--tree", "2"], "--tree 2 shapes a draft tree, and --draft none drafts nothing"),
    (["--plain", "--tree", "2"], "--tree 2 shapes a draft tree, and --plain drafts nothing"),
    # --draft auto drafts with n-gram lookup on this (non-embedded) target: the shipped head does not fit it
    (["--tree", "3", "--temperature", "1"], "--tree shapes a model or head draft, and --draft auto drafts with "
                                            "n-gram lookup on this target"),
    (["--law", "iid", "--temperature", "1"], "--law shapes a model or head draft"),
    (["--min-confidence", "0.3"], "--min-confidence shapes a model or head draft"),
    (["--max-reject", "0.5"], "--max-reject shapes a model or head draft"),
    (["--draft", "ngram", "--max-reject", "0.5"], "--max-reject reads the shipped acceptance head, trained for the "
                                                 "shipped draft head (--draft head or lookup+head); this run drafts "
                                                 "with 'ngram'"),
    (["--draft", "head", "--max-reject", "1.5"], "--max-reject must be in [0, 1), got 1.5"),
    (["--draft", "head", "--max-reject", "0.5", "--min-confidence", "0.2"],
     "--max-reject replaces --min-confidence as the stopping rule: give one of them"),
    (["--draft", "ngram:0,4"], "--draft ngram:0,4: DEPTH and BRANCHES must be positive integers"),
    (["--draft", "ngram:8"], "--draft ngram:8: n-gram lookup takes ngram:DEPTH,BRANCHES"),
    (["--draft", "ngram:a,b"], "--draft ngram:a,b: n-gram lookup takes ngram:DEPTH,BRANCHES"),
    (["--draft", "ngram:40,40"], f"--draft ngram:40,40 asks for 1600 draft nodes (DEPTH x BRANCHES); the limit is "
                                 f"{MAX_TREE_NODES}"),
])
def test_tree_shapes_model_and_head_drafts_only(capsys, monkeypatch, tiny_dir, argv, match):  # noqa: F811
    """--tree meant per-depth widths for a model draft, depth,branches for n-gram lookup and a switch of what
    --draft auto picks; now it is widths of a model or head draft only, and n-gram lookup is spelled
    --draft ngram:DEPTH,BRANCHES. Anything else is one line naming the right spelling, before any loading."""
    import treespec.models.loading as loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", no_loading)
    monkeypatch.setattr(loading, "load_tokenizer", no_loading)
    err = assert_refused(capsys, "w1 w2", "--target", tiny_dir, "--max-new-tokens", "2", *argv, match=match)
    assert len(err.strip().splitlines()) == 1 and err.startswith("treespec: error: CliInputError: "), err


def test_ngram_spelling_sets_depth_and_branches(capsys, tiny_dir):  # noqa: F811
    """--draft ngram:32,32 is 32 x 32 = 1024 nodes (the limit, accepted), branches 32 of depth 32."""
    from treespec.drafters import LOOKUP, MAX_NGRAM_NODES, build_drafter, ngram_config

    assert MAX_NGRAM_NODES == MAX_TREE_NODES
    code, out, err = run_cli(capsys, "w1 w2 w1", "--target", tiny_dir, "--temperature", "1", "--draft", "ngram:32,32",
                             "--max-new-tokens", "2", "--threads", "1", "--json")
    assert code == 0, err
    assert json.loads(out)["statistics"]["method"] == "NgramDrafter"
    config = build_drafter("ngram:8,4", None).config
    assert (config.depth, config.branches, config.max_nodes, config.adaptive) == (8, 4, 32, False)
    assert build_drafter("ngram", None).config == LOOKUP == ngram_config("ngram")  # the measured adaptive default
    with pytest.raises(ValueError, match="n-gram lookup takes its shape in its name: ngram:DEPTH,BRANCHES"):
        from treespec.drafters import DraftOptions

        build_drafter("ngram", None, DraftOptions(tree=(8, 4)))


class _LargestAllocation(torch.overrides.TorchFunctionMode):
    """Records the element count of the largest non-meta tensor any torch function returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.largest = max(self.largest, out.numel())
        return out


@pytest.mark.parametrize("cls", ["head", "medusa"])
@pytest.mark.parametrize("size", [1_000_000, 2_000_000_000])
def test_zero_size_tensor_cannot_lift_the_size_ceiling(tmp_path, target, cls, size):
    """A crafted file adds an empty tensor of shape (0, size): its dimension lifts the "no size above the
    largest stored dimension" bound, so the config may declare ``size``. The module is probed on the meta
    device: the file is refused by name without allocating the declared module (a 1e6-wide head would
    allocate 384 MB, a 2e9-wide one 768 GB)."""
    from safetensors import safe_open

    if cls == "head":
        path, key, load = tmp_path / "h.safetensors", "intermediate_size", EagleHead.load
        new_head(target, torch.arange(0, 64, 2)).save(path)
    else:
        path, key, load = tmp_path / "m.safetensors", "hidden_size", MedusaHeads.load
        new_medusa_heads(target, torch.arange(0, 64, 2), num_heads=2).save(path)
    with safe_open(str(path), framework="pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys()}
    config = json.loads(meta["config"])
    config[key] = size
    meta["config"] = json.dumps(config)
    tensors["ceiling"] = torch.empty(0, size)
    path.write_bytes(save(tensors, metadata=meta))
    mode = _LargestAllocation()
    start = time.perf_counter()
    with mode, pytest.raises(ValueError, match="tensors do not match its config") as info:
        load(path, target)
    assert str(path) in str(info.value)
    assert mode.largest < 100_000, mode.largest  # the real module has ~10k parameters
    assert time.perf_counter() - start < 2


def test_file_missing_a_tensor_is_refused_before_allocation(tmp_path, target):
    path = _head_file(tmp_path, target)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta, tensors = fh.metadata(), {k: fh.get_tensor(k) for k in fh.keys() if k != "layer.down.weight"}
    path.write_bytes(save(tensors, metadata=meta))
    with pytest.raises(ValueError, match="layer.down.weight stored nothing"):
        EagleHead.load(path, target)


def test_draft_auto_is_the_best_measured_drafter_per_temperature_and_dtype():
    """auto on the embedded target: lookup+head at T=0 in bf16, n-gram lookup at T=0 in float32; at T>0 the
    shipped head in bf16 and plain decoding in float32 (train-prompt tuning runs, see
    treespec.cli._resolved_draft); n-gram lookup on any other target (the head fits Gemma-3-270M only)."""
    from treespec.cli import _resolved_draft, build_parser

    def resolved(*argv):
        return _resolved_draft(build_parser().parse_args(["generate", "x", *argv]))

    assert resolved("--dtype", "bfloat16") == "lookup+head"
    assert resolved("--dtype", "float32") == "ngram" and resolved("--exact") == "ngram"
    for dtype in ("bfloat16", "float32"):
        assert resolved("--dtype", dtype, "--target", "some/other-model") == "ngram"
        assert resolved("--dtype", dtype, "--temperature", "1", "--target", "some/other-model") == "ngram"
        assert resolved("--dtype", dtype, "--temperature", "1", "--draft", "ngram") == "ngram"
    assert resolved("--temperature", "0.7", "--dtype", "bfloat16") == "head"
    assert resolved("--temperature", "0.7", "--dtype", "float32") == "none"
    assert resolved("--temperature", "0.7", "--exact") == "none"  # --exact runs float32
    assert resolved("--temperature", "0.7", "--dtype", "float32", "--tree", "2,1") == "head"  # a tree asked for
    assert resolved("--temperature", "0.7", "--dtype", "float32", "--min-confidence", "0.2") == "head"
    assert resolved("--temperature", "0.7", "--dtype", "float32", "--law", "without_replacement") == "head"
    # --tree shapes the head of what auto picks: lookup+head keeps its lookup at T=0 in bf16 (it meant n-gram
    # lookup before); where auto picks n-gram lookup (float32, T=0), a shaping option asks for the shipped head
    assert resolved("--dtype", "bfloat16", "--tree", "2,1") == "lookup+head"
    assert resolved("--dtype", "float32", "--tree", "8,4") == "head"
    assert resolved("--dtype", "float32", "--law", "iid") == "head"
    # dtype auto: the run's own dtype wins
    args = build_parser().parse_args(["generate", "x", "--temperature", "1", "--target", "embedded"])
    assert _resolved_draft(args, torch.bfloat16) == "head" and _resolved_draft(args, torch.float32) == "none"
    args = build_parser().parse_args(["generate", "x", "--target", "embedded"])
    assert _resolved_draft(args, torch.bfloat16) == "lookup+head" and _resolved_draft(args, torch.float32) == "ngram"
    for target in ("embedded-gguf", "m.gguf"):  # llama.cpp: plain decoding measured fastest on every CPU kind
        for dtype, temperature in ((torch.bfloat16, "0"), (torch.bfloat16, "1"), (torch.float32, "0")):
            args = build_parser().parse_args(["generate", "x", "--target", target, "--temperature", temperature])
            assert _resolved_draft(args, dtype) == "none", (target, dtype, temperature)


def test_default_drafts_are_data_with_their_evidence():
    """Every entry of the defaults table names a results folder that exists (the measurement behind it), and
    the CLI reads the table: a changed entry changes what --draft auto resolves to."""
    from pathlib import Path

    from treespec import drafters
    from treespec.cli import _resolved_draft, build_parser

    root = Path(__file__).resolve().parents[2]
    for key, entry in drafters.DEFAULT_DRAFTS.items():
        assert (root / entry.evidence).is_dir(), f"{key}: no results folder {entry.evidence}"
        assert entry.draft in ("ngram", "head", "lookup+head", "none"), key
    assert drafters.target_kind("embedded-gguf") == drafters.target_kind("x/m.GGUF") == "gguf"
    assert drafters.default_draft("embedded-gguf", torch.float32, 0.7) == "none"  # measured: plain is fastest
    assert drafters.default_draft("x.gguf", torch.bfloat16, 0.0) == "none"  # measured: n-gram lookup only tied
    assert drafters.default_draft("some/model", torch.float32, 0.0) == "ngram"
    args = build_parser().parse_args(["generate", "x", "--dtype", "bfloat16"])
    key = ("embedded", "bfloat16", "greedy")
    original = drafters.DEFAULT_DRAFTS[key]
    try:
        drafters.DEFAULT_DRAFTS[key] = drafters.DefaultDraft("ngram", original.evidence)
        assert _resolved_draft(args) == "ngram"
    finally:
        drafters.DEFAULT_DRAFTS[key] = original
    assert _resolved_draft(args) == "lookup+head"


def test_target_auto_picks_the_engine_measured_fastest(monkeypatch):
    """--target auto, the default: llama.cpp where the run would be float32 by --dtype auto (a CPU without native
    bf16) and, on a native-bf16 CPU, at T > 0 (T=0.7 with top-p too), PyTorch at T=0 there; PyTorch whenever an
    option asks for it, the run is on a GPU or llama.cpp is missing (the reason then names what to install); the
    evidence folder of every entry exists."""
    from pathlib import Path

    import treespec.cli as cli
    import treespec.models.llama_cpp as llama_mod
    from treespec.cli import build_parser, resolve_target
    from treespec.drafters import DEFAULT_TARGETS

    def target(*argv, dtype=torch.float32):
        return resolve_target(build_parser().parse_args(["generate", "x", *argv]), dtype)

    monkeypatch.setattr(cli, "resolve_cli_device", lambda args: torch.device("cpu"))  # hosts with a GPU too
    monkeypatch.setattr(llama_mod, "llama_cpp_available", lambda: None)
    assert target()[0] == "embedded-gguf" and target("--temperature", "1")[0] == "embedded-gguf"
    assert target(dtype=torch.bfloat16)[0] == "embedded"
    for argv in (["--temperature", "1"], ["--temperature", "0.7", "--top-p", "0.95"], ["--plain", "--temperature", "1"]):
        assert target(*argv, dtype=torch.bfloat16)[0] == "embedded-gguf", argv
    assert "fastest for bfloat16 at T > 0" in target("--temperature", "1", dtype=torch.bfloat16)[1]
    for asked in (["--dtype", "float32"], ["--exact"], ["--runner", "eager"], ["--draft", "early-exit:4"],
                  ["--quantize", "int4"], ["--quantize", "int8-head"], ["--draft-quantize", "int4"],
                  ["--tree", "8,8", "--temperature", "1"],
                  ["--draft", "ngram:8,64"]):
        chosen, why = target(*asked)
        assert chosen == "embedded" and f"({asked[0]} " in why, asked
    assert target("--dtype", "bfloat16", dtype=torch.bfloat16)[1] == \
        "--target auto: the PyTorch target (--dtype asks for it)"
    assert target("--draft", "ngram:4,2")[0] == "embedded-gguf"  # an n-gram shape within a llama.cpp pass
    assert target("--draft", "head", "--temperature", "1")[0] == "embedded-gguf"  # float32: llama.cpp wins anyway
    # native bf16: the engines were compared with --draft auto; a named draft, a shaping option or a verifier
    # stays on the PyTorch target, where they were tuned
    for named in (["--draft", "head"], ["--draft", "ngram"], ["--min-confidence", "0.3"], ["--verifier", "rrs"]):
        chosen, why = target(*named, "--temperature", "1", dtype=torch.bfloat16)
        assert chosen == "embedded" and "compared with --draft auto" in why, named
    assert target("--target", "embedded")[0] == "embedded" and target("--target", "embedded")[1] is None
    monkeypatch.setattr(cli, "resolve_cli_device", lambda args: torch.device("cuda"))
    assert target("--temperature", "1", dtype=torch.bfloat16)[0] == "embedded"  # a GPU runs the PyTorch target
    monkeypatch.setattr(cli, "resolve_cli_device", lambda args: torch.device("cpu"))
    monkeypatch.setattr(llama_mod, "llama_cpp_available", lambda: "llama-cpp-python is not usable")
    chosen, why = target()
    assert chosen == "embedded" and "llama.cpp would be faster here" in why and "not usable" in why
    repo = Path(__file__).resolve().parents[2]
    assert {key[1] for key in DEFAULT_TARGETS} == {"greedy", "sampled"}
    for entry in DEFAULT_TARGETS.values():
        assert (repo / entry.evidence).is_dir(), entry


def test_the_llama_cpp_target_gets_room_for_the_prompt_and_the_new_tokens(monkeypatch):
    """The llama.cpp runner's context covers the prompt (one token per byte at most) and --max-new-tokens (it had
    llama.cpp's 4,096 whatever the run asked for, and a long run ended in a context overflow)."""
    import treespec.models.llama_cpp as llama_mod
    from treespec.cli import _gguf_runner, build_parser

    seen = {}

    class Stop(Exception):
        pass

    def runner(path, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(llama_mod, "llama_cpp_available", lambda: None)
    monkeypatch.setattr(llama_mod, "LlamaCppRunner", runner)
    monkeypatch.setattr("treespec.models.loading.embedded_gguf", lambda **kw: "x.gguf")
    for prompt, new, least in (("hi", 64, 4096), ("w " * 3000, 9000, 6000 + 9000)):
        args = build_parser().parse_args(["generate", prompt, "--target", "embedded-gguf", "--plain",
                                          "--max-new-tokens", str(new)])
        with pytest.raises(Stop):
            _gguf_runner(args)
        assert seen["context"] >= least, (len(prompt), new, seen)


# ---------------------------------------------------------------------- failures outside the argument checks
def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


def test_threads_are_bounded_by_the_usable_cores(capsys):
    from treespec.cli import usable_cores

    cores = usable_cores()
    assert 1 <= cores <= (__import__("os").cpu_count() or 1)
    assert_refused(capsys, "hello", "--threads", str(cores + 1), match=f"use at most {cores}")


def test_disk_full_during_the_embedded_conversion_is_named(stubbed_gguf, capsys, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (neither OSError nor ValueError): it escaped
    as a traceback. Now one named line, status 2, and nothing left in the cache."""
    import safetensors.torch
    from safetensors import SafetensorError

    def disk_full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_model", disk_full)
    code, out, err = run_cli(capsys, "w1 w2", "--draft", "ngram", "--dtype", "float32", "--max-new-tokens", "2")
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert len(_error_lines(err)) == 1, err
    assert "CacheError" in err and "No space left on device" in err and "free disk space" in err, err
    root = stubbed_gguf.parent
    assert not stubbed_gguf.exists()
    assert [p.name for p in root.iterdir() if p.name.startswith(".gemma-3-270m-") and p.is_dir()] == []


@pytest.fixture
def pickled_model_dir(tmp_path, tiny_dir):  # noqa: F811
    """A model folder as older tools save it: config, tokenizer and a pickled pytorch_model.bin whose loading
    would create a marker file (no safetensors)."""
    import os
    import shutil

    folder = tmp_path / "pickled-model"
    folder.mkdir()
    for item in __import__("pathlib").Path(tiny_dir).iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, folder / item.name)
    marker = tmp_path / "PAYLOAD-RAN"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model.embed_tokens.weight": Payload()}, folder / "pytorch_model.bin")
    return folder, marker


def test_pickled_model_folder_is_named_and_never_unpickled(pickled_model_dir, capsys):
    """transformers refused the pickle (weights_only) with an UnpicklingError traceback; now a named error says
    that only safetensors are read, for a target and a draft model, and the payload never runs."""
    from treespec.models.loading import PickledWeightsError, load_model

    folder, marker = pickled_model_dir
    with pytest.raises(PickledWeightsError, match=r"pytorch_model.bin\) and were not loaded: treespec reads only "
                                                  r"safetensors"):
        load_model(str(folder))
    err = assert_refused(capsys, "w1 w2", "--target", str(folder), "--plain", "--max-new-tokens", "2",
                         match="PickledWeightsError")
    assert "reads only safetensors weights" in err and len(_error_lines(err)) == 1
    assert not marker.exists()


def test_pickled_draft_model_folder_is_named(pickled_model_dir, tiny_dir, capsys):  # noqa: F811
    folder, marker = pickled_model_dir
    assert_refused(capsys, "w1 w2", "--target", tiny_dir, "--draft", str(folder), "--max-new-tokens", "2",
                   match="reads only safetensors weights")
    assert not marker.exists()


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection and name lookup fails at once (a machine offline); the hub is not switched off."""
    import socket

    import huggingface_hub.constants

    def blocked(*args, **kwargs):
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket, "create_connection", blocked)
    monkeypatch.setattr(socket, "getaddrinfo", blocked)
    monkeypatch.setattr(socket.socket, "connect", blocked)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.mark.parametrize("flag", ["--target", "--draft"])
def test_unreachable_hub_id_fails_at_once(no_network, tiny_dir, capsys, flag):  # noqa: F811
    """A hub id that is no local folder and not cached, with the network down: transformers retried for about
    a minute before its OSError; now a named error within seconds."""
    argv = ["--target", "treespec-tests/no-such-model"] if flag == "--target" else \
        ["--target", tiny_dir, "--draft", "treespec-tests/no-such-draft"]
    start = time.perf_counter()
    err = assert_refused(capsys, "w1 w2", *argv, "--max-new-tokens", "2", match="cannot be reached")
    assert time.perf_counter() - start < 5, err
    assert f"{flag} treespec-tests/no-such-" in err and "network blocked by the test" in err


def test_hub_id_with_hub_off_fails_at_once(no_network, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    assert_refused(capsys, "w1 w2", "--target", "treespec-tests/no-such-model", match="the hub is off (HF_HUB_OFFLINE)")
    assert time.perf_counter() - start < 5


def test_hub_probe_times_out(monkeypatch):
    """A resolver or connection that hangs costs the probe's timeout, not a minute."""
    import socket

    from treespec import cli

    def hang(*args, **kwargs):  # a connection that never answers (then fails, as a real one would)
        time.sleep(30)
        raise OSError("timed out")

    monkeypatch.setattr(socket, "create_connection", hang)
    start = time.perf_counter()
    assert "no answer" in cli._hub_reachable(timeout=0.5)
    assert time.perf_counter() - start < 2


def _treespec_lines(err: str) -> list[str]:
    """The lines treespec printed (transformers may draw a progress bar while a model loads)."""
    return [line for line in err.splitlines()
            if line.startswith("treespec") and not line.startswith("treespec: loading")]


def _interrupting_generate(monkeypatch, after: int = 3) -> None:
    """generate() as the CLI calls it, with Ctrl-C arriving once ``after`` tokens have been emitted."""
    from treespec import cli

    real = cli.generate

    def generate(*args, on_tokens=None, **kwargs):
        seen = []

        def step(new_ids):
            if on_tokens is not None:
                on_tokens(new_ids)
            seen.extend(new_ids)
            if len(seen) >= after:
                raise KeyboardInterrupt

        return real(*args, on_tokens=step, **kwargs)

    monkeypatch.setattr(cli, "generate", generate)


@pytest.mark.parametrize("json_mode", [True, False])
def test_ctrl_c_ends_with_one_line_and_status_130(tiny_dir, capsys, monkeypatch, json_mode):  # noqa: F811
    """Ctrl-C printed a KeyboardInterrupt traceback, and --json printed nothing. Now one line on stderr, status
    130, and with --json a JSON document marked "interrupted" with the tokens generated so far."""
    _interrupting_generate(monkeypatch)
    argv = ["generate", "w1 w2 w3", "--target", tiny_dir, "--max-new-tokens", "40", "--no-stop", "--plain",
            "--threads", "1", *(["--json"] if json_mode else [])]
    try:
        code = cli_main(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped as a KeyboardInterrupt")
    out, err = capsys.readouterr()
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert _treespec_lines(err) == ["treespec: interrupted (Ctrl-C) after 3 generated tokens"], err
    if json_mode:
        doc = json.loads(out)  # the whole of stdout is one JSON document
        assert doc["interrupted"] is True and len(doc["token_ids"]) == 3
        assert all(0 <= t < 64 for t in doc["token_ids"]) and isinstance(doc["text"], str)
        assert doc["prompt_ids"] and doc["statistics"]["new_tokens"] == 3
    else:
        assert out.startswith("w1 w2 w3") and out.endswith("\n"), out


def test_ctrl_c_while_loading_with_json(tiny_dir, capsys, monkeypatch):  # noqa: F811
    import treespec.models.loading as loading

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loading, "load_model", interrupted)
    try:
        code = cli_main(["generate", "w1 w2", "--target", tiny_dir, "--json", "--threads", "1"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped as a KeyboardInterrupt")
    out, err = capsys.readouterr()
    assert code == 130 and json.loads(out) == {"interrupted": True, "text": "", "token_ids": [], "prompt_ids": None,
                                               "statistics": {"new_tokens": 0}}
    assert _treespec_lines(err) == ["treespec: interrupted (Ctrl-C) after 0 generated tokens"], err
