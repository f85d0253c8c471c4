"""Every tree builder x draft law x verifier the API accepts: at temperature 0 the output is
token-identical to plain greedy decoding (tiny Llama and Gemma-3, fp32, Gemma's sliding window of 8
crossed); at temperature 1 each accepted combination runs and respects max_new_tokens."""

import pytest
import torch

from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape
from treespec.verify import VERIFIER_LAWS

from trees_common import BUILDERS

GREEDY = GenerationConfig(max_new_tokens=30, sampling=SamplingConfig(0.0), stop_on_eos=False)
PROMPTS = [[3, 4, 5, 6, 7, 3, 4, 5], [10, 11, 12, 10, 11]]
ARCHS = ("llama", "gemma3")


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    arch = request.param
    target = tiny_model(arch, 64, seed=0, logit_scale=8)
    plain = {tuple(p): generate(target, p, None, GREEDY).token_ids for p in PROMPTS}
    return arch, target, tiny_model(arch, 64, seed=1, logit_scale=8), plain


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_greedy_identical_to_plain(models, builder):
    arch, target, draft, plain = models
    for prompt in PROMPTS:
        out = generate(target, prompt, BUILDERS[builder](draft), GREEDY)
        assert out.token_ids == plain[tuple(prompt)], f"{builder} on {arch}"


def test_greedy_self_draft_dynamic_trees_accept_long_paths(models):
    arch, _, _, _ = models
    peaked = tiny_model(arch, 64, seed=0, logit_scale=60)  # draft = target, peaked: deep trees pay
    plain = generate(peaked, PROMPTS[0], None, GREEDY).token_ids
    for name in ("dyspec_heap", "eagle2"):
        out = generate(peaked, PROMPTS[0], BUILDERS[name](peaked), GREEDY)
        assert out.token_ids == plain
        assert out.tau > 3.0, (name, out.tau)


def _combos():
    """(builder, law, verifier) for every verifier and each builder accepting its law."""
    laws_of = {"dyspec_heap": ("without_replacement", "deterministic"),
               "dyspec_threshold": ("without_replacement", "deterministic"),
               "eagle2": ("deterministic",), "merged": ("deterministic",), "merged_shape": ("deterministic",)}
    out = []
    for verifier, laws in sorted(VERIFIER_LAWS.items()):
        for builder in ("shape", *laws_of):
            allowed = ("iid", "without_replacement", "deterministic", "greedy_draft", "spechub") \
                if builder == "shape" else laws_of[builder]
            for law in (allowed if laws is None else laws):
                if law in allowed and (laws is None or law in laws):
                    if verifier == "greedy":
                        continue  # greedy: temperature 0 only (above); refused at T > 0 (test_bad_input.py)
                    out.append((builder, law, verifier))
    return out


@pytest.mark.parametrize("builder,law,verifier", _combos())
def test_sampling_combinations_run(builder, law, verifier):
    target = tiny_model("llama", 16, seed=0, logit_scale=4)
    draft = tiny_model("llama", 16, seed=1, logit_scale=4)
    if builder == "shape":
        shape = TreeShape.chain(3) if verifier in ("single", "block") else (  # chain verifiers
            TreeShape.widths((2, 2)) if law == "spechub" else TreeShape.from_paths([[0], [1], [2], [0, 0], [1, 0]]))
        make = lambda: ShapeDrafter(draft, shape, law)  # noqa: E731
    else:
        make = lambda: BUILDERS[builder](draft, law)  # noqa: E731
    cfg = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(1.0), stop_on_eos=False, verifier=verifier)
    for seed in range(2):
        out = generate(target, [1, 2, 3], make(), GenerationConfig(**{**cfg.__dict__, "seed": seed}))
        assert len(out.token_ids) == 12 and all(0 <= t < 16 for t in out.token_ids)
