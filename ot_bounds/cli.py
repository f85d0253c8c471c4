"""Command line: ``python -m ot_bounds P Q [--n N] [--sampling S] [--verifier V] [--json]``.

``P`` and ``Q`` are ``.npy`` or ``.pt`` files holding a probability vector of
shape (V,) or a matrix of shape (positions, V) (one distribution per row).
For each row the optimal acceptance ``alpha*`` (and, with ``--verifier``, the
verifier's exact acceptance) is printed, as a table or as JSON.
Exit status 0 on success, 2 on bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
from numpy.typing import NDArray

from ._validation import TooManyTuples, check_distributions, check_n
from .draft_laws import TUPLE_LAWS
from .optimal import optimal_acceptance
from .verifiers import VERIFIER_LAW, VERIFIERS, verifier_acceptance


def load_array(path: str) -> NDArray[np.float64]:
    """Load a ``.npy`` or ``.pt`` file as a float64 array (1-D or 2-D)."""
    file = Path(path)
    if not file.exists():
        raise ValueError(f"file not found: {path}")
    suffix = file.suffix.lower()
    if suffix == ".npy":
        arr = np.load(file, allow_pickle=False)
    elif suffix in (".pt", ".pth"):
        import torch

        obj = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(obj, torch.Tensor):
            raise ValueError(f"{path} must contain a single tensor, got {type(obj).__name__}")
        arr = obj.detach().to(torch.float64).numpy()
    else:
        raise ValueError(f"unsupported file type {suffix!r} for {path}; use .npy or .pt")
    arr = np.asarray(arr, dtype=np.float64)
    if arr.ndim not in (1, 2):
        raise ValueError(f"{path} must be 1-D (V,) or 2-D (positions, V), got shape {arr.shape}")
    return arr


def _verifier_acceptance(p: NDArray[np.float64], q: NDArray[np.float64], n: int, verifier: str) -> float:
    """``verifier_acceptance``, its refusal of a too large enumeration told in the CLI's options."""
    try:
        return verifier_acceptance(p, q, n, verifier)
    except TooManyTuples as exc:
        raise ValueError(f"--verifier {verifier} enumerates about V**n = {exc.size:.3g} draft tuples "
                         f"(V={exc.v}, --n {exc.n}); the limit is {exc.limit}: use a smaller --n, or leave out "
                         f"--verifier for the optimal acceptance alone") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ot_bounds", description="Optimal multi-draft acceptance bounds.")
    ap.add_argument("p", help="target distribution(s), .npy or .pt, shape (V,) or (positions, V)")
    ap.add_argument("q", help="draft distribution(s), same shape as p")
    ap.add_argument("--n", type=int, default=1, help="number of drafted children (default 1)")
    ap.add_argument("--sampling", default="iid", help=f"draft law, one of {list(TUPLE_LAWS)} (default iid)")
    ap.add_argument("--verifier", default=None, help=f"also report a verifier, one of {list(VERIFIERS)}")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status.

    Examples
    --------
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); np.save(os.path.join(d, "p.npy"), [0.5, 0.5])
    >>> np.save(os.path.join(d, "q.npy"), [0.9, 0.1])
    >>> main([os.path.join(d, "p.npy"), os.path.join(d, "q.npy"), "--json"])
    {"n": 1, "sampling": "iid", "verifier": null, "rows": [{"position": 0, "optimal": 0.6}]}
    0
    """
    args = _parser().parse_args(argv)
    try:
        n = check_n(args.n)
        if args.sampling not in TUPLE_LAWS:
            hint = " (greedy drafting is --sampling greedy_draft)" if args.sampling == "greedy" else ""
            raise ValueError(f"unknown sampling {args.sampling!r}; expected one of {list(TUPLE_LAWS)}{hint}")
        if args.verifier is not None and args.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {args.verifier!r}; expected one of {list(VERIFIERS)}")
        p_all, q_all = load_array(args.p), load_array(args.q)
        if p_all.shape != q_all.shape:
            raise ValueError(f"p and q shapes differ: {p_all.shape} vs {q_all.shape}")
        p_rows, q_rows = np.atleast_2d(p_all), np.atleast_2d(q_all)  # shape (positions, V)
        rows = []
        for i, (p_row, q_row) in enumerate(zip(p_rows, q_rows)):
            try:
                p_i, q_i = check_distributions(p_row, q_row)
                row: dict[str, object] = {"position": i, "optimal": optimal_acceptance(p_i, q_i, n, args.sampling)}
                if args.verifier is not None:
                    row["verifier"] = _verifier_acceptance(p_i, q_i, n, args.verifier)
                    row["verifier_law_optimal"] = optimal_acceptance(p_i, q_i, n, VERIFIER_LAW[args.verifier])
            except ValueError as exc:
                raise ValueError(f"row {i}: {exc}") from exc
            rows.append(row)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"n": n, "sampling": args.sampling, "verifier": args.verifier, "rows": rows}))
    else:
        header = f"{'position':>8}  {'optimal':>10}"
        if args.verifier:
            header += f"  {args.verifier:>24}  {'its law optimal':>16}"
        print(f"# n={n} sampling={args.sampling}")
        print(header)
        for row in rows:
            line = f"{row['position']:>8}  {row['optimal']:>10.6f}"
            if args.verifier:
                line += f"  {row['verifier']:>24.6f}  {row['verifier_law_optimal']:>16.6f}"
            print(line)
    return 0
