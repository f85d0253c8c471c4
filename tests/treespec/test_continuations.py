"""Stage 1 of the distillation corpus: the target's own continuations (treespec.distill.continuations).

- Batched greedy continuations equal one-prompt-at-a-time greedy decoding (left padding, position
  ids and the sliding window handled), for Llama and Gemma-3 (window crossed).
- Sampled continuations draw with :func:`treespec.sampling.draw` (its exactness: test_sampling.py).
- Chunked building resumes to the same files as an uninterrupted build, refuses a changed recipe,
  and removes temporaries left by a killed writer.
"""

from __future__ import annotations

import json
import math
import pytest
import torch

from treespec.distill.continuations import (
    ContinuationOptions,
    build_continuations,
    continue_batch,
    read_continuations,
)
from treespec.models.tiny import tiny_model

EOS = {1}


def _plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        nxt = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(nxt)
        if nxt in EOS:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
def test_batched_greedy_equals_one_prompt_at_a_time(arch):
    model = tiny_model(arch, vocab_size=64, seed=3, sliding_window=6, logit_scale=4.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (3, 9, 5, 14)]
    opts = ContinuationOptions(mode="greedy", new_tokens=12, batch_size=4, chunk_size=4)
    got = continue_batch(model, prompts, opts, EOS)
    assert got == [_plain_greedy(model, p, 12) for p in prompts]


def test_chunked_build_resumes_to_the_same_files(tmp_path, monkeypatch):
    model = tiny_model("llama", vocab_size=64, seed=1, logit_scale=3.0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (10,), generator=g)]
    opts = ContinuationOptions(mode="sample", new_tokens=6, batch_size=2, chunk_size=4, seed=7)
    whole = build_continuations(model, prompts, tmp_path / "whole", opts, eos=EOS, progress=False)
    part = tmp_path / "part"
    assert whole["complete"] and whole["num_chunks"] == 3
    # a run that crashes inside its second chunk (third batch), then is resumed
    import treespec.distill.continuations as cont

    real, calls = cont.continue_batch, {"n": 0}

    def crashing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(cont, "continue_batch", crashing)
    with pytest.raises(KeyboardInterrupt):
        build_continuations(model, prompts, part, opts, eos=EOS, progress=False)
    monkeypatch.setattr(cont, "continue_batch", real)
    assert json.loads((part / "manifest.json").read_text())["chunks_done"] == [0]
    (part / ".chunk-00001.json.gz.tmp999999999").write_text("half")  # a killed writer's leftover
    done = build_continuations(model, prompts, part, opts, eos=EOS, progress=False)
    assert done["complete"]
    for c in range(3):
        name = f"chunk-{c:05d}.json.gz"  # byte-identical: gzip without a time stamp
        assert (part / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert not [p for p in part.iterdir() if ".tmp" in p.name]
    rows = read_continuations(part)
    assert [r["index"] for r in rows] == list(range(10))
    assert all(len(r["continuation"]) <= 6 for r in rows)
    with pytest.raises(ValueError, match="other prompts or options"):
        build_continuations(model, prompts[:-1], part, opts, eos=EOS, progress=False)


def test_options_are_validated():
    with pytest.raises(ValueError, match="mode"):
        ContinuationOptions(mode="beam")
    with pytest.raises(ValueError, match="multiple of batch_size"):
        ContinuationOptions(batch_size=3, chunk_size=4)
    with pytest.raises(ValueError, match="temperature"):
        ContinuationOptions(mode="sample", temperature=math.nan)
    with pytest.raises(ValueError, match="at least one token"):
        continue_batch(tiny_model("llama"), [[]], ContinuationOptions(batch_size=1, chunk_size=1), EOS)
    json.dumps(ContinuationOptions().__dict__)  # the recipe is stored as JSON


def test_stage_two_teacher_forces_stored_continuations_chunk_by_chunk(tmp_path):
    """Stage 2 (``build_corpus_from_continuations``): one shard per finished chunk, holding exactly
    ``prompt + continuation`` (the prompt cut to its last ``max_prompt_tokens``, as when generating),
    ``gen_start`` = the prompt's length and the hidden states of a one-sequence, unpadded forward;
    chunks finished later are added by calling again (earlier shards untouched); other prompts are
    refused by name."""
    from safetensors.torch import load_file

    from treespec.distill.continuations import build_corpus_from_continuations
    from treespec.distill.corpus import CorpusOptions

    model = tiny_model("gemma3", vocab_size=64, seed=2, sliding_window=6, logit_scale=4.0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 64, (int(n),), generator=g).tolist() for n in torch.randint(2, 16, (10,), generator=g)]
    opts = ContinuationOptions(mode="greedy", new_tokens=7, max_prompt_tokens=9, batch_size=2, chunk_size=4)
    cont = tmp_path / "cont"
    build_continuations(model, prompts, cont, opts, eos=EOS, progress=False)
    full_manifest = (cont / "manifest.json").read_text()
    early = dict(json.loads(full_manifest), chunks_done=[0, 2], complete=False)  # chunk 1 "not yet finished"
    (cont / "manifest.json").write_text(json.dumps(early))
    copts = CorpusOptions(topk=4, batch_size=3)
    first = build_corpus_from_continuations(model, prompts, cont, tmp_path / "tf", copts, progress=False)
    assert [s["chunk"] for s in first["shards"]] == [0, 2] and not first["complete"]
    kept = (tmp_path / "tf" / "shard-00000.safetensors").read_bytes()
    (cont / "manifest.json").write_text(full_manifest)
    man = build_corpus_from_continuations(model, prompts, cont, tmp_path / "tf", copts, progress=False)
    assert [s["chunk"] for s in man["shards"]] == [0, 2, 1] and man["complete"]
    assert (tmp_path / "tf" / "shard-00000.safetensors").read_bytes() == kept
    rows = {r["index"]: r for r in read_continuations(cont)}
    for sh in man["shards"]:
        data = load_file(str(tmp_path / "tf" / sh["file"]))
        lo = sh["chunk"] * opts.chunk_size
        indices = list(range(lo, min(lo + opts.chunk_size, len(prompts))))
        off = data["offsets"].tolist()
        seqs = [data["tokens"][a:b].tolist() for a, b in zip(off, off[1:])]
        expected = {tuple(prompts[j][-9:] + rows[j]["continuation"]): len(prompts[j][-9:]) for j in indices}
        assert sorted(map(tuple, seqs)) == sorted(expected)
        assert [expected[tuple(s)] for s in seqs] == data["gen_start"].tolist()
        for s, a in zip(seqs, off):
            with torch.no_grad():
                ref = model.base_model(input_ids=torch.tensor([s])).last_hidden_state[0]
            assert torch.allclose(data["hidden"][a:a + len(s)].float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="other prompts"):
        build_corpus_from_continuations(model, prompts[:-1], cont, tmp_path / "tf2", copts, progress=False)
    with pytest.raises(ValueError, match="other prompts"):
        build_corpus_from_continuations(model, [[1] + p for p in prompts], cont, tmp_path / "tf3", copts,
                                        progress=False)


