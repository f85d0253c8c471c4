"""Tree shapes exported to vLLM and SGLang: the format, checked on a CPU (no engine is loaded).

vLLM's ``speculative_token_tree`` is checked by properties written here, independently of the module's own
reader: a Python literal list of tuples, breadth-first, every prefix listed before the path, sibling ranks
0..k-1 under every parent, one entry per drafted node, and back to the same shape. A depth-first twin of a
valid string must fail both those checks and the module's reader. SGLang's three numbers are checked on
known shapes (a chain, the uniform 4,2,1, a non-uniform Sequoia tree). The command line ends bad input
with one line on stderr and exit status 2.
"""

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from treespec.trees.export import (as_shape, check_vllm_token_tree, main, parse_token_tree, serving_settings,
                                   sglang_export, sglang_settings, shape_from_token_tree, token_tree_paths,
                                   vllm_export, vllm_token_tree)
from treespec.trees.sequoia import SequoiaDP
from treespec.trees.shape import TreeShape

from trees_common import MEDUSA, SEQUOIA, SHAPES

ROOT = Path(__file__).resolve().parents[2]
UNIFORM = {"chain5": TreeShape.chain(5), "widths421": TreeShape.widths((4, 2, 1)),
           "widths22": TreeShape.widths((2, 2)), "level3": TreeShape.widths((3,)),
           "kary2x3": TreeShape.kary(2, 3)}


def assert_vllm_format(text: str, shape: TreeShape) -> list[tuple[int, ...]]:
    """The properties vLLM's reader relies on, checked without the module under test."""
    paths = ast.literal_eval(text)
    assert isinstance(paths, list) and paths, text
    assert all(isinstance(p, tuple) and p and all(type(r) is int and r >= 0 for r in p) for p in paths)
    assert len(paths) == len(set(paths)) == shape.num_drafted  # one entry per drafted node, root left out
    assert paths == sorted(paths, key=lambda p: (len(p), p)), "not breadth-first"
    for i, path in enumerate(paths):
        assert all(path[:j] in paths[:i] for j in range(1, len(path))), f"a prefix of {path} is not before it"
    ranks = defaultdict(list)
    for path in paths:
        ranks[path[:-1]].append(path[-1])
    assert all(sorted(r) == list(range(len(r))) for r in ranks.values()), "sibling ranks not 0..k-1"
    assert TreeShape.from_paths(paths) == shape  # round trip
    return paths


# ---------------------------------------------------------------------- vLLM
@pytest.mark.parametrize("name", sorted(UNIFORM))
def test_vllm_token_tree_format(name):
    shape = UNIFORM[name]
    text = vllm_token_tree(shape)
    paths = assert_vllm_format(text, shape)
    assert check_vllm_token_tree(text) == paths and shape_from_token_tree(text) == shape
    config = vllm_export(shape).settings
    assert config == {"method": "eagle", "num_speculative_tokens": shape.num_drafted, "speculative_token_tree": text}
    assert json.loads(json.dumps(config)) == config  # pastes into --speculative-config as JSON


def test_vllm_known_strings():
    assert vllm_export(TreeShape.independent_chains(3, 2)).settings == vllm_export((3, 1)).settings  # SpecTr fits
    assert vllm_token_tree((2, 1)) == "[(0,), (1,), (0, 0), (1, 0)]"
    assert vllm_token_tree(TreeShape.chain(3)) == "[(0,), (0, 0), (0, 0, 0)]"  # vLLM's own default chain
    assert vllm_token_tree((4, 2, 1)) == str(token_tree_paths(TreeShape.widths((4, 2, 1))))
    assert vllm_export((4, 2, 1), "eagle3").settings["num_speculative_tokens"] == 20  # nodes, not depth 3


@pytest.mark.parametrize("shape", [SEQUOIA, MEDUSA, TreeShape.from_paths([[0], [1], [0, 0]])],
                         ids=["sequoia", "medusa", "leaf-beside-parent"])
def test_vllm_refuses_shapes_it_would_draft_differently(shape):
    """vLLM gives every node of a depth the same child count: other shapes are refused, naming the depth."""
    with pytest.raises(ValueError, match=r"at depth \d+ this shape has nodes with \[.*\] children"):
        vllm_export(shape)
    with pytest.raises(ValueError, match="same number of children"):
        check_vllm_token_tree(str(token_tree_paths(shape)))
    assert "refused" in serving_settings(shape)["vllm"]


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_any_shape_round_trips_through_the_choice_list(name):
    shape = SHAPES[name]
    text = str(token_tree_paths(shape))
    assert_vllm_format(text, shape)
    assert parse_token_tree(text) == ast.literal_eval(text) and shape_from_token_tree(text) == shape


