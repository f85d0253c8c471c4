"""Checked loading of what a user hands to the distill commands: checkpoints, head files, folders.

Everything here raises :class:`DistillInputError` (a ``ValueError``) with a message that names the
file and the problem; the CLI prints it as one line and exits with status 2. Checkpoints are read
with ``torch.load(weights_only=True)``: tensors, plain containers, numbers and strings only, so a
checkpoint from someone else cannot run code when it is loaded.
"""

from __future__ import annotations

import gzip
import json
import numbers
import pickle
import zlib
from pathlib import Path
from typing import Any

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


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first non-blank line of ``err``'s message, at most ``limit`` characters (its type's name when
    the message is empty, e.g. the bare ``EOFError`` of an empty file)."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()[:limit]
    return type(err).__name__


#: the most a gzip-compressed JSON file may expand to (a continuation chunk holds well under 1 MiB)
MAX_GZIP_JSON_BYTES = 64 << 20


def read_json_object(path: str | Path, what: str) -> dict:
    """The JSON object stored in ``path`` (a manifest; ``.gz``: gzip-compressed, read up to
    :data:`MAX_GZIP_JSON_BYTES` expanded); missing, damaged, oversized or non-object files are a
    :class:`DistillInputError` naming ``what``."""
    path = require_file(path, what)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                raw = fh.read(MAX_GZIP_JSON_BYTES + 1)
            if len(raw) > MAX_GZIP_JSON_BYTES:
                raise DistillInputError(f"{what} {path}: damaged (expands beyond {MAX_GZIP_JSON_BYTES >> 20} MiB)")
            data = json.loads(raw.decode("utf-8"))
        else:
            data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, OSError, EOFError, zlib.error) as err:
        raise DistillInputError(f"{what} {path}: damaged ({first_line(err)})") from None
    if not isinstance(data, dict):
        raise DistillInputError(f"{what} {path}: damaged (expected a JSON object, found {type(data).__name__})")
    return data


def require_count(record: dict, key: str, where: str, low: int = 0) -> int:
    """``record[key]`` if it is an integer >= ``low`` (``True`` is not a count), else a :class:`DistillInputError`."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DistillInputError(f"{where}: {key!r} must be an integer >= {low}, found {value!r}")
    return value


def require_number(record: dict, key: str, where: str) -> float:
    """``record[key]`` if it is a finite real number >= 0, else a :class:`DistillInputError`."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < float("inf"):
        raise DistillInputError(f"{where}: {key!r} must be a number >= 0, found {value!r}")
    return float(value)


def require_type(record: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``record[key]`` if it is present and of type ``kind``, else a :class:`DistillInputError`."""
    if key not in record:
        raise DistillInputError(f"{where}: no {key!r} entry")
    value = record[key]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise DistillInputError(f"{where}: {key!r} must be a {names}, found {type(value).__name__}")
    return value


def contained_path(folder: str | Path, name: object, where: str) -> Path:
    """``folder / name`` for a relative file name read from a manifest in ``folder``, refused
    (:class:`DistillInputError`) unless it stays inside ``folder``: absolute paths, ``..`` escapes and
    symbolic links leading out are checked on the resolved path."""
    folder = Path(folder)
    if not isinstance(name, str) or not name.strip():
        raise DistillInputError(f"{where}: expected a file name, found {name!r}")
    base = folder.resolve()
    resolved = (base / name).resolve()
    if Path(name).is_absolute() or resolved == base or not resolved.is_relative_to(base):
        raise DistillInputError(f"{where}: {name!r} points outside {folder}; refused")
    return folder / resolved.relative_to(base)


def load_checkpoint(path: str | Path) -> dict:
    """A training checkpoint, loaded without unpickling arbitrary objects.

    Raises :class:`UnsafeCheckpointError` for a checkpoint that needs full unpickling (an old-format
    or foreign file; it is never executed) and :class:`DistillInputError` for a damaged one.
    """
    path = require_file(path, "checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise UnsafeCheckpointError(
            f"checkpoint {path}: refused, it holds objects other than tensors and plain containers "
            f"(an old-format or foreign checkpoint; loading it could run code): {last[:200]}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:  # empty / truncated / not a torch zip file
        raise DistillInputError(f"checkpoint {path}: unreadable (empty, truncated or not a checkpoint): "
                                f"{first_line(err)}") from None
    if not isinstance(state, dict):
        raise DistillInputError(f"checkpoint {path}: expected a dict, found {type(state).__name__}")
    require_count(state, "step", f"checkpoint {path}")
    rng = state.get("rng")
    if rng is not None and not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8
                                and rng.shape == torch.get_rng_state().shape):
        raise DistillInputError(f"checkpoint {path}: damaged RNG state 'rng' (expected a uint8 tensor of shape "
                                f"{tuple(torch.get_rng_state().shape)})")
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
