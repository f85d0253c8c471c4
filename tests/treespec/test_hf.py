"""The Hugging Face front door (:mod:`treespec.hf`): ``generate_hf`` against ``model.generate`` on a tiny model and
a character-level tokenizer (stop strings then span tokens): the same greedy sequences, the same streamer calls,
the same stop-string cuts; refused settings; the chat template in Python and in the CLI; a hub id that cannot be
reached fails at once; the embedded model's first conversion says so on stderr; the README's snippet."""

from __future__ import annotations

import itertools
import json
import re
import string
import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import GenerationConfig, PreTrainedTokenizerFast, TextIteratorStreamer

from treespec.cli import main as cli_main
from treespec.hf import HFGenerationOutput, chat_prompt, generate_hf, sampling_from_hf, target_word
from treespec.models import loading
from treespec.models.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 64
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}bot {% endif %}")


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Letters, a space and 35 two-letter merges (64 tokens): text decodes back to itself, tokens concatenated."""
    vocab = {"<unk>": 0, "<eos>": 1, " ": 2, **{c: 3 + i for i, c in enumerate(string.ascii_lowercase)}}
    merges = []
    for a, b in itertools.product("staeoinr", "toenrais"):
        if len(vocab) < VOCAB and a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return char_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", VOCAB, seed=0, logit_scale=2.0)  # float32; greedy output varies, then loops


def hf_new(model, inputs, **kwargs) -> list[int]:
    out = model.generate(**inputs, pad_token_id=0, **kwargs)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("draft", ["auto", "ngram", "none"])
def test_greedy_sequences_equal_model_generate(model, tok, draft):
    inputs = tok("the stop", return_tensors="pt")
    config = GenerationConfig(do_sample=False, max_new_tokens=40)
    ref = model.generate(**inputs, generation_config=config, pad_token_id=0)  # [1, P + 40]
    out = generate_hf(model, tok, inputs, config, draft=draft)
    assert isinstance(out, HFGenerationOutput) and out.sequences.dtype == torch.long
    assert out.sequences.tolist() == ref.tolist()
    assert out.text == tok.decode(ref[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out.draft == ("ngram" if draft == "auto" else draft)  # an "other" target: n-gram lookup, as the CLI
    assert out.target_calls == len(out.result.steps) and out.tau == 40 / out.target_calls
    if draft != "none":
        assert out.tau > 1  # the output loops: lookup drafts accepted
    # text prompts, keyword overrides, a max_length instead of max_new_tokens: read as model.generate reads them
    assert generate_hf(model, tok, "the stop", max_new_tokens=40).sequences.tolist() == ref.tolist()
    short = model.generate(**inputs, max_length=12, do_sample=False, pad_token_id=0)
    assert generate_hf(model, tok, inputs, GenerationConfig(max_length=12)).sequences.tolist() == short.tolist()


def test_eos_ids_from_the_config_one_or_several(model, tok):
    inputs = tok("the stop", return_tensors="pt")
    new = hf_new(model, inputs, do_sample=False, max_new_tokens=40)
    for eos in (new[5], [999 % VOCAB, new[9]]):  # one id; a list whose second id is generated
        ref = hf_new(model, inputs, do_sample=False, max_new_tokens=40, eos_token_id=eos)
        out = generate_hf(model, tok, inputs, GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=eos))
        assert out.sequences[0, inputs["input_ids"].shape[1]:].tolist() == ref and len(ref) < 40


class Recorder:
    """An HF streamer that records what it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list]] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(("put", value.tolist()))

    def end(self) -> None:
        self.calls.append(("end", []))


def test_streamer_gets_the_prompt_then_exactly_the_new_tokens_then_end(model, tok):
    inputs = tok("the stop", return_tensors="pt")
    config = GenerationConfig(do_sample=False, max_new_tokens=40)
    theirs, ours = Recorder(), Recorder()
    model.generate(**inputs, generation_config=config, streamer=theirs, pad_token_id=0)
    out = generate_hf(model, tok, inputs, config, streamer=ours)
    assert ours.calls[0] == theirs.calls[0] == ("put", inputs["input_ids"].tolist())  # [1, P] first
    assert [kind for kind, _ in ours.calls].count("end") == 1 and ours.calls[-1][0] == "end"
    chunks = [ids for kind, ids in ours.calls[1:-1]]
    assert all(kind == "put" and ids for kind, ids in ours.calls[1:-1])
    assert len(chunks) == out.target_calls  # one chunk per step: several tokens at a time
    assert sum(chunks, []) == sum([ids for _, ids in theirs.calls[1:-1]], []) == \
        out.sequences[0, inputs["input_ids"].shape[1]:].tolist()


