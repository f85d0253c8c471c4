"""What `treespec generate` says around its output, on a tiny local model (no download): a line on stderr while
the model loads, a closing line in plain words, and a fresh recorded seed for a run without --seed."""

from __future__ import annotations

import json

import pytest

from treespec.cli import main as cli_main

from .test_cli_exact import tiny_dir  # noqa: F401  (fixture)

PROMPT = "w1 w2 w3 w1 w2 w3 w1"


def _run(capsys, tiny_dir: str, *argv: str) -> tuple[str, str]:  # noqa: F811
    code = cli_main(["generate", PROMPT, "--target", tiny_dir, "--max-new-tokens", "6", "--no-stop",
                     "--threads", "1", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("treespec")]


@pytest.mark.parametrize("json_mode", [False, True])
def test_a_line_on_stderr_while_the_model_loads(capsys, tiny_dir, json_mode):  # noqa: F811
    """Loading printed nothing (the embedded model takes seconds to load); now one line names what loads, on
    stderr in every mode (stdout stays one JSON document with --json)."""
    from treespec.models.loading import resolve_dtype

    out, err = _run(capsys, tiny_dir, "--plain", *(["--json"] if json_mode else []))
    dtype = str(resolve_dtype("auto")).removeprefix("torch.")  # bfloat16 on a CPU that computes it natively
    assert _lines(err)[0] == f"treespec: loading {tiny_dir} (PyTorch, {dtype})...", err
    if json_mode:
        json.loads(out)


def test_loading_words_name_the_model_and_engine():
    import torch

    from treespec.cli import _model_words

    assert _model_words("embedded", torch.float32) == "the embedded Gemma-3-270M (PyTorch, float32)"
    assert _model_words("embedded", torch.bfloat16) == "the embedded Gemma-3-270M (PyTorch, bfloat16)"
    assert _model_words("embedded-gguf", torch.float32) == "the embedded Gemma-3-270M's Q4_K_M GGUF in llama.cpp"
    assert _model_words("/m/x.gguf", torch.float32) == "the GGUF /m/x.gguf in llama.cpp"


@pytest.mark.parametrize("argv, words", [
    (["--draft", "ngram"], "drafted by n-gram lookup;"),
    (["--draft", "ngram:4,2"], "drafted by n-gram lookup (2 continuations of 4 tokens);"),
    (["--draft", "early-exit:1", "--tree", "2,1"], "drafted by the target's first 1 layers;"),
    (["--plain"], "target passes (plain decoding, one token per pass);"),
])
def test_closing_line_speaks_plainly(capsys, tiny_dir, argv, words):  # noqa: F811
    """The closing line spoke of `[NgramDrafter, ...]` / `FirstOf(...)`, tau and passes without saying what they
    are; now it says tokens in target passes, tokens per pass (tau) and the drafter's name in words."""
    _, err = _run(capsys, tiny_dir, *argv)
    line = _lines(err)[-1]
    assert line.startswith("treespec: 6 tokens in "), line
    assert words in line and "tokens/s" in line and "Drafter" not in line, line
    if "--plain" not in argv:
        assert "tokens per pass, tau) drafted by" in line


def test_draft_words():
    from treespec.cli import _draft_words

    assert _draft_words("lookup+head", [3, 5]) == "n-gram lookup (3 trees), then the shipped head (5 trees)"
    assert _draft_words("lookup+head", [16, 1]) == "n-gram lookup (16 trees), then the shipped head (1 tree)"
    assert _draft_words("lookup+head") == "n-gram lookup, then the shipped head"
    assert _draft_words("head") == "the shipped head"
    assert _draft_words("lookup+h.safetensors") == "n-gram lookup, then the head h.safetensors"
    assert _draft_words("some/model") == "the draft model some/model"


def test_runs_without_seed_draw_a_recorded_seed_that_reproduces_them(capsys, tiny_dir):  # noqa: F811
    """Each sampled run without --seed draws a fresh seed and records it (--json's "seed", the closing line);
    --seed with it reproduces the token ids."""
    args = ("--temperature", "1", "--draft", "ngram", "--json")
    first, second = (json.loads(_run(capsys, tiny_dir, *args)[0]) for _ in range(2))
    assert isinstance(first["seed"], int) and isinstance(second["seed"], int)
    assert first["seed"] != second["seed"]  # 63 random bits each
    for run in (first, second):
        again = json.loads(_run(capsys, tiny_dir, *args, "--seed", str(run["seed"]))[0])
        assert again["seed"] == run["seed"] and again["token_ids"] == run["token_ids"]
    assert {"new_tokens", "target_calls", "tau", "method", "dtype", "temperature", "runner", "quantize",
            "accepted_per_step"} <= set(first["statistics"])
    assert {"text", "token_ids", "prompt_ids", "statistics"} <= set(first)
    seeded = json.loads(_run(capsys, tiny_dir, *args, "--seed", "7")[0])
    assert seeded["seed"] == 7
    _, err = _run(capsys, tiny_dir, "--temperature", "1", "--draft", "ngram", "--seed", "7")
    assert "seed 7 (--seed 7 repeats this run)" in _lines(err)[-1]


def test_greedy_runs_record_a_seed_too(capsys, tiny_dir):  # noqa: F811
    out, _ = _run(capsys, tiny_dir, "--draft", "ngram", "--json")
    assert isinstance(json.loads(out)["seed"], int)
