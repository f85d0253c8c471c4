"""How much of the target's output a frequency-ranked draft vocabulary covers, by subset size.

A draft head scores only a vocabulary subset S (q = 0 elsewhere), so S caps what it can accept: at
T = 0 a greedy token outside S can never be drafted, and at T = 1 the single-draft acceptance
sum min(p, q) is at most p(S). Both caps are measured on the target's own continuations
(corpora/head-v2/continuations, stage 1 of the head-v2 recipe), held out by chunk:

* greedy folder: the fraction of held-out greedy tokens (the target's argmax) inside S;
* sampled folder (when built): the fraction of held-out sampled tokens inside S, an unbiased
  estimate of the mean target mass E[p(S)] at T = 1 (each token is a draw from p).

S is ranked (frequency-ranked subsets as in FR-Spec, Zhao et al., arXiv 2502.14856; own code) by
token counts of the chunks that are not held out, two ways: continuation tokens only, or prompt +
continuation tokens (every next token of a stage-2 corpus: what ``distill train`` ranks by). The
shipped head's subset is measured beside them. No model runs here: token ids only.

    python benchmarks/vocab_coverage.py [--held-out 3] [--sizes 4096,8192,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import add_output_args, finish, open_results, require_shared, write_json  # noqa: E402

FOLDERS = {"greedy": ("v2-greedy", "0:6000"), "sample": ("v2-sample", "6000:11000")}
SIZES = (2048, 4096, 8192, 16384, 24576, 32768, 49152, 65536)


def _prompt_ids(rows_arg: str) -> list[list[int]]:
    from treespec.distill.corpus import DEFAULT_TRAIN
    from treespec.distill.corpus import read_prompts
    from treespec.models.loading import load_tokenizer

    lo, _, hi = rows_arg.partition(":")
    rows = read_prompts(require_shared(REPO / DEFAULT_TRAIN), seed=0)[int(lo or 0): int(hi) if hi else None]
    tok = load_tokenizer("embedded")
    return [tok(r["prompt"])["input_ids"] for r in rows]


def main(argv: list[str] | None = None) -> int:
    from treespec.distill.continuations import continuation_sequences
    from treespec.drafting.shipped import DEFAULT_HEAD

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--continuations", type=Path, default=REPO / "corpora" / "head-v2" / "continuations")
    ap.add_argument("--held-out", type=int, default=3, help="last finished chunks of each folder held out")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    add_output_args(ap)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    started = time.time()
    vocab = 262144
    counts = {"continuations": torch.zeros(vocab, dtype=torch.float64),
              "prompts+continuations": torch.zeros(vocab, dtype=torch.float64)}
    held: dict[str, torch.Tensor] = {}
    sources = {}
    for kind, (name, rows) in FOLDERS.items():
        folder = args.continuations / name
        if not (folder / "manifest.json").is_file():
            continue
        stored = continuation_sequences(folder, _prompt_ids(rows))  # checks prompts against the fingerprint
        if len(stored.chunks) <= args.held_out:
            continue
        fit, test = stored.chunks[:-args.held_out], stored.chunks[-args.held_out:]
        for c in fit:
            seqs, gen_start = stored.chunk(c)
            for s, g in zip(seqs, gen_start):
                counts["continuations"].index_add_(0, torch.tensor(s[g:], dtype=torch.long),
                                                   torch.ones(len(s) - g, dtype=torch.float64))
                counts["prompts+continuations"].index_add_(0, torch.tensor(s[1:], dtype=torch.long),
                                                           torch.ones(len(s) - 1, dtype=torch.float64))
        toks = []
        for c in test:
            seqs, gen_start = stored.chunk(c)
            toks.extend(t for s, g in zip(seqs, gen_start) for t in s[g:])
        held[kind] = torch.tensor(toks, dtype=torch.long)
        sources[kind] = {"folder": str(folder.relative_to(REPO)), "fit_chunks": fit, "held_out_chunks": test,
                         "held_out_tokens": len(toks)}
    if not held:
        print("vocab_coverage: no continuation folder with more than --held-out finished chunks", file=sys.stderr)
        return 2
    out, _ = open_results("vocab", args.out, allow_dirty=args.allow_dirty)
    from safetensors import safe_open

    with safe_open(str(DEFAULT_HEAD), framework="pt") as fh:
        shipped = fh.get_tensor("vocab_ids").long()
    results = {"sources": sources, "sizes": sizes, "rankings": {}, "shipped_head": {}}
    for rank_name, c in counts.items():
        order = torch.argsort(c, descending=True, stable=True)
        table = {}
        for size in sizes:
            member = torch.zeros(vocab, dtype=torch.bool)
            member[order[:size]] = True
            table[str(size)] = {kind: float(member[t].float().mean()) for kind, t in held.items()}
        results["rankings"][rank_name] = table
    member = torch.zeros(vocab, dtype=torch.bool)
    member[shipped] = True
    results["shipped_head"] = {"size": int(shipped.numel()),
                               **{kind: float(member[t].float().mean()) for kind, t in held.items()}}
    lines = ["# Held-out coverage of frequency-ranked draft vocabularies", "",
             "Fraction of held-out tokens of the target's own continuations inside the subset "
             "(greedy: cap on T=0 top-1 agreement; sampled: estimate of E[p(S)], the cap on T=1 acceptance).", "",
             "| ranked by | size | " + " | ".join(held) + " |", "|---|---:|" + "---:|" * len(held)]
    for rank_name, table in results["rankings"].items():
        for size in sizes:
            lines.append(f"| {rank_name} | {size} | " + " | ".join(f"{table[str(size)][k]:.4f}" for k in held) + " |")
    sh = results["shipped_head"]
    lines.append(f"| shipped head v1 | {sh['size']} | " + " | ".join(f"{sh[k]:.4f}" for k in held) + " |")
    lines += ["", "Held-out: " + "; ".join(f"{k}: chunks {v['held_out_chunks']} of {v['folder']} "
                                           f"({v['held_out_tokens']} tokens), ranked on chunks "
                                           f"{v['fit_chunks'][0]}-{v['fit_chunks'][-1]}" for k, v in sources.items())]
    write_json(out / "coverage.json", results)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    finish(out, started)
    print("\n".join(lines))
    print(f"saved to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