def test_streamer_ends_when_generation_fails(model, tok):
    """A consumer of a TextIteratorStreamer must not wait forever on a failed run."""
    recorder = Recorder()
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        generate_hf(model, tok, [3, VOCAB + 5], None, recorder, max_new_tokens=4)
    assert [kind for kind, _ in recorder.calls] == ["put", "end"]


def test_text_iterator_streamer_yields_the_new_text(model, tok):
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=generate_hf(model, tok, "the stop", streamer=streamer,
                                                                        max_new_tokens=30, do_sample=False)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text == box["out"].text and len(text) >= 30


def test_stop_strings_end_where_model_generate_ends(model, tok):
    inputs = tok("the stop", return_tensors="pt")
    full = hf_new(model, inputs, do_sample=False, max_new_tokens=40)
    text = tok.decode(full)
    # strings across token boundaries, inside one token, overhanging a token, and one begun in the prompt ("p")
    cases = [text[i:i + n] for i, n in ((3, 3), (8, 2), (13, 3), (20, 4), (30, 1))] + ["po" if text[0] == "o" else "p"]
    cases.append("aoaoa")  # completed by the first token of a two-token step: the step is cut in the middle
    free = generate_hf(model, tok, inputs, max_new_tokens=40, do_sample=False).result.steps
    boundaries = set(itertools.accumulate(s.emitted for s in free))  # where the unstopped run's steps end
    cut = []
    for stop in cases:
        ref = hf_new(model, inputs, do_sample=False, max_new_tokens=40, stop_strings=stop, tokenizer=tok)
        out = generate_hf(model, tok, inputs, GenerationConfig(do_sample=False, max_new_tokens=40, stop_strings=stop))
        assert out.sequences[0, inputs["input_ids"].shape[1]:].tolist() == ref, stop
        assert out.result.token_ids == ref and sum(s.emitted for s in out.result.steps) == len(ref)
        cut.append(len(ref))
    assert min(cut) < 40 and len(set(cut)) > 2  # the cases do stop, at several places
    assert any(n not in boundaries for n in cut)  # and one inside a step of several tokens
    # a list of strings: the first completed wins; the streamer receives nothing past the cut
    recorder = Recorder()
    ref = hf_new(model, inputs, do_sample=False, max_new_tokens=40, stop_strings=[cases[3], cases[1]], tokenizer=tok)
    out = generate_hf(model, tok, inputs, None, recorder, max_new_tokens=40, stop_strings=[cases[3], cases[1]])
    assert out.sequences[0, inputs["input_ids"].shape[1]:].tolist() == ref
    assert sum([ids for kind, ids in recorder.calls[1:-1]], []) == ref


@pytest.mark.parametrize("setting, name", [
    ({"num_beams": 2}, "num_beams"), ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"), ({"min_new_tokens": 5}, "min_new_tokens"),
    ({"do_sample": True, "min_p": 0.1}, "min_p"), ({"num_return_sequences": 2, "do_sample": True},
                                                   "num_return_sequences"),
    ({"suppress_tokens": [3]}, "suppress_tokens"), ({"typical_p": 0.5, "do_sample": True}, "typical_p"),
])
def test_unsupported_settings_are_refused_by_name(model, tok, setting, name):
    with pytest.raises(ValueError, match=f"{name}=.* is not supported by treespec"):
        generate_hf(model, tok, "the stop", GenerationConfig(max_new_tokens=4, **setting))


def test_bad_calls_are_refused(model, tok):
    batch = torch.tensor([[3, 4, 5], [6, 7, 8]])
    with pytest.raises(ValueError, match="batch of one; got 2 prompts"):
        generate_hf(model, tok, batch, max_new_tokens=4)
    with pytest.raises(ValueError, match="attention mask hides"):
        generate_hf(model, tok, {"input_ids": torch.tensor([[3, 4, 5]]), "attention_mask": torch.tensor([[0, 1, 1]])},
                    max_new_tokens=4)
    with pytest.raises(TypeError, match="generation_config must be a transformers GenerationConfig"):
        generate_hf(model, tok, "the stop", Recorder())
    with pytest.raises(ValueError, match="unknown generation settings"):
        generate_hf(model, tok, "the stop", max_new_tokns=4)
    with pytest.raises(ValueError, match="chat=True takes the prompt as text"):
        generate_hf(model, tok, [3, 4, 5], chat=True, max_new_tokens=4)
    # the model's own generation config is read as model.generate reads it: a penalty there is refused too
    m = tiny_model("llama", VOCAB, seed=0)
    m.generation_config.repetition_penalty = 1.3
    with pytest.raises(ValueError, match="repetition_penalty=1.3"):
        generate_hf(m, tok, "the stop", max_new_tokens=4)


