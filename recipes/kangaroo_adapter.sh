#!/usr/bin/env bash
# Recipe: Kangaroo's adapter for the embedded Gemma-3-270M (issue 47): one attention block and two norms over the
# residual stream after the target's first EXIT layers, scoring with the target's LM-head rows on the shipped
# head's vocabulary subset (16,384 tokens). Resumable: run it again and each stage goes on where it stopped; each
# stops cleanly when its time budget is spent.
#
# Stage corpus: the corpora of recipes/eagle3_head.sh (the target's teacher-forced pass over the committed
#   continuations of train prompts, storing the residual stream after decoder layers 1, 8 and 14): the adapter
#   after EXIT=2 layers reads layer 1. Built by that recipe's corpus stage, shared with it.
# Stage train: python -m treespec.distill kangaroo on every finished shard of both corpora; checkpoints in the cache.
# Stage export: the run's newest checkpoint as a treespec file (OUT, fp16), training nothing (a run stopped by its
#   time limit is exported as it stands; its summary says steps < of): treespec generate --draft OUT.
#
# Only ../shared/data/train prompts are used (rows 11000: of the seeded order stay held out).
# STAGE=corpus|train|export|all (default all), MINUTES per stage (default 30), THREADS (default 2), EXIT (default 2),
# STEPS (default 900), LR (default 0.001), WARMUP (default 50), PIN (shards per corpus, default 5,5: the
# corpora the first run read), RUN (default kangaroo-adapter),
# OUT (default .cache/kangaroo-adapter.safetensors).
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${MINUTES:-30}"
THREADS="${THREADS:-2}"
STAGE="${STAGE:-all}"
PY="${PY:-.venv/bin/python}"
CACHE="${TREESPEC_CACHE:-$HOME/.cache/treespec}/distill"
EXIT="${EXIT:-2}"
STEPS="${STEPS:-900}"
LR="${LR:-0.001}"
WARMUP="${WARMUP:-50}"
PIN="${PIN:-5,5}"
RUN="${RUN:-kangaroo-adapter}"
OUT="${OUT:-.cache/kangaroo-adapter.safetensors}"
if [ "$STAGE" = corpus ] || [ "$STAGE" = all ]; then
    STAGE=corpus MINUTES="$MINUTES" PY="$PY" recipes/eagle3_head.sh
fi
corpora="$CACHE/corpus/e3-v2-greedy-f1-8-14,$CACHE/corpus/e3-v4-sample-f1-8-14"
if [ "$STAGE" = train ] || [ "$STAGE" = all ]; then
    "$PY" -m treespec.distill kangaroo --corpus "$corpora" --run "$RUN" --exit-layers "$EXIT" --steps "$STEPS" \
        --lr "$LR" --warmup "$WARMUP" --max-shards "$PIN" --threads "$THREADS" --time-limit "$MINUTES" --no-progress
fi
if [ "$STAGE" = export ] || [ "$STAGE" = all ]; then
    "$PY" -m treespec.distill kangaroo --corpus "$corpora" --run "$RUN" --exit-layers "$EXIT" --steps "$STEPS" \
        --lr "$LR" --warmup "$WARMUP" --max-shards "$PIN" --threads "$THREADS" --no-train --export "$OUT" \
        --no-progress
fi
