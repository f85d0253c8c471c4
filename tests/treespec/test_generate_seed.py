"""Random unless seeded: GenerationConfig(seed=None), the default, draws a fresh seed per call and the result
records it (GenerationResult.seed), so any sampled run can be reproduced; a given seed is recorded as given."""

from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5]


def drafter():
    return ShapeDrafter(tiny_model("llama", 64, seed=1, logit_scale=2), TreeShape.widths((2, 2, 1)), "iid")


def test_default_seed_is_drawn_per_call_recorded_and_reproducible():
    target = tiny_model("llama", 64, seed=0, logit_scale=2)  # a flat law: two random runs differ
    cfg = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(1.0), stop_on_eos=False)
    assert cfg.seed is None
    first, second = (generate(target, PROMPT, drafter(), cfg) for _ in range(2))
    assert isinstance(first.seed, int) and isinstance(second.seed, int)
    assert first.seed != second.seed and first.token_ids != second.token_ids
    for run in (first, second):
        again = generate(target, PROMPT, drafter(), GenerationConfig(**{**cfg.__dict__, "seed": run.seed}))
        assert again.seed == run.seed and again.token_ids == run.token_ids


def test_given_seed_is_recorded_and_reproduces():
    target = tiny_model("llama", 64, seed=0, logit_scale=2)
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(1.0), seed=2**64 - 1, stop_on_eos=False)
    runs = [generate(target, PROMPT, drafter(), cfg) for _ in range(2)]
    assert [r.seed for r in runs] == [2**64 - 1] * 2 and runs[0].token_ids == runs[1].token_ids
    assert generate(target, PROMPT, None, GenerationConfig(max_new_tokens=2, seed=7)).seed == 7