def test_sampling_settings_map_and_runs_reproduce(model, tok):
    s = sampling_from_hf(GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.9))
    assert (s.temperature, s.top_k, s.top_p) == (0.7, 20, 0.9)
    assert sampling_from_hf(GenerationConfig(do_sample=False, temperature=0.7)).greedy
    # transformers' defaults when sampling: temperature 1, top_k 50 (merged in by generate_hf, as by generate)
    torch.manual_seed(3)
    a = generate_hf(model, tok, "the stop", do_sample=True, max_new_tokens=20)
    assert a.result.steps and a.sequences.shape[1] <= len(tok("the stop")["input_ids"]) + 20
    torch.manual_seed(3)
    assert generate_hf(model, tok, "the stop", do_sample=True, max_new_tokens=20).sequences.tolist() == \
        a.sequences.tolist()
    assert generate_hf(model, tok, "the stop", do_sample=True, max_new_tokens=20, seed=5).sequences.tolist() == \
        generate_hf(model, tok, "the stop", do_sample=True, max_new_tokens=20, seed=5).sequences.tolist()
    with pytest.raises(ValueError, match="do_sample=True needs temperature > 0"):
        generate_hf(model, tok, "the stop", do_sample=True, temperature=0.0, max_new_tokens=4)


def test_chat_template(model, tok):
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        generate_hf(model, tok, "hi there", chat=True, max_new_tokens=4)
    templated = char_tokenizer()
    templated.chat_template = TEMPLATE
    assert chat_prompt(templated, "hi there") == "user hi there bot "
    out = generate_hf(model, templated, "hi there", chat=True, max_new_tokens=6, do_sample=False)
    prompt = templated("user hi there bot ", add_special_tokens=False)["input_ids"]
    assert out.sequences[0, :len(prompt)].tolist() == prompt and out.sequences.shape[1] > len(prompt)
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.sequences.tolist() == ref.tolist()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[str, str]:
    """A tiny model folder with a chat template in its tokenizer, and one without."""
    plain, chat = tmp_path_factory.mktemp("tiny-plain"), tmp_path_factory.mktemp("tiny-chat")
    for path, template in ((plain, None), (chat, TEMPLATE)):
        t = char_tokenizer()
        t.chat_template = template
        t.save_pretrained(path)
        tiny_model("llama", VOCAB, seed=0, logit_scale=2.0).save_pretrained(path)
    return str(plain), str(chat)


