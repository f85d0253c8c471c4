"""Training checkpoints are checked against their stored tensors before anything is allocated.

A ``ckpt-N.pt`` of about 130 kB whose head config declares a huge layer (``intermediate_size=400000``: a
25.6M-element matrix on this tiny target, 3.4 GB of memory on Gemma-3-270M) is refused by
``distill export`` and by ``distill train``'s resume with one named ``error:`` line (exit status 2),
within seconds and without allocating any tensor of 100k elements or more (the real head has about 10k
per matrix): the config is checked as head files are (sizes beyond every stored dimension; a probe on
the meta device, so an empty stored tensor of shape ``(0, N)`` cannot lift that bound). A Medusa
checkpoint cannot size the heads (its config must equal the run's own); one declaring other sizes, or
holding tensors of another shape, is refused by name too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.treespec.test_cli_robustness import _LargestAllocation
from tests.treespec.test_distill_inputs import PROMPTS, make_model_dir, run_cli, write_prompts

HUGE = 400_000
LARGEST_ALLOWED = 100_000  # elements; the refused head would allocate a 25.6M one (gate/up, hidden size 32)
TRAIN = ["--steps", 3, "--batch-size", 2, "--seq-len", 16, "--vocab-size", 64, "--intermediate-size", 32,
         "--num-heads", 4, "--ckpt-every", 3]
MEDUSA = ["--steps", 2, "--batch-size", 8, "--ckpt-every", 1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A tiny target, its corpus, a finished head run (``ckpt-3.pt``) and a Medusa run, made once."""
    from treespec.distill.cli import main

    tmp = tmp_path_factory.mktemp("checkpoint-bounds")
    model = make_model_dir(tmp / "model")
    m = ["--target", model, "--dtype", "float32", "--no-progress"]
    prompts, corpus = write_prompts(tmp / "train.jsonl", PROMPTS), tmp / "corpus"
    with pytest.MonkeyPatch.context() as patch, torch.enable_grad():
        patch.setenv("TREESPEC_CACHE", str(tmp / "cache"))
        main([str(a) for a in ["build-corpus", *m, "--prompts", prompts, "--out", corpus, "--max-len", 40,
                               "--topk", 4, "--shard-positions", 100, "--batch-size", 2]])
        main([str(a) for a in ["train", *m, "--corpus", corpus, "--run-dir", tmp / "run", *TRAIN]])
        main([str(a) for a in ["medusa", *m, "--corpus", corpus, "--run-dir", tmp / "medusa", *MEDUSA]])
    assert (tmp / "run" / "ckpt-3.pt").is_file() and (tmp / "medusa" / "medusa-ckpt.pt").is_file()
    return {"model": model, "corpus": corpus, "run": tmp / "run", "medusa": tmp / "medusa"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))


def crafted_copy(src: Path, dest: Path, name: str, edit) -> Path:
    """A copy of run folder ``src`` whose checkpoint ``name`` went through ``edit(state)``."""
    import shutil

    shutil.copytree(src, dest)
    state = torch.load(dest / name, weights_only=True)
    edit(state)
    torch.save(state, dest / name)
    return dest


def huge_layer(state: dict) -> None:
    state["head_config"]["intermediate_size"] = HUGE


def huge_layer_lifted(state: dict) -> None:
    """The huge config plus an empty stored tensor of width HUGE (lifts the largest-dimension bound)."""
    huge_layer(state)
    state["head"]["ceiling"] = torch.empty(0, HUGE)


def huge_hidden(state: dict) -> None:
    state["head_config"]["hidden_size"] = 1 << 40


def refused(argv: list, capsys) -> tuple[str, int, float]:
    """Runs a distill command that must be refused: (its one stderr line, the largest tensor it allocated
    in elements, seconds)."""
    mode = _LargestAllocation()
    start = time.perf_counter()
    with mode:
        code, out, err = run_cli(argv, capsys)
    seconds = time.perf_counter() - start
    lines = [line for line in err.strip().splitlines() if not line.startswith("Loading weights")]  # HF's bar
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, f"status {code}: {err[-1500:]}"
    assert lines[0].startswith(f"python -m treespec.distill {argv[0]}: error: "), lines[0]
    return lines[0], mode.largest, seconds


