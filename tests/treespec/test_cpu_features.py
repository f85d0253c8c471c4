"""The CPU bf16 detection behind the default dtype (:func:`treespec.models.loading.cpu_supports_bf16`)."""

from pathlib import Path

import torch

from treespec.models import loading


def _flags_say_bf16() -> bool:
    """The detection as first written: the two flags anywhere in /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in text or "amx_bf16" in text


def test_answer_on_this_host_is_the_flags_answer():
    assert loading.cpu_supports_bf16() == _flags_say_bf16()
    expected = torch.bfloat16 if _flags_say_bf16() else torch.float32
    assert loading.default_dtype("cpu") == expected


def test_flags_flip_the_answer(tmp_path, monkeypatch):
    with_bf16 = tmp_path / "with"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    with_amx = tmp_path / "amx"
    with_amx.write_text("flags\t\t: fpu avx2 amx_tile amx_bf16\n")
    avx2_only = tmp_path / "without"
    avx2_only.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    for path, answer in ((with_bf16, True), (with_amx, True), (avx2_only, False), (tmp_path / "absent", False)):
        monkeypatch.setattr(loading, "CPUINFO", path)
        assert loading.cpu_supports_bf16() is answer
        assert loading.default_dtype("cpu") == (torch.bfloat16 if answer else torch.float32)
