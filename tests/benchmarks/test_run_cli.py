"""benchmarks/run.py's command line: missing shared data is one clear line (before any results folder exists), and
--list-methods prints every row with what it runs."""

from __future__ import annotations

import pytest


def test_missing_eval_prompts_fail_with_one_line_naming_the_shared_folder(tmp_path, monkeypatch):
    from benchmarks import common, run

    monkeypatch.setattr(common, "SPEC_BENCH", tmp_path / "nowhere" / "spec_bench.prompts.jsonl")
    with pytest.raises(SystemExit) as info:
        run.main(["--quick", "--no-llama", "--dtypes", "float32", "--allow-dirty", "--out", str(tmp_path / "out")])
    message = str(info.value.code)
    assert "../shared/data/eval" in message and "beside the repository checkout" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_missing_train_prompts_fail_with_one_line(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.setattr(common, "TRAIN_PROMPTS", tmp_path / "train_prompts.jsonl")
    with pytest.raises(common.MissingSharedData, match=r"\.\./shared/data/train"):
        common.load_train_prompts(2)


def test_list_methods_names_every_row_and_what_it_runs(capsys):
    from benchmarks import run
    from benchmarks.methods import ROWS

    assert run.main(["--list-methods"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("protocol: ts_plain ")
    for row in ROWS:
        assert f"  {row.name}: " in out
    assert "ts_ngram_tree: treespec NgramDrafter(depth=8, branches=4, max_nodes=16)" in out
    assert "tsl_ngram: treespec generate --draft ngram --target embedded-gguf --leaf-logits on" in out


def test_the_plot_library_of_run_py_is_a_benchmark_dependency_not_only_a_dev_one():
    """run.py writes speedup.png with matplotlib: the `bench` extra (or the main dependencies) must carry it."""
    import re

    from benchmarks.common import REPO

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    assert "import matplotlib" in (REPO / "benchmarks" / "report.py").read_text()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs}  # noqa: E731
    assert "matplotlib" in names(project["dependencies"]) | names(project["optional-dependencies"].get("bench", []))
    assert "scipy" in names(project["dependencies"])  # the bootstrap interval and the sign test


@pytest.mark.parametrize("conf, draft, words", [
    ("reject:-", "head", "CONF must be '-', a confidence or reject:H"),
    ("reject:1.5", "head", "CONF must be '-', a confidence or reject:H"),
    ("2", "head", "CONF must be '-', a confidence or reject:H"),
    ("reject:0.5", "ngram", "reads the shipped acceptance head"),
])
def test_a_variant_confidence_is_checked_before_loading(capsys, conf, draft, words):
    """--variant's CONF (a confidence or reject:H, SpecDec++'s --max-reject for the shipped head) is refused in one
    line, exit 2, before any model loads."""
    from benchmarks import run

    tree = "-" if draft == "ngram" else "3"
    with pytest.raises(SystemExit) as exc:
        run.main(["--variant", "v", draft, tree, conf, "-", "--no-llama", "--dtypes", "float32"])
    assert exc.value.code == 2 and words in capsys.readouterr().err


def test_a_reject_variant_becomes_max_reject():
    from benchmarks.methods import cli_flags, variant_row

    row = variant_row(["v", "head", "6", "reject:0.5", "-"])
    assert row.max_reject == 0.5 and row.min_confidence is None and row.tree == (6,)
    assert cli_flags(row) == "--draft head --tree 6 --max-reject 0.5"


def test_the_protocol_runs_the_cli_default_of_every_block(monkeypatch):
    """Without --methods the run holds `treespec generate`'s default row of each (dtype, T) block, so that every
    block gets its paired table (the T>0 default on a native-bf16 CPU, plain decoding on llama.cpp, is no
    protocol row); an explicit --methods list is run as given, with the plain baselines."""
    from benchmarks import run

    monkeypatch.setattr(run, "llama_available", lambda: None)
    ap = run.build_parser()
    args = run.argparse.Namespace(methods=None, variant=None, no_llama=False, temperatures=[0.0, 1.0])
    wanted, _ = run.wanted_methods(ap, args, ["bfloat16"])
    assert {"ts_lookup_head", "tsl_plain", "llama_plain"} <= wanted
    args.methods = ["ts_ngram"]
    wanted, _ = run.wanted_methods(ap, args, ["bfloat16"])
    assert wanted == {"ts_ngram", "ts_plain", "hf_plain"}


def _blocks(argv: list[str]):
    from benchmarks import run

    ap = run.build_parser()
    args = ap.parse_args(argv)
    run.split_blocks(ap, args)
    return args.temperatures, args.top_p_by_temperature


def test_the_protocol_has_a_block_as_chat_users_sample():
    """Issue 43: the protocol's blocks are T=0, T=0.7 with top-p 0.95 and T=1 (no filter); T:P gives a block its own
    top-p, a bare temperature takes --top-p."""
    assert _blocks([]) == ([0.0, 0.7, 1.0], [[0.7, 0.95], [1.0, 1.0]])
    assert _blocks(["--temperatures", "0", "0.7", "--top-p", "0.9"]) == ([0.0, 0.7], [[0.7, 0.9]])
    assert _blocks(["--temperatures", "0.7:0.8", "1", "--top-p", "0.9"]) == ([0.7, 1.0], [[0.7, 0.8], [1.0, 0.9]])


@pytest.mark.parametrize("argv, words", [
    (["--temperatures", "0:0.9"], "top-p filters sampled blocks only"),
    (["--temperatures", "1", "1:0.9"], "each temperature once"),
    (["--temperatures", "1:x"], "expected a temperature T or T:P"),
    (["--temperatures", "0.7:1.5"], "top-p must be in (0, 1]"),
    (["--temperatures", "-1"], "a temperature is >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
])
def test_a_malformed_block_is_refused_in_one_line(capsys, argv, words):
    from benchmarks import run

    with pytest.raises(SystemExit) as exc:
        run.main(argv + ["--list-methods"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and words in err.strip().splitlines()[-1] and " error: " in err.strip().splitlines()[-1]


def test_each_block_samples_with_its_own_top_p():
    """The rows read the top-p of the block they run in (RunOptions.top_p_at): a tiny model sampled at T=1 under a
    top-p that keeps only its most likely token gives its greedy text, in the HF row and the treespec row alike,
    while the block without a filter samples other tokens (seed 0, 24 tokens; the model's top probability is
    below 0.9 at some step, so the unfiltered run differs from greedy with near certainty). A row that ignored the
    block's top-p (the broken twin: no_top_p) samples freely and fails the first assertion."""
    from benchmarks.methods import ForwardCounter, RunOptions, hf_method, no_top_p, ts_method
    from treespec.models.tiny import tiny_model

    model = tiny_model("llama", 64, seed=0, logit_scale=2.0)
    model.generation_config.pad_token_id = 0
    prompt = {"ids": [3, 17, 5, 9]}
    opts = RunOptions(top_p=((1.0, 1e-6), (0.5, 1.0)))
    assert (opts.top_p_at(0.0), opts.top_p_at(1.0), opts.top_p_at(0.5), opts.top_p_at(0.7)) == (1.0, 1e-6, 1.0, 1.0)
    rows = {"hf": lambda top_p_at: hf_method("hf", model, ForwardCounter(model), "t", top_p_at=top_p_at),
            "ts": lambda top_p_at: ts_method("ts", model, lambda t: None, "t", top_p_at=top_p_at)}
    for make in rows.values():
        greedy = make(opts.top_p_at)(prompt, 24, 0.0, 0)["tokens"]
        assert make(opts.top_p_at)(prompt, 24, 1.0, 0)["tokens"] == greedy
        assert make(no_top_p)(prompt, 24, 1.0, 0)["tokens"] != greedy


def test_a_block_heading_names_its_top_p():
    from benchmarks.common import block_heading, block_top_p

    settings = {"temperatures": [0.0, 0.7, 1.0], "top_p_by_temperature": [[0.7, 0.95], [1.0, 1.0]]}
    assert [block_heading(f"bfloat16/T={t:g}", settings) for t in (0, 0.7, 1)] == \
        ["bfloat16/T=0", "bfloat16/T=0.7, top-p 0.95", "bfloat16/T=1"]
    old_run = {"temperatures": [0.0, 0.7], "top_p": 0.95}  # one --top-p for every sampled block
    assert (block_top_p(old_run, 0.0), block_top_p(old_run, 0.7)) == (1.0, 0.95)
    odd = {"temperatures": [2 / 3], "top_p_by_temperature": [[2 / 3, 0.9]]}  # the key rounds it to 0.666667
    assert block_heading(f"bfloat16/T={2 / 3:g}", odd) == "bfloat16/T=0.666667, top-p 0.9"


def test_the_rows_a_run_builds_read_the_blocks_of_its_command_line(monkeypatch):
    """The wiring from run.py's arguments to the rows: the protocol's default blocks reach the treespec and HF rows
    that build_methods makes (T=0.7: top-p 0.95; T=1: none; T=0: none), through run_options. A run_options that
    dropped the blocks (the broken twin) gives 1.0 at T=0.7 and fails."""
    from benchmarks import methods, run
    from treespec.models.tiny import tiny_model

    ap = run.build_parser()
    args = ap.parse_args([])
    run.split_blocks(ap, args)
    seen = {}
    monkeypatch.setattr(methods, "ts_method", lambda name, *a, top_p_at, **k: seen.setdefault(name, top_p_at))
    monkeypatch.setattr(methods, "hf_method", lambda name, *a, top_p_at, **k: seen.setdefault(name, top_p_at))
    model = tiny_model("llama", 64, seed=0)
    targets = methods.Targets(model, None, "float32", run.run_options(args))
    methods.build_methods([methods.ROW["ts_plain"], methods.ROW["hf_plain"]], targets)
    assert set(seen) == {"ts_plain", "hf_plain"}
    for top_p_at in seen.values():
        assert (top_p_at(0.0), top_p_at(0.7), top_p_at(1.0)) == (1.0, 0.95, 1.0)
    args.top_p_by_temperature = []  # the twin: blocks lost on the way
    assert run.run_options(args).top_p_at(0.7) == 1.0


def test_quick_keeps_no_sampled_block():
    from benchmarks import run

    ap = run.build_parser()
    args = ap.parse_args(["--quick"])
    run.split_blocks(ap, args)
    run.apply_quick(args)
    assert (args.temperatures, args.top_p_by_temperature) == ([0.0], [])


def test_paired_rows_name_their_blocks_top_p():
    from benchmarks.paired import render

    rows = [{"dtype": "bfloat16", "temperature": t, "a": "x", "b": "y", "prompts": 3, "median": 1.0, "ci95": [1, 1],
             "wins": 1, "losses": 1, "p_sign": 1.0} for t in (0.7, 1.0)]
    text = render(rows, "run", {"temperatures": [0.7, 1.0], "top_p_by_temperature": [[0.7, 0.95], [1.0, 1.0]]})
    assert "| bfloat16/T=0.7, top-p 0.95 | x | y |" in text and "| bfloat16/T=1 | x | y |" in text
