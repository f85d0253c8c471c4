"""One reader for every head file a user hands treespec: an EAGLE head, an EAGLE-3 head, a Kangaroo adapter (all
treespec ``.safetensors`` files, told apart by their format tag), or a ``speculators`` EAGLE-3 checkpoint folder."""

from __future__ import annotations

from pathlib import Path

import torch

from .eagle3 import Eagle3Head
from .head import EagleHead
from .kangaroo import KangarooAdapter
from .subset_head import SubsetHead


def load_head(path: str | Path, target, *, dtype: torch.dtype = torch.float32) -> SubsetHead:
    """The head at ``path``, attached to ``target``: a folder is read as a ``speculators`` EAGLE-3 checkpoint
    (:func:`~treespec.drafting.eagle3_export.load_speculators`), a file by its format tag. A file of neither
    format is refused in one line (``ValueError``)."""
    path = Path(path)
    if path.is_dir():
        from .eagle3_export import load_speculators

        return load_speculators(path, target, dtype=dtype)
    return head_class_of(path).load(path, target, dtype=dtype)


def load_layer_head(path: str | Path, target, *, dtype: torch.dtype = torch.float32, what: str = "this tool"):
    """:func:`load_head` for the tools that emulate a tree along a text with the head's unrolled pass
    (:class:`~treespec.drafting.head.LayerHead`: an EAGLE or EAGLE-3 head, a file or a ``speculators`` folder); a
    Kangaroo adapter, which drafts through the target's own early layers, is refused in one line
    (``ValueError``) naming ``what`` refuses it."""
    from .head import LayerHead

    head = load_head(path, target, dtype=dtype)
    if not isinstance(head, LayerHead):
        raise ValueError(not_a_layer_head(type(head), what))
    return head


def not_a_layer_head(cls: type, what: str) -> str:
    """The one line refusing a head of class ``cls`` in a tool that needs an EAGLE or EAGLE-3 head."""
    return (f"a {cls.__name__} drafts through the target's own early layers; {what} takes an EAGLE or EAGLE-3 head "
            f"(a head file or a speculators folder)")


def head_class_of(path: str | Path) -> type[SubsetHead]:
    """The class of the head file at ``path`` by its format tag: :class:`~treespec.drafting.eagle3.Eagle3Head` for
    an EAGLE-3 head, :class:`~treespec.drafting.kangaroo.KangarooAdapter` for a Kangaroo adapter, else
    :class:`~treespec.drafting.head.EagleHead` (whose reader refuses what is none of them)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            fmt = (fh.metadata() or {}).get("format")
    except Exception:  # missing or not a safetensors file: the EAGLE head's reader says which, in one line
        fmt = None
    return {Eagle3Head.FORMAT: Eagle3Head, KangarooAdapter.FORMAT: KangarooAdapter}.get(fmt, EagleHead)


def is_speculators_checkpoint(name: str | Path) -> bool:
    """Whether ``name`` is a folder whose ``config.json`` names a ``speculators`` model (``--draft`` reads it as a
    head; :func:`load_head` refuses the model types it cannot compute)."""
    import json

    config = Path(name) / "config.json"
    try:
        return config.is_file() and "speculators_model_type" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        return False
