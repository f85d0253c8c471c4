"""``benchmarks/memory.py``'s table from fixed figures (no model): the soak's drift against request 50, the
long prompt's peak above the loaded model."""

from benchmarks.memory import render, status_kb


def test_render_reports_drift_and_peak():
    data = {"provenance": {"commit": "abcdef0123", "command": {"shell": "memory.py"}},
            "machine": {"cpu_flags": {"avx2": True}, "cores": 2},
            "studies": [{"study": "soak", "requests": 200, "new_tokens": 4, "draft": "ngram", "dtype": "float32",
                         "prompts": 64, "wall_s": 100.0, "rss_kb": [1024 * 2000] * 50 + [1024 * 2020] * 150},
                        {"study": "long", "prompt_tokens": 30000, "new_tokens": 4, "draft": "ngram",
                         "dtype": "float32", "prefill_chunk": 512, "wall_s": 300.0, "loaded_rss_kb": 1024 * 1200,
                         "peak_rss_kb": 1024 * 2500}]}
    table = render(data)
    assert "After the last request against after request 50: +1.00%" in table
    assert "| 200 | 2020.0 |" in table and "| 50 | 2000.0 |" in table
    assert "Long prompt: 30,000 tokens" in table and "| 1200.0 | 2500.0 | 1300.0 |" in table


def test_status_reads_this_process():
    assert status_kb("VmRSS") > 0 and status_kb("VmHWM") >= status_kb("VmRSS") // 2
