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
    (part / ".chunk-00001.json.tmp999999999").write_text("half")  # a killed writer's leftover
    done = build_continuations(model, prompts, part, opts, eos=EOS, progress=False)
    assert done["complete"]
    for c in range(3):
        name = f"chunk-{c:05d}.json"
        assert (part / name).read_text() == (tmp_path / "whole" / name).read_text()
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
