"""Every figure the README and the pages of docs/ quote from a results file is found in that file.

Convention (README.md and docs/*.md; links are relative to the page, so docs/ writes ``../benchmarks/...``): a quoted figure is written as a markdown link whose text holds
the figure(s) and whose target is the results FILE they come from, e.g.
``[2.08x](benchmarks/results/speed/2026-11-22-t0/table.md)`` or
``[1.93 / 2.05 / 2.21](benchmarks/results/trees/X/results.md)``. The test opens each linked file under
``benchmarks/results/`` (markdown, JSON, any text) and checks that every number in the link text occurs
in it, up to formatting: ``2.08x`` matches ``2.08x``, ``2.08`` or ``2.0812`` (rounded to the quoted
decimals), ``-2.8%`` matches ``-2.8%`` or ``-0.028``, ``1,490`` matches ``1490``. So a claim cannot drift
from its evidence: change the figure or the file and the test fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS_PREFIX = "benchmarks/results/"

LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
# a quoted figure: optional sign, digits with thousands separators, optional decimals, optional % / x
QUOTED = re.compile(r"(?<![\w.])([-+−]?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(%?)")
FILE_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def quoted_figures(text: str) -> list[tuple[float, int, bool, str]]:
    """(value, decimals, is_percent, as written) for every number in a link text."""
    out = []
    for m in QUOTED.finditer(text):
        sign, whole, frac, pct = m.groups()
        value = float(whole.replace(",", "") + (f".{frac}" if frac else ""))
        if sign in ("-", "−"):
            value = -value
        out.append((value, len(frac or ""), pct == "%", m.group(0)))
    return out


def file_numbers(text: str) -> list[float]:
    nums = []
    for tok in FILE_NUMBER.findall(text.replace(",", "")):
        try:
            nums.append(float(tok))
        except ValueError:
            pass
    return nums


def _matches(value: float, decimals: int, percent: bool, candidates: list[float]) -> bool:
    """Some number of the file, rounded to the quoted decimals (x 100 too for a percentage), is the figure."""
    scales = (1.0, 100.0) if percent else (1.0,)
    return any(abs(round(c * s, decimals) - value) < 1e-9 for c in candidates for s in scales)


def check_readme(text: str, root: Path = ROOT, page_dir: Path | None = None) -> tuple[list[str], int]:
    """Returns (errors, number of figures checked) for a page in ``page_dir`` (default: ``root``)."""
    errors, checked, cache = [], 0, {}
    page_dir = root if page_dir is None else page_dir
    for m in LINK.finditer(text):
        label, link = m.group(1), m.group(2).split("#", 1)[0]
        if "://" in link:
            continue
        try:
            target = (page_dir / link).resolve().relative_to(root.resolve()).as_posix()
        except ValueError:  # outside the repository
            continue
        if not target.startswith(RESULTS_PREFIX):
            if not (root / target).exists():  # a broken link to a page, script or folder of the repository
                errors.append(f"[{label}]({m.group(2)}): the linked path does not exist")
            continue
        path = root / target
        if not path.is_file():
            errors.append(f"[{label}]({target}): the results file does not exist")
            continue
        if target not in cache:
            cache[target] = file_numbers(path.read_text(encoding="utf-8", errors="replace"))
        figures = quoted_figures(label)
        if not figures:
            errors.append(f"[{label}]({target}): a results link without a figure in its text")
        for value, decimals, percent, written in figures:
            checked += 1
            if not _matches(value, decimals, percent, cache[target]):
                errors.append(f"[{label}]({target}): {written!r} is not in {target}")
    return errors, checked


PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_figures_are_in_their_results_files():
    total = 0
    for page in PAGES:
        errors, checked = check_readme(page.read_text(encoding="utf-8"), page_dir=page.parent)
        assert not errors, f"{page.name}: figures without evidence:\n" + "\n".join(errors)
        total += checked
    assert total >= 10, f"only {total} linked figures found: the pages lost their results links"


def test_a_figure_in_docs_is_checked_against_its_file():
    """A page in docs/ links with ``../``: its figures are found, and a wrong one fails."""
    link = "../benchmarks/results/speed/2026-11-27-ae53130-epyc-v2cont7-protocol/table.md"
    ok, checked = check_readme(f"[99.79]({link})", page_dir=ROOT / "docs")
    bad, _ = check_readme(f"[99.71]({link})", page_dir=ROOT / "docs")
    assert checked == 1 and not ok and bad


def test_a_changed_figure_fails():
    """The broken twin: the results page with one linked figure changed must fail."""
    page = ROOT / "docs" / "results.md"
    text = page.read_text(encoding="utf-8")
    prefix = "../" + RESULTS_PREFIX
    m = next(m for m in LINK.finditer(text) if m.group(2).startswith(prefix) and quoted_figures(m.group(1)))
    value, decimals, percent, written = quoted_figures(m.group(1))[0]
    numbers = file_numbers((page.parent / m.group(2)).read_text(encoding="utf-8", errors="replace"))
    # the smallest of a few bumps whose value the file does not hold by chance (tables hold many numbers)
    bumps = [value + k * 10 ** -decimals if decimals else value + 7777 * k for k in (7, 13, 29, 53, 97)]
    new = next(b for b in bumps if not _matches(b, decimals, percent, numbers))
    bumped = f"{new:.{decimals}f}" if decimals else str(int(new))
    broken = text[:m.start(1)] + m.group(1).replace(written.lstrip("+-−"), bumped, 1) + text[m.end(1):]
    errors, _ = check_readme(broken, page_dir=page.parent)
    assert errors, f"changing {written} to {bumped} in [{m.group(1)}] went unnoticed"


def test_a_missing_file_fails():
    errors, _ = check_readme("[2.08x](benchmarks/results/speed/no-such-run/table.md)")
    assert errors and "does not exist" in errors[0]


def test_a_broken_link_outside_the_results_fails():
    """A link to a page of the repository must lead somewhere (an unfilled ``({T})`` template once slipped by)."""
    ok, _ = check_readme("[the docs](docs/results.md) and [figures](docs/)")
    errors, _ = check_readme("[1.766]({T}) and [a page](docs/no-such-page.md)")
    assert not ok and len(errors) == 2 and all("does not exist" in e for e in errors)


@pytest.mark.parametrize("quoted, file_text, ok", [
    ("2.08x", "| ts | 2.08x |", True),
    ("2.08x", '"speedup": 2.0812', True),
    ("2.08x", '"speedup": 2.0912', False),
    ("-2.8%", "| -2.8% |", True),
    ("-2.8%", '"error": -0.028', True),
    ("-2.8%", '"error": 0.028', False),
    ("1,490 s", '"runtime_s": 1490.3', True),
    ("0.548", '"x": 0.5481', True),
    ("0.548", '"x": 0.5491', False),
])
def test_formatting_tolerance(tmp_path, quoted, file_text, ok):
    f = tmp_path / "benchmarks" / "results" / "r.md"
    f.parent.mkdir(parents=True)
    f.write_text(file_text)
    errors, checked = check_readme(f"[{quoted}](benchmarks/results/r.md)", tmp_path)
    assert checked >= 1 and (not errors) == ok, errors
