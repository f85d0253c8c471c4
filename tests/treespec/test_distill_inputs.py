"""The distill commands against hostile or broken input, and in both dtypes.

* checkpoints are loaded without unpickling objects: a planted ``ckpt-N.pt`` / ``medusa-ckpt.pt``
  whose pickle would create a marker file is refused (named error; CLI exit 2) and never executed;
* every command (build-corpus, train, export, evaluate, medusa) runs in float32 and with bfloat16
  forced (``--dtype bfloat16``, ``--amp bf16``) on a tiny Gemma-3 saved with a byte-level tokenizer;
* bad input (missing / garbage / truncated files, non-UTF-8 prompts, bad numbers) ends with one
  line on stderr and exit status 2, no traceback;
* the eval-set guard checks content: a renamed copy of an eval file, or one eval prompt mixed into
  train prompts, is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treespec.distill.cli import main
from treespec.distill.corpus import check_not_eval, shared_dir
from treespec.distill.inputs import DistillInputError, UnsafeCheckpointError

from cache_helpers import read_only_corrupted_cache

PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
           "Translate to French: good morning", "What is 12 times 7? Think step by step.",
           "Once upon a time there was a small robot.", "List three prime numbers and explain why."]


def make_model_dir(out: Path) -> Path:
    """A tiny random Gemma-3 (vocabulary 260) + a byte-level word tokenizer, saved as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from treespec.models.tiny import tiny_model

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = 4 + i
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                pre_tokenizers.Split("", "isolated")])
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    model = tiny_model("gemma3", len(vocab), seed=0, logit_scale=6.0)
    model.config.eos_token_id = 2
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny-gemma"))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)`` in-process: (exit status, stdout, stderr)."""
    code = 0
    try:
        with torch.enable_grad():
            main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def last_json(out: str) -> dict:
    """The JSON document a command prints last (log lines may come before it)."""
    return json.loads(out[out.index("{") if out.startswith("{") else out.index("\n{") + 1:])


def small_run(model_dir: Path, tmp: Path, dtype: str, capsys) -> dict[str, Path]:
    """build-corpus -> train -> export with ``dtype``; returns the paths."""
    p = write_prompts(tmp / "train.jsonl", PROMPTS)
    corpus, run, head = tmp / f"corpus-{dtype}", tmp / f"run-{dtype}", tmp / f"head-{dtype}.safetensors"
    common = ["--target", model_dir, "--dtype", dtype, "--no-progress"]
    code, out, err = run_cli(["build-corpus", *common, "--prompts", p, "--out", corpus, "--max-len", 40, "--topk", 4,
                              "--shard-positions", 100, "--batch-size", 2, "--continuation", "greedy",
                              "--new-tokens", 4], capsys)
    assert code == 0, err
    assert last_json(out)["complete"]
    amp = "bf16" if dtype == "bfloat16" else "off"
    code, out, err = run_cli(["train", *common, "--corpus", corpus, "--run-dir", run, "--steps", 6, "--batch-size", 2,
                              "--seq-len", 16, "--vocab-size", 64, "--intermediate-size", 32, "--num-heads", 4,
                              "--ckpt-every", 3, "--amp", amp], capsys)
    assert code == 0, err
    assert last_json(out)["precision"] == ("bf16" if dtype == "bfloat16" else "fp32")
    code, out, err = run_cli(["export", "--run-dir", run, "--out", head, "--dtype", dtype], capsys)
    assert code == 0, err
    return {"prompts": p, "corpus": corpus, "run": run, "head": head}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_command_in_both_dtypes(model_dir, tmp_path, capsys, dtype):
    from safetensors import safe_open

    paths = small_run(model_dir, tmp_path, dtype, capsys)
    with safe_open(str(paths["head"]), framework="pt") as fh:
        assert fh.get_tensor("fc.weight").dtype == getattr(torch, dtype)
    common = ["--target", model_dir, "--dtype", dtype, "--no-progress"]
    code, out, err = run_cli(["evaluate", *common, "--head", paths["head"], "--prompts", paths["prompts"],
                              "--num-prompts", 2, "--new-tokens", 4, "--json", tmp_path / "m.json"], capsys)
    assert code == 0, err  # bf16: "expected m1 and m2 to have the same dtype" before the fix
    metrics = last_json(out)
    assert metrics["dtype"] == f"torch.{dtype}" and metrics["positions_T0"] > 0
    assert 0 <= metrics["top1_agreement_T0"] <= 1 and 0 <= metrics["sum_min_pq_T1"] <= 1
    assert json.loads((tmp_path / "m.json").read_text()) == metrics
    code, out, err = run_cli(["medusa", *common, "--corpus", paths["corpus"], "--run-dir", tmp_path / "medusa",
                              "--steps", 4, "--batch-size", 8, "--vocab-from", paths["head"], "--ckpt-every", 2,
                              "--export", tmp_path / "medusa.safetensors", "--evaluate", paths["corpus"]], capsys)
    assert code == 0, err
    assert last_json(out)["steps"] == 4 and (tmp_path / "medusa.safetensors").exists()


