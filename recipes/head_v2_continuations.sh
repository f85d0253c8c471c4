#!/usr/bin/env bash
# Recipe, stage 1 of the head-v2 distillation corpus (issue 15): Gemma-3-270M's own continuations of
# ../shared/data/train prompts (never the eval set). Seeded and resumable: run it again (in as many
# sessions as it takes) and it continues after the last finished chunk of 128 prompts; a lost cache
# is rebuilt by running it from scratch. Output: <cache>/distill/continuations/{v2-greedy,v2-sample}/.
# Rows 11000: of the seeded prompt order stay held out (calibration / held-out agreement).
# One core, bf16 where the CPU computes it natively (measured ~150 generated tokens/s at batch 32).
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${MINUTES:-120}"
PY="${PY:-.venv/bin/python}"
"$PY" -m treespec.distill.continuations --name v2-greedy --mode greedy --rows 0:6000 \
    --new-tokens 256 --batch-size 32 --chunk-size 128 --dtype auto --threads 1 --time-limit "$MINUTES"
"$PY" -m treespec.distill.continuations --name v2-sample --mode sample --temperature 1.0 --rows 6000:11000 \
    --new-tokens 256 --batch-size 32 --chunk-size 128 --seed 1 --dtype auto --threads 1 --time-limit "$MINUTES"
