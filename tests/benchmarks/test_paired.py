"""``benchmarks/paired.py``: per-prompt ratios of two methods of one run, their median and sign test (fixed
numbers); a pair missing from the run gives no row."""

import pytest

from benchmarks.paired import main, paired_rows


def _row(method: str, prompt: int, tps: float, temp: float = 0.0) -> dict:
    return {"dtype": "float32", "temperature": temp, "prompt_id": prompt, "method": method, "tokens_per_s": tps}


def test_paired_rows_compare_the_same_prompts():
    per_prompt = [_row("a", i, 10.0) for i in range(5)] + [_row("b", i, 12.0 if i else 9.0) for i in range(5)]
    [row] = paired_rows(per_prompt, [("a", "b"), ("a", "missing")])
    assert (row["prompts"], row["wins"], row["losses"]) == (5, 4, 1)
    assert row["median"] == pytest.approx(1.2)
    assert row["p_sign"] == pytest.approx(0.375)


def test_bad_pairs_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path), "--pairs", "a"])
    assert exc.value.code == 2 and "A:B" in capsys.readouterr().err
