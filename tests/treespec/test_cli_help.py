"""The command line's front door: ``--help`` builds the parser without the engine (no torch, no transformers:
it answers in a fraction of a second), ``import treespec`` loads its public names on first use, and the
parser's choices copied from the engine's registries stay equal to them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")


def _fresh(code: str) -> str:
    """stdout of ``code`` run by a fresh interpreter in the repository root."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"]])
def test_help_imports_no_torch(argv):
    """`python -m treespec [generate] --help` imports neither torch nor transformers: the parser is built from
    torch-free constants, so help comes at once."""
    out = _fresh(f"""
import io, runpy, sys, contextlib
sys.argv = ["treespec", *{argv!r}]
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    try:
        runpy.run_module("treespec", run_name="__main__")
    except SystemExit as stop:
        assert stop.code == 0, stop.code
assert "usage: treespec" in buf.getvalue()
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
""")
    assert out.strip() == "[]", out


def test_parsing_a_generate_command_imports_no_torch():
    out = _fresh(f"""
import sys
from treespec.cli import build_parser
args = build_parser().parse_args(["generate", "hello", "--draft", "ngram:8,4", "--seed", "3"])
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
""")
    assert out.strip() == "[]", out


def test_import_treespec_is_lazy_and_its_names_resolve():
    out = _fresh(f"""
import sys
import treespec
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
assert set(treespec.__all__) <= set(dir(treespec))
import treespec.cli  # the submodule treespec.generate imported by the engine must not shadow the function
from treespec import generate, TokenTree, GenerationConfig, VERIFIERS, NgramDrafter, TreeShape
assert callable(generate) and generate.__module__ == "treespec.generate", generate
import treespec.generate
assert treespec.generate is generate
print(TokenTree.__module__, sorted(VERIFIERS)[0], all(getattr(treespec, n) is not None for n in treespec.__all__))
""")
    lines = out.strip().splitlines()
    assert lines[0] == "[]", out
    assert lines[1] == "treespec.tree block True", out


def test_missing_public_name_is_an_attribute_error():
    import treespec

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        treespec.nope  # noqa: B018


def test_parser_choices_equal_the_engine_registries():
    """The CLI's copies of the registries (kept torch-free for --help) equal the registries themselves."""
    from treespec import cli, drafters
    from treespec.models.fast import QUANTIZE_MODES, TARGET_QUANTIZE_MODES
    from treespec.tree import DRAFT_LAWS
    from treespec.verify import VERIFIERS

    assert set(cli.VERIFIER_MEANINGS) == set(VERIFIERS)
    assert cli.DRAFT_LAWS == DRAFT_LAWS
    assert cli.QUANTIZE_MODES == QUANTIZE_MODES
    assert cli.TARGET_QUANTIZE_MODES == TARGET_QUANTIZE_MODES
    assert cli.EMBEDDED_GGUF == drafters.EMBEDDED_GGUF


def _generate_help() -> str:
    from treespec.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices["generate"].format_help()


def test_help_states_every_default():
    """Every option that takes a value says its default in its help (--seed, --max-new-tokens, --top-k,
    --top-p, --temperature, --threads and --verifier included)."""
    from treespec.cli import build_parser

    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    silent = []
    for action in generate._actions:
        if not action.option_strings or action.nargs == 0:  # the prompt, -h/--help, --json and other flags
            continue
        text = " ".join((action.help or "").split())
        if "default" not in text:
            silent.append(action.option_strings[0])
    assert silent == [], f"options whose help states no default: {silent}"
    help_text = " ".join(_generate_help().split())
    for name in ("greedy", "rrs", "block", "spechub", "kseq"):  # --verifier says what each name means
        assert f"{name}: " in help_text, name
    assert "auto (default: greedy at temperature 0" in help_text


def test_min_confidence_help_is_true_to_the_code():
    """--min-confidence applies at any temperature (ShapeDrafter stops growing below it at T > 0 too), and its
    stated default is the shipped head's."""
    from treespec.drafting.shipped import DEFAULT_HEAD_SETTINGS

    help_text = " ".join(_generate_help().split())
    start = help_text.index("--min-confidence MIN_CONFIDENCE adaptive")
    text = help_text[start:help_text.index("--tree TREE", start)]
    assert "at any temperature" in text and "temperature 0, head drafts" not in text
    values = {settings["min_confidence"] for settings in DEFAULT_HEAD_SETTINGS.values()}
    assert values == {0.2} and "0.2 at either temperature" in text
    assert DEFAULT_HEAD_SETTINGS["greedy"]["tree"] == DEFAULT_HEAD_SETTINGS["sampled"]["tree"] == (1, 1, 1)
    assert "the shipped head's measured tree, a chain of 3" in help_text
