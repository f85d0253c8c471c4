"""The base of draft heads that score with the target's own LM-head rows on a vocabulary subset.

EAGLE-style heads (:mod:`.head`) and Medusa heads (:mod:`.medusa`) share everything but their
trained layers: a sorted subset ``S`` of the target's vocabulary; the target's LM-head rows
``W[S]`` copied when the head is attached (frozen, never saved); float32 logits ``f @ W[S].T``
with the target's final soft-capping; and one ``.safetensors`` file holding the trained weights,
``S`` and the config. The draft's probability is exactly 0 outside ``S`` (rows are padded back to
the target vocabulary by the runners), so verification stays lossless.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ..models.fast.packed import PackedLinear, pack_linears, pack_weight, packed_linear, prepack_default
from ..models.fast.quant import QUANTIZE_MODES, Int4Linear, check_int4_shape, int4_linear, quantize_int4
from .weights_file import build_checked, read_weights, write_weights


class SubsetHead(nn.Module):
    """Vocabulary subset, target coupling, logits and the weights file of a draft head.

    Subclasses set ``FORMAT`` (the file's format tag), ``FILE_WHAT`` (how its files are named in
    errors), ``CONFIG`` (their frozen config dataclass, with ``hidden_size``, ``target_vocab_size``
    and ``softcap``), and implement :meth:`as_runner` and :meth:`depth_logits`.
    """

    FORMAT: ClassVar[str]
    FORMAT_VERSION: ClassVar[int] = 1
    FILE_WHAT: ClassVar[str]
    CONFIG: ClassVar[type]

    def __init__(self, cfg, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        ids = torch.as_tensor(vocab_ids, dtype=torch.long,  # checked on its device (also under torch.device("meta"))
                              device=vocab_ids.device if isinstance(vocab_ids, torch.Tensor) else "cpu").flatten()
        if ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 \
                or int(ids[-1]) >= cfg.target_vocab_size:
            raise ValueError("vocab_ids must be strictly increasing ids inside the target vocabulary")
        self.register_buffer("vocab_ids", ids, persistent=False)
        self.register_buffer("lm_rows", torch.empty(0), persistent=False)  # W[S] [|S|, H], frozen copy
        self._rows_packed: torch.Tensor | None = None  # W[S] in oneDNN's layout (for_inference in bf16)
        self._rows_int4 = None  # W[S] on 4-bit weights (for_inference(..., quantize="int4"))

    # ------------------------------------------------------------------ target coupling
    @property
    def attached(self) -> bool:
        return self.lm_rows.numel() > 0

    def attach(self, target) -> "SubsetHead":
        """Take the LM-head rows of the subset from ``target`` (a causal LM or its runner), frozen."""
        from ..models.runner import ModelRunner

        model = target.model if isinstance(target, ModelRunner) else target
        out = model.get_output_embeddings()
        if out.weight.shape[1] != self.cfg.hidden_size or out.weight.shape[0] != self.cfg.target_vocab_size:
            raise ValueError(f"{self.FILE_WHAT}: built for another target (hidden size or vocabulary differ)")
        self._attach_inputs(model)
        self.lm_rows = out.weight.detach().index_select(0, self.vocab_ids.to(out.weight.device)).float().clone()
        return self

    def _attach_inputs(self, model) -> None:
        """Take what else the head reads from the target (nothing by default)."""

    def logits(self, feature: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Features ``[..., H]`` -> logits over the subset ``[..., |S|]``: the product in the rows' dtype
        (float32 unless :meth:`for_inference` chose another, or autocast's), returned in float32, or in the
        product's dtype with ``float32=False`` (training hands bf16 logits to a loss that upcasts block by block)."""
        if not self.attached:
            raise RuntimeError("attach the head to its target first")
        if self._rows_int4 is not None:
            logits = int4_linear(feature.to(self.lm_rows.dtype), self._rows_int4)
        elif self._rows_packed is not None:
            logits = packed_linear(feature.to(self.lm_rows.dtype), self._rows_packed)
        else:
            logits = feature.to(self.lm_rows.dtype) @ self.lm_rows.t()
        if self.cfg.softcap:  # capped in float32
            capped = torch.tanh(logits.float() / self.cfg.softcap) * self.cfg.softcap
            return capped if float32 else capped.to(logits.dtype)
        return logits.float() if float32 else logits

    def for_inference(self, dtype: torch.dtype, quantize: str | None = None) -> "SubsetHead":
        """This (attached) head, for drafting only, computing in ``dtype``; returns ``self``.

        The trained weights and the subset's LM-head rows are cast to ``dtype``; in bf16 on a CPU with
        oneDNN every linear layer and the rows are also packed once into oneDNN's layout
        (:mod:`treespec.models.fast.packed`), which makes a one-row head step several times cheaper
        than float32 or a plain bf16 product (``benchmarks/results/profile``). ``quantize="int4"``
        (CPU) puts every linear layer and the rows on 4-bit weights instead
        (:mod:`treespec.models.fast.quant`: about a third of the bf16 bytes per step, another q; bf16 only). The head
        then no longer trains (packed or quantised weights have no gradient). Verification stays
        lossless: the draft's q is whatever this head computes, and the verifier is handed exactly that q.
        """
        if not self.attached:
            raise RuntimeError("attach the head to its target first")
        if quantize is not None and quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize={quantize!r}: expected one of {QUANTIZE_MODES} or None")
        if quantize == "int4" and (dtype != torch.bfloat16 or self.lm_rows.device.type != "cpu"):
            raise ValueError(f"quantize='int4' runs torch's int4 CPU kernel on bfloat16 activations; this head would "
                             f"compute in {str(dtype).removeprefix('torch.')} on {self.lm_rows.device}")
        wanted = "int4" if quantize == "int4" else "packed" if prepack_default(dtype, self.lm_rows.device) else "plain"
        if self.inference_weights != "plain":
            if self.inference_weights != wanted or self.lm_rows.dtype != dtype:
                raise ValueError(f"this head is already set for inference ({self.inference_weights}, "
                                 f"{str(self.lm_rows.dtype).removeprefix('torch.')}); load it again for another form")
            return self
        self.to(dtype)
        pack = prepack_default(dtype, self.lm_rows.device)
        if quantize == "int4":  # weights whose shape the 4-bit kernel does not take stay as they would be without
            def fits(w: torch.Tensor) -> bool:
                return check_int4_shape(*w.shape) is None

            pack_linears(self, lambda lin: Int4Linear(lin, dtype) if fits(lin.weight)
                         else PackedLinear(lin) if pack else lin)
            if fits(self.lm_rows):
                self._rows_int4 = quantize_int4(self.lm_rows, dtype)
        elif pack:
            pack_linears(self)
        if pack and self._rows_int4 is None:
            self._rows_packed = pack_weight(self.lm_rows)
        return self.eval()

    @property
    def inference_weights(self) -> str:
        """How the head's products run: ``"int4"``, ``"packed"`` (oneDNN bf16) or ``"plain"``."""
        if self._rows_int4 is not None or any(isinstance(m, Int4Linear) for m in self.modules()):
            return "int4"
        return "packed" if self._rows_packed is not None else "plain"

    # ------------------------------------------------------------------ drafting
    def as_runner(self):
        """The draft runner every tree builder drafts through."""
        raise NotImplementedError

    def depth_logits(self, target, ids: torch.Tensor, depths: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Target logits ``[L - 1, V]`` and the head's logits at tree depths ``1..depths`` along ``ids``
        ``[1, L]`` (calibration; row ``i`` predicts position ``i + 2``, undefined rows NaN)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ saving
    def save(self, path: str | Path, *, dtype: torch.dtype | None = None, extra: dict | None = None) -> None:
        """Atomically write the trained weights + subset + config to one ``.safetensors`` file."""
        write_weights(path, self.state_dict(), self.vocab_ids, fmt=self.FORMAT, version=self.FORMAT_VERSION,
                      config=self.cfg.record() if hasattr(self.cfg, "record") else asdict(self.cfg), extra=extra,
                      dtype=dtype)

    @classmethod
    def load(cls, path: str | Path, target=None, *, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> "SubsetHead":
        """A head from its file, attached to ``target`` when given; on ``device``, by default the target's
        (the CPU without one)."""
        if device is None:
            device = _target_device(target)
        config, state, vocab_ids, extra = read_weights(path, fmt=cls.FORMAT, what=cls.FILE_WHAT)
        head = build_checked(path, cls.FILE_WHAT, cls.CONFIG, config, state, lambda cfg: cls(cfg, vocab_ids))
        head.load_state_dict({k: v.to(dtype) for k, v in state.items()})
        head.extra = extra
        head = head.to(device=device, dtype=dtype).eval()
        if target is not None:
            head.attach(target)
        return head

    @property
    def num_trained_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _target_device(target) -> torch.device:
    """Where ``target`` (a causal LM, its runner, or None) computes; the CPU for None."""
    if target is None:
        return torch.device("cpu")
    model = getattr(target, "model", None) if not isinstance(target, torch.nn.Module) else target
    return next(model.parameters()).device if model is not None else torch.device("cpu")
