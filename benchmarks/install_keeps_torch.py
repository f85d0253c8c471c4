"""Does installing treespec keep a user's own CUDA build of torch? (issue 46)

    python benchmarks/install_keeps_torch.py [--torch-version 2.11.0+cu126] [--out DIR]

Builds a stand-in distribution named ``torch`` at a CUDA build's version (metadata only: a CUDA wheel is several
GB), installs it into a fresh virtual environment, then asks pip what ``pip install <this checkout>`` would
install there (``--dry-run --report``), resolving every other requirement from the configured indexes. treespec
keeps the user's torch when ``torch`` is not among the packages pip would install. Writes ``results.json``
(the versions, pip's install list, the verdict) and ``README.md``; exit 0 when torch is kept, 1 otherwise.
Needs the package indexes (network or a local mirror); not a test for that reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, add_output_args, finish, open_results_from_args, write_json  # noqa: E402


def stand_in_torch(folder: Path, version: str) -> Path:
    """A source tree of a metadata-only package ``torch`` at ``version``."""
    (folder / "torch").mkdir(parents=True)
    (folder / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (folder / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "torch"\nversion = "{version}"\n[tool.setuptools]\npackages = ["torch"]\n')
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--torch-version", default="2.11.0+cu126", help="the user's CUDA torch (default: %(default)s)")
    add_output_args(ap)
    args = ap.parse_args(argv)
    folder, _ = open_results_from_args("install", args, tag="keeps-torch")
    with tempfile.TemporaryDirectory() as tmp:
        env_dir = Path(tmp) / "env"
        venv.create(env_dir, with_pip=True)
        pip = [str(env_dir / "bin" / "python"), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", str(stand_in_torch(Path(tmp) / "torch-src", args.torch_version))],
                       check=True)
        report = Path(tmp) / "report.json"
        subprocess.run([*pip, "install", "-q", "--dry-run", "--report", str(report), str(REPO)], check=True)
        would = sorted(f"{item['metadata']['name']}=={item['metadata']['version']}"
                       for item in json.loads(report.read_text())["install"])
    kept = not any(name.lower().startswith("torch==") for name in would)
    write_json(folder / "results.json", {"user_torch": args.torch_version, "would_install": would,
                                         "torch_kept": kept})
    (folder / "README.md").write_text(
        f"# Installing treespec beside torch {args.torch_version}\n\n"
        f"pip would install {len(would)} packages; torch is {'not ' if kept else ''}among them: the user's torch "
        f"is {'kept' if kept else 'REPLACED'}.\n\n" + "\n".join(f"- {w}" for w in would) + "\n")
    finish(folder)
    print(f"install_keeps_torch: torch {args.torch_version} {'kept' if kept else 'replaced'} ({folder})")
    return 0 if kept else 1


if __name__ == "__main__":
    sys.exit(main())
