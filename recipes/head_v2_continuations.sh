#!/usr/bin/env bash
# Recipe, stage 1 of the head-v2 distillation corpus (issue 15): Gemma-3-270M's own continuations of
# ../shared/data/train prompts (never the eval set). Seeded and resumable: run it again (in as many
# sessions as it takes) and it continues after the last finished chunk of 128 prompts. Chunks hold token
# ids only (gzip JSON, chunk-NNNNN.json.gz, ~45 KB each) and are written into the repo
# (corpora/head-v2/continuations/NAME/),
# so that finished chunks are committed and survive a lost cache; deleting the folder and running the
# recipe rebuilds it from scratch. Rows 11000: of the seeded prompt order stay held out (calibration /
# held-out agreement). One core, bf16 where the CPU computes it natively.
# Measured rates (manifest.json records tokens and seconds per run): ~95-150 generated tokens/s at batch 32
# on one core of an AMD EPYC with avx512_bf16, depending on what shares the machine.
# v3-sample (added in session 23, once all 11,000 rows had one continuation each): a second, sampled (T=1,
# another seed) continuation of rows 0:6000, whose v2 continuation is greedy: new text of the target on
# prompts the head has seen (complete since session 24; recipes/head_v2_train.sh lists it, PIN's third value).
# v4-sample (added in session 26): a second sampled continuation (T=1, seed 3) of rows 6000:11000, whose v2
# continuation is sampled with seed 1: more of the target's T=1 text, the distribution the T=1 goal is measured on.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${MINUTES:-120}"
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-corpora/head-v2/continuations}"
"$PY" -m treespec.distill.continuations --name v2-greedy --mode greedy --rows 0:6000 --out "$OUT" \
    --new-tokens 256 --batch-size 32 --chunk-size 128 --dtype auto --threads 1 --time-limit "$MINUTES"
"$PY" -m treespec.distill.continuations --name v2-sample --mode sample --temperature 1.0 --rows 6000:11000 \
    --out "$OUT" --new-tokens 256 --batch-size 32 --chunk-size 128 --seed 1 --dtype auto --threads 1 \
    --time-limit "$MINUTES"
"$PY" -m treespec.distill.continuations --name v3-sample --mode sample --temperature 1.0 --rows 0:6000 \
    --out "$OUT" --new-tokens 256 --batch-size 32 --chunk-size 128 --seed 2 --dtype auto --threads 1 \
    --time-limit "$MINUTES"
"$PY" -m treespec.distill.continuations --name v4-sample --mode sample --temperature 1.0 --rows 6000:11000 \
    --out "$OUT" --new-tokens 256 --batch-size 32 --chunk-size 128 --seed 3 --dtype auto --threads 1 \
    --time-limit "$MINUTES"
