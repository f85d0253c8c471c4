"""The README's Python example runs, and reproduces the CLI's default: the same tokens as `treespec generate` with
the same prompt (temperature 0, the embedded target, the drafter `--draft auto` picks for this CPU's dtype): the same
tokens and the same number of target passes. (A plain-decoding variant of the example gives the same tokens but one
pass per token, and fails the second check.)"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.gemma


def test_readme_python_example_reproduces_the_cli_default(capsys):
    from treespec.cli import main

    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert "default_draft" in code and "build_drafter" in code
    code = code.replace("max_new_tokens=64", "max_new_tokens=12")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the project's own README
    capsys.readouterr()
    assert main(["generate", "The capital of France is", "--max-new-tokens", "12", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert scope["out"].token_ids == cli["token_ids"]
    assert scope["out"].text == cli["text"]
    # the same drafter, not only the same tokens (greedy output is the same whatever drafts it): the same passes
    assert scope["out"].target_calls == cli["statistics"]["target_calls"]
