"""The one training loop of the distillation trainers (:mod:`.train`'s head, :mod:`.medusa`'s heads).

:func:`run_loop` drives ``step_fn(step) -> losses`` (a dict holding the ``"total"`` to minimise)
with AdamW-style optimizer steps under :func:`cosine_lr` (linear warmup, cosine decay to ``floor``
times the peak), gradient clipping, a wall-clock time limit, and checkpoints written atomically
every ``ckpt_every`` steps and at the end. A checkpoint holds the model, the optimizer, the step,
torch's global RNG state and whatever the trainer adds (``extra``); resuming from it (see
:func:`open_run`) continues the run exactly: data order must be a pure function of the step, which
both trainers guarantee. Checkpoints are named by a pattern: with ``{step}`` (``ckpt-{step}.pt``)
the newest ``keep`` are kept; without, one file is rewritten in place. They are loaded only through
:func:`.inputs.load_checkpoint` (``weights_only=True``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..files import atomic_write, remove_stale_temporaries
from .inputs import DistillInputError, first_line, load_checkpoint, require_number, require_type


@dataclass(frozen=True)
class LoopConfig:
    steps: int
    lr: float
    warmup: int = 0
    floor: float = 0.0  # final learning rate as a fraction of ``lr``
    clip: float = 1.0  # max gradient norm
    ckpt_every: int = 100
    keep: int = 1  # checkpoints kept (numbered names only)
    time_limit_s: float | None = None


def cosine_lr(step: int, warmup: int, steps: int, floor: float) -> float:
    """Learning-rate factor at ``step``: linear warmup to 1 over ``warmup`` steps, then cosine decay to
    ``floor`` at ``steps``.

    Not the same numbers as transformers' ``get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, steps,
    min_lr_rate=floor)`` (measured with transformers 5.24; ``tests/treespec/test_distill_schedule.py`` pins
    it), so do not swap one for the other: its warmup factor is ``step / warmup``, one step behind this
    one's ``(step + 1) / warmup`` (its step 0 trains at learning rate 0; it reaches 1 at ``step = warmup``
    where this one does at ``warmup - 1``); from ``warmup`` to ``steps`` the two agree (to 1e-12); past
    ``steps`` it rises again along the cosine, while this one stays at ``floor``. Resumed runs must keep
    the factors of their first part.
    """
    if step < warmup:
        return (step + 1) / warmup
    frac = min((step - warmup) / max(steps - warmup, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))


def checkpoints(run_dir: str | Path, name: str) -> list[Path]:
    """The checkpoints named ``name`` in ``run_dir``, oldest first (``{step}`` in ``name`` numbers them)."""
    run_dir = Path(run_dir)
    if "{step}" not in name:
        return [run_dir / name] if (run_dir / name).is_file() else []
    head, tail = name.split("{step}")
    found = []
    for path in run_dir.glob(f"{head}*{tail}"):
        mid = path.name[len(head):len(path.name) - len(tail)]
        if mid.isdigit():
            found.append((int(mid), path))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path, name: str = "ckpt-{step}.pt") -> Path | None:
    found = checkpoints(run_dir, name)
    return found[-1] if found else None


def open_run(run_dir: str | Path, name: str) -> tuple[Path, Path | None, dict | None]:
    """Create ``run_dir``, remove what killed writers left there; (run_dir, newest checkpoint, its state)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(run_dir)
    path = latest_checkpoint(run_dir, name)
    return run_dir, path, (load_checkpoint(path) if path is not None else None)


