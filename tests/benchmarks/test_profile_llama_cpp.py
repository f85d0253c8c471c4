"""``benchmarks/profile_llama_cpp.py``'s table: every measured cell rendered, the LM-head share of the row sweep
computed against the body of the same node count (fixed numbers, no llama.cpp needed)."""

from benchmarks.profile_llama_cpp import render


def _cell(ms: float) -> dict:
    return {"median_ms": ms, "min_ms": ms - 1, "max_ms": ms + 1}


def test_render_reports_the_row_sweep_against_the_body():
    data = {"provenance": {"commit": "abcdef0123", "command": {"shell": "profile_llama_cpp.py"}},
            "machine": {"cpu_flags": {"avx2": True, "avx512f": False}, "cores": 2},
            "settings": {"prefix": 100, "threads": 2, "reps": 5, "rows_of": 8},
            "rows": [{"nodes": 1, "logits": _cell(20.0), "body": _cell(10.0), "hidden": _cell(11.0)},
                     {"nodes": 8, "logits": _cell(90.0), "body": _cell(40.0), "hidden": _cell(45.0)}],
            "row_sweep": [{"rows": 3, "pass": _cell(100.0)}, {"rows": 4, "pass": _cell(72.0)}]}
    table = render(data)
    assert "| 8 | 90.0 [89.0, 91.0] | 40.0 [39.0, 41.0] | 45.0 [44.0, 46.0] | 6.2 | 4.50 | 4.00 |" in table
    assert "| 3 | 100.0 [99.0, 101.0] | 60.0 | 20.0 |" in table
    assert "| 4 | 72.0 [71.0, 73.0] | 32.0 | 8.0 |" in table
    assert "flags: avx2" in table and "avx512f" not in table


def test_render_without_a_sweep_has_no_sweep_table():
    data = {"provenance": {"commit": "abcdef0123", "command": {"shell": "x"}}, "machine": {},
            "settings": {"prefix": 100, "threads": 2, "reps": 5},
            "rows": [{"nodes": 1, "logits": _cell(20.0), "body": _cell(10.0), "hidden": _cell(11.0)}]}
    assert "k rows" not in render(data)


def test_render_adds_the_int8_head_column_where_measured():
    data = {"provenance": {"commit": "abcdef0123", "command": {"shell": "x"}}, "machine": {},
            "settings": {"prefix": 100, "threads": 2, "reps": 5},
            "rows": [{"nodes": 1, "logits": _cell(20.0), "body": _cell(10.0), "hidden": _cell(11.0),
                      "hidden_int8": _cell(18.0)}]}
    table = render(data)
    assert "hidden states + treespec's int8 head (ms) |" in table
    assert "| 1 | 20.0 [19.0, 21.0] | 10.0 [9.0, 11.0] | 11.0 [10.0, 12.0] | 18.0 [17.0, 19.0] | 10.0 |" in table
    assert table.count("|---") == 8  # nodes, four modes, per row, two ratios
