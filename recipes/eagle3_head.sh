#!/usr/bin/env bash
# Recipe: a draft head in EAGLE-3's layout for the embedded Gemma-3-270M (issue 45), the layout vLLM, SGLang and
# vllm-project's speculators load. Resumable: run it again (in as many sessions as it takes) and each stage goes on
# where it stopped; each stops cleanly when its time budget is spent.
#
# Stage corpus: the target's teacher-forced pass over the committed continuations of train prompts
#   (corpora/head-v2/continuations, recipes/head_v2_continuations.sh), storing the residual stream after decoder
#   layers 1, 8 and 14 (the inputs of layers 2, 9 and 15: the engines' default EAGLE-3 layers on 18 layers) beside
#   the last hidden state. Two corpora built side by side, one core each: v2-greedy (rows 0:6000, greedy) and
#   v4-sample (rows 6000:11000, T=1). ~5 KB a position in the cache.
# Stage train: a new EAGLE-3 head (one Llama-style layer, 8 heads of 80, SwiGLU 2048, vocabulary subset 16,384)
#   trained with the training-time test (depths 1-3) on the first PIN shards of each corpus; checkpoints in the cache.
# Stage export: the head as a treespec file (OUT) and as a speculators checkpoint folder (SPEC_OUT, with
#   VERIFIER written as the model the engine verifies with).
#
# Only ../shared/data/train prompts are used (rows 11000: of the seeded order stay held out).
# STAGE=corpus|train|export|all (default all), MINUTES per stage (default 30), THREADS for training (default 2),
# PIN (shards per corpus, default 8,8), STEPS (default 1500), RUN (default eagle3-head), LR (default 0.001),
# WARMUP (default 100), OUT (default .cache/eagle3-head.safetensors), SPEC_OUT (default .cache/eagle3-speculators),
# VERIFIER (default google/gemma-3-270m), INIT (a head file a NEW run starts from: a continuation in a later session,
# whose cache may be gone), SEED (default 0; give a continued run another, so that it reads the data in another order).
# Second segment (session of 2026-11-29, an AMD EPYC with avx512_bf16; the cache was gone): both corpora rebuilt for
# 35 minutes (29 + 28 shards, 2.27M positions), then a new run of 2,000 steps (~2.4 s a step, bf16 autocast):
#   TREESPEC_CACHE=$PWD/.cache/treespec STAGE=corpus MINUTES=35 recipes/eagle3_head.sh
#   TREESPEC_CACHE=$PWD/.cache/treespec STAGE=train PIN=29,28 STEPS=2000 LR=0.001 WARMUP=100 THREADS=2 MINUTES=88 \
#     RUN=eagle3-head-s31 recipes/eagle3_head.sh
# Its head file is kept in git history, out of the tree (the checkout must stay under 64 MiB):
#   git show fdb0840:benchmarks/results/draft/2026-11-29-ee798ae-eagle3-head-2000/head.safetensors > .cache/e3-2000.safetensors
# Third segment (session of 2026-11-29, third; the corpora of the second were still in the cache), continuing it:
#   TREESPEC_CACHE=$PWD/.cache/treespec INIT=.cache/e3-2000.safetensors SEED=1 LR=0.0005 WARMUP=50 STAGE=train \
#     PIN=29,28 STEPS=1500 THREADS=2 MINUTES=63 RUN=eagle3-head-s32 recipes/eagle3_head.sh
# It stopped at step 1463 (its time limit); its head (3,463 steps in all), to continue from with INIT and SEED=2:
#   git show 8f940ab:benchmarks/results/draft/2026-11-29-5aa5f0b-eagle3-head-3463/head.safetensors \
#     > .cache/e3-3463.safetensors
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${MINUTES:-30}"
THREADS="${THREADS:-2}"
STAGE="${STAGE:-all}"
PY="${PY:-.venv/bin/python}"
CONT="${CONT:-corpora/head-v2/continuations}"
CACHE="${TREESPEC_CACHE:-$HOME/.cache/treespec}/distill"
LAYERS=1,8,14
PIN="${PIN:-8,8}"
STEPS="${STEPS:-1500}"
RUN="${RUN:-eagle3-head}"
LR="${LR:-0.001}"
WARMUP="${WARMUP:-100}"
OUT="${OUT:-.cache/eagle3-head.safetensors}"
SPEC_OUT="${SPEC_OUT:-.cache/eagle3-speculators}"
VERIFIER="${VERIFIER:-google/gemma-3-270m}"
INIT="${INIT:-}"
SEED="${SEED:-0}"
corpora=()
pids=()
for spec in v2-greedy:0:6000 v4-sample:6000:11000; do
    name="${spec%%:*}"; rows="${spec#*:}"
    corpora+=("$CACHE/corpus/e3-$name-f${LAYERS//,/-}")
    if [ "$STAGE" = corpus ] || [ "$STAGE" = all ]; then
        "$PY" -m treespec.distill build-corpus --continuations "$CONT/$name" --rows "$rows" \
            --out "$CACHE/corpus/e3-$name-f${LAYERS//,/-}" --feature-layers "$LAYERS" --topk 0 --batch-size 8 \
            --dtype auto --threads 1 --time-limit "$MINUTES" --no-progress &
        pids+=($!)
    fi
done
for pid in "${pids[@]}"; do wait "$pid"; done
if [ "$STAGE" = train ] || [ "$STAGE" = all ]; then
    IFS=,; corpus_list="${corpora[*]}"; unset IFS
    "$PY" -m treespec.distill train --corpus "$corpus_list" --run "$RUN" --layout eagle3 \
        --feature-layers "$LAYERS" --depths 3 --steps "$STEPS" --lr "$LR" --warmup "$WARMUP" --w-feat 0 \
        --max-shards "$PIN" --threads "$THREADS" --time-limit "$MINUTES" --seed "$SEED" ${INIT:+--init-head "$INIT"} \
        --no-progress
fi
if [ "$STAGE" = export ] || [ "$STAGE" = all ]; then
    "$PY" -m treespec.distill export --run "$RUN" --out "$OUT" --dtype float16
    "$PY" -m treespec.distill export --run "$RUN" --out "$SPEC_OUT" --format speculators --verifier "$VERIFIER"
fi
