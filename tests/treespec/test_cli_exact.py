"""--exact and the dtype guarantee, through the CLI on a tiny local model (saved to a tmp dir, no download)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from treespec.cli import build_parser, main as cli_main, resolve_cli_dtype
from treespec.models.tiny import tiny_model

VOCAB = 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny Llama + word-level tokenizer saved as an HF model directory."""
    path = tmp_path_factory.mktemp("tiny")
    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(path)
    tiny_model("llama", VOCAB, seed=3).save_pretrained(path)
    return str(path)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "x", *argv])


def test_exact_resolves_to_float32():
    assert resolve_cli_dtype(_args("--exact")) == torch.float32
    assert resolve_cli_dtype(_args("--exact", "--dtype", "auto")) == torch.float32
    assert resolve_cli_dtype(_args("--dtype", "bfloat16")) == torch.bfloat16
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split())
    assert "token-identity with --plain at temperature 0 is guaranteed only in float32" in help_text


def _run(capsys, tiny_dir: str, *argv: str) -> dict:
    code = cli_main(["generate", "w1 w2 w3 w1 w2 w3 w1", "--target", tiny_dir, "--max-new-tokens", "16",
                     "--no-stop", "--json", "--threads", "1", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)  # stdout is exactly one JSON document


@pytest.mark.parametrize("draft", ["ngram", "early-exit:1"])
def test_exact_speculative_equals_plain(capsys, tiny_dir, draft):
    plain = _run(capsys, tiny_dir, "--plain", "--exact")
    spec = _run(capsys, tiny_dir, "--draft", draft, "--exact")
    assert spec["statistics"]["dtype"] == "float32"
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["statistics"]["method"] != "plain"


def test_stderr_summary_states_the_guarantee(capsys, tiny_dir):
    base = ["generate", "w1 w2 w3", "--target", tiny_dir, "--max-new-tokens", "3", "--draft", "ngram"]
    assert cli_main([*base, "--exact"]) == 0
    assert "T=0 token-identical to --plain" in capsys.readouterr().err
    assert cli_main([*base, "--dtype", "bfloat16"]) == 0
    assert "not token-identical to --plain (use --exact)" in capsys.readouterr().err