# ---------------------------------------------------------------------- malicious checkpoints
class _Payload:
    """Unpickling this object runs ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": 1, "head": {}, "payload": _Payload(marker)}, path)
    return path


def test_payload_really_runs_when_unpickled(tmp_path):
    """Positive control: the planted checkpoint executes its payload under full unpickling."""
    marker = tmp_path / "marker"
    plant(tmp_path / "ckpt-1.pt", marker)
    torch.load(tmp_path / "ckpt-1.pt", weights_only=False)
    assert marker.exists()


def test_export_refuses_malicious_checkpoint(tmp_path, capsys):
    marker = tmp_path / "marker"
    plant(tmp_path / "run" / "ckpt-1.pt", marker)
    code, _, err = run_cli(["export", "--run-dir", tmp_path / "run", "--out", tmp_path / "x.safetensors"], capsys)
    assert code == 2 and "ckpt-1.pt" in err and "refused" in err and "Traceback" not in err
    assert not marker.exists() and not (tmp_path / "x.safetensors").exists()


def test_export_refuses_malicious_checkpoint_subprocess(tmp_path):
    """The real command line: exit status 2, one line on stderr, payload not run."""
    marker = tmp_path / "marker"
    plant(tmp_path / "run" / "ckpt-1.pt", marker)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TREESPEC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "treespec.distill", "export", "--run-dir", str(tmp_path / "run"),
                           "--out", str(tmp_path / "x.safetensors")], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert not marker.exists(), "the checkpoint's payload ran"
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "ckpt-1.pt" in proc.stderr


def test_train_and_medusa_resume_refuse_malicious_checkpoints(model_dir, tmp_path, capsys):
    from treespec.distill.medusa import MedusaTrainConfig, train_medusa
    from treespec.distill.train import TrainConfig, train
    from treespec.models.loading import load_model

    paths = small_run(model_dir, tmp_path, "float32", capsys)
    marker = tmp_path / "marker"
    plant(tmp_path / "evil-run" / "ckpt-99.pt", marker)
    plant(tmp_path / "evil-medusa" / "medusa-ckpt.pt", marker)
    target = load_model(str(model_dir), dtype="float32")
    with pytest.raises(UnsafeCheckpointError, match="ckpt-99.pt"):
        train(target, paths["corpus"], tmp_path / "evil-run", TrainConfig(steps=2), progress=False,
              log=lambda *_: None)
    with pytest.raises(UnsafeCheckpointError, match="medusa-ckpt.pt"):
        train_medusa(target, [paths["corpus"]], tmp_path / "evil-medusa", MedusaTrainConfig(steps=2),
                     progress=False)
    common = ["--target", model_dir, "--dtype", "float32", "--no-progress", "--corpus", paths["corpus"]]
    code, _, err = run_cli(["train", *common, "--run-dir", tmp_path / "evil-run", "--steps", 2], capsys)
    assert code == 2 and "ckpt-99.pt" in err and "Traceback" not in err
    code, _, err = run_cli(["medusa", *common, "--run-dir", tmp_path / "evil-medusa", "--steps", 2], capsys)
    assert code == 2 and "medusa-ckpt.pt" in err
    assert not marker.exists()


def test_checkpoints_written_now_load_safely(model_dir, tmp_path, capsys):
    """What train and medusa write loads with weights_only=True (and resumes)."""
    paths = small_run(model_dir, tmp_path, "float32", capsys)
    for ckpt in paths["run"].glob("ckpt-*.pt"):
        state = torch.load(ckpt, weights_only=True)
        assert state["step"] in (3, 6) and isinstance(state["head_config"], dict)


# ---------------------------------------------------------------------- bad input
def _bad_head_files(tmp: Path, good: Path) -> dict[str, Path]:
    garbage = tmp / "garbage.safetensors"
    garbage.write_bytes(os.urandom(3000))
    truncated = tmp / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return {"missing": tmp / "nope.safetensors", "garbage": garbage, "truncated": truncated}


def test_bad_input_is_one_line_and_status_2(model_dir, tmp_path, capsys):
    paths = small_run(model_dir, tmp_path, "float32", capsys)
    heads = _bad_head_files(tmp_path, paths["head"])
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\u00e9 cr\u00e8me"}\n'.encode("latin-1"))
    notjson = tmp_path / "notjson.jsonl"
    notjson.write_text('{"prompt": "ok"}\n{"prompt": \n', encoding="utf-8")
    m = ["--target", model_dir, "--dtype", "float32", "--no-progress"]
    ev = ["evaluate", *m, "--prompts", paths["prompts"], "--num-prompts", 2, "--new-tokens", 4]
    bc = ["build-corpus", *m, "--out", tmp_path / "c2"]
    tr = ["train", *m, "--run-dir", tmp_path / "r2"]
    cases = {
        "head missing": (ev + ["--head", heads["missing"]], "no such file"),
        "head garbage": (ev + ["--head", heads["garbage"]], "not a readable treespec EAGLE head"),
        "head truncated": (ev + ["--head", heads["truncated"]], "not a readable treespec EAGLE head"),
        "head is a checkpoint": (ev + ["--head", next(paths["run"].glob("ckpt-*.pt"))], "not a readable"),
        "prompts missing (evaluate)": (ev[:5] + ["--head", paths["head"], "--prompts", tmp_path / "no.jsonl"],
                                       "no such file"),
        "run dir missing": (["export", "--run-dir", tmp_path / "no-run", "--out", tmp_path / "x.safetensors"],
                            "no such directory"),
        "run dir without checkpoint": (["export", "--run-dir", tmp_path, "--out", tmp_path / "x.safetensors"],
                                       "no checkpoint"),
        "corpus missing (train)": (tr + ["--corpus", tmp_path / "no-corpus"], "no such directory"),
        "corpus missing (medusa)": (["medusa", *m, "--corpus", tmp_path / "no-corpus", "--run-dir", tmp_path / "m"],
                                    "no such directory"),
        "corpus without manifest": (tr + ["--corpus", paths["run"]], "manifest"),
        "prompts missing": (bc + ["--prompts", tmp_path / "no.jsonl"], "no such file"),
        "prompts not UTF-8": (bc + ["--prompts", latin1], "not UTF-8"),
        "prompts not JSON": (bc + ["--prompts", notjson], "line 2: not JSON"),
        "negative steps": (tr + ["--corpus", paths["corpus"], "--steps", -5], "steps must be >= 1"),
        "zero lr": (tr + ["--corpus", paths["corpus"], "--lr", 0], "lr"),
        "zero batch size": (bc + ["--prompts", paths["prompts"], "--batch-size", 0], "batch-size"),
        "negative topk": (bc + ["--prompts", paths["prompts"], "--topk", -1], "topk"),
        "negative num-prompts": (ev + ["--head", paths["head"], "--num-prompts", -1], "--num-prompts"),
        "negative time limit": (bc + ["--prompts", paths["prompts"], "--time-limit", -1], "--time-limit"),
        "zero threads": (["export", "--run-dir", paths["run"], "--out", tmp_path / "y.st", "--threads", 0],
                         "--threads"),
        "medusa bad weights": (["medusa", *m, "--corpus", paths["corpus"], "--corpus-weights", "a",
                                "--run-dir", tmp_path / "m"], "--corpus-weights"),
        "medusa negative steps": (["medusa", *m, "--corpus", paths["corpus"], "--steps", -1,
                                   "--run-dir", tmp_path / "m"], "steps"),
    }
    failures = []
    for name, (argv, expected) in cases.items():
        code, _, err = run_cli(argv, capsys)
        lines = err.strip().splitlines()
        if code != 2 or len(lines) != 1 or expected not in err or "Traceback" in err:
            failures.append(f"{name}: status {code}, stderr {err[-300:]!r}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------- eval-set guard
needs_shared = pytest.mark.skipif(not (shared_dir() / "data" / "eval" / "spec_bench.prompts.jsonl").exists(),
                                  reason="the shared eval set is not present")


@needs_shared
def test_renamed_copy_of_eval_set_is_refused(tmp_path, model_dir, capsys):
    copy = tmp_path / "my_train_prompts.jsonl"
    copy.write_bytes((shared_dir() / "data" / "eval" / "spec_bench.prompts.jsonl").read_bytes())
    with pytest.raises(DistillInputError, match="evaluation set"):
        check_not_eval(copy)
    code, _, err = run_cli(["build-corpus", "--target", model_dir, "--prompts", copy, "--out", tmp_path / "c",
                            "--no-progress"], capsys)
    assert code == 2 and "evaluation set" in err and not (tmp_path / "c").exists()


@needs_shared
@pytest.mark.parametrize("eval_file", ["spec_bench.prompts.jsonl", "humaneval.prompts.jsonl"])
def test_one_eval_prompt_mixed_into_train_prompts_is_refused(tmp_path, eval_file):
    rows = [json.loads(x) for x in (shared_dir() / "data" / "eval" / eval_file).read_text().splitlines() if x.strip()]
    sneaky = "  " + "\n\n ".join(rows[len(rows) // 2]["prompt"].split()) + " \t"  # other whitespace, same words
    mixed = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:3] + [sneaky] + PROMPTS[3:])
    with pytest.raises(DistillInputError, match="prompt 4 is a prompt of the evaluation set"):
        check_not_eval(mixed)
    clean = write_prompts(tmp_path / "clean.jsonl", PROMPTS)
    assert check_not_eval(clean) == clean.resolve()


# ---------------------------------------------------------------------- targets and caches
def test_bad_target_is_one_line_and_status_2(model_dir, tmp_path, capsys):
    """A missing --target directory is refused before anything is read; an existing folder that holds
    no model ends in the loader's OSError / ValueError, also named on one line with status 2."""
    paths = small_run(model_dir, tmp_path, "float32", capsys)
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    commands = {
        "build-corpus": ["build-corpus", "--prompts", paths["prompts"], "--out", tmp_path / "c"],
        "train": ["train", "--corpus", paths["corpus"], "--run-dir", tmp_path / "r", "--steps", 2],
        "medusa": ["medusa", "--corpus", paths["corpus"], "--run-dir", tmp_path / "m", "--steps", 2],
        "evaluate": ["evaluate", "--head", paths["head"], "--prompts", paths["prompts"], "--num-prompts", 1],
    }
    failures = []
    for name, argv in commands.items():
        for target, expected in ((tmp_path / "no-such-model", "no such model directory"), (empty, "error:")):
            code, out, err = run_cli([*argv, "--target", target, "--no-progress"], capsys)
            lines = err.strip().splitlines()
            if code != 2 or len(lines) != 1 or expected not in err or "Traceback" in err:
                failures.append(f"{name} --target {target.name}: status {code}, stderr {err[-300:]!r}")
    assert not failures, "\n".join(failures)
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists() and not (tmp_path / "m").exists()


