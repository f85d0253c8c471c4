#!/usr/bin/env bash
# Recipe: SpecDec++'s acceptance head for the shipped draft head (treespec/assets/gemma3-270m-stop.safetensors;
# issue 47). Reads the target's own sampled continuations of train prompts rows 6000:11000
# (corpora/head-v2/continuations/v4-sample), chunks 24 to 27 only: the shipped head was trained on that folder's
# first 11 chunks, so these sequences are text it never read. Every sequence gives 24 generated positions at
# draft depths 1-6; the greedy rows label the head's top token by the target's, the sampled rows draw 2 tokens from
# q at T=1 and label each with min(1, p/q). 10% of the sequences are held out and scored (cross-entropy and Brier
# score against the draft's confidence q(x) taken as the prediction); 10% of the training sequences choose the
# epoch (early stopping; a first run on chunks 20-27 without it and with weight decay 1e-4 fitted its training
# sequences and lost to the confidence on held-out ones: benchmarks/results/draft/2026-11-28-a5d0993-acceptance-head-
# first-run; the shipped run's best epoch was the first in both regimes). About 15 minutes on two threads of an AMD
# EPYC in float32 to collect the rows, then a minute to train; with ROWS_CACHE the rows are kept and a rerun only
# trains.
# OUT (default treespec/assets/gemma3-270m-stop.safetensors), JSON (the record, default next to OUT), THREADS (2),
# ROWS_CACHE (a file for the rows, e.g. .cache/acceptance-rows.pt).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-treespec/assets/gemma3-270m-stop.safetensors}
JSON=${JSON:-${OUT%.safetensors}.json}
PY=${PY:-.venv/bin/python}
"$PY" -m treespec.distill acceptance --continuations corpora/head-v2/continuations/v4-sample --chunks 24:28 \
    --depths 6 --positions 24 --draws 2 --seed 0 --held-out 0.1 --threads "${THREADS:-2}" \
    --out "$OUT" --json "$JSON" ${ROWS_CACHE:+--rows-cache "$ROWS_CACHE"}
