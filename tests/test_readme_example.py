"""The README's Python example runs, and reproduces the CLI's default: the same tokens as `treespec generate` with
the same prompt (temperature 0, the engine `--target auto` picks and the drafter `--draft auto` picks for this
CPU's dtype): the same tokens and the same number of target passes. (A plain-decoding variant of the example
gives the same tokens but one pass per token, and fails the second check.)"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.gemma


@pytest.mark.parametrize("engine", ["embedded", "embedded-gguf"])
def test_readme_python_example_reproduces_the_cli_default(capsys, monkeypatch, engine):
    """On each engine ``--target auto`` can pick: the table entry for this CPU's dtype at T=0 is set to it, so that
    both branches of the example run on any host."""
    from treespec import drafters
    from treespec.cli import main
    from treespec.models.llama_cpp import llama_cpp_available
    from treespec.models.loading import resolve_dtype

    if engine != "embedded" and llama_cpp_available() is not None:
        pytest.skip(llama_cpp_available())
    key = (str(resolve_dtype("auto")).removeprefix("torch."), "greedy")
    monkeypatch.setitem(drafters.DEFAULT_TARGETS, key,
                        drafters.DefaultTarget(engine, drafters.DEFAULT_TARGETS[key].evidence))
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert "default_draft" in code and "build_drafter" in code and "default_target" in code
    code = code.replace("max_new_tokens=64", "max_new_tokens=12")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the project's own README
    capsys.readouterr()
    assert main(["generate", "The capital of France is", "--max-new-tokens", "12", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert (type(scope["runner"]).__name__ == "LlamaCppRunner") == (engine == "embedded-gguf")
    assert (cli["statistics"]["runner"] == "llama.cpp") == (engine == "embedded-gguf")
    assert scope["out"].token_ids == cli["token_ids"]
    assert scope["out"].text == cli["text"]
    # the same drafter, not only the same tokens (greedy output is the same whatever drafts it): the same passes
    assert scope["out"].target_calls == cli["statistics"]["target_calls"]
