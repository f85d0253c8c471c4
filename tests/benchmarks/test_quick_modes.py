"""The benchmarks' quick modes run in fp32 and with bf16 forced, writing results + provenance into --out.

bench_trees.py --tiny --quick runs on tiny random Gemma-3 models (its --dtype applies to them); the
builders are cut to ngram (model-free), sequoia (calibration + a draft model) and eagle2 to keep it short.
run.py has no tiny mode (every row is the embedded Gemma-3-270M): its --quick runs with one treespec
method besides the two plain baselines, marked ``gemma``.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_trees_tiny_quick(tmp_path, dtype):
    from benchmarks import bench_trees

    out = tmp_path / "trees"
    assert bench_trees.main(["--tiny", "--quick", "--dtype", dtype, "--threads", "1", "--builders",
                             "ngram,sequoia,eagle2", "--calib-prompts", "2", "--allow-dirty", "--out", str(out)]) == 0
    prov = json.loads((out / "provenance.json").read_text())
    res = json.loads((out / "results.json").read_text())
    assert prov["complete"] and res["meta"]["complete"] and res["meta"]["dtype"] == dtype
    seen = {(r["builder"], r["temperature"]) for r in res["results"]}
    assert seen == {(b, t) for b in ("plain", "ngram", "sequoia", "eagle2") for t in (0.0, 1.0)}
    assert all(r["tau"] >= 1.0 for r in res["results"])
    assert (out / "results.png").exists()


@pytest.mark.gemma
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_run_quick(tmp_path, dtype):
    from benchmarks import run

    out = tmp_path / "speed"
    assert run.main(["--quick", "--methods", "ts_ngram", "--no-llama", "--dtypes", dtype, "--threads", "1",
                     "--allow-dirty", "--out", str(out)]) == 0
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["complete"]
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"ts_plain", "hf_plain", "ts_ngram"}
    assert {r["dtype"] for r in rows} == {dtype} and all(r["new_tokens"] > 0 for r in rows)
    if dtype == "float32":  # T=0 in fp32: treespec rows are token-identical to its plain decoding
        assert all(r["equal_to_ts_plain"] for r in rows if r["engine"] == "treespec")
