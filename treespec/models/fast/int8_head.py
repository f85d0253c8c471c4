"""An 8-bit LM head (CPU): the target of ``--quantize int8-head``.

Gemma-3-270M's LM head reads a ``[262144, 640]`` table on every step: 335 MB in bf16, about two thirds of what a
one-token step of the bf16 target reads. Here the head's product runs on 8-bit integers in oneDNN's int8 matrix
product (VNNI on x86), which reads a quarter of the float32 bytes and whose cost grows slowly with the rows of a
tree pass. The rest of the model is unchanged. The head stands for

    logits[r, v] = s[r] * c[v] * sum_{j in K} round(x[r, j] / s[r]) * code[v, j]  +  sum_{j in O} h[r, j] W[v, j]

with

* ``O``: the ``outliers`` hidden dimensions with the largest activations (a few dimensions of the final hidden
  state carry values 10-20 times the median: quantising them with the rest would spend the 8 bits on them);
  their columns stay in float32;
* ``K``: the other dimensions, smoothed (``x = h[:, K] / m``, ``W[:, K] * m`` with
  ``m_j = (a_j / w_j) ** alpha`` for activation range ``a_j`` and weight range ``w_j``, SmoothQuant, arXiv
  2211.10438) and quantised symmetrically: activations per row (``s[r] = max_j |x[r, j]| / L``, codes in -L..L,
  so a row's logits do not depend on the other rows of its pass), weights per vocabulary row (``c[v] = max_j
  |W'[v, j]| / 127``, ``code`` in -127..127).

``L`` (the plan's ``act_levels``) is 127 where oneDNN's kernel sums each product in 32 bits (VNNI's and AMX's
dot products), and 63 where it does not: AVX2's ``u8 x s8`` instruction adds two products into a saturating
16-bit lane, and with activations stored as ``code + L + 1`` in 0..255 two products of 255 x 127 exceed 32767.
With ``L = 63`` every pair stays within 2 x 127 x 127 = 32258 and the sums are exact again (7-bit activations:
docs/results.md has what they cost on Gemma-3-270M). :func:`int8_pairs_saturate` asks the kernel
itself, once, so that a CPU flag or ``ONEDNN_MAX_CPU_ISA`` cannot mislead it; the head is thus another model on
such CPUs, and speculative decoding is lossless with respect to the one it runs.

The activation ranges come from the model itself, without data: the final hidden states of
``CALIBRATION_TOKENS`` seeded random token ids. A quantised head makes another model; speculative decoding is
lossless with respect to it, and its own plain decoding is the baseline. How far it is from the float32 model,
beside the whole GGUF model in llama.cpp (8-bit activations in every product), is measured by
``benchmarks/profile_int8_head.py``.
:func:`int8_head_reference` is the slow, obvious float64 formula the fast product is tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .packed import pad_rows

#: hidden dimensions whose columns stay in float32 (the largest activation ranges)
OUTLIERS = 16
#: SmoothQuant's migration strength: 0 leaves activations as they are, 1 moves their whole range onto the weights
ALPHA = 0.3
#: random token ids whose final hidden states give the activation ranges (seeded: the same head every time)
CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0
#: the oneDNN ops the head calls
INT8_OPS = ("qlinear_prepack", "qlinear_pointwise")
#: rows per float32 product of the outlier columns: every product has this shape (zero rows padded), so a row's
#: value does not depend on how many rows its pass has (a product of another shape may sum in another order)
OUTLIER_BLOCK = 8
#: the largest activation code: where the kernel sums in 32 bits, and where its pair sums saturate 16 bits
FULL_LEVELS, SATURATING_LEVELS = 127, 63
_TINY = 1e-30  # the least range a row is divided by (an all-zero row gives zero codes, not NaN)


def int8_kernel_missing() -> str | None:
    """None where this torch has oneDNN's int8 matrix product (:data:`INT8_OPS`), else why not, in words."""
    if not torch.backends.mkldnn.is_available():
        return f"torch {torch.__version__} is built without oneDNN"
    onednn = getattr(torch.ops, "onednn", None)
    missing = [op for op in INT8_OPS if onednn is None or not hasattr(onednn, op)]
    if missing:
        return f"torch {torch.__version__} has no onednn.{', onednn.'.join(missing)} (oneDNN's int8 product)"
    return None


