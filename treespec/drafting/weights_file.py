"""One ``.safetensors`` file per trained draft component (head, Medusa heads): weights, the
vocabulary subset, a config and free-form metadata, written atomically."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch


def write_weights(path: str | Path, state: dict[str, torch.Tensor], vocab_ids: torch.Tensor, *, fmt: str,
                  version: int, config: dict, extra: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """Atomically write ``state`` (floating tensors cast to ``dtype`` if given) + ``vocab_ids`` + metadata."""
    from safetensors.torch import save

    from ..files import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().cpu()
               for k, v in state.items()}
    tensors["vocab_ids"] = vocab_ids.cpu().to(torch.int64).contiguous()
    meta = {"format": fmt, "version": str(version), "config": json.dumps(config), "extra": json.dumps(extra or {})}
    data = save(tensors, metadata=meta)  # bytes: save_file (0.8) writes its own .tmpXXXXXX, left behind by kill -9
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def read_weights(path: str | Path, *, fmt: str, what: str) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor, dict]:
    """``(config, state, vocab_ids, extra)`` of a file written by :func:`write_weights` in format ``fmt``."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise FileNotFoundError(f"no {what} file at {path}")
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("format") != fmt:
                raise ValueError(f"{path} is not a treespec {what}")
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        vocab_ids = tensors.pop("vocab_ids")
        config, extra = json.loads(meta["config"]), json.loads(meta.get("extra", "{}"))
    except ValueError:
        raise
    except Exception as err:  # safetensors' SafetensorError (garbage, truncated), KeyError (no vocab_ids/config)
        raise ValueError(f"{path} is not a readable treespec {what} ({type(err).__name__}: {err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: {what} config is not a JSON object")
    return config, tensors, vocab_ids, extra


def build_checked(path: str | Path, what: str, config_cls: type, config: dict, state: dict[str, torch.Tensor],
                  build: Callable[[object], torch.nn.Module]) -> torch.nn.Module:
    """Validate a stored ``config`` and ``state``, then return ``build(config_cls(**config))``.

    Refuses unknown or missing config keys, non-integer sizes, sizes larger than every dimension stored
    in the file (so a config declaring a huge size is refused instead of allocated), and any stored tensor
    whose shape differs from the module the config describes.
    """
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    required = {n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown, missing = sorted(set(config) - set(fields)), sorted(required - set(config))
    if unknown or missing:
        raise ValueError(f"{path}: {what} config has unknown keys {unknown} / missing keys {missing}")
    for name, value in config.items():
        default = fields[name].default
        if isinstance(default, int) and not isinstance(default, bool) or name in required:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{path}: {what} config {name}={value!r} is not a positive integer")
    # sane bounds before allocating: no size may exceed the largest dimension stored in the file
    # (target_vocab_size is no tensor dimension: it is checked against the target when attached)
    largest = max((max(v.shape, default=1) for v in state.values()), default=0)
    for name, value in config.items():
        if name in fields and isinstance(fields[name].default, float):  # a number, not a size (a judge's threshold)
            continue
        if name != "target_vocab_size" and isinstance(value, int) and not isinstance(value, bool) and value > largest:
            raise ValueError(f"{path}: {what} tensors do not match its config: {name}={value} exceeds every "
                             f"stored tensor dimension (largest {largest})")
    cfg = config_cls(**config)
    # the bound above can be lifted by an empty stored tensor of shape (0, N): the shapes the config
    # describes are taken from a probe on the meta device (no memory), the module is built only once
    # every stored tensor matches them
    try:
        with torch.device("meta"):
            probe = build(cfg)
    except RuntimeError as err:  # e.g. "Storage size calculation overflowed"
        raise ValueError(f"{path}: {what} tensors do not match its config: it describes a module that "
                         f"cannot be built ({str(err).splitlines()[0]})") from None
    expected = {k: tuple(v.shape) for k, v in probe.state_dict().items() if k != "vocab_ids"}
    got = {k: tuple(v.shape) for k, v in state.items()}
    bad = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))[:3]
    if bad:
        raise ValueError(f"{path}: {what} tensors do not match its config: "
                         + ", ".join(f"{k} stored {got.get(k, 'nothing')}, config says "
                                     f"{expected.get(k, 'no such tensor')}" for k in bad))
    return build(cfg)


def save_module(module: torch.nn.Module, path: str | Path, *, fmt: str, config: dict, extra: dict | None = None
                ) -> None:
    """A small trained module without a vocabulary subset (acceptance head, judge), float32, atomically."""
    write_weights(path, module.state_dict(), torch.zeros(0, dtype=torch.long), fmt=fmt, version=1, config=config,
                  extra=extra, dtype=torch.float32)


def load_module(cls: type, config_cls: type, path: str | Path, *, fmt: str, what: str,
                device: torch.device | str = "cpu") -> torch.nn.Module:
    """A module written by :func:`save_module`, checked against its config (:func:`build_checked`), with the file's
    free-form metadata as ``extra``; one clear ``ValueError`` for a file that is not one."""
    config, state, _, extra = read_weights(path, fmt=fmt, what=what)
    module = build_checked(path, what, config_cls, config, state, cls)
    module.load_state_dict(state)
    module.extra = extra
    return module.to(device).eval()
