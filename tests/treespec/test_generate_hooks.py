"""The per-step hook of generate(): ``on_tokens`` sees each step's committed tokens (accepted, then the
recovered or bonus token, cut at EOS and max_new_tokens), may stop generation, and its errors propagate."""

import pytest

from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", 64, seed=0, logit_scale=8)


def tree_drafter():
    return ShapeDrafter(tiny_model("llama", 64, seed=1, logit_scale=8), TreeShape.widths((2, 2, 1)), "iid")


def config(temperature: float, max_new_tokens: int = 30, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature), seed=0, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hook_calls_concatenate_to_the_new_tokens(target, temperature):
    calls: list[list[int]] = []
    out = generate(target, PROMPT, tree_drafter(), config(temperature, stop_on_eos=False), on_tokens=calls.append)
    assert [t for call in calls for t in call] == out.token_ids
    assert len(out.token_ids) == 30  # never more than max_new_tokens, the last step cut to fit
    assert [len(call) for call in calls] == [s.emitted for s in out.steps]
    assert all(calls) and not out.stopped_by_hook
    # the hook changes nothing: the same seed without it gives the same tokens
    assert generate(target, PROMPT, tree_drafter(), config(temperature, stop_on_eos=False)).token_ids == out.token_ids


def test_hook_sees_tokens_cut_at_eos(target):
    plain = generate(target, PROMPT, None, config(0.0, stop_on_eos=False)).token_ids
    eos = plain[12]
    calls: list[list[int]] = []
    out = generate(target, PROMPT, tree_drafter(), config(0.0), eos_ids={eos}, on_tokens=calls.append)
    assert out.stopped_on_eos and out.token_ids == plain[: plain.index(eos) + 1]
    assert [t for call in calls for t in call] == out.token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_returning_true_stops_after_that_step(target, temperature):
    calls: list[list[int]] = []

    def stop_at_once(tokens: list[int]) -> bool:
        calls.append(tokens)
        return True

    out = generate(target, PROMPT, tree_drafter(), config(temperature, stop_on_eos=False), on_tokens=stop_at_once)
    assert len(calls) == 1 and out.token_ids == calls[0]
    assert out.stopped_by_hook and not out.stopped_on_eos
    assert out.target_calls == 1 and out.steps[0].emitted == len(out.token_ids)
    summary = out.summary()
    assert summary["new_tokens"] == len(calls[0]) and summary["stopped_by_hook"]
    full = generate(target, PROMPT, tree_drafter(), config(temperature, stop_on_eos=False))
    assert full.token_ids[: len(calls[0])] == calls[0]


def test_hook_returning_none_or_false_goes_on(target):
    out = generate(target, PROMPT, tree_drafter(), config(0.0, stop_on_eos=False), on_tokens=lambda tokens: False)
    assert len(out.token_ids) == 30 and not out.stopped_by_hook


def test_hook_error_propagates_and_frees_the_drafter(target):
    drafter = tree_drafter()

    def boom(tokens: list[int]) -> None:
        raise KeyError("stop string table missing")

    with pytest.raises(KeyError, match="stop string table missing"):
        generate(target, PROMPT, drafter, config(0.0), on_tokens=boom)
    assert len(generate(target, PROMPT, drafter, config(0.0, max_new_tokens=5)).token_ids) == 5


def test_the_hook_has_one_name(target):
    """``on_tokens`` is the only name of the per-step hook: the older ``callback`` keyword is refused."""
    with pytest.raises(TypeError, match="callback"):
        generate(target, PROMPT, None, config(0.0), callback=print)
