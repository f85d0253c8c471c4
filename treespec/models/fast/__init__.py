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
from .graphs import GraphedGemmaRunner
from .quant import QUANTIZE_MODES, TARGET_QUANTIZE_MODES


def make_runner(model, fast: bool = False, quantize: str | None = None) -> ModelRunner:
    """The runner of ``model``: the fast lean forward where it covers the model (``fast=True``),
    else the eager Hugging Face reference runner. A runner passed in is returned as it is.
    ``quantize`` (``"int4"``, :mod:`.quant`; ``"int8-head"``, :mod:`.int8_head`) needs the fast path and
    refuses other models."""
    if isinstance(model, ModelRunner):
        return model
    if quantize is not None:
        reason = fast_supported(model)
        if reason is not None:
            raise ValueError(f"quantize={quantize!r} needs the fast runner: {reason}")
        return FastGemmaRunner(model, quantize=quantize)
    if fast and fast_supported(model) is None:
        return FastGemmaRunner(model)
    return ModelRunner(model)


def choose_runner(model, choice: str = "auto", quantize: str = "none") -> ModelRunner:
    """The target's runner for a ``--runner`` choice (``auto``: fast where it covers the model, ``fast``, ``eager``,
    ``graphs``: the fast runner at fixed shapes, replayed as CUDA graphs on a GPU, :mod:`.graphs`) and a
    ``--quantize`` mode; ``fast``, ``graphs`` and a quantisation refuse a model the fast path does not cover
    (ValueError naming the reason)."""
    reason = fast_supported(model)
    if choice == "graphs":
        if reason is not None or quantize != "none":
            raise ValueError(f"--runner graphs: {reason or 'a quantised target runs on the CPU kernel'}; use "
                             f"--runner fast, eager or auto")
        return GraphedGemmaRunner(model)
    if quantize != "none":
        if reason is not None:
            raise ValueError(f"--quantize {quantize}: {reason}")
        return make_runner(model, quantize=quantize)
    if choice == "fast" and reason is not None:
        raise ValueError(f"--runner fast: {reason}; use --runner eager or auto")
    return make_runner(model, fast=choice != "eager")


__all__ = ["QUANTIZE_MODES", "TARGET_QUANTIZE_MODES", "FastGemmaRunner", "GraphedGemmaRunner", "choose_runner",
           "fast_supported", "make_runner"]
