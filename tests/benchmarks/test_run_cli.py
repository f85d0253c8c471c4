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
