"""The benchmarks' quick modes run in fp32 and with bf16 forced, writing results + provenance into --out.

bench_trees.py --tiny --quick runs on tiny random Gemma-3 models (its --dtype applies to them); the
builders are cut to ngram (model-free), sequoia (calibration + a draft model) and eagle2 to keep it short.
run.py has no tiny mode (every row is the embedded Gemma-3-270M): its --quick runs with one treespec
method besides the two plain baselines, marked ``gemma``.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import common

#: the quick modes read Spec-Bench / train prompts from the shared folder beside the checkout (or TREESPEC_SHARED)
needs_prompts = pytest.mark.skipif(not (common.SPEC_BENCH.exists() and common.TRAIN_PROMPTS.exists()),
                                   reason="needs the shared prompts (../shared/data, or TREESPEC_SHARED)")


@needs_prompts
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_trees_tiny_quick(tmp_path, dtype):
    from benchmarks import bench_trees

    out = tmp_path / "trees"
    conf = ["--min-confidence", "0.2"] if dtype == "bfloat16" else []  # the model builders' confidence rule
    assert bench_trees.main(["--tiny", "--quick", "--dtype", dtype, "--threads", "1", "--builders",
                             "ngram,sequoia,eagle2", "--calib-prompts", "2", "--allow-dirty", "--out", str(out),
                             *conf]) == 0
    prov = json.loads((out / "provenance.json").read_text())
    res = json.loads((out / "results.json").read_text())
    assert prov["complete"] and res["meta"]["complete"] and res["meta"]["dtype"] == dtype
    seen = {(r["builder"], r["temperature"]) for r in res["results"]}
    assert seen == {(b, t) for b in ("plain", "ngram", "sequoia", "eagle2") for t in (0.0, 1.0)}
    assert all(r["tau"] >= 1.0 for r in res["results"])
    assert (out / "results.png").exists()


@pytest.mark.parametrize("value", ["1.0", "-0.1", "nan"])
def test_bench_trees_refuses_a_confidence_outside_0_1(tmp_path, value, capsys):
    from benchmarks import bench_trees

    with pytest.raises(SystemExit) as exc:
        bench_trees.main(["--tiny", "--quick", "--min-confidence", value, "--allow-dirty", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--min-confidence must be in [0, 1)" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@needs_prompts
@pytest.mark.gemma
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_run_quick(tmp_path, dtype):
    from benchmarks import run

    out = tmp_path / "speed"
    # in bf16 a tuning variant on the 4-bit head (the sixth --variant value; int4 needs bf16)
    variant = ["--variant", "q4", "head", "2,1", "0.2", "without_replacement", "int4"] if dtype == "bfloat16" else []
    assert run.main(["--quick", "--methods", "ts_ngram", "--no-llama", "--dtypes", dtype, "--threads", "1",
                     *variant, "--allow-dirty", "--out", str(out)]) == 0
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["complete"]
    from benchmarks.harness import read_rounds

    assert not (out / "rounds.jsonl").exists()  # a finished run keeps its rounds compressed
    rows = read_rounds(out / "rounds.jsonl")
    assert {r["method"] for r in rows} == {"ts_plain", "hf_plain", "ts_ngram"} | ({"q4"} if variant else set())
    if variant:
        assert ("treespec generate --draft head --tree 2,1 --min-confidence 0.2 --law without_replacement "
                "--draft-quantize int4") in (out / "table.md").read_text()
    assert {r["dtype"] for r in rows} == {dtype} and all(r["new_tokens"] > 0 for r in rows)
    # the host reference: one weight read per round, in every row of it, summarised in the table
    assert all(r["host_stream_s"] > 0 and r["host_stream_bytes"] > 4e8 for r in rows)
    table = (out / "table.md").read_text()
    assert f"- Host reference ({dtype}): reading the target's" in table
    assert "Where a round goes" in table and "| ts_ngram | " in table.split("Where a round goes")[1]
    if dtype == "float32":  # T=0 in fp32: treespec rows are token-identical to its plain decoding
        assert all(r["equal_to_ts_plain"] for r in rows if r["engine"] == "treespec")


@pytest.mark.parametrize("variant, match", [
    (["q4", "head", "2,1", "0.2"], "(5 or 6 values); got 4"),
    (["q4", "head", "2,1", "0.2", "iid", "int3"], "QUANTIZE must be '-', 'none' or one of int4"),
    (["q4", "head", "2,1", "0.2", "iid", "int4"], "q4: a 4-bit draft head runs in bfloat16 only; the run's dtypes "
                                                  "are float32"),
    (["ng", "ngram", "8,4", "-", "-"], "ng: n-gram lookup takes its shape in its name: DRAFT ngram:8,4 with TREE '-'"),
])
def test_run_refuses_a_malformed_variant(capsys, variant, match):
    from benchmarks import run

    with pytest.raises(SystemExit) as info:
        run.main(["--variant", *variant, "--no-llama", "--dtypes", "float32"])
    assert info.value.code == 2 and match in " ".join(capsys.readouterr().err.split())


@needs_prompts
@pytest.mark.gemma
def test_run_stopped_part_way_resumes_to_every_round_once(tmp_path, monkeypatch):
    from benchmarks import common, harness, run

    clean = {"commit": "f" * 40, "short": "f" * 7, "dirty": False, "changed": [], "untracked": []}
    monkeypatch.setattr(common, "git_state", lambda repo=common.REPO: dict(clean))
    monkeypatch.setattr(run, "git_state", lambda repo=common.REPO: dict(clean))
    monkeypatch.setattr(harness, "git_state", lambda repo=common.REPO: dict(clean))
    out = tmp_path / "speed"
    real, calls = harness.round_order, {"n": 0}

    def stopped_at_the_third_prompt(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "round_order", stopped_at_the_third_prompt)
    with pytest.raises(KeyboardInterrupt):
        run.main(["--quick", "--methods", "ts_plain", "--no-llama", "--dtypes", "float32", "--threads", "1",
                  "--out", str(out)])
    first = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert len({r["prompt_id"] for r in first}) == 2 and len(first) == 4  # ts_plain and hf_plain on 2 prompts
    assert "PARTIAL RUN: 2 of 3 rounds" in (out / "table.md").read_text()
    assert not json.loads((out / "provenance.json").read_text()).get("complete")
    with (out / "rounds.jsonl").open("a") as f:  # a writer killed in the middle of a line
        f.write('{"dtype": "flo')
    monkeypatch.setattr(harness, "round_order", real)
    monkeypatch.setattr(harness, "machine_info", lambda: {**common.machine_info(), "cpu": "Another CPU"})
    with pytest.raises(run.ProvenanceError, match="machine differs"):
        run.main(["--resume", str(out)])
    monkeypatch.setattr(harness, "machine_info", common.machine_info)
    assert run.main(["--resume", str(out)]) == 0
    rows = harness.read_rounds(out / "rounds.jsonl")  # finished: rounds.jsonl.gz
    assert rows[:4] == first  # what was measured is kept as it was
    keys = [(r["prompt_id"], r["repeat"], r["method"]) for r in rows]
    assert len(keys) == len(set(keys)) == 6
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["complete"] and len(prov["sessions"]) == 1
    assert "PARTIAL" not in (out / "table.md").read_text()
    with pytest.raises(run.ProvenanceError, match="complete"):
        run.main(["--resume", str(out)])


def test_head_ablation_tiny(tmp_path):
    """head_ablation.py --tiny: a tiny random target, its own corpus (with the fused layers), three variants."""
    from benchmarks import head_ablation

    out = tmp_path / "ablation"
    assert head_ablation.main(["--tiny", "--steps", "6", "--variants", "base,fused,ttt2", "--prompts", "3",
                               "--new-tokens", "8", "--depths", "3", "--threads", "1", "--allow-dirty",
                               "--out", str(out)]) == 0
    assert json.loads((out / "provenance.json").read_text())["complete"]
    fused = json.loads((out / "variant-fused.json").read_text())
    assert fused["changes"] == {"feature_layers": [0, 2]} and fused["train_summary"]["step"] == 6
    assert len(fused["top1_agreement_T0_by_depth"]) == 3 and fused["positions_T0_by_depth"][0] > 0
    assert "| fused |" in (out / "table.md").read_text()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_profile_components_add_up(dtype):
    """profile_hardware's breakdown on a tiny Gemma-3: every part measured, the rest is what the pass
    spends outside the body and the LM head product, and the LM head rate follows from its time."""
    import torch

    from benchmarks.profile_hardware import component_times
    from treespec.models.tiny import tiny_model

    model = tiny_model("gemma3", 64, num_layers=2).to(getattr(torch, dtype)).eval()
    comp = component_times(model, sizes=(1, 4), rounds=3, prefix=8)
    for n, c in comp["ms"].items():
        assert min(c["pass"], c["body"], c["lm_head"]) > 0
        assert c["rest"] == pytest.approx(c["pass"] - c["body"] - c["lm_head"])
        assert c["lm_head_gflops"] == pytest.approx(2 * int(n) * 64 * 32 / (c["lm_head"] / 1000) / 1e9, rel=1e-9)
        # the floor: n tokens x every linear weight (the 2 decoder layers' and the 64 x 32 LM head) at the peak rate
        layer_weights = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "layers" in name)
        assert comp["matmul_params"] == 64 * 32 + layer_weights
        assert c["matmul_floor"] == pytest.approx(2 * int(n) * comp["matmul_params"] / comp["peak_gflops"] / 1e6)
    assert comp["peak_gflops"] > 0


def test_profile_verification_times_measure_every_part():
    """profile_hardware --verification on a tiny Gemma-3 (vocabulary 64, q on 16 tokens): every part of a
    T=1 tree (pass, target_probs, both rejection verifiers on the support path and dense, greedy) timed."""
    import torch

    from benchmarks.profile_hardware import verification_times
    from treespec.models.tiny import tiny_model

    model = tiny_model("gemma3", 64, num_layers=2).to(torch.float32).eval()
    ver = verification_times(model, sizes=(4, 8), rounds=2, prefix=8, subset=16, width=3)
    assert set(ver["ms"]) == {"4", "8"}
    for c in ver["ms"].values():
        assert set(c) == {"pass", "probs", "rrs", "rrs_wor", "rrs_dense", "rrs_wor_dense", "greedy"}
        assert min(c.values()) > 0


def test_head_ablation_continued_from_a_head(tmp_path):
    """--init-head: every variant starts from the given head with the recipe's base (depths 3), the run folder
    names the starting head; a variant changing what the head fixes and a missing file are refused."""
    import torch

    from benchmarks import head_ablation
    from treespec.distill.train import TrainConfig
    from treespec.drafting.head import new_head
    from treespec.models.tiny import tiny_model

    target = tiny_model("gemma3", 64, seed=0, num_layers=4, logit_scale=6.0, max_positions=2048)  # as --tiny builds it
    start = new_head(target, torch.arange(64), seed=5)
    start.save(tmp_path / "start.safetensors")
    common = ["--tiny", "--prompts", "3", "--new-tokens", "8", "--depths", "2", "--threads", "1", "--allow-dirty"]
    out = tmp_path / "ablation"
    assert head_ablation.main([*common, "--steps", "4", "--warmup", "1", "--variants", "base,tv",
                               "--init-head", str(tmp_path / "start.safetensors"), "--out", str(out)]) == 0
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["complete"] and prov["ablation"]["base"]["depths"] == 3 and prov["ablation"]["base"]["warmup"] == 1
    tv = json.loads((out / "variant-tv.json").read_text())
    assert tv["changes"] == {"w_tv": 1.0} and tv["train_summary"]["step"] == 4
    assert "agree_d3" in tv["train_summary"]["ema"] and "tv" in tv["train_summary"]["ema"]  # trained at depths 3, with tv
    assert "tv" not in json.loads((out / "variant-base.json").read_text())["train_summary"]["ema"]
    assert "| tv |" in (out / "table.md").read_text()
    other = new_head(target, torch.arange(64), seed=6)
    other.save(tmp_path / "other.safetensors")
    cfg = TrainConfig(steps=4)
    names = {head_ablation.run_name("tv", cfg, tmp_path / f) for f in ("start.safetensors", "other.safetensors")}
    assert len(names | {head_ablation.run_name("tv", cfg)}) == 3  # the starting head's bytes name the run
    assert head_ablation.main([*common, "--variants", "vocab8k", "--init-head", str(tmp_path / "start.safetensors"),
                               "--out", str(tmp_path / "x")]) == 2
    assert head_ablation.main([*common, "--variants", "tv", "--init-head", str(tmp_path / "none.safetensors"),
                               "--out", str(tmp_path / "y")]) == 2
    assert head_ablation.main([*common, "--variants", "tv", "--max-shards", "0", "--out", str(tmp_path / "z")]) == 2
    assert not any((tmp_path / d).exists() for d in ("x", "y", "z"))  # refused before a results folder exists


def test_head_ablation_starts_every_variant_from_the_head(tmp_path, monkeypatch):
    """With --init-head, train() receives the head file and the continued base (depths 3, lr 5e-4) for every variant."""
    import importlib

    import torch

    from benchmarks import head_ablation
    from treespec.drafting.head import new_head
    from treespec.models.tiny import tiny_model

    target = tiny_model("gemma3", 64, seed=0, num_layers=4, logit_scale=6.0, max_positions=2048)
    new_head(target, torch.arange(64), seed=5).save(tmp_path / "start.safetensors")
    train_module = importlib.import_module("treespec.distill.train")  # the module (the package exports a function of that name)
    calls = []
    real = train_module.train

    def spy(target, corpus, run_dir, cfg, **kw):
        calls.append((cfg, kw.get("init_head")))
        return real(target, corpus, run_dir, cfg, **kw)

    monkeypatch.setattr(train_module, "train", spy)
    assert head_ablation.main(["--tiny", "--prompts", "2", "--new-tokens", "4", "--depths", "1", "--threads", "1",
                               "--allow-dirty", "--steps", "2", "--warmup", "1", "--variants", "base,tv",
                               "--init-head", str(tmp_path / "start.safetensors"), "--out", str(tmp_path / "o")]) == 0
    assert [str(c[1]) for c in calls] == [str(tmp_path / "start.safetensors")] * 2
    assert all(c[0].depths == 3 and c[0].lr == 5e-4 and c[0].warmup == 1 for c in calls)
    assert [c[0].w_tv for c in calls] == [0.0, 1.0]


@needs_prompts
@pytest.mark.gemma
def test_sampling_cost_quick(tmp_path):
    """benchmarks/sampling_cost.py: the filter timings and the paired plain-decoding table, in one round."""
    from benchmarks import sampling_cost

    out = tmp_path / "cost"
    assert sampling_cost.main(["--per-category", "1", "--new-tokens", "3", "--rounds", "1", "--threads", "1",
                               "--dtype", "float32", "--allow-dirty", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [f["filter"] for f in res["filters"]] == [name for name, *_ in sampling_cost.FILTERS] + list(
        sampling_cost.KERNELS)
    assert all(f["median_ms"] > 0 for f in res["filters"])
    assert {r["setting"] for r in res["summary"]} == {name for name, *_ in sampling_cost.SETTINGS}
    assert res["summary"][0]["ratio_median"] == 1.0 and "| T=0.7 top-p 0.95 |" in (out / "table.md").read_text()


@needs_prompts
@pytest.mark.gemma
def test_profile_int8_head_quick(tmp_path, monkeypatch):
    """benchmarks/profile_int8_head.py: the distance table (every target) and t(n) for both dtypes, in one pass."""
    from benchmarks import profile_int8_head

    monkeypatch.setattr(profile_int8_head, "ROWS", (1, 2))
    out = tmp_path / "int8"
    assert profile_int8_head.main(["--per-category", "1", "--new-tokens", "2", "--passes", "1", "--threads", "1",
                                   "--allow-dirty", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    names = [d["target"] for d in res["distance"]]
    assert names[:3] == ["bfloat16", "bfloat16, int8 head", "float32, int8 head"]
    assert all(0 <= d["kl_mean"] and 0 <= d["top1_agreement"] <= 1 for d in res["distance"])
    assert {(c["target"], c["n"]) for c in res["pass_costs"]} == {
        (t, n) for t in ("bf16", "bf16, int8 head", "float32", "float32, int8 head") for n in (1, 2)}
    assert "| float32 | 2 |" in (out / "table.md").read_text()
    from treespec.models.fast.int8_head import activation_levels

    levels = activation_levels()
    assert res["act_levels"] == levels and f"activation codes: -{levels}..{levels}" in (out / "table.md").read_text()


@needs_prompts
@pytest.mark.gemma
def test_judge_quality_quick(tmp_path):
    """benchmarks/judge_quality.py --quick: the lossless default and the shipped judge on two items of each task
    and one Spec-Bench prompt; the lossless setting judges nothing, every run is scored."""
    from benchmarks import judge_quality

    out = tmp_path / "judge"
    assert judge_quality.main(["--quick", "--threads", "1", "--thresholds=-1e9", "--allow-dirty",
                               "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert json.loads((out / "provenance.json").read_text())["complete"]
    assert set(res["summary"]) == {"lossless", "judge@-1e+09"} and len(res["tasks"]) == 8
    assert all(r["runs"]["lossless"]["judged"] == 0 for r in res["tasks"])
    assert res["summary"]["lossless"]["judged_share"] == 0 and res["summary"]["lossless"]["prompts_diverged"] == 0
    # a judge that accepts every draft keeps some token the target would not have chosen
    assert res["summary"]["judge@-1e+09"]["judged_share"] > 0
    assert "| lossless |" in (out / "table.md").read_text()


def test_judge_tasks_are_seeded_and_answered():
    from benchmarks.judge_quality import make_tasks

    tasks = make_tasks(3, seed=0)
    assert tasks == make_tasks(3, seed=0) and tasks != make_tasks(3, seed=1)
    assert [t["task"] for t in tasks[:4]] == ["addition", "sequence", "repeat", "next letter"]
    assert not any(t["prompt"].endswith(" ") for t in tasks)  # a word's space belongs to the answer's token
    a, b = (int(x) for x in tasks[0]["prompt"].splitlines()[-1].rstrip(" =").split(" + "))
    assert tasks[0]["answer"] == str(a + b)