def test_read_only_corrupted_cache_is_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    """--target embedded over a corrupted cache that cannot be rebuilt: the loader's CacheError is
    reported as one line, exit status 2 (a stub stands in for the Gemma conversion)."""
    from treespec.models import loading

    def stub(out_dir, progress):
        for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
            (out_dir / name).write_bytes(b"{}")

    root = tmp_path / "cache"
    monkeypatch.setattr(loading, "_convert_embedded_gemma", stub)
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    with read_only_corrupted_cache(root, monkeypatch):
        code, out, err = run_cli(["build-corpus", "--prompts", prompts, "--out", tmp_path / "c", "--no-progress"],
                                 capsys)
    assert code == 2, err
    lines = err.strip().splitlines()  # the loader may first say it tries to rebuild
    assert sum("error:" in line for line in lines) == 1 and lines[-1].startswith(
        "python -m treespec.distill build-corpus: error: CacheError:"), err
    assert "TREESPEC_CACHE" in lines[-1], err
    assert "Traceback" not in err and out == ""


def test_build_corpus_from_stored_continuations_by_command_line(model_dir, tmp_path, capsys):
    """``build-corpus --continuations DIR``: rows from the folder's recorded source (or --rows), one shard
    per chunk, the JSON summary; bad combinations and a mismatched row range are one error line, exit 2."""
    from transformers import AutoTokenizer

    from treespec.distill.continuations import ContinuationOptions, build_continuations
    from treespec.distill.corpus import read_prompts
    from treespec.models.loading import load_model

    p = write_prompts(tmp_path / "train.jsonl", PROMPTS)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = read_prompts(p, seed=0)[1:5]
    model = load_model(str(model_dir), dtype="float32")
    cont = tmp_path / "cont"
    build_continuations(model, [tok(r["prompt"])["input_ids"] for r in rows], cont,
                        ContinuationOptions(new_tokens=3, batch_size=2, chunk_size=2), eos={2}, progress=False,
                        source={"prompts": p.name, "rows": "1:5", "order_seed": 0})
    common = ["build-corpus", "--target", model_dir, "--dtype", "float32", "--no-progress", "--prompts", p,
              "--continuations", cont, "--topk", 0]
    code, out, err = run_cli([*common, "--out", tmp_path / "c"], capsys)
    assert code == 0, err
    summary = last_json(out)
    assert summary["shards"] == 2 and summary["sequences"] == 4 and summary["complete"]
    code, _, err = run_cli([*common, "--out", tmp_path / "c2", "--rows", "0:4"], capsys)
    assert code == 2 and "other prompts" in err and err.count("\n") == 1
    code, _, err = run_cli([*common, "--out", tmp_path / "c3", "--continuation", "greedy"], capsys)
    assert code == 2 and "--continuation" in err
    code, _, err = run_cli([*common[:-4], "--continuations", tmp_path, "--out", tmp_path / "c4"], capsys)
    assert code == 2 and "no continuation manifest" in err