def test_recipe_rows_refuse_the_held_out_part(tmp_path, capsys):
    """Rows HELD_OUT_FROM: of the seeded order stay out of every continuation recipe unless asked
    for by name; refused before any model is loaded (exit 2, one error line)."""
    from treespec.distill.continuations import main
    from treespec.distill.corpus import shared_dir

    if not (shared_dir() / "data" / "train" / "train_prompts.jsonl").exists():
        pytest.skip("needs ../shared/data/train")
    assert main(["--name", "x", "--rows", "10000:12000", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "held out" in err and "--held-out-rows" in err and not (tmp_path / "x").exists()


def test_chunks_are_stored_compressed_and_older_uncompressed_chunks_still_read(tmp_path, monkeypatch):
    """Chunks are gzip-compressed JSON, the same rows read back; a folder of older ``chunk-NNNNN.json`` files
    reads alike; a damaged or oversized compressed chunk is refused in one line naming the file."""
    import gzip

    from treespec.distill import inputs
    from treespec.distill.continuations import chunk_path, read_chunk_rows, write_chunk
    from treespec.distill.inputs import DistillInputError

    rows = [{"index": 0, "prompt_tokens": 3, "continuation": [5, 6, 7] * 50}, {"index": 1, "prompt_tokens": 2,
                                                                               "continuation": []}]
    old = tmp_path / "old"
    old.mkdir()
    (old / "chunk-00000.json").write_text(json.dumps({"chunk": 0, "rows": rows}))
    assert chunk_path(old, 0).name == "chunk-00000.json" and read_chunk_rows(old, 0, 2) == rows
    path = write_chunk(old, 0, rows)  # rewriting replaces the uncompressed copy
    assert path.name == "chunk-00000.json.gz" and not (old / "chunk-00000.json").exists()
    assert chunk_path(old, 0) == path and read_chunk_rows(old, 0, 2) == rows
    assert path.stat().st_size < len(json.dumps({"chunk": 0, "rows": rows}))
    path.write_bytes(gzip.compress(b'{"chunk": 0, "rows": [')[:-8])  # cut short
    with pytest.raises(DistillInputError, match="continuation chunk .*chunk-00000.json.gz: damaged"):
        read_chunk_rows(old, 0, 2)
    write_chunk(old, 0, rows)
    (old / "chunk-00000.json").write_text(json.dumps({"chunk": 0, "rows": rows[:1]}))  # a writer killed before it
    assert read_chunk_rows(old, 0, 2) == rows  # removed the older copy: the complete compressed one is read
    monkeypatch.setattr(inputs, "MAX_GZIP_JSON_BYTES", 100)
    with pytest.raises(DistillInputError, match="expands beyond"):
        read_chunk_rows(old, 0, 2)
