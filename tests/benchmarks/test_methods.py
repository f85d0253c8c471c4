"""The method rows of benchmarks/run.py come from one table, and each row's description is generated from the
settings the row runs with: parsed back by `treespec generate`'s own parser it gives the same drafter settings."""

from __future__ import annotations

import re

import pytest

from benchmarks import harness, methods
from benchmarks.methods import ROW, ROWS, RunOptions, describe, ordered_rows, resolve


def _cli_args(row):
    """`treespec generate`'s arguments for the flags a row's description names."""
    from treespec.cli import build_parser

    text = describe(resolve(row, RunOptions()), runner="auto", runner_kind="FastRunner")
    flags = re.sub(r"\([^)]*\)", "", text.removeprefix("treespec generate ")).split()
    return build_parser().parse_args(["generate", "x", *flags])


@pytest.mark.parametrize("row", [r for r in ROWS if r.target.startswith("ts") and r.drafter is None],
                         ids=lambda r: r.name)
def test_a_cli_row_describes_the_settings_it_runs_with(row):
    from treespec.cli import _leaf_logits

    args = _cli_args(row)
    row = resolve(row, RunOptions())
    assert args.plain == (row.draft is None)
    if row.draft is not None:
        assert args.draft == row.draft
    assert args.tree == row.tree and args.min_confidence == row.min_confidence and args.law == row.law
    assert args.draft_quantize == (row.quantize or "auto")
    assert args.quantize == {"ts_int4": "int4", "ts_int8h": "int8-head"}.get(row.target, "none")
    assert args.target == ("embedded-gguf" if row.target == "ts_gguf" else "embedded")
    assert args.runner == ("eager" if row.target == "ts_eager" else "auto")
    assert _leaf_logits(args) == row.leaf_logits  # the GGUF target's `auto` would differ: the rows say it


def test_the_ngram_tree_row_describes_the_tree_it_builds():
    """ts_ngram_tree builds at most 16 nodes (depth 8, 4 branches); `--tree 8,4` on the CLI allows 32, so its
    description names its own settings, not that flag."""
    row = ROW["ts_ngram_tree"]
    make, reset = methods.CUSTOM_DRAFTERS[row.drafter].make(None, dict(row.settings))
    config = make(0.0).config
    text = describe(row)
    assert "--tree" not in text and reset is None
    assert f"NgramDrafter(depth={config.depth}, branches={config.branches}, max_nodes={config.max_nodes})" in text
    assert config.max_nodes == 16


def test_variant_rows_and_baselines_keep_the_build_order():
    wanted = {r.name for r in ROWS if r.name not in ("ts_plain_int4", "tsl_plain", "llama_plain")}
    variant = methods.variant_row(["q4", "head", "2,1", "0.2", "without_replacement", "int4"])
    names = [r.name for r in ordered_rows(wanted, [variant], "auto")]
    assert names == ["ts_plain", "ts_plain_eager", "ts_ngram", "ts_head", "ts_head_int4", "ts_head_bf16",
                     "ts_head_chain", "ts_lookup_head", "q4", "ts_lookup_head_judge", "ts_plain_int4", "ts_ngram_int4",
                     "ts_lookup_head_int4",
                     "ts_plain_int8h", "ts_head_int8h", "ts_lookup_head_int8h",
                     "ts_ngram_tree", "ts_online_ngram", "ts_lookup12_head", "ts_lookup16_head", "ts_head_dyspec",
                     "ts_lookup_dyspec", "ts_head_eagle2", "ts_head_dyspec_c02",
                     "ts_head_eagle2_c02", "ts_online_head",
                     "ts_early_exit", "ts_medusa", "hf_plain", "hf_prompt_lookup", "hf_assisted", "llama_plain",
                     "llama_prompt_lookup", "tsl_plain", "tsl_ngram", "tsl_head", "tsl_lookup_head",
                     "tsl_ngram_noleaf", "tsl_head_noleaf", "tsl_lookup_head_noleaf"]
    assert [r.name for r in ordered_rows({"ts_plain", "hf_plain"}, [], "eager")] == ["ts_plain", "hf_plain"]
    assert describe(variant).startswith("treespec generate --draft head --tree 2,1 --min-confidence 0.2 "
                                        "--law without_replacement --draft-quantize int4")


def test_rounds_report_progress_on_stderr_only(tmp_path, capsys, monkeypatch):
    """One stderr line per method per prompt and round (and one per prompt and the warm-up), nothing on stdout."""
    monkeypatch.setattr(harness, "write_report", lambda *a, **k: None)

    def fake(name, engine):
        return methods.Method(name, engine, lambda p, n, t, s: {"tokens": [1] * n, "wall_s": 0.01,
                                                                "target_calls": n}, name)

    ms = [fake("ts_plain", "treespec"), fake("hf_plain", "hf"), fake("ts_ngram", "treespec")]
    prompts = [{"id": f"p{i}", "subtask": "qa", "ids": [1, 2]} for i in range(2)]
    with (tmp_path / "rounds.jsonl").open("a") as log:
        session = harness.Session(tmp_path, [], set(), {}, log, 4)
        harness.measure_block(session, "float32", ms, prompts, prompts[0], harness.Plan((0.0,), 2, 4, 0),
                              lambda: (0.001, 100))
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert "float32 T=0 round 2/2: ts_ngram prompt 2/2" in lines
    assert len([x for x in lines if " round " in x]) == 3 * 2 * 2  # methods x prompts x repeats
    assert len(session.runs) == 12


def test_the_judge_row_is_lossy_and_runs_at_temperature_0_only(capsys):
    """ts_lookup_head_judge says LOSSY in its description; run.py refuses it beside a temperature above 0, in one
    line, before anything loads."""
    from benchmarks import run

    text = describe(ROW["ts_lookup_head_judge"])
    assert text.startswith("treespec generate --draft lookup+head --judge shipped ") and text.endswith("(LOSSY: judge "
                                                                                                       "decoding)")
    with pytest.raises(SystemExit) as exc:
        run.main(["--methods", "ts_lookup_head_judge", "--temperatures", "0", "1", "--no-llama"])
    assert exc.value.code == 2
    assert "judge decoding (LOSSY) is defined at temperature 0 only" in capsys.readouterr().err


def test_run_refuses_an_unknown_method_by_name(capsys):
    """A misspelt row was left out of a run without a word; now one line names it, exit 2."""
    from benchmarks import run

    with pytest.raises(SystemExit) as exc:
        run.main(["--methods", "ts_lookup_head", "ts_lokup_head", "--no-llama"])
    assert exc.value.code == 2 and "unknown --methods ts_lokup_head" in capsys.readouterr().err


def test_llama_rows_load_with_the_runners_model_parameters(monkeypatch):
    """llama.cpp's own rows (``llama_plain``, ``llama_prompt_lookup``) load through the runner's model parameters
    (the same extra buffer types as treespec's llama.cpp target), and llama-cpp-python's default comes back
    afterwards, also when loading fails."""
    from treespec.models import llama_cpp as runner_module

    if runner_module.llama_cpp_available() is not None:
        pytest.skip(runner_module.llama_cpp_available())
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params
    for allowed in (True, False):
        monkeypatch.setattr(runner_module, "default_extra_buffers", lambda: allowed)
        with methods._runner_model_params():
            assert low.llama_model_default_params().use_extra_bufts is allowed
            assert low.llama_model_default_params().n_gpu_layers == 0
        assert low.llama_model_default_params is default
    with pytest.raises(RuntimeError, match="load failed"):
        with methods._runner_model_params():
            raise RuntimeError("load failed")
    assert low.llama_model_default_params is default
