"""Library drafters with bf16 forced on tiny models (and in fp32): ShapeDrafter over a Sequoia shape,
DySpec, EAGLE-2, Merged (EAGLE-2 + n-gram), the online n-gram drafter, and ShapeDrafter over Medusa heads
(MedusaRunner). Each runs generate() at T=0 and T=1: exactly max_new_tokens tokens (no EOS stop), all in
the vocabulary, the drafter really drafted. In fp32 at T=0 the output equals plain greedy decoding (bf16
tree passes round differently from one-token passes: no identity is claimed there)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from treespec.drafting.base import Drafter
from treespec.drafting.medusa import new_medusa_heads
from treespec.drafting.ngram import NgramConfig
from treespec.drafting.online import OnlineNgramConfig, OnlineNgramDrafter
from treespec.generate import GenerationConfig, generate
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig
from treespec.trees.grow import ShapeDrafter
from treespec.trees.shape import TreeShape

from trees_common import BUILDERS, SEQUOIA

V = 64
NEW = 12
PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 6]


def _drafters(target, draft) -> dict[str, Callable[[], Drafter]]:
    heads = new_medusa_heads(target, torch.arange(0, V, 2), num_heads=3)
    return {
        "shape_sequoia": lambda: ShapeDrafter(draft, SEQUOIA, "without_replacement"),
        "dyspec": lambda: BUILDERS["dyspec_heap"](draft),
        "eagle2": lambda: BUILDERS["eagle2"](draft),
        "merged": lambda: BUILDERS["merged"](draft),
        "online_ngram": lambda: OnlineNgramDrafter(OnlineNgramConfig(NgramConfig(depth=4, branches=2, max_nodes=8))),
        "medusa_shape": lambda: ShapeDrafter(heads, TreeShape.widths((3, 2, 1)), "deterministic"),
    }


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def setup(request):
    dtype = getattr(torch, request.param)
    target = tiny_model("gemma3", V, seed=0, logit_scale=8, dtype=dtype)
    draft = tiny_model("gemma3", V, seed=1, logit_scale=8, dtype=dtype)
    greedy = GenerationConfig(max_new_tokens=NEW, sampling=SamplingConfig(0.0), stop_on_eos=False)
    plain = generate(target, PROMPT, None, greedy).token_ids
    return dtype, target, _drafters(target, draft), plain


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", ["shape_sequoia", "dyspec", "eagle2", "merged", "online_ngram", "medusa_shape"])
def test_drafter_runs_in_both_dtypes(setup, name, temperature):
    dtype, target, drafters, plain = setup
    assert next(target.parameters()).dtype == dtype
    config = GenerationConfig(max_new_tokens=NEW, sampling=SamplingConfig(temperature), seed=3, stop_on_eos=False)
    out = generate(target, PROMPT, drafters[name](), config)
    assert len(out.token_ids) == NEW and all(0 <= t < V for t in out.token_ids), out.token_ids
    assert sum(s.tree_nodes for s in out.steps) > 0, "the drafter never drafted"
    if dtype == torch.float32 and temperature == 0:
        assert out.token_ids == plain, name


def test_the_shipped_head_takes_its_settings_by_temperature(monkeypatch):
    """``--draft head`` without options drafts with DEFAULT_HEAD_SETTINGS["greedy"] at T=0 and ["sampled"] at
    T>0 (tree, confidence, law); explicit options win over both. The shipped file is replaced by a tiny head
    and the settings by distinct values, so a mix-up of the two entries shows."""
    from treespec.drafters import DraftOptions, build_drafter
    from treespec.drafting import shipped
    from treespec.drafting.head import new_head

    target = tiny_model("gemma3", V, seed=0, logit_scale=8, dtype=torch.float32)
    monkeypatch.setattr(shipped, "load_default_head", lambda t: new_head(t, torch.arange(0, V, 2), num_heads=4))
    monkeypatch.setattr(shipped, "DEFAULT_HEAD_SETTINGS", {
        "greedy": {"tree": (2, 1), "min_confidence": 0.3},
        "sampled": {"tree": (3, 1, 1), "min_confidence": 0.1, "law": "without_replacement"}})
    greedy, sampled = build_drafter("head", target, temperature=0.0), build_drafter("head", target, temperature=0.7)
    assert greedy.tree_shape == TreeShape.widths((2, 1)) and greedy.min_confidence == 0.3
    assert greedy.draft_law == "iid"  # no law in the greedy entry: T=0 drafts deterministically anyway
    assert sampled.tree_shape == TreeShape.widths((3, 1, 1)) and sampled.min_confidence == 0.1
    assert sampled.draft_law == "without_replacement"
    mine = build_drafter("head", target, DraftOptions(tree=(1, 1), law="iid", min_confidence=0.0), temperature=0.7)
    assert mine.tree_shape == TreeShape.widths((1, 1)) and mine.draft_law == "iid" and mine.min_confidence == 0.0
    out = generate(target, PROMPT, sampled, GenerationConfig(max_new_tokens=NEW, sampling=SamplingConfig(0.7), seed=1,
                                                             stop_on_eos=False))
    assert len(out.token_ids) == NEW


def test_the_cli_and_the_benchmark_pass_the_temperature_to_the_drafter(monkeypatch):
    """`treespec generate` and benchmarks/run.py build the drafter for the run's temperature (which of the shipped
    head's settings apply); a path that dropped it would draft at T>0 with the T=0 entry."""
    import benchmarks.run as run
    import treespec.cli as cli
    import treespec.drafters as drafters

    seen = []
    monkeypatch.setattr(cli, "build_drafter", lambda *a, **k: seen.append(k["temperature"]))
    monkeypatch.setattr(drafters, "build_drafter", lambda *a, **k: seen.append(k["temperature"]))
    args = cli.build_parser().parse_args(["generate", "x", "--draft", "head", "--temperature", "0.7"])
    cli._drafter(args, None, None, torch.float32)
    run.cli_drafter(None, None, "float32", "head")(0.9)
    assert seen == [0.7, 0.9]
