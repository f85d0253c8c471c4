"""Execute notebooks/01_bounds_small_examples.ipynb headless with nbclient."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from benchmarks import common

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "01_bounds_small_examples.ipynb"


def test_bounds_notebook_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OT_BOUNDS_NB_SMALL", os.environ.get("OT_BOUNDS_NB_SMALL", "1"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not any(o.output_type == "error" for o in outputs)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "largest disagreement between the five numbers" in text


STUDY_NOTEBOOK = ROOT / "notebooks" / "02_real_model_study.ipynb"
STUDY_RESULTS = ROOT / "benchmarks" / "results" / "ot_study" / "2026-11-25-f5b5598"  # the run the README quotes


def _run_study_notebook(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], cwd: Path = ROOT) -> str:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(STUDY_NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not any(o.output_type == "error" for o in outputs)
    assert sum(o.output_type == "display_data" for o in outputs) >= 3  # the three figures
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream")


def test_study_notebook_runs_on_saved_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Notebook (b) on the committed study results (no model needed)."""
    assert (STUDY_RESULTS / "summary.json").exists(), f"committed study results missing: {STUDY_RESULTS}"
    assert (STUDY_RESULTS / "provenance.json").exists(), "the study results carry no provenance record"
    monkeypatch.delenv("OT_STUDY_NB_RECOMPUTE", raising=False)
    monkeypatch.delenv("OT_STUDY_NB_RESULTS", raising=False)  # the notebook's own default: the run the README quotes
    text = _run_study_notebook(monkeypatch, {})
    assert f"results: {STUDY_RESULTS.relative_to(ROOT)}" in text
    assert "study summary printed above: done" in text


def test_study_notebook_runs_from_any_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Notebook (b) finds the repository from the ot_bounds package, not from the working folder."""
    monkeypatch.delenv("OT_STUDY_NB_RECOMPUTE", raising=False)
    monkeypatch.delenv("OT_STUDY_NB_RESULTS", raising=False)
    text = _run_study_notebook(monkeypatch, {}, cwd=tmp_path)
    assert f"results: {STUDY_RESULTS.relative_to(ROOT)}" in text
    assert "study summary printed above: done" in text


@pytest.mark.skipif(not (common.SPEC_BENCH.exists() and common.TRAIN_PROMPTS.exists()),
                    reason="needs the shared prompts (../shared/data, or TREESPEC_SHARED)")
@pytest.mark.gemma
def test_study_notebook_recomputes_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """Notebook (b) recomputing the study with --small settings on the embedded Gemma (~1.5 min)."""
    text = _run_study_notebook(monkeypatch, {"OT_STUDY_NB_RECOMPUTE": "1"})
    assert "48 positions" in text
    assert "study summary printed above: done" in text
