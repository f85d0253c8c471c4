"""The typed contract between the engine, the target runner and the draft runners, and the one-way
import between the EAGLE-style head and its runner."""

import grimp
import torch

from treespec.drafting.base import DraftState
from treespec.models.runner import DraftObservation, ModelRunner, TargetView
from treespec.models.tiny import tiny_model


def _members(protocol) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_draft_state_and_runners_offer_what_the_protocols_name():
    state = DraftState([1, 2], 3, torch.zeros(1, 4), None)
    assert _members(DraftObservation) == {"tokens", "max_depth", "target_hidden", "target_runner"}
    assert all(hasattr(state, name) for name in _members(DraftObservation))
    runner = ModelRunner(tiny_model("llama", vocab_size=32, seed=0))
    assert _members(TargetView) == {"model", "device", "length", "slots"}
    assert all(hasattr(runner, name) for name in _members(TargetView))
    from treespec.models.llama_cpp import LlamaCppRunner

    assert LlamaCppRunner.device == torch.device("cpu")  # the GGUF target's drafters build their trees there


def test_head_and_its_runner_import_one_way():
    graph = grimp.build_graph("treespec")
    assert "treespec.drafting.head_runner" in graph.find_modules_directly_imported_by("treespec.drafting.head")
    assert "treespec.drafting.head" not in graph.find_modules_directly_imported_by("treespec.drafting.head_runner")
