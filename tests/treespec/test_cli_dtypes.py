"""Every drafter the CLI builds runs in float32 AND bfloat16, at T=0 and T=1, on a tiny local model.

bf16 need not match plain decoding token for token (tree passes round differently from one-token
passes); it must run, stay in the vocabulary and emit exactly max-new-tokens tokens (--no-stop).
In float32 at T=0 the output must equal --plain.
"""

from __future__ import annotations

import json

import pytest
import torch

from treespec.cli import main as cli_main
from treespec.drafting.head import new_head
from treespec.models.tiny import tiny_model

from .test_cli_exact import VOCAB, tiny_dir  # noqa: F401  (fixture)

NEW = 6


@pytest.fixture(scope="module")
def head_file(tiny_dir, tmp_path_factory) -> str:  # noqa: F811
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_dir)
    path = tmp_path_factory.mktemp("head") / "tiny-head.safetensors"
    new_head(target, torch.arange(0, VOCAB), num_heads=2).save(path)
    return str(path)


def _run(capsys, tiny_dir: str, *argv: str) -> dict:  # noqa: F811
    code = cli_main(["generate", "w1 w2 w3 w1 w2 w3 w1", "--target", tiny_dir, "--max-new-tokens", str(NEW),
                     "--no-stop", "--json", "--threads", "1", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


DRAFTS = ["ngram", "early-exit:1", "MODEL", "HEAD", "lookup+HEAD"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", ["0", "1"])
@pytest.mark.parametrize("draft", DRAFTS)
def test_every_drafter_in_both_dtypes(capsys, tiny_dir, head_file, draft, temperature, dtype):  # noqa: F811
    draft_arg = draft.replace("MODEL", tiny_dir).replace("HEAD", head_file)
    extra = ["--tree", "2,1"] if draft in ("MODEL", "early-exit:1") else []
    out = _run(capsys, tiny_dir, "--draft", draft_arg, "--temperature", temperature, "--dtype", dtype, *extra)
    assert out["statistics"]["dtype"] == dtype
    assert out["statistics"]["method"] != "plain"
    assert len(out["token_ids"]) == NEW
    assert all(0 <= t < VOCAB for t in out["token_ids"])
    if dtype == "float32" and temperature == "0":
        plain = _run(capsys, tiny_dir, "--plain", "--dtype", "float32")
        assert out["token_ids"] == plain["token_ids"]
