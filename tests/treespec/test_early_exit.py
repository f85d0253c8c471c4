"""Self-speculative early-exit drafts share the target's weights and are exact HF models."""

import pytest
import torch

from treespec.drafting.model import ModelDrafter, StaticTreeShape
from treespec.generate import GenerationConfig, generate
from treespec.models.early_exit import early_exit_model
from treespec.models.tiny import tiny_model
from treespec.sampling import SamplingConfig


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_early_exit_logits_are_the_truncated_target(arch):
    target = tiny_model(arch, 64, seed=0, num_layers=4)
    draft = early_exit_model(target, 2)
    assert all(a is b for a, b in zip(draft.get_output_embeddings().parameters(),
                                      target.get_output_embeddings().parameters()))
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(0))
    hidden = target(ids, output_hidden_states=True).hidden_states[2]  # after layer 2, before the final norm
    expected = target.get_output_embeddings()(target.base_model.norm(hidden))
    torch.testing.assert_close(draft(ids).logits, expected, atol=1e-6, rtol=0)


def test_early_exit_draft_is_lossless_at_temperature_zero():
    target = tiny_model("gemma3", 64, seed=0, num_layers=4, logit_scale=8)
    drafter = ModelDrafter(early_exit_model(target, 3), StaticTreeShape((2, 2, 1)))
    cfg = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(0.0), stop_on_eos=False)
    assert generate(target, [5, 6, 7], drafter, cfg).token_ids == generate(target, [5, 6, 7], None, cfg).token_ids


def test_bad_layer_count():
    target = tiny_model("llama", 64, num_layers=4)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 3\]"):
        early_exit_model(target, 4)