CRAFTED = {  # name: (edit, what the error line says)
    "huge intermediate_size": (huge_layer, f"intermediate_size={HUGE} exceeds every stored tensor dimension"),
    "huge size lifted by an empty tensor": (huge_layer_lifted, "tensors do not match its config"),
    "huge hidden_size": (huge_hidden, f"hidden_size={1 << 40} exceeds"),
}


@pytest.mark.parametrize("command", ["export", "resume"])
@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_head_checkpoint_is_refused_before_allocation(runs, tmp_path, capsys, command, case):
    edit, expected = CRAFTED[case]
    run = crafted_copy(runs["run"], tmp_path / "run", "ckpt-3.pt", edit)
    assert (run / "ckpt-3.pt").stat().st_size < 400_000  # a small file declaring a huge head
    if command == "export":
        argv = ["export", "--run-dir", run, "--out", tmp_path / "x.safetensors"]
    else:
        argv = ["train", "--target", runs["model"], "--dtype", "float32", "--no-progress", "--corpus",
                runs["corpus"], "--run-dir", run, *TRAIN[:1], 6, *TRAIN[2:]]
    line, largest, seconds = refused(argv, capsys)
    assert largest < LARGEST_ALLOWED, (largest, line)
    assert seconds < 20, seconds
    assert "ckpt-3.pt" in line and expected in line, line
    assert not (tmp_path / "x.safetensors").exists()


def test_checkpoint_as_written_still_exports_and_resumes(runs, tmp_path, capsys):
    """The check refuses nothing a run writes: export and a resume (3 -> 6 steps) of the untouched run."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["run"], run)
    code, _, err = run_cli(["export", "--run-dir", run, "--out", tmp_path / "h.safetensors"], capsys)
    assert code == 0, err
    code, _, err = run_cli(["train", "--target", runs["model"], "--dtype", "float32", "--no-progress", "--corpus",
                            runs["corpus"], "--run-dir", run, *TRAIN[:1], 6, *TRAIN[2:]], capsys)
    assert code == 0, err
    assert (run / "ckpt-6.pt").is_file()


def _medusa_sizes(state: dict) -> None:
    state["config"]["num_layers"] = HUGE


def _medusa_tensor(state: dict) -> None:
    key = next(iter(state["heads"]))
    state["heads"][key] = torch.zeros(3, 5)


@pytest.mark.parametrize("edit, expected", [(_medusa_sizes, "another configuration"),
                                            (_medusa_tensor, "medusa-ckpt.pt")])
def test_crafted_medusa_checkpoint_is_refused(runs, tmp_path, capsys, edit, expected):
    run = crafted_copy(runs["medusa"], tmp_path / "medusa", "medusa-ckpt.pt", edit)
    argv = ["medusa", "--target", runs["model"], "--dtype", "float32", "--no-progress", "--corpus", runs["corpus"],
            "--run-dir", run, *MEDUSA]  # the run's own configuration: a resume
    line, largest, seconds = refused(argv, capsys)
    assert expected in line, line
    assert largest < LARGEST_ALLOWED, largest
    assert seconds < 20, seconds


def test_crafted_checkpoint_by_command_line(runs, tmp_path):
    """The real command line: ``distill export`` of the crafted checkpoint, one line, exit status 2."""
    run = crafted_copy(runs["run"], tmp_path / "run", "ckpt-3.pt", huge_layer)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TREESPEC_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "treespec.distill", "export", "--run-dir", str(run),
                           "--out", str(tmp_path / "x.safetensors")], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "ckpt-3.pt" in lines[0] and f"intermediate_size={HUGE}" in lines[0], proc.stderr
    assert not (tmp_path / "x.safetensors").exists()