def test_a_depth_first_twin_fails():
    """The same nodes listed depth first: the test's own checks and the module's reader both reject it."""
    shape = TreeShape.widths((2, 1))
    good = ast.literal_eval(vllm_token_tree(shape))
    depth_first = sorted(good)  # (0,), (0, 0), (1,), (1, 0): parents still before children, but not by depth
    assert depth_first != good and set(depth_first) == set(good)
    with pytest.raises(AssertionError, match="not breadth-first"):
        assert_vllm_format(str(depth_first), shape)
    with pytest.raises(ValueError, match=r"not breadth-first: \(0, 0\) is listed before \(1,\)"):
        check_vllm_token_tree(str(depth_first))


@pytest.mark.parametrize("text, problem", [
    ("[(0,), (0, 0), (1,)]", "not breadth-first"),
    ("[(0,), (1, 0)]", r"parent \(1,\)"),
    ("[(0,), (2,)]", "ranks not contiguous"),
    ("[(0,), (0,)]", "listed twice"),
    ("[]", "empty tree"),
    ("[(0,), ()]", "non-empty tuple"),
    ("[(0,), (-1,)]", ">= 0"),
    ("[(0,), (1.0,)]", "integers"),
    ("[(0,), (1,)", "not a Python literal"),
    ("{(0,): 1}", "list of paths"),
])
def test_broken_token_trees_are_named(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_token_tree(text)


# ---------------------------------------------------------------------- SGLang
def settings(steps, topk, tokens):
    return {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens}


def test_sglang_chain_is_exact():
    """A chain of 5: top-1, 5 steps, 6 verified tokens (SGLang resets num_draft_tokens to steps + 1 at topk 1)."""
    out = sglang_export(TreeShape.chain(5))
    assert out.settings == settings(5, 1, 6) and out.exact and out.note.startswith("exact")
    assert sglang_export((1, 1, 1, 1, 1)).settings == out.settings


def test_sglang_uniform_421_is_approximate():
    """4,2,1: depth 3, 20 drafted + the root; topk 8 because eight depth-2 nodes have a child."""
    out = sglang_export((4, 2, 1))
    assert out.settings == settings(3, 8, 21) and not out.exact
    assert out.note.startswith("approximate") and "8 nodes of one depth have children" in out.note
    assert out.command_line() == ("--speculative-num-steps 3 --speculative-eagle-topk 8 "
                                  "--speculative-num-draft-tokens 21")


def test_sglang_nonuniform_sequoia_is_approximate():
    shape = SequoiaDP([0.55, 0.2, 0.1], 8, 4).shape(8, 4)
    assert shape.parents == (-1, 0, 0, 0, 1, 1, 2, 4, 7)  # the known shape this test is about
    out = sglang_export(shape)
    assert out.settings == settings(4, 3, 9) and not out.exact and "a node has 3 children" in out.note
    assert sglang_settings(shape) == out.settings


@pytest.mark.parametrize("widths, expected", [((3,), settings(1, 3, 4)), ((2, 2), settings(2, 2, 7))])
def test_sglang_exact_when_its_candidates_are_the_tree(widths, expected):
    out = sglang_export(widths)
    assert out.settings == expected and out.exact


@pytest.mark.parametrize("name", sorted(SHAPES) + sorted(UNIFORM))
def test_sglang_numbers_fit_its_candidate_pool(name):
    """Depth and node count are kept; SGLang's top-k over its candidates can hold num_draft_tokens - 1."""
    shape = {**SHAPES, **UNIFORM}[name]
    s = sglang_settings(shape)
    steps, topk, tokens = s["speculative_num_steps"], s["speculative_eagle_topk"], s["speculative_num_draft_tokens"]
    assert steps == shape.max_depth and tokens == shape.num_drafted + 1
    assert tokens - 1 <= topk + (steps - 1) * topk ** 2
    assert topk >= max(shape.num_children) and (topk > 1 or tokens == steps + 1)


# ---------------------------------------------------------------------- input
@pytest.mark.parametrize("bad, problem", [((), "empty tree"), (TreeShape(), "empty tree"),
                                          ((2, 0), ">= 1"), ((2, True), "integers")])
def test_bad_shapes_are_named(bad, problem):
    with pytest.raises(ValueError, match=problem):
        as_shape(bad)
    with pytest.raises(ValueError, match=problem):
        sglang_export(bad)


def test_engine_packages_if_installed():
    """Where vLLM / SGLang are importable, their config classes still have the fields written (else skipped)."""
    vllm_config = pytest.importorskip("vllm.config", reason="vLLM is not installed: the test is on the format")
    fields = getattr(vllm_config.SpeculativeConfig, "__dataclass_fields__", {})
    if "speculative_token_tree" not in fields:
        pytest.skip("this vLLM has no speculative_token_tree (removed May 2026)")
    server_args = pytest.importorskip("sglang.srt.server_args")
    names = getattr(server_args.ServerArgs, "__dataclass_fields__", {})
    assert {"speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"} <= set(names)


# ---------------------------------------------------------------------- command line
def run_main(argv):
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def test_cli_vllm_json(capsys):
    assert run_main(["--tree", "4,2,1", "--engine", "vllm", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "vllm" and out["exact"]
    assert_vllm_format(out["settings"]["speculative_token_tree"], TreeShape.widths((4, 2, 1)))


def test_cli_sglang_flags_and_note(capsys, tmp_path):
    assert run_main(["--tree", "4,2,1", "--engine", "sglang"]) == 0
    captured = capsys.readouterr()
    assert captured.out == sglang_export((4, 2, 1)).command_line() + "\n"
    assert captured.err.count("\n") == 1 and "note: approximate" in captured.err
    assert run_main(["--tree", "3", "--engine", "sglang", "--json", "--out", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["settings"] == settings(3, 1, 4)  # one number: a chain


def test_cli_reads_a_shape_file(capsys, tmp_path):
    SEQUOIA.save(tmp_path / "tree.json")
    assert run_main(["--shape", str(tmp_path / "tree.json"), "--engine", "sglang", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"] == sglang_settings(SEQUOIA)


@pytest.mark.parametrize("argv, problem", [
    (["--tree", "0", "--engine", "vllm"], "empty tree"),
    (["--tree", "4,x", "--engine", "sglang"], "comma-separated integers"),
    (["--tree", "2,0", "--engine", "sglang"], ">= 1"),
    (["--tree", "4,2,1"], "--engine"),
    (["--tree", "4,2,1", "--engine", "trt"], "invalid choice"),
    (["--tree", "4", "--shape", "x.json", "--engine", "vllm"], "not allowed with"),
    (["--shape", "SHAPE", "--engine", "vllm"], "at depth 1 this shape"),
    (["--shape", "missing.json", "--engine", "vllm"], "No such file"),
    (["--shape", "BROKEN", "--engine", "sglang"], "Expecting"),
])
def test_cli_bad_input_exits_2_with_one_line(capsys, tmp_path, argv, problem):
    SEQUOIA.save(tmp_path / "shape.json")
    (tmp_path / "broken.json").write_text("{not json")
    names = {"SHAPE": tmp_path / "shape.json", "BROKEN": tmp_path / "broken.json",
             "missing.json": tmp_path / "missing.json"}
    argv = [str(names.get(a, a)) for a in argv]
    assert run_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("python -m treespec.trees.export: error: ") and problem in captured.err


def test_python_dash_m_exits_2_with_one_line():
    done = subprocess.run([sys.executable, "-m", "treespec.trees.export", "--tree", "0", "--engine", "vllm"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "python -m treespec.trees.export: error: empty tree: the shape drafts no node, so there is nothing to export"]


# ---------------------------------------------------------------------- bench_trees
def test_bench_trees_keeps_serving_settings():
    from benchmarks import bench_trees

    class Fixed:
        tree_shape = TreeShape.widths((4, 2, 1))

    row = bench_trees.serving_of(Fixed())
    assert row["shape"]["parents"] == list(Fixed.tree_shape.parents)
    assert row["serving"]["vllm"]["settings"]["num_speculative_tokens"] == 20
    assert row["serving"]["sglang"]["settings"] == settings(3, 8, 21)
    assert bench_trees.serving_of(object()) is None  # dynamic builders: no fixed shape


def test_sglang_deep_tree_with_full_candidate_count_is_approximate():
    """Depth 3, top-k 2: SGLang's 10 candidates have this tree's size, but which depth-2 nodes it expands depends
    on the draft's scores at every step, so the verified tree is not always this one."""
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    out = sglang_export(TreeShape.from_paths(paths))
    assert out.settings == {"speculative_num_steps": 3, "speculative_eagle_topk": 2,
                            "speculative_num_draft_tokens": 11}
    assert not out.exact and "approximate" in out.note
