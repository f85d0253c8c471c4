"""Fast paths for target (and model-draft) forwards: the same function as the eager HF runner.

``make_runner(model, fast=True)`` returns a :class:`FastGemmaRunner` for the models it covers
(Gemma-3 text models) and the reference :class:`~treespec.models.runner.ModelRunner` otherwise.
A fast runner *is* a ``ModelRunner`` (same interface: tree/chain forwards, commit, reset), so
``generate()``, the drafters and the profilers take it unchanged::

    runner = make_runner(target, fast=True)
    out = generate(runner, prompt_ids, drafter, config)
"""

from __future__ import annotations

from ..runner import ModelRunner
from .gemma import FastGemmaRunner, fast_supported


def make_runner(model, fast: bool = False) -> ModelRunner:
    """The runner of ``model``: the fast lean forward where it covers the model (``fast=True``),
    else the eager Hugging Face reference runner. A runner passed in is returned as it is."""
    if isinstance(model, ModelRunner):
        return model
    if fast and fast_supported(model) is None:
        return FastGemmaRunner(model)
    return ModelRunner(model)


__all__ = ["FastGemmaRunner", "fast_supported", "make_runner"]