def test_cli_chat_applies_the_template_and_refuses_a_tokenizer_without_one(model_dirs, capsys):
    plain, chat = model_dirs
    argv = ["generate", "hi there", "--max-new-tokens", "5", "--json", "--threads", "1", "--exact", "--no-stop"]
    assert cli_main([*argv, "--target", chat, "--chat"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == char_tokenizer()("user hi there bot ", add_special_tokens=False)["input_ids"]
    assert cli_main([*argv, "--target", chat]) == 0  # without --chat: the text as it is
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == char_tokenizer()("hi there")["input_ids"]
    assert cli_main([*argv, "--target", plain, "--chat"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["treespec: error: ValueError: the tokenizer has no chat template (a base model takes plain text): "
                   "drop chat=True / --chat"]
    from treespec.cli import build_parser

    assert build_parser().parse_args(["generate", "hi", "--chat"]).chat
    assert not build_parser().parse_args(["generate", "hi"]).chat


@pytest.fixture
def closed_hub(tmp_path, monkeypatch):
    """The hub endpoint is a closed local port and the Hugging Face cache is empty; the hub is not switched off."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("load", [loading.load_model, loading.load_tokenizer])
def test_unreachable_hub_id_fails_at_once_naming_it(closed_hub, load):
    start = time.perf_counter()
    with pytest.raises(loading.HubUnreachableError, match=r"^treespec-tests/no-such-model: no such local folder.*"
                                                          r"127\.0\.0\.1:9.*cannot be reached"):
        load("treespec-tests/no-such-model")
    assert time.perf_counter() - start < 15  # without the probe: about a minute of retries


def test_hub_off_fails_at_once_naming_the_id(closed_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(loading.HubUnreachableError, match=r"treespec-tests/no-such-model: .*the hub is off"):
        loading.load_model("treespec-tests/no-such-model")


def test_local_folders_and_cached_ids_do_not_probe(model_dirs, closed_hub, monkeypatch):
    monkeypatch.setattr(loading, "hub_reachable", lambda *a, **k: pytest.fail("probed the hub for a local folder"))
    assert loading.load_tokenizer(model_dirs[0]) is not None
    assert not loading.is_hub_id(model_dirs[0]) and not loading.is_hub_id("embedded")
    assert loading.is_hub_id("owner/name") and not loading.is_hub_id("./owner/name")


def test_first_conversion_reports_start_and_end_on_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))

    def fake_convert(out_dir, progress):
        for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(loading, "_convert_embedded_gemma", fake_convert)
    folder = loading.embedded_gemma_dir()
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("treespec")]
    assert out == "" and len(lines) == 2
    assert "converting the embedded Gemma-3-270M" in lines[0] and "about 90 s" in lines[0]
    assert "converted" in lines[1] and str(folder) in lines[1]
    loading.embedded_gemma_dir()  # cached: silent
    assert capsys.readouterr().err == ""


def readme_hf_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "generate_hf" in b]
    assert len(blocks) == 1
    return blocks[0]


def test_readme_hf_snippet_is_short_and_changes_one_call():
    code = readme_hf_snippet()
    lines = code.strip().splitlines()
    assert len(lines) <= 12
    hf_call = [line for line in lines if "model.generate(" in line]
    ours = [line for line in lines if "generate_hf(" in line and not line.startswith("from")]
    assert len(hf_call) == 1 and hf_call[0].lstrip().startswith("#") and len(ours) == 1
    # the treespec call takes the HF call's arguments
    assert "generation_config" in hf_call[0] and "config" in ours[0] and "streamer" in ours[0]


@pytest.mark.gemma
def test_readme_hf_snippet_gives_model_generates_tokens(capsys):
    code = readme_hf_snippet().replace("max_new_tokens=64", "max_new_tokens=12")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the project's own README
    streamed = capsys.readouterr().out
    ref = scope["model"].generate(**scope["inputs"], generation_config=scope["config"])
    assert scope["out"].sequences.tolist() == ref.tolist()
    assert scope["out"].text in streamed
    assert target_word(scope["model"]) == "embedded"  # the drafter tables' embedded entries apply to it


def _hf_law(model, prompt_ids: list[int], temperature: float, top_k: int, top_p: float) -> dict:
    """P(x1, x2 | prompt) with transformers' own warpers (temperature, then top-k, then top-p, as generate)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warp = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k),
                                TopPLogitsWarper(top_p)])

    def probs(ids: list[int]) -> torch.Tensor:
        t = torch.tensor([ids])
        with torch.no_grad():
            logits = model(t).logits[:, -1].double()
        return torch.softmax(warp(t, logits), dim=-1)[0]  # [V]

    law, first = {}, probs(prompt_ids)
    for a in torch.nonzero(first).flatten().tolist():
        second = probs(prompt_ids + [a])
        for b in torch.nonzero(second).flatten().tolist():
            law[(a, b)] = float(first[a] * second[b])
    return law


@pytest.mark.stats
@pytest.mark.parametrize("top_k, passes", [(4, True), (50, False)])
def test_sampled_output_follows_transformers_law(model, tok, top_k, passes):
    """do_sample=True with temperature 0.7, top-k 4, top-p 0.9 and n-gram drafts: the first two tokens follow the
    law transformers' own warpers give (G test, seeds 0..1499, N = 1500, alpha = 1e-3). Twin: a run whose top-k
    is transformers' default 50 (a mapping that lost the user's top-k) against the top-k 4 law must fail."""
    from stats_helpers import g_test_law

    inputs = tok("the stop", return_tensors="pt")
    law = _hf_law(model, inputs["input_ids"][0].tolist(), 0.7, 4, 0.9)
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=top_k, top_p=0.9, max_new_tokens=2)
    counts: dict = {}
    n = 1500
    for seed in range(n):
        new = generate_hf(model, tok, inputs, config, draft="ngram", seed=seed).result.token_ids
        counts[tuple(new)] = counts.get(tuple(new), 0) + 1
    if passes:
        assert g_test_law(counts, law, n) > 1e-3
    else:
        stray = sum(c for cell, c in counts.items() if cell not in law)
        pval = 0.0 if stray else g_test_law(counts, law, n)
        assert pval < 1e-6
