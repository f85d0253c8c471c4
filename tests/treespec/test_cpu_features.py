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


def test_flags_are_the_words_of_the_flags_lines(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: amx_int8 in a name is no flag\nflags\t\t: fpu avx2 amx_tile\n"
                    "processor\t: 1\nflags\t\t: fpu avx2 amx_tile amx_int8\n")
    monkeypatch.setattr(loading, "CPUINFO", info)
    assert loading.cpu_flags() == {"fpu", "avx2", "amx_tile", "amx_int8"}
    monkeypatch.setattr(loading, "CPUINFO", tmp_path / "absent")
    assert loading.cpu_flags() == frozenset()


def test_amx_flag_turns_llama_cpp_extra_buffers_off(tmp_path, monkeypatch):
    """llama.cpp's AMX matrix product crashed on every batched decode of an AMX Xeon: a runner on such a CPU
    loads without llama.cpp's extra buffer types unless asked; everywhere else it keeps llama.cpp's default."""
    from treespec.models import llama_cpp

    amx, avx512 = tmp_path / "amx", tmp_path / "avx512"
    amx.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    avx512.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    # the model name may say anything: only a flags line counts
    named = tmp_path / "named"
    named.write_text("model name\t: Xeon amx_int8\nflags\t\t: fpu avx2\n")

    class Params:  # what llama_model_default_params() gives, as far as set_model_params reads it
        n_gpu_layers, use_extra_bufts = 99, True

    for path, has_amx in ((amx, True), (avx512, False), (named, False), (tmp_path / "absent", False)):
        monkeypatch.setattr(loading, "CPUINFO", path)
        assert loading.cpu_has_amx() is has_amx
        assert llama_cpp.default_extra_buffers() is (not has_amx)
        params = llama_cpp.set_model_params(Params())
        assert params.use_extra_bufts is (not has_amx) and params.n_gpu_layers == 0
        assert llama_cpp.set_model_params(Params(), extra_buffers=True).use_extra_bufts is True
        assert llama_cpp.set_model_params(Params(), extra_buffers=False).use_extra_bufts is False


def test_vnni_flags(tmp_path, monkeypatch):
    """An 8-bit dot product is any of AVX512-VNNI, AVX-VNNI or AMX's int8 tiles, named on an x86 flags line; a CPU whose
    flags are unknown (no file, or not x86) gets None, not False."""
    cases = {"fpu sse2 avx2 avx512f avx512_vnni": True, "fpu sse2 avx2 avx_vnni": True,
             "fpu sse2 avx2 amx_tile amx_int8": True, "fpu sse2 avx avx2 fma": False}
    for i, (flags, answer) in enumerate(cases.items()):
        info = tmp_path / f"cpuinfo{i}"
        info.write_text(f"processor\t: 0\nmodel name\t: avx512_vnni in a name is no flag\nflags\t\t: {flags}\n")
        monkeypatch.setattr(loading, "CPUINFO", info)
        assert loading.cpu_has_vnni() is answer, flags
    arm = tmp_path / "arm"  # aarch64 names its features on "Features" lines: unknown, not "no VNNI"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 asimddp\n")
    for unknown in (arm, tmp_path / "absent"):
        monkeypatch.setattr(loading, "CPUINFO", unknown)
        assert loading.cpu_has_vnni() is None
