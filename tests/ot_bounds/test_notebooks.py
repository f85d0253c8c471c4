"""Execute notebooks/01_bounds_small_examples.ipynb headless with nbclient."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

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
