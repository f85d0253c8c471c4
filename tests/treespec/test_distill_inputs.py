"""The distill commands against hostile or broken input, and in both dtypes.

* checkpoints are loaded without unpickling objects: a planted ``ckpt-N.pt`` / ``medusa-ckpt.pt``
  whose pickle would create a marker file is refused (named error; CLI exit 2) and never executed;
* every command (build-corpus, train, export, evaluate, medusa) runs in float32 and with bfloat16
  forced (``--dtype bfloat16``, ``--amp bf16``) on a tiny Gemma-3 saved with a byte-level tokenizer;
* bad input (missing / garbage / truncated files, non-UTF-8 prompts, bad numbers) ends with one
  line on stderr and exit status 2, no traceback;
* the eval-set guard checks content: a renamed copy of an eval file, or one eval prompt mixed into
  train prompts, is refused, also with its case, whitespace or punctuation changed, a character added, removed
  or changed, or inside a longer prompt; the shipped train prompts pass.
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


EVAL_LIKE = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
             "Who is the coach of the university of Kentucky basketball team?",
             "def fib(n: int):\n    \"\"\"Return the n-th Fibonacci number.\n    >>> fib(10)\n    55\n    \"\"\"\n"]


def _edited(prompt: str, edit: str) -> str:
    middle = len(prompt) // 2
    return {"one character added": prompt[:middle] + "x" + prompt[middle:],
            "one character removed": prompt[:middle] + prompt[middle + 1:],
            "one character changed": prompt[:middle] + ("Q" if prompt[middle] != "Q" else "Z") + prompt[middle + 1:],
            "case changed": prompt.swapcase(),
            "upper case": prompt.upper(),
            "punctuation changed": prompt.replace(".", "!").replace(",", ";").replace("?", ".") + " ...",
            "punctuation removed": "".join(ch for ch in prompt if ch.isalnum() or ch.isspace()),
            "inside a longer prompt": "Answer the question below, briefly. " + prompt + " Give one sentence."}[edit]


EDITS = ["one character added", "one character removed", "one character changed", "case changed", "upper case",
         "punctuation changed", "punctuation removed", "inside a longer prompt"]


@pytest.mark.parametrize("edit", EDITS)
def test_eval_index_refuses_edited_copies(edit):
    """The guard matches on case-folded text without whitespace or punctuation, and on near-duplicates
    (a few character edits, or the eval prompt inside a longer one); before it compared whitespace-normalised
    text only, so every one of these edits slipped through."""
    from treespec.distill.corpus import EvalIndex

    index = EvalIndex([(f"row {i + 1}", p) for i, p in enumerate(EVAL_LIKE)])
    for i, prompt in enumerate(EVAL_LIKE):
        found = index.match(_edited(prompt, edit))
        assert found is not None and found[1] == f"row {i + 1}", (edit, prompt, found)


def test_eval_index_accepts_different_prompts():
    from treespec.distill.corpus import EvalIndex

    index = EvalIndex([(f"row {i + 1}", p) for i, p in enumerate(EVAL_LIKE)])
    different = ["Compose an engaging travel blog post about a recent trip to Japan, highlighting the food.",
                 "Who is the coach of the university of Michigan football team?",
                 "def fact(n: int):\n    \"\"\"Return n factorial.\"\"\"\n", "Who?", "Compose", "...", "",
                 *PROMPTS]
    for prompt in different:
        assert index.match(prompt) is None, prompt


@needs_shared
@pytest.mark.parametrize("edit", ["one character added", "case changed", "punctuation changed"])
def test_edited_eval_prompt_mixed_into_train_prompts_is_refused(tmp_path, edit):
    rows = [json.loads(x) for x in (shared_dir() / "data" / "eval" / "spec_bench.prompts.jsonl").read_text()
            .splitlines() if x.strip()]
    row = len(rows) // 3
    mixed = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[:2] + [_edited(rows[row]["prompt"], edit)] + PROMPTS[2:])
    where = f"spec_bench.prompts.jsonl row {row + 1}"
    with pytest.raises(DistillInputError, match=f"prompt 3 is .*evaluation set .*{where}"):
        check_not_eval(mixed)


@pytest.mark.skipif(not (shared_dir() / "data" / "train" / "train_prompts.jsonl").exists(),
                    reason="the shared train prompts are not present")
def test_shipped_train_prompts_are_not_taken_for_eval_prompts(tmp_path):
    """No false positive on a sample of the shipped train prompts (the whole file, 12,141 prompts, passes too:
    about 6 s on 2 cores)."""
    import time

    lines = (shared_dir() / "data" / "train" / "train_prompts.jsonl").read_text(encoding="utf-8").splitlines()
    sample = tmp_path / "sample.jsonl"
    sample.write_text("\n".join(lines[::10]) + "\n", encoding="utf-8")
    start = time.perf_counter()
    assert check_not_eval(sample) == sample.resolve()
    assert time.perf_counter() - start < 20


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


def continuation_folder(model_dir: Path, tmp_path: Path, start: int, end: int, new_tokens: int):
    """(prompts file, continuation folder, model): the tiny model's continuations of rows ``start:end`` of the
    seeded order of PROMPTS, two per chunk, recording their source as the recipes do."""
    from transformers import AutoTokenizer

    from treespec.distill.continuations import ContinuationOptions, build_continuations
    from treespec.distill.corpus import read_prompts
    from treespec.models.loading import load_model

    p = write_prompts(tmp_path / "train.jsonl", PROMPTS)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = read_prompts(p, seed=0)[start:end]
    model = load_model(str(model_dir), dtype="float32")
    cont = tmp_path / "cont"
    build_continuations(model, [tok(r["prompt"])["input_ids"] for r in rows], cont,
                        ContinuationOptions(new_tokens=new_tokens, batch_size=2, chunk_size=2), eos={2},
                        progress=False, source={"prompts": p.name, "rows": f"{start}:{end}", "order_seed": 0})
    return p, cont, model


def test_build_corpus_from_stored_continuations_by_command_line(model_dir, tmp_path, capsys):
    """``build-corpus --continuations DIR``: rows from the folder's recorded source (or --rows), one shard
    per chunk, the JSON summary; bad combinations and a mismatched row range are one error line, exit 2."""
    p, cont, _ = continuation_folder(model_dir, tmp_path, 1, 5, new_tokens=3)
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


def test_acceptance_head_from_stored_continuations_by_command_line(model_dir, tmp_path, capsys):
    """``acceptance``: SpecDec++'s acceptance head trained on a continuation folder for a head file, written with
    its record (the head's SHA-256, scores on held-out sequences); bad settings are one error line, exit 2."""
    from treespec.drafting.head import new_head
    from treespec.drafting.stopping import AcceptanceHead
    from treespec.files import file_sha256

    p, cont, model = continuation_folder(model_dir, tmp_path, 0, 6, new_tokens=12)
    head_file = tmp_path / "head.safetensors"
    new_head(model, torch.arange(0, 200, 2), num_heads=2).save(head_file)
    common = ["acceptance", "--target", model_dir, "--dtype", "float32", "--no-progress", "--prompts", p,
              "--continuations", cont, "--head", head_file, "--depths", 2, "--positions", 4, "--epochs", 2,
              "--held-out", 0.34]
    code, out, err = run_cli([*common, "--out", tmp_path / "stop.safetensors", "--json", tmp_path / "r.json"],
                             capsys)
    assert code == 0, err
    record = last_json(out)
    assert record["head_sha256"] == file_sha256(head_file) and record["sequences"] == 6
    assert set(record["held_out_scores"]) == {"greedy", "sampled"}
    assert AcceptanceHead.load(tmp_path / "stop.safetensors").extra == json.loads((tmp_path / "r.json").read_text())
    for extra, words in ((["--held-out", 1.5], "--held-out must be in [0, 1)"), (["--lr", 0], "--lr must be"),
                         (["--chunks", "7:9"], "no finished chunk"), (["--rows", "1:7"], "other prompts"),
                         (["--positions", 0], "--positions must be >= 1")):
        code, _, err = run_cli([*common, *extra, "--out", tmp_path / "x.safetensors"], capsys)
        assert code == 2 and words in err and err.count("\n") == 1, (extra, err)
    assert not (tmp_path / "x.safetensors").exists()



def test_acceptance_head_for_an_eagle3_head_and_not_for_an_adapter(model_dir, tmp_path, capsys):
    """``acceptance --head`` takes an EAGLE-3 head file (fused features of three target layers) as it takes an EAGLE
    head; a Kangaroo adapter, which has no unrolled one-layer pass, is one error line, exit 2, nothing written."""
    from treespec.drafting.eagle3 import new_eagle3_head
    from treespec.drafting.kangaroo import new_adapter
    from treespec.drafting.stopping import AcceptanceHead

    p, cont, model = continuation_folder(model_dir, tmp_path, 0, 6, new_tokens=12)
    eagle3, adapter = tmp_path / "eagle3.safetensors", tmp_path / "adapter.safetensors"
    new_eagle3_head(model, torch.arange(0, 200, 2), feature_layers=(0,), num_heads=2, head_dim=16).save(eagle3)
    new_adapter(model, torch.arange(0, 200, 2), 1, num_heads=2, head_dim=16).save(adapter)
    common = ["acceptance", "--target", model_dir, "--dtype", "float32", "--no-progress", "--prompts", p,
              "--continuations", cont, "--depths", 2, "--positions", 4, "--epochs", 2, "--held-out", 0.34]
    code, out, err = run_cli([*common, "--head", eagle3, "--out", tmp_path / "stop.safetensors"], capsys)
    assert code == 0, err
    assert AcceptanceHead.load(tmp_path / "stop.safetensors").cfg.hidden_size == model.config.hidden_size
    code, _, err = run_cli([*common, "--head", adapter, "--out", tmp_path / "x.safetensors"], capsys)
    assert code == 2 and "KangarooAdapter" in err and "EAGLE or EAGLE-3 head" in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.safetensors").exists()


# ---------------------------------------------------------------------- damaged resume files
def _tiny_args(model_dir: Path) -> list:
    return ["--target", model_dir, "--dtype", "float32", "--no-progress"]


_TRAIN_OPTS = ["--steps", 6, "--batch-size", 2, "--seq-len", 16, "--vocab-size", 64, "--intermediate-size", 32,
               "--num-heads", 4, "--ckpt-every", 3]


@pytest.fixture(scope="module")
def resumable(model_dir, tmp_path_factory) -> dict[str, Path]:
    """A finished corpus, head run (checkpoints at steps 3 and 6) and Medusa run, made once for the module;
    each case edits a copy."""
    tmp = tmp_path_factory.mktemp("resumable")
    p = write_prompts(tmp / "train.jsonl", PROMPTS)
    corpus, run, medusa = tmp / "corpus", tmp / "run", tmp / "medusa"
    m = _tiny_args(model_dir)
    with torch.enable_grad():
        main([str(a) for a in ["build-corpus", *m, "--prompts", p, "--out", corpus, "--max-len", 40, "--topk", 4,
                               "--shard-positions", 100, "--batch-size", 2]])
        main([str(a) for a in ["train", *m, "--corpus", corpus, "--run-dir", run, *_TRAIN_OPTS]])
        main([str(a) for a in ["medusa", *m, "--corpus", corpus, "--run-dir", medusa, "--steps", 2, "--batch-size", 8,
                               "--ckpt-every", 1]])
    assert (run / "ckpt-6.pt").is_file() and (medusa / "medusa-ckpt.pt").is_file()
    return {"prompts": p, "corpus": corpus, "run": run, "medusa": medusa}



def _edit_manifest(folder: Path, edit) -> None:
    path = folder / "manifest.json"
    man = json.loads(path.read_text())
    path.write_text(json.dumps(edit(man)))


def _edit_checkpoint(path: Path, edit) -> None:
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def _first_shard(folder: Path) -> Path:
    return folder / json.loads((folder / "manifest.json").read_text())["shards"][0]["file"]


def _outside_copy(folder: Path, tmp: Path) -> Path:
    """A readable shard outside the corpus folder (so that reading it would succeed if it were allowed)."""
    (tmp / "elsewhere").mkdir(exist_ok=True)
    out = tmp / "elsewhere" / "shard.safetensors"
    out.write_bytes(_first_shard(folder).read_bytes())
    return out


def _set_shard_file(value):
    def edit(man: dict) -> dict:
        man["shards"][0]["file"] = value
        return man
    return edit


# name: (what is damaged, edit(paths, tmp), command: "train" | "resume" | "build" | "export" | "medusa", expected)
DAMAGED = {
    "manifest is a list": ("corpus", lambda c, t: (c / "manifest.json").write_text("[1, 2]"), "train",
                           "corpus manifest"),
    "manifest without fingerprint": ("corpus", lambda c, t: _edit_manifest(c, lambda m: {
        k: v for k, v in m.items() if k != "fingerprint"}), "build", "fingerprint"),
    "shards not a list": ("corpus", lambda c, t: _edit_manifest(c, lambda m: {**m, "shards": {"a": 1}}), "train",
                          "shards"),
    "shard entry without file": ("corpus", lambda c, t: _edit_manifest(c, lambda m: {
        **m, "shards": [{k: v for k, v in sh.items() if k != "file"} for sh in m["shards"]]}), "train", "file"),
    "shard path absolute": ("corpus", lambda c, t: _edit_manifest(c, _set_shard_file(str(_outside_copy(c, t)))),
                            "train", "outside"),
    "shard path escapes with ..": ("corpus", lambda c, t: _edit_manifest(
        c, _set_shard_file(f"../elsewhere/{_outside_copy(c, t).name}")), "train", "outside"),
    "shard truncated": ("corpus", lambda c, t: _first_shard(c).write_bytes(
        _first_shard(c).read_bytes()[: _first_shard(c).stat().st_size // 2]), "train", "shard"),
    "shard missing": ("corpus", lambda c, t: _first_shard(c).unlink(), "train", "shard"),
    "zero positions": ("corpus", lambda c, t: _edit_manifest(c, lambda m: {
        **m, "shards": [{**sh, "positions": 0} for sh in m["shards"]]}), "train", "positions"),
    "non-numeric step": ("run", lambda r, t: _edit_checkpoint(r / "ckpt-6.pt", lambda s: s.update(step="six")),
                         "resume", "step"),
    "garbage RNG state": ("run", lambda r, t: _edit_checkpoint(
        r / "ckpt-6.pt", lambda s: s.update(rng=torch.tensor([7, 1, 2], dtype=torch.uint8))), "resume", "rng"),
    "empty newest checkpoint (export)": ("run", lambda r, t: (r / "ckpt-99.pt").write_bytes(b""), "export",
                                         "ckpt-99.pt"),
    "empty newest checkpoint (train)": ("run", lambda r, t: (r / "ckpt-99.pt").write_bytes(b""), "resume",
                                        "ckpt-99.pt"),
    "medusa checkpoint without history": ("medusa", lambda d, t: _edit_checkpoint(
        d / "medusa-ckpt.pt", lambda s: s.pop("history")), "medusa", "history"),
}


def _run_catching(argv: list, capsys) -> tuple[int, str]:
    """``main(argv)`` in-process: (exit status, stderr); an escaping exception is a traceback (status 1)."""
    import traceback

    try:
        code, _, err = run_cli(argv, capsys)
    except Exception:  # noqa: BLE001 - what the user would have seen
        return 1, capsys.readouterr().err + "Traceback (most recent call last):\n" + traceback.format_exc()
    return code, err


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_resume_file_is_one_named_error(resumable, model_dir, tmp_path, capsys, case):
    """Each damaged corpus manifest, shard, checkpoint or RNG state: one ``error:`` line naming the problem,
    exit status 2, no traceback; a shard path outside its corpus folder is refused, not opened."""
    import shutil

    what, edit, command, expected = DAMAGED[case]
    work = {k: tmp_path / k for k in ("corpus", "run", "medusa")}
    for k, dest in work.items():
        shutil.copytree(resumable[k], dest)
    edit(work[what], tmp_path)
    m = _tiny_args(model_dir)
    argv = {
        "train": ["train", *m, "--corpus", work["corpus"], "--run-dir", tmp_path / "fresh-run", *_TRAIN_OPTS],
        "resume": ["train", *m, "--corpus", work["corpus"], "--run-dir", work["run"],
                   "--steps", 8, *_TRAIN_OPTS[2:]],  # resumes from ckpt-6.pt
        "build": ["build-corpus", *m, "--prompts", resumable["prompts"], "--out", work["corpus"], "--max-len", 40,
                  "--topk", 4, "--shard-positions", 100, "--batch-size", 2],
        "export": ["export", "--run-dir", work["run"], "--out", tmp_path / "x.safetensors"],
        "medusa": ["medusa", *m, "--corpus", work["corpus"], "--run-dir", work["medusa"], "--steps", 2,
                   "--batch-size", 8, "--ckpt-every", 1],
    }[command]
    code, err = _run_catching(argv, capsys)
    lines = err.strip().splitlines()  # the model loader's progress bar may come first
    assert code == 2 and sum("error:" in line for line in lines) == 1 and "Traceback" not in err, \
        f"status {code}: {err[-1500:]}"
    assert lines[-1].startswith(f"python -m treespec.distill {argv[0]}: error: ") and expected in lines[-1], lines[-1]


def test_empty_newest_checkpoint_by_command_line(resumable, tmp_path):
    """The real command line: an empty newest checkpoint is one error line, exit status 2."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(resumable["run"], run)
    (run / "ckpt-99.pt").write_bytes(b"")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TREESPEC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "treespec.distill", "export", "--run-dir", str(run),
                           "--out", str(tmp_path / "x.safetensors")], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "ckpt-99.pt" in proc.stderr, proc.stderr


def test_judge_from_stored_greedy_continuations_by_command_line(model_dir, tmp_path, capsys):
    """``judge``: judge decoding's judge trained on a greedy continuation folder, written with its record (the
    target's vocabulary, scores on held-out sequences, the threshold), the rows kept and reused with --rows-cache;
    sampled continuations and bad settings are one error line, exit 2, nothing written."""
    from treespec.distill.continuations import ContinuationOptions, build_continuations
    from treespec.drafting.judge import JudgeHead

    p, cont, model = continuation_folder(model_dir, tmp_path, 0, 6, new_tokens=16)
    common = ["judge", "--target", model_dir, "--dtype", "float32", "--no-progress", "--prompts", p,
              "--continuations", cont, "--positions", 6, "--resync", 2, "--epochs", 2, "--held-out", 0.34,
              "--precision", 0.5, "--rows-cache", tmp_path / "rows.pt"]
    code, out, err = run_cli([*common, "--out", tmp_path / "judge.safetensors", "--json", tmp_path / "r.json"],
                             capsys)
    assert code == 0, err
    record = last_json(out)
    assert record["lossy"] is True and record["sequences"] == 6 and record["held_out_scores"]["rows"] > 0
    assert record["target_vocab_size"] == model.config.vocab_size
    judge = JudgeHead.load(tmp_path / "judge.safetensors")
    assert judge.extra == json.loads((tmp_path / "r.json").read_text()) and (tmp_path / "rows.pt").is_file()
    code, out, err = run_cli([*common, "--out", tmp_path / "again.safetensors"], capsys)
    assert code == 0 and "judge rows:" not in err and last_json(out)["rows"] == record["rows"]  # rows reused
    for extra, words in ((["--precision", 1.5], "--precision must be in (0, 1]"), (["--resync", 0], "--resync must"),
                         (["--chunks", "7:9"], "no finished chunk")):
        code, _, err = run_cli([*common, *extra, "--out", tmp_path / "x.safetensors"], capsys)
        assert code == 2 and words in err and err.count("\n") == 1, (extra, err)
    sampled = tmp_path / "sampled"
    build_continuations(model, [[5, 6, 7]] * 2, sampled, ContinuationOptions(mode="sample", new_tokens=4,
                        batch_size=2, chunk_size=2), eos={2}, progress=False,
                        source={"prompts": p.name, "rows": "0:2", "order_seed": 0})
    code, _, err = run_cli(["judge", "--target", model_dir, "--prompts", p, "--continuations", sampled,
                            "--out", tmp_path / "x.safetensors"], capsys)
    assert code == 2 and "need the target's greedy text" in err
    assert not (tmp_path / "x.safetensors").exists()
