"""The README's results table is the rendering of the newest protocol run (benchmarks/readme_table.py), and the
README stays a guide: at most 250 lines, the two commands in its first 20, the results table in its first 60."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import readme_table  # noqa: E402


def test_readme_table_is_the_newest_protocol_run():
    readme = (ROOT / "README.md").read_text()
    assert readme_table.readme_block(readme) == readme_table.render(readme_table.newest_protocol_run()), \
        "README's results table is stale: run python benchmarks/readme_table.py --write"


def test_a_typed_figure_fails(tmp_path):
    """The twin: one figure of the table edited by hand no longer matches the rendering."""
    block = readme_table.render(readme_table.newest_protocol_run())
    edited = block.replace("| 1.00 |", "| 1.01 |", 1)
    assert edited != block and readme_table.readme_block(f"x\n{edited}\ny") != block


def test_newest_run_is_chosen_by_date(tmp_path):
    for name in ("2026-11-20-aaa-protocol", "2026-11-27-bbb-protocol", "2026-11-28-ccc-other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text("{}")
    assert readme_table.newest_protocol_run(tmp_path).name == "2026-11-27-bbb-protocol"


def test_runs_of_one_day_are_ordered_by_their_recorded_start_not_file_times(tmp_path):
    """A fresh clone gives every folder its checkout time: the later run of a day is the one its provenance says
    started later, even when its files look older."""
    import os

    for name, started, mtime in (("2026-11-28-aaa-protocol", "2026-11-28T21:00:00+00:00", 100),
                                 ("2026-11-28-bbb-protocol", "2026-11-28T14:00:00+00:00", 200)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text("{}")
        (tmp_path / name / "provenance.json").write_text(f'{{"date_utc": "{started}"}}')
        os.utime(tmp_path / name, (mtime, mtime))
    assert readme_table.newest_protocol_run(tmp_path).name == "2026-11-28-aaa-protocol"


def test_readme_is_a_short_guide():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README has {len(lines)} lines"
    head = "\n".join(lines[:20])
    assert "make demo" in head and "make test" in head
    assert any(readme_table.BEGIN in line for line in lines[:60])