@functools.cache
def int8_pairs_saturate() -> bool:
    """Whether oneDNN's int8 product on this machine loses a product of full-range activation codes, found by
    one worst case (every activation code 127, so stored as 255, against weight codes of 127 and of -127): True
    on AVX2's 16-bit pair sums, False where products are summed in 32 bits. Raises ValueError without the
    kernel."""
    missing = int8_kernel_missing()
    if missing:
        raise ValueError(f"cannot probe the int8 product: {missing}")
    hidden, vocab = 64, 16
    codes = torch.full((vocab, hidden), 127, dtype=torch.int8)
    codes[vocab // 2:] = -127
    packed = torch.ops.onednn.qlinear_prepack(codes, [1, hidden])
    x = torch.full((8, hidden), 2 * FULL_LEVELS + 1, dtype=torch.uint8)  # [8, H]: code 127 + zero point 128
    out = _qlinear(x, FULL_LEVELS, packed, torch.ones(vocab), torch.zeros(vocab, dtype=torch.long))  # [8, V]
    exact = codes.double().sum(1)  # [V]: (127 x 127 or -127) x H / 127, i.e. +-127 H
    # a saturated sum is off by about half; float32 rounding of the scales by a few parts in 1e7
    return not torch.allclose(out.double(), exact.expand(8, vocab), rtol=1e-3, atol=0)


def activation_levels() -> int:
    """The largest activation code whose products this machine's int8 kernel sums exactly (module docs)."""
    return SATURATING_LEVELS if int8_pairs_saturate() else FULL_LEVELS


@dataclass(frozen=True)
class Int8HeadPlan:
    """Which columns stay in float32 and how the others are smoothed: ``outliers`` ``[k]`` and ``kept``
    ``[H - k]`` column indices (ascending), ``smooth`` ``[H - k]`` float32 (``m`` in the module docs), and
    ``act_levels``, the largest activation code (``L``)."""

    outliers: torch.Tensor
    kept: torch.Tensor
    smooth: torch.Tensor
    act_levels: int = FULL_LEVELS


def plan_int8_head(weight: torch.Tensor, act_range: torch.Tensor, outliers: int = OUTLIERS,
                   alpha: float = ALPHA, act_levels: int | None = None) -> Int8HeadPlan:
    """The plan for a ``[V, H]`` head ``weight`` from ``act_range`` ``[H]`` (max |activation| per dimension);
    ``act_levels`` None takes :func:`activation_levels` (the kernel is probed), else 1..127."""
    hidden = weight.shape[1]
    if act_levels is None:
        act_levels = activation_levels()
    if not 1 <= act_levels <= FULL_LEVELS:
        raise ValueError(f"act_levels must be in 1..{FULL_LEVELS}, got {act_levels}")
    if act_range.shape != (hidden,):
        raise ValueError(f"act_range has shape {tuple(act_range.shape)}; expected ({hidden},)")
    if not 0 <= outliers < hidden:
        raise ValueError(f"outliers must be in 0..{hidden - 1}, got {outliers}")
    act = act_range.detach().float().cpu()
    out_idx = act.topk(outliers).indices.sort().values if outliers else torch.zeros(0, dtype=torch.long)
    keep = torch.ones(hidden, dtype=torch.bool)
    keep[out_idx] = False
    kept = keep.nonzero().squeeze(1)
    w_range = weight.detach().abs().amax(0).float().cpu()[kept]
    smooth = (act[kept].clamp_min(1e-6) / w_range.clamp_min(1e-6)) ** alpha  # [H - k]
    return Int8HeadPlan(out_idx, kept, smooth, int(act_levels))


@dataclass(frozen=True)
class Int8Head:
    """A ``[V, H]`` LM head in the form of :func:`int8_head_logits` (build it with :func:`quantize_int8_head`)."""

    packed: torch.Tensor  # oneDNN-packed int8 codes of the smoothed kept columns (opaque to torch)
    scales: torch.Tensor  # [V] float32: c
    zero_points: torch.Tensor  # [V] int64 zeros (symmetric weights)
    outlier_weight: torch.Tensor  # [k, V] float32: W[:, O].T
    plan: Int8HeadPlan
    vocab: int


def weight_codes(weight: torch.Tensor, plan: Int8HeadPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``[V, H]`` weight -> (codes ``[V, H - k]`` int8 of the smoothed kept columns, scales ``[V]`` float32)."""
    smoothed = weight.detach().float()[:, plan.kept] * plan.smooth  # [V, H - k]
    scales = (smoothed.abs().amax(1) / 127).clamp_min(_TINY)  # [V]
    codes = torch.round(smoothed / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales


def quantize_int8_head(weight: torch.Tensor, plan: Int8HeadPlan) -> Int8Head:
    """``weight`` ``[V, H]`` (CPU) on 8-bit codes per :func:`plan_int8_head`'s plan. Raises ValueError where this
    torch lacks the kernel, the weight is not on the CPU, or the plan's activation codes exceed what this
    machine's kernel sums exactly."""
    missing = int8_kernel_missing()
    if missing:
        raise ValueError(f"cannot build an int8 LM head: {missing}")
    if weight.device.type != "cpu":
        raise ValueError(f"the int8 LM head runs on oneDNN's CPU kernel; the weight is on {weight.device}")
    if plan.act_levels > activation_levels():
        raise ValueError(f"the plan's activation codes reach {plan.act_levels}, but this CPU's int8 kernel sums "
                         f"pairs of products in 16 bits (no VNNI), exact only up to {SATURATING_LEVELS}")
    codes, scales = weight_codes(weight, plan)
    packed = torch.ops.onednn.qlinear_prepack(codes, [1, codes.shape[1]])
    outlier_weight = weight.detach().float()[:, plan.outliers].t().contiguous()  # [k, V]
    return Int8Head(packed, scales, torch.zeros_like(scales, dtype=torch.long), outlier_weight, plan,
                    weight.shape[0])


def activation_codes(hidden: torch.Tensor, plan: Int8HeadPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` ``[R, H]`` -> (codes ``[R, H - k]`` float32 in -L..L, row ranges ``[R, 1]`` = L s), ``L`` the
    plan's ``act_levels``."""
    x = hidden.float()[:, plan.kept] / plan.smooth  # [R, H - k]
    rng = x.abs().amax(1, keepdim=True).clamp_min(_TINY)  # [R, 1]
    return torch.round(x * (plan.act_levels / rng)), rng


def int8_head_logits(hidden: torch.Tensor, head: Int8Head) -> torch.Tensor:
    """float32 logits ``[R, V]`` of ``hidden`` ``[R, H]`` through ``head`` (formula in the module docs)."""
    levels = head.plan.act_levels
    codes, rng = activation_codes(hidden, head.plan)
    x_u8 = (codes + (levels + 1)).to(torch.uint8)  # [R, H - k]: 1..2 L + 1
    # padded to MIN_ROWS: oneDNN's 1- and 2-row int8 products round otherwise on an AMX Xeon
    out = _qlinear(pad_rows(x_u8, levels + 1), levels, head.packed, head.scales, head.zero_points)
    out = out[:x_u8.shape[0]].mul_(rng)  # [R, V]
    if head.outlier_weight.shape[0]:
        out += _outlier_term(hidden.float()[:, head.plan.outliers], head.outlier_weight)
    return out


def _qlinear(x_u8: torch.Tensor, levels: int, packed: torch.Tensor, scales: torch.Tensor,
             zero_points: torch.Tensor) -> torch.Tensor:
    """oneDNN's product of activations stored as ``code + levels + 1`` (``[R, in]`` uint8, dequantised as
    ``code / levels``) with packed int8 weights of per-row ``scales``: float32 ``[R, V]``."""
    return torch.ops.onednn.qlinear_pointwise(x_u8, 1.0 / levels, levels + 1, packed, scales, zero_points, None,
                                              1.0, 0, torch.float32, "none", [], "")


def _outlier_term(h_out: torch.Tensor, outlier_weight: torch.Tensor) -> torch.Tensor:
    """``h_out`` ``[R, k]`` @ ``outlier_weight`` ``[k, V]`` in products of :data:`OUTLIER_BLOCK` rows each."""
    rows = h_out.shape[0]
    padded = h_out.new_zeros(-(-rows // OUTLIER_BLOCK) * OUTLIER_BLOCK, h_out.shape[1])
    padded[:rows] = h_out
    blocks = [block @ outlier_weight for block in padded.split(OUTLIER_BLOCK)]  # each [OUTLIER_BLOCK, V]
    return torch.cat(blocks)[:rows] if len(blocks) > 1 else blocks[0][:rows]


def int8_head_reference(hidden: torch.Tensor, weight: torch.Tensor, plan: Int8HeadPlan) -> torch.Tensor:
    """The same logits as :func:`int8_head_logits` from the module's formula, written out on its own (codes in
    float32 as the fast path makes them, products in float64; slow, for tests)."""
    k, m = plan.kept, plan.smooth
    w = weight.detach().float()
    w_kept = w[:, k] * m  # [V, H - k]: W[:, K] * m
    c = torch.clamp(w_kept.abs().amax(1) / 127, min=_TINY)  # [V]
    code_w = torch.clamp(torch.round(w_kept / c[:, None]), -127, 127)
    levels = plan.act_levels
    x = hidden.float()[:, k] / m  # [R, H - k]
    row_range = torch.clamp(x.abs().amax(1), min=_TINY)  # [R]: L s
    code_x = torch.round(x * (levels / row_range[:, None]))
    main = (code_x.double() @ code_w.double().t()) * (row_range.double()[:, None] / levels) * c.double()[None, :]
    o = plan.outliers
    return main + hidden.double()[:, o] @ weight.detach().double()[:, o].t()


def calibration_ids(vocab: int, n: int = CALIBRATION_TOKENS, seed: int = CALIBRATION_SEED) -> torch.Tensor:
    """``[n]`` seeded random token ids below ``vocab``: the input whose final hidden states set the ranges."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
