"""benchmarks/cli_startup.py times the command line's quick paths and writes what it measured."""

import json

import pytest


def test_cli_startup_writes_every_command(tmp_path):
    from benchmarks import cli_startup

    assert cli_startup.main(["--repeats", "1", "--out", str(tmp_path / "run"), "--allow-dirty"]) == 0
    data = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [r["command"] for r in data["rows"]] == list(cli_startup.COMMANDS)
    assert all(len(r["seconds"]) == 1 and r["seconds"][0] > 0 for r in data["rows"])
    assert "| `treespec --help` |" in (tmp_path / "run" / "table.md").read_text()


def test_cli_startup_refuses_no_repeats(capsys):
    from benchmarks import cli_startup

    with pytest.raises(SystemExit) as info:
        cli_startup.main(["--repeats", "0"])
    assert info.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err
