"""Command-line interface: .npy and .pt inputs, JSON/table output, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ot_bounds import optimal_acceptance, verifier_acceptance
from ot_bounds.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _save(tmp_path: Path, name: str, arr) -> str:
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, np.asarray(arr))
    else:
        torch.save(torch.as_tensor(np.asarray(arr)), path)
    return str(path)


def test_npy_rows_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(6), size=3), rng.dirichlet(np.ones(6), size=3)  # shape (3, 6)
    code = main([_save(tmp_path, "p.npy", p), _save(tmp_path, "q.npy", q), "--n", "3", "--sampling", "without_replacement", "--verifier", "rrs_without_replacement", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == 3
    for i, row in enumerate(out["rows"]):
        assert row["optimal"] == pytest.approx(optimal_acceptance(p[i], q[i], 3, "without_replacement"))
        assert row["verifier"] == pytest.approx(verifier_acceptance(p[i], q[i], 3, "rrs_without_replacement"))
        assert row["verifier"] <= row["verifier_law_optimal"] + 1e-12


def test_pt_vector_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p, q = [0.5, 0.5], [0.9, 0.1]
    code = main([_save(tmp_path, "p.pt", p), _save(tmp_path, "q.pt", q), "--n", "1"])
    assert code == 0
    text = capsys.readouterr().out
    assert "0.600000" in text


def test_module_entry_point(tmp_path: Path) -> None:
    p = _save(tmp_path, "p.npy", [0.2, 0.8])
    q = _save(tmp_path, "q.npy", [0.6, 0.4])
    proc = subprocess.run([sys.executable, "-m", "ot_bounds", p, q, "--n", "2", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rows"][0]["optimal"] == pytest.approx(optimal_acceptance([0.2, 0.8], [0.6, 0.4], 2))


@pytest.mark.parametrize(
    ("p", "q", "extra", "message"),
    [
        ([0.5, 0.5], [0.3, 0.3, 0.4], [], "shapes differ"),
        ([0.5, 0.5], [1.5, -0.5], [], "negative"),
        ([0.5, np.nan], [0.5, 0.5], [], "NaN"),
        ([0.5, 0.6], [0.5, 0.5], [], "not normalised"),
        ([0.5, 0.5], [0.5, 0.5], ["--n", "0"], "n must be a positive integer"),
        ([0.5, 0.5], [0.5, 0.5], ["--sampling", "bogus"], "unknown sampling"),
        ([0.5, 0.5], [0.5, 0.5], ["--verifier", "bogus"], "unknown verifier"),
        ([0.5, 0.5], [0.5, 0.5], ["--verifier", "spechub", "--n", "3"], "n = 2 only"),
    ],
)
def test_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str], p, q, extra, message) -> None:
    code = main([_save(tmp_path, "p.npy", p), _save(tmp_path, "q.npy", q), *extra])
    assert code == 2
    assert message in capsys.readouterr().err


def test_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _save(tmp_path, "q.npy", [0.5, 0.5])
    assert main([str(tmp_path / "missing.npy"), good]) == 2
    assert "file not found" in capsys.readouterr().err
    other = tmp_path / "p.txt"
    other.write_text("0.5 0.5")
    assert main([str(other), good]) == 2
    assert "unsupported file type" in capsys.readouterr().err
    cube = _save(tmp_path, "cube.npy", np.full((2, 2, 2), 0.5))
    assert main([cube, cube]) == 2
    assert "1-D" in capsys.readouterr().err


def test_greedy_draft_is_the_law_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI names greedy drafting as treespec does (``greedy_draft``), in its options, help and output."""
    p, q = [0.1, 0.5, 0.4], [0.5, 0.3, 0.2]
    files = [_save(tmp_path, "p.npy", p), _save(tmp_path, "q.npy", q)]
    assert main([*files, "--n", "2", "--sampling", "greedy_draft", "--verifier", "greedy_draft", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sampling"] == "greedy_draft"
    assert out["rows"][0]["optimal"] == pytest.approx(optimal_acceptance(p, q, 2, "greedy_draft"))
    assert out["rows"][0]["verifier_law_optimal"] == pytest.approx(out["rows"][0]["optimal"])
    assert main([*files, "--n", "2", "--sampling", "greedy"]) == 2
    assert "unknown sampling 'greedy'" in (err := capsys.readouterr().err) and "--sampling greedy_draft" in err
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "greedy_draft" in help_text and "'greedy'" not in help_text


def test_too_large_enumeration_is_told_in_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A refused enumeration says what to type (--n, --verifier), not which Python function to call."""
    p = np.full(1500, 1 / 1500)
    files = [_save(tmp_path, "p.npy", p), _save(tmp_path, "q.npy", p)]
    assert main([*files, "--n", "2", "--verifier", "rrs_without_replacement"]) == 2
    err = capsys.readouterr().err
    assert "--verifier rrs_without_replacement enumerates" in err and "use a smaller --n" in err
    assert "optimal_acceptance" not in err and err.count("\n") == 1
