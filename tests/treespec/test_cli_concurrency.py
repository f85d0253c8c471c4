"""Concurrency rule: one drafter serves one request at a time. Passing a drafter that is generating
in one thread to generate() in another raises ConcurrentDrafterError (a shared ShapeDrafter used to
corrupt its KV cache: shape errors or wrong tokens); one drafter per thread gives the single-threaded
outputs."""

from __future__ import annotations

import threading

import pytest
import torch

from treespec.generate import ConcurrentDrafterError, GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

CONFIG = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(1.0), seed=3, stop_on_eos=False)
PROMPTS = [[1, 2, 3, 1, 2, 3, i] for i in range(4)]


@pytest.fixture(scope="module")
def models():
    torch.set_grad_enabled(False)
    return tiny_model("llama", 32, seed=1), tiny_model("llama", 32, seed=2)


def test_shared_drafter_in_another_thread_is_refused(models):
    target, draft = models
    drafter = ShapeDrafter(draft, TreeShape.widths((2, 1)), "iid")
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold(_new_ids: list[int]) -> None:  # keeps the first call inside generate()
        inside.set()
        release.wait(10)

    first = threading.Thread(target=lambda: generate(target, PROMPTS[0], drafter, CONFIG, on_tokens=hold))
    first.start()
    assert inside.wait(10)

    def second() -> None:
        try:
            generate(target, PROMPTS[1], drafter, CONFIG)
        except ConcurrentDrafterError as err:
            errors.append(str(err))

    other = threading.Thread(target=second)
    other.start()
    other.join(10)
    release.set()
    first.join(10)
    assert len(errors) == 1 and "give each thread its own drafter" in errors[0]
    # released afterwards: the same drafter serves the next request, with the sequential result
    fresh = generate(target, PROMPTS[1], ShapeDrafter(draft, TreeShape.widths((2, 1)), "iid"), CONFIG).token_ids
    assert generate(target, PROMPTS[1], drafter, CONFIG).token_ids == fresh


def test_one_drafter_per_thread_equals_single_threaded(models):
    target, draft = models
    reference = [generate(target, p, ShapeDrafter(draft, TreeShape.widths((2, 1)), "iid"), CONFIG).token_ids
                 for p in PROMPTS]
    results: list[list[int] | None] = [None] * 4

    def run(i: int) -> None:
        results[i] = generate(target, PROMPTS[i], ShapeDrafter(draft, TreeShape.widths((2, 1)), "iid"), CONFIG).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == reference


def test_shared_runner_in_another_thread_is_refused(models):
    """A ModelRunner holds the target's KV cache: a second call on the same runner while the first is
    inside generate() is refused; with no drafter at all (plain decoding) too. A bare model is fine:
    each call gets its own runner."""
    from treespec.models.runner import ModelRunner

    target, _ = models
    runner = ModelRunner(target)
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold(_new_ids: list[int]) -> None:
        inside.set()
        release.wait(10)

    first = threading.Thread(target=lambda: generate(runner, PROMPTS[0], None, CONFIG, on_tokens=hold))
    first.start()
    assert inside.wait(10)
    try:
        with pytest.raises(ConcurrentDrafterError, match="give each thread its own runner"):
            generate(runner, PROMPTS[1], None, CONFIG)
        bare = generate(target, PROMPTS[1], None, CONFIG).token_ids  # a fresh runner: allowed
    finally:
        release.set()
        first.join(10)
    assert generate(runner, PROMPTS[1], None, CONFIG).token_ids == bare  # released afterwards