def check_subset_run(ckpt: dict, path: Path, what: str, config: dict, free: tuple[str, ...] = ("time_limit_s",)
                     ) -> None:
    """A checkpoint of a trainer of subset heads (Medusa, Kangaroo) checked before resuming: its ``config``,
    ``vocab_ids``, ``history`` and ``seconds`` entries, and a configuration equal to ``config`` (the new run's, as a
    dict) outside the ``free`` fields; a :class:`.inputs.DistillInputError` naming the problem otherwise."""
    if not isinstance(ckpt.get("config"), dict) or not isinstance(ckpt.get("vocab_ids"), torch.Tensor):
        raise DistillInputError(f"checkpoint {path}: not a {what} checkpoint")
    require_type(ckpt, "history", list, f"checkpoint {path}")
    require_number(ckpt, "seconds", f"checkpoint {path}")
    if {k: v for k, v in ckpt["config"].items() if k not in free} != {k: v for k, v in config.items() if k not in free}:
        raise DistillInputError(f"{Path(path).parent} holds a run with another configuration; use another run "
                                "directory")


def resume_state(state: dict, model: torch.nn.Module, opt: torch.optim.Optimizer, keys: tuple[str, str],
                 path: str | Path | None = None) -> int:
    """Load a checkpoint of :func:`run_loop` (as :func:`.inputs.load_checkpoint` checked it: ``step`` a count,
    ``rng`` absent or of the right shape) into ``model``, ``opt`` and torch's global RNG; returns its step.
    States that do not fit are a :class:`.inputs.DistillInputError` naming ``path``."""
    model_key, opt_key = keys
    where = f"checkpoint {path}" if path is not None else "checkpoint"
    for key in keys:
        if not isinstance(state.get(key), dict):
            raise DistillInputError(f"{where}: no {key!r} state (not a checkpoint of this trainer)")
    try:
        model.load_state_dict(state[model_key])
        opt.load_state_dict(state[opt_key])
        if "rng" in state:
            torch.set_rng_state(state["rng"])  # random draws continue the uninterrupted stream
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
        raise DistillInputError(f"{where}: its states do not fit this run ({type(err).__name__}: "
                                f"{first_line(err)})") from None
    return state["step"]


def run_loop(cfg: LoopConfig, model: torch.nn.Module, opt: torch.optim.Optimizer,
             step_fn: Callable[[int], dict], *, run_dir: str | Path, name: str = "ckpt-{step}.pt",
             keys: tuple[str, str] = ("model", "optimizer"), state: dict | None = None,
             extra: Callable[[], dict] = dict, on_step: Callable[[int, dict], None] | None = None,
             state_path: str | Path | None = None) -> int:
    """Train ``model`` from ``state`` (a checkpoint of this loop, or None) up to ``cfg.steps``; returns the step.

    ``keys``: the checkpoint's entries for the model and optimizer state dicts. ``on_step(step, losses)``
    runs after each optimizer step (``step`` counts the steps done), before that step's checkpoint;
    ``extra()`` adds entries to every checkpoint; ``state_path`` (where ``state`` was read) names the file
    when its states do not fit (:func:`resume_state`)."""
    run_dir = Path(run_dir)
    model_key, opt_key = keys
    step = 0
    if state is not None:
        step = resume_state(state, model, opt, keys, state_path)

    def save() -> None:
        ckpt = {"step": step, model_key: model.state_dict(), opt_key: opt.state_dict(),
                "rng": torch.get_rng_state(), **extra()}
        atomic_write(run_dir / name.format(step=step), lambda tmp: torch.save(ckpt, tmp))
        if "{step}" in name:
            for old in checkpoints(run_dir, name)[:-cfg.keep]:
                old.unlink(missing_ok=True)

    t0 = time.perf_counter()
    while step < cfg.steps:
        if cfg.time_limit_s is not None and time.perf_counter() - t0 > cfg.time_limit_s:
            break
        for group in opt.param_groups:  # a group may scale the peak rate ("lr_scale")
            group["lr"] = cfg.lr * group.get("lr_scale", 1.0) * cosine_lr(step, cfg.warmup, cfg.steps, cfg.floor)
        opt.zero_grad(set_to_none=True)
        with torch.enable_grad():  # also when the caller runs under no_grad
            losses = step_fn(step)
            losses["total"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        step += 1
        if on_step is not None:
            on_step(step, losses)
        if step % cfg.ckpt_every == 0:
            save()
    save()
    return step
