"""One ``.safetensors`` file per trained draft component (head, Medusa heads): weights, the
vocabulary subset, a config and free-form metadata, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def write_weights(path: str | Path, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor, *, fmt: str,
                  version: int, config: dict, extra: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """Atomically write ``state`` (floating tensors cast to ``dtype`` if given) + ``vocab_ids`` + metadata."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().cpu()
               for k, v in state.items()}
    tensors["vocab_ids"] = vocab_ids.cpu().to(torch.int64).contiguous()
    meta = {"format": fmt, "version": str(version), "config": json.dumps(config), "extra": json.dumps(extra or {})}
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_weights(path: str | Path, *, fmt: str, what: str) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor, dict]:
    """``(config, state, vocab_ids, extra)`` of a file written by :func:`write_weights` in format ``fmt``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
        if meta.get("format") != fmt:
            raise ValueError(f"{path} is not a treespec {what}")
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    vocab_ids = tensors.pop("vocab_ids")
    return json.loads(meta["config"]), tensors, vocab_ids, json.loads(meta.get("extra", "{}"))
