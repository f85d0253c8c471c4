#!/usr/bin/env bash
# Recipe: judge decoding's judge for the embedded Gemma-3-270M (treespec/assets/gemma3-270m-judge.safetensors;
# issue 47). LOSSY decoding, opt-in only (`treespec generate --judge shipped`). Labels come from the target's own
# greedy continuations of train prompts rows 0:6000 (corpora/head-v2/continuations/v2-greedy), chunks 40 to 43
# (512 sequences): at 16 positions of each sequence's first 96 generated tokens, the target's ranks 2-4 and two
# tokens far down its ranking (one of ranks 5-101, one from the whole vocabulary) are put in the text's place, and
# a substitution is labelled acceptable when the target's greedy choice after it is the text again for the next 4
# tokens (treespec/distill/judge.py says what that label can and cannot tell). 10% of the sequences are held out
# and scored; 20% of the rest choose the epoch and the threshold, the lowest whose precision on them reaches
# PRECISION (default 0.7; a first run without the far tokens reached 0.8 with no threshold,
# benchmarks/results/draft/2026-11-29-a9c7754-judge-head/first-run-precision-0.8.json). About 10 minutes on two
# threads of an AMD EPYC in bf16 to collect the rows, seconds to train; with ROWS_CACHE the rows are kept and a
# rerun only trains.
# OUT (default treespec/assets/gemma3-270m-judge.safetensors), JSON (the record, default next to OUT), THREADS (2),
# ROWS_CACHE (a file for the rows, e.g. .cache/judge-rows.pt), PRECISION (0.7).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-treespec/assets/gemma3-270m-judge.safetensors}
JSON=${JSON:-${OUT%.safetensors}.json}
PY=${PY:-.venv/bin/python}
"$PY" -m treespec.distill judge --continuations corpora/head-v2/continuations/v2-greedy --chunks 40:44 \
    --positions 16 --alternatives 3 --far 2 --resync 4 --max-tokens 96 --seed 0 --held-out 0.1 \
    --precision "${PRECISION:-0.7}" --threads "${THREADS:-2}" --out "$OUT" --json "$JSON" \
    ${ROWS_CACHE:+--rows-cache "$ROWS_CACHE"}
