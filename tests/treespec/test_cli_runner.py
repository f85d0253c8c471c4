"""``treespec generate --runner auto|fast|eager`` on tiny local models (saved to a tmp dir, no download).

The fast runner is the default wherever it covers the target (Gemma-3); both runners must give the
same tokens (greedy, float32) for plain decoding and for speculative decoding with a model draft, and
``--runner fast`` on a model it does not cover is refused with a message naming the reason.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from treespec.cli import main as cli_main
from treespec.models.tiny import tiny_model

VOCAB = 64


def _save(path, arch: str) -> str:
    words = ["<unk>", "</s>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    tiny_model(arch, VOCAB, seed=2).save_pretrained(path)  # seed 2: greedy output varies
    return str(path)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory) -> str:
    return _save(tmp_path_factory.mktemp("tiny-gemma"), "gemma3")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return _save(tmp_path_factory.mktemp("tiny-llama"), "llama")


def _run(capsys, target: str, *argv: str) -> tuple[int, dict | None, str]:
    code = cli_main(["generate", "w1 w2 w3 w4 w5 w1 w2", "--target", target, "--max-new-tokens", "24",
                     "--no-stop", "--json", "--threads", "1", "--exact", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


@pytest.mark.parametrize("temperature", ["0", "1"])
@pytest.mark.parametrize("draft", [["--plain"], ["--draft", "early-exit:1", "--tree", "2,2,1"],
                                   ["--draft", "ngram"]])
def test_fast_and_eager_runners_give_the_same_tokens(capsys, gemma_dir, draft, temperature):
    """Same seed, logits equal within float32 rounding: the same greedy and the same sampled tokens."""
    draft = [*draft, "--temperature", temperature, "--seed", "5"]
    code, eager, err = _run(capsys, gemma_dir, "--runner", "eager", *draft)
    assert code == 0, err
    code, fast, err = _run(capsys, gemma_dir, "--runner", "fast", *draft)
    assert code == 0, err
    code, auto, err = _run(capsys, gemma_dir, *draft)
    assert code == 0, err
    assert eager["statistics"]["runner"] == "eager"
    assert fast["statistics"]["runner"] == "fast" and auto["statistics"]["runner"] == "fast"
    assert fast["token_ids"] == eager["token_ids"] == auto["token_ids"]
    assert len(fast["token_ids"]) == 24
    assert len(set(fast["token_ids"])) >= 4  # a degenerate repetition would hide a broken forward


def test_auto_falls_back_and_fast_is_refused_where_not_covered(capsys, llama_dir):
    code, out, err = _run(capsys, llama_dir, "--plain")
    assert code == 0, err
    assert out["statistics"]["runner"] == "eager"
    code, _, err = _run(capsys, llama_dir, "--plain", "--runner", "fast")
    assert code == 2
    assert "--runner fast" in err and "gemma3_text" in err


def _run_bf16(capsys, target: str, *argv: str) -> tuple[int, dict | None, str]:
    code = cli_main(["generate", "w1 w2 w3 w4 w5 w1 w2", "--target", target, "--max-new-tokens", "24",
                     "--no-stop", "--json", "--threads", "1", "--dtype", "bfloat16", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_quantized_target_through_the_cli(capsys, gemma_dir, llama_dir):
    """--quantize int4 runs in bf16 (its kernel's fast dtype); token identity with its own plain decoding
    is tested in float32 on the library (test_quantized_target.py); here: it runs, says so, and every
    combination it cannot serve is refused with exit 2 and a reason."""
    code, plain, err = _run_bf16(capsys, gemma_dir, "--plain", "--quantize", "int4")
    assert code == 0, err
    assert plain["statistics"]["quantize"] == "int4" and plain["statistics"]["runner"] == "fast"
    assert len(plain["token_ids"]) == 24
    code, spec, err = _run_bf16(capsys, gemma_dir, "--draft", "ngram", "--quantize", "int4")
    assert code == 0 and len(spec["token_ids"]) == 24, err
    for argv, words in ((["--dtype", "float32"], ["--quantize int4", "bfloat16"]),
                        (["--runner", "eager"], ["--quantize int4", "--runner eager"])):
        code, _, err = _run_bf16(capsys, gemma_dir, "--plain", "--quantize", "int4", *argv)
        assert code == 2 and all(w in err for w in words), err
    code, _, err = _run(capsys, gemma_dir, "--plain", "--quantize", "int4")  # --exact: float32
    assert code == 2 and "--quantize int4" in err and "float32" in err, err
    code, _, err = _run_bf16(capsys, llama_dir, "--plain", "--quantize", "int4")
    assert code == 2 and "--quantize int4" in err and "gemma3_text" in err


def test_the_8_bit_head_through_the_cli(capsys, gemma_dir, llama_dir):
    """--quantize int8-head runs in bf16 and in float32 (--exact: T=0 speculation token-identical to its own plain
    decoding), says so in the statistics, and is refused with the eager runner and a model the fast path does not
    cover."""
    code, plain, err = _run_bf16(capsys, gemma_dir, "--plain", "--quantize", "int8-head")
    assert code == 0, err
    assert plain["statistics"]["quantize"] == "int8-head" and plain["statistics"]["runner"] == "fast"
    code, plain32, err = _run(capsys, gemma_dir, "--plain", "--quantize", "int8-head")  # --exact: float32
    assert code == 0, err
    code, spec32, err = _run(capsys, gemma_dir, "--draft", "ngram", "--quantize", "int8-head")
    assert code == 0 and spec32["token_ids"] == plain32["token_ids"], err
    code, _, err = _run_bf16(capsys, gemma_dir, "--plain", "--quantize", "int8-head", "--runner", "eager")
    assert code == 2 and "--quantize int8-head" in err and "--runner eager" in err, err
    code, _, err = _run_bf16(capsys, llama_dir, "--plain", "--quantize", "int8-head")
    assert code == 2 and "--quantize int8-head" in err and "gemma3_text" in err


def test_the_8_bit_head_says_where_the_cpu_lacks_vnni(capsys, gemma_dir, tmp_path, monkeypatch):
    """On an x86 CPU without an 8-bit dot product, --quantize int8-head still decodes as asked and says so once, in
    one line after loading; with VNNI, on a CPU whose flags are unknown, or without the option, no such line."""
    from treespec.cli import INT8_HEAD_WITHOUT_VNNI
    from treespec.models import loading

    avx2, vnni = tmp_path / "avx2", tmp_path / "vnni"
    avx2.write_text("flags\t\t: fpu sse2 avx avx2 fma\n")
    vnni.write_text("flags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n")
    int8 = ("--quantize", "int8-head")
    runs = {}
    for info, argv in ((avx2, int8), (vnni, int8), (tmp_path / "absent", int8), (avx2, ())):
        monkeypatch.setattr(loading, "CPUINFO", info)
        code, out, err = _run(capsys, gemma_dir, "--plain", *argv)
        assert code == 0, err
        runs[info.name, argv] = (out["token_ids"], err.count(INT8_HEAD_WITHOUT_VNNI))
        if info is avx2 and argv:
            assert err.index("treespec: loading") < err.index(INT8_HEAD_WITHOUT_VNNI)
    assert runs["avx2", int8][1] == 1
    assert runs["vnni", int8][1] == runs["absent", int8][1] == runs["avx2", ()][1] == 0
    assert runs["avx2", int8][0] == runs["vnni", int8][0]  # the line changes nothing of what is decoded


def test_draft_quantize_puts_a_head_on_4_bit_weights_through_the_cli(capsys, gemma_dir, tmp_path, monkeypatch):
    """--draft-quantize int4 drafts with a head on 4-bit weights (bf16): it runs, emits every token and the head it
    drafted with is on 4-bit weights (without the flag: packed bf16 or plain); a drafter that is not a head, plain
    decoding and float32 are refused with exit 2 and a reason."""
    import torch

    from treespec.drafting.head import new_head
    from treespec.drafting.subset_head import SubsetHead

    head_file = tmp_path / "head.safetensors"
    new_head(tiny_model("gemma3", VOCAB, seed=2), torch.arange(32), num_heads=4, intermediate_size=64).save(head_file)
    seen, original = [], SubsetHead.for_inference

    def spy(self, dtype, quantize=None):
        out = original(self, dtype, quantize)
        seen.append(out.inference_weights)
        return out

    monkeypatch.setattr(SubsetHead, "for_inference", spy)
    code, out, err = _run_bf16(capsys, gemma_dir, "--draft", str(head_file), "--draft-quantize", "int4")
    assert code == 0, err
    assert len(out["token_ids"]) == 24 and seen == ["int4"]
    code, out, err = _run_bf16(capsys, gemma_dir, "--draft", str(head_file))
    assert code == 0 and seen[1] in ("packed", "plain"), err
    for argv, words in ((["--draft", "ngram"], ["--draft-quantize int4", "draft head", "'ngram'"]),
                        (["--plain"], ["--draft-quantize int4", "'none'"]),
                        (["--draft", str(head_file), "--dtype", "float32"], ["--draft-quantize int4", "bfloat16"])):
        code, _, err = _run_bf16(capsys, gemma_dir, "--draft-quantize", "int4", *argv)
        assert code == 2 and all(w in err for w in words), (argv, err)


def test_the_shipped_heads_default_weights_follow_its_settings_where_the_kernel_runs(tmp_path, monkeypatch):
    """DEFAULT_HEAD_SETTINGS puts the shipped head on 4-bit weights at both temperatures: in bf16 on a CPU the
    head drafts on them unless the caller asks for 'none'; in float32 (no int4 kernel for it) and for any other
    head file it computes in the target's dtype. The shipped head is stood in for by a tiny one."""
    import torch

    from treespec.drafters import DraftOptions, build_drafter
    from treespec.drafting import shipped
    from treespec.drafting.head import EagleHead, new_head
    from treespec.drafting.subset_head import SubsetHead

    head_file = tmp_path / "head.safetensors"
    new_head(tiny_model("gemma3", VOCAB, seed=2), torch.arange(32), num_heads=4, intermediate_size=64).save(head_file)
    asked, original = [], SubsetHead.for_inference

    def spy(self, dtype, quantize=None):
        asked.append(quantize)
        return original(self, dtype, quantize)

    monkeypatch.setattr(SubsetHead, "for_inference", spy)
    monkeypatch.setattr(shipped, "load_default_head", lambda target: EagleHead.load(head_file, target))
    bf16 = tiny_model("gemma3", VOCAB, seed=2).to(torch.bfloat16)
    fp32 = tiny_model("gemma3", VOCAB, seed=2)
    for temperature in (0.0, 1.0):
        want = shipped.DEFAULT_HEAD_SETTINGS["greedy" if temperature == 0 else "sampled"].get("quantize")
        assert want == "int4"  # the measured setting; the rest of the test follows it
        for name in ("head", "lookup+head"):
            asked.clear()
            build_drafter(name, bf16, DraftOptions(), temperature=temperature)
            assert asked == ["int4"], (name, temperature)
        asked.clear()
        build_drafter("head", bf16, DraftOptions(quantize="none"), temperature=temperature)
        build_drafter("head", fp32, DraftOptions(), temperature=temperature)
        build_drafter(str(head_file), bf16, DraftOptions(), temperature=temperature)
        assert asked == [None, None, None]
    with pytest.raises(ValueError, match="quantize='int8'"):
        DraftOptions(quantize="int8")


def test_the_cli_reports_the_heads_weights_and_takes_draft_quantize_none(capsys, gemma_dir, tmp_path):
    import torch

    from treespec.drafting.head import new_head

    head_file = tmp_path / "head.safetensors"
    new_head(tiny_model("gemma3", VOCAB, seed=2), torch.arange(32), num_heads=4, intermediate_size=64).save(head_file)
    code, out, err = _run_bf16(capsys, gemma_dir, "--draft", f"lookup+{head_file}", "--draft-quantize", "int4")
    assert code == 0 and out["statistics"]["draft_weights"] == "int4", err
    code, out, err = _run_bf16(capsys, gemma_dir, "--draft", str(head_file), "--draft-quantize", "none")
    assert code == 0 and out["statistics"]["draft_weights"] in ("packed", "plain"), err
    code, out, err = _run_bf16(capsys, gemma_dir, "--draft", "ngram", "--draft-quantize", "none")  # nothing to do
    assert code == 0 and "draft_weights" not in out["statistics"], err
