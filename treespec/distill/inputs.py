"""Checked loading of what a user hands to the distill commands: checkpoints, head files, folders.

Everything here raises :class:`DistillInputError` (a ``ValueError``) with a message that names the
file and the problem; the CLI prints it as one line and exits with status 2. Checkpoints are read
with ``torch.load(weights_only=True)``: tensors, plain containers, numbers and strings only, so a
checkpoint from someone else cannot run code when it is loaded.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch


class DistillInputError(ValueError):
    """Bad input to a distill command (missing, unreadable, malformed or unsafe file; bad option)."""


class UnsafeCheckpointError(DistillInputError):
    """A checkpoint that holds objects other than tensors / plain containers (loading could run code)."""


def require_file(path: str | Path, what: str) -> Path:
    """``path`` if it is an existing file, else a :class:`DistillInputError` naming ``what``."""
    p = Path(path)
    if not p.is_file():
        raise DistillInputError(f"{what} {p}: " + ("is a directory, not a file" if p.is_dir() else "no such file"))
    return p


def require_dir(path: str | Path, what: str) -> Path:
    """``path`` if it is an existing directory, else a :class:`DistillInputError` naming ``what``."""
    p = Path(path)
    if not p.is_dir():
        raise DistillInputError(f"{what} {p}: no such directory")
    return p


def load_checkpoint(path: str | Path) -> dict:
    """A training checkpoint, loaded without unpickling arbitrary objects.

    Raises :class:`UnsafeCheckpointError` for a checkpoint that needs full unpickling (an old-format
    or foreign file; it is never executed) and :class:`DistillInputError` for a damaged one.
    """
    path = require_file(path, "checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise UnsafeCheckpointError(
            f"checkpoint {path}: refused, it holds objects other than tensors and plain containers "
            f"(an old-format or foreign checkpoint; loading it could run code): {first[:200]}") from None
    except (RuntimeError, EOFError, OSError) as err:  # truncated / not a torch zip file
        raise DistillInputError(f"checkpoint {path}: unreadable (truncated or not a checkpoint): "
                                f"{str(err).splitlines()[0][:200]}") from None
    if not isinstance(state, dict):
        raise DistillInputError(f"checkpoint {path}: expected a dict, found {type(state).__name__}")
    return state


def read_head_file(path: str | Path, loader, *args, **kwargs):
    """``loader(path, *args, **kwargs)`` (e.g. ``EagleHead.load``) with bad files turned into
    :class:`DistillInputError`: missing, not safetensors, truncated, not a treespec head."""
    from safetensors import SafetensorError

    path = require_file(path, "head file")
    try:
        return loader(path, *args, **kwargs)
    except SafetensorError as err:
        raise DistillInputError(f"head file {path}: not a readable safetensors file ({err})") from None
    except (KeyError, json.JSONDecodeError, TypeError) as err:
        raise DistillInputError(f"head file {path}: damaged metadata ({type(err).__name__}: {err})") from None
    except ValueError as err:  # read_weights: "is not a treespec ..."; shape mismatches with the target
        raise DistillInputError(f"head file {path}: {err}") from None


def read_prompt_texts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompt texts of a JSONL file of ``{"prompt": ...}`` rows, in file order (the first ``limit``)."""
    out = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                out.append(json.loads(line)["prompt"])
                if limit is not None and len(out) >= limit:
                    break
    return out
