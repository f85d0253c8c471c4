#!/usr/bin/env bash
# Recipe, stages 2 and 3 of head v2 (issue 15). Resumable: run it again (in as many sessions as it takes)
# and every step continues where it stopped; each step stops cleanly when its time budget is spent.
#
# Stage 2: the target's teacher-forced pass over every finished chunk of the stage-1 continuations
#   (recipes/head_v2_continuations.sh, committed under corpora/head-v2/continuations/): sequences =
#   train prompt + the target's own continuation, one shard per chunk (last hidden states plus the
#   outputs of decoder layers 2 and 9 of 18, for heads with fused features; soft labels are recomputed
#   exactly on the head's vocabulary subset while training, so no top-k is stored).
#   Shards live in the cache (~3.9 KB a position); a lost cache is rebuilt from the committed chunks.
#   TREESPEC_CACHE=$PWD/.cache/treespec, run from the repository root (.cache/ is ignored by git), keeps shards and
#   checkpoints beside the repository, whose folder has outlived ~/.cache between sessions (copy
#   ~/.cache/treespec/gemma-3-270m-v1 there too to skip converting the target again, ~90 s).
# Stage 3: training the head from scratch on those shards with the training-time test (depths 1-3,
#   EAGLE-3 arXiv 2503.01840); checkpoints in the cache, resumed by running the recipe again. The run trains
#   on the first PIN shards of each corpus (v2-greedy, v2-sample, v3-sample, v4-sample), so that continuations added later
#   never change its data; a PIN of fewer values reads the first corpora only (PIN=47,40: the two v2 corpora, as
#   the runs before v3-sample did), unless CORPORA names them. Cost measured at commit c644d9f (bf16 autocast, subset logits in bf16, one thread of an AMD EPYC
#   with avx512_bf16): 4.8 s a step at --depths 3, 1.9 s at --depths 1; in float32 on a CPU without native
#   bf16 expect several times more.
#
# Only ../shared/data/train prompts are used (rows 0:11000 of the seeded order; rows 11000: stay held out).
# STAGE=corpus|train|all (default all), MINUTES per step (default 60), THREADS (default 1), PIN (shards per corpus),
# STEPS (training steps), RUN (run name, default head-v2), INIT (a head file a NEW run starts from, e.g. the
# shipped treespec/assets/gemma3-270m-head.safetensors: continued training), LR (default 0.001), WARMUP (default 200),
# SEED (default 0; it orders the batches: give a continued run another seed, so that it reads the data in another order),
# W_TV (default 0: weight of the total-variation loss), CORPORA (the corpora the training step reads, comma-separated
# names in order, e.g. v2-greedy,v3-sample,v4-sample; default: the first as many as PIN gives counts, one count: every
# corpus; with CORPORA set, PIN must be given too, and the corpus step builds only the corpora named).
#
# Only the repository survives between sessions: the cache (shards, checkpoints) can be gone at the next
# start, and a session lasts 3 hours. Session 16's 4,000-step run on PIN=47,21 (2.8M positions, ~2.5 h of two
# threads after ~1.7 h of corpus) was lost with its cache before export. The shipped head is the run that fits in
# one session: both corpora built side by side (one core each, `taskset`, THREADS=1) for ~50 minutes, then
# PIN=21,21 (the shards each had finished: 901,782 greedy + 775,062 sampled positions). Training started with
# STEPS=2400 on two threads; that session's CPU (an Intel Xeon with avx512_bf16 but no AMX) ran 5.1 s a step,
# against 2.2 s on the AMD EPYC, so it was resumed from step 200 (the end of warmup, before which the learning
# rate does not depend on STEPS) with STEPS=1000. The head file records its train_config; its card shows it.
# Shipped since 2026-11-26: that head continued for 1,000 steps on the same data (card: T=0 top-1 0.402 -> 0.461 on
# Spec-Bench), 24 minutes on two threads of an AMD EPYC with avx512_bf16, exported in float16:
#   STAGE=train RUN=head-v2-cont INIT=<the head above> SEED=1 LR=0.0005 WARMUP=50 STEPS=1000 PIN=21,21 THREADS=2 \
#     recipes/head_v2_train.sh
#   python -m treespec.distill export --run head-v2-cont --out treespec/assets/gemma3-270m-head.safetensors
# (the head above is the file committed before 0f2db97: git show 4dba31b:treespec/assets/gemma3-270m-head.safetensors).
# Shipped since 2026-11-26 (later): that head continued for 1,200 more steps on all 47 greedy shards (stage 2 of
# chunks 21-46 built first, ~45 s a shard on one core) and the 21 sampled ones, 2.78M positions (card: T=0 top-1
# 0.461 -> 0.531), 28 minutes on two threads of the same AMD EPYC:
#   STAGE=corpus recipes/head_v2_train.sh   (the greedy corpus only needs it: its chunks 21-46)
#   STAGE=train RUN=head-v2-cont2 INIT=<the continued head above> SEED=2 LR=0.0005 WARMUP=50 STEPS=1200 PIN=47,21 \
#     THREADS=2 recipes/head_v2_train.sh
#   python -m treespec.distill export --run head-v2-cont2 --out treespec/assets/gemma3-270m-head.safetensors
# (the continued head is the file committed before this one: git show 9877c69:treespec/assets/gemma3-270m-head.safetensors).
# Third continuation (session 22): sampled chunks 21-39 generated (stage 1, ~3 minutes a chunk of 128 prompts on one
# core; the sampled corpus is complete: 5,000 sequences, 1,435,405 positions), their stage 2 built, then 1,500 more
# steps from the head above on all 47 + 40 shards (3.44M positions), 36 minutes on two threads of an AMD EPYC:
#   MINUTES=55 recipes/head_v2_continuations.sh; STAGE=corpus recipes/head_v2_train.sh
#   STAGE=train RUN=head-v2-cont3 INIT=treespec/assets/gemma3-270m-head.safetensors SEED=3 LR=0.0005 WARMUP=50 \
#     STEPS=1500 PIN=47,40 THREADS=2 MINUTES=70 recipes/head_v2_train.sh
#   python -m treespec.distill export --run head-v2-cont3 --out treespec/assets/gemma3-270m-head.safetensors
# (the head it continued: git show 6bb6abc:treespec/assets/gemma3-270m-head.safetensors).
# Fourth continuation (session 23, an Intel Xeon with AMX): the cache was gone, so stage 2 was rebuilt first (all 87
# shards, ~30 s a shard on one core), then 1,300 steps from the head above on the same 47 + 40 shards, on ONE thread
# (2.5 s a step, 54 minutes) while stage 1 of v3-sample ran on the other core:
#   STAGE=corpus THREADS=1 recipes/head_v2_train.sh
#   STAGE=train RUN=head-v2-cont4 INIT=treespec/assets/gemma3-270m-head.safetensors SEED=4 LR=0.0005 WARMUP=50 \
#     STEPS=1300 PIN=47,40 THREADS=1 MINUTES=80 recipes/head_v2_train.sh
#   python -m treespec.distill export --run head-v2-cont4 --out treespec/assets/gemma3-270m-head.safetensors
# (the head it continued: git show 7a82a7c:treespec/assets/gemma3-270m-head.safetensors).
# Fifth continuation (session 24, the same kind of Xeon): stage 2 of the first 24 chunks of v3-sample (a second,
# sampled continuation of rows 0:6000; ~25 s a shard on one core), then 2,400 steps from the head above on
# 47 + 40 + 24 shards (4.33M positions): 2,000 steps on ONE thread (~2.5 s a step) while stage 1 of v3-sample
# finished on the other core, then the run was stopped after its step-2000 checkpoint and resumed on two threads
# (~1.4 s a step) for the last 400:
#   STAGE=corpus THREADS=1 MINUTES=40 recipes/head_v2_train.sh
#   STAGE=train RUN=head-v2-cont5 INIT=treespec/assets/gemma3-270m-head.safetensors SEED=5 LR=0.0005 WARMUP=50 \
#     STEPS=2400 PIN=47,40,24 THREADS=1 MINUTES=160 recipes/head_v2_train.sh   (then THREADS=2 MINUTES=60 to resume)
#   python -m treespec.distill export --run head-v2-cont5 --out treespec/assets/gemma3-270m-head.safetensors
# (the head it continued: git show 6c4a03d:treespec/assets/gemma3-270m-head.safetensors).
# Sixth continuation (session 25, the same kind of Xeon; the cache had survived, so no stage 2 was needed: v3-sample's
# 47 shards were all built in session 24): 2,400 steps from the head above on 47 + 40 + 47 shards (5.17M positions),
# on two threads (~1.7 s a step, 69 minutes):
#   STAGE=train RUN=head-v2-cont6 INIT=treespec/assets/gemma3-270m-head.safetensors SEED=6 LR=0.0005 WARMUP=50 \
#     STEPS=2400 PIN=47,40,47 THREADS=2 MINUTES=150 recipes/head_v2_train.sh
#   python -m treespec.distill export --run head-v2-cont6 --out treespec/assets/gemma3-270m-head.safetensors
# (the head it continued: git show 4fc3132:treespec/assets/gemma3-270m-head.safetensors).
# Seventh continuation (session 27, an AMD EPYC with avx512_bf16; the cache was gone, so stage 2 was rebuilt first, in
# a cache inside the repository folder: v2-greedy, v3-sample and the 11 committed chunks of v4-sample, ~35-50 s a shard
# on one core, two or three builders side by side), then 1,600 steps from the head above on 47 + 47 + 11 shards
# (4.14M positions: v2-sample, read by every run since head-v2-cont, was left out to fit the session), on two threads
# (~2.3 s a step):
#   for c in v2-greedy v3-sample v4-sample; do   # one builder per corpus, side by side (here on two cores)
#     TREESPEC_CACHE=$PWD/.cache/treespec STAGE=corpus CORPORA=$c PIN=1 THREADS=1 MINUTES=150 recipes/head_v2_train.sh &
#   done; wait
#   TREESPEC_CACHE=$PWD/.cache/treespec STAGE=train RUN=head-v2-cont7 INIT=treespec/assets/gemma3-270m-head.safetensors \
#     SEED=7 LR=0.0005 WARMUP=50 STEPS=1600 CORPORA=v2-greedy,v3-sample,v4-sample PIN=47,47,11 THREADS=2 MINUTES=75 \
#     recipes/head_v2_train.sh
#   python -m treespec.distill export --run head-v2-cont7 --out treespec/assets/gemma3-270m-head.safetensors
# (the head it continued: git show 76b7f57:treespec/assets/gemma3-270m-head.safetensors).
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${MINUTES:-60}"
THREADS="${THREADS:-1}"
STAGE="${STAGE:-all}"
PY="${PY:-.venv/bin/python}"
CONT="${CONT:-corpora/head-v2/continuations}"
CACHE="${TREESPEC_CACHE:-$HOME/.cache/treespec}/distill"
LAYERS=2,9  # stored besides the last hidden state (a low and a middle layer of Gemma-3-270M's 18)
[ -n "${CORPORA:-}" ] && [ -z "${PIN:-}" ] && { echo "CORPORA is set: give PIN too (one shard count per corpus)" >&2; exit 2; }
PIN="${PIN:-47,40,47,11}"  # shards the run reads of each corpus: v2-greedy (all 6,000 sequences), v2-sample (all 5,000),
# v3-sample (all 6,000; head-v2-cont5 read its first 24 chunks of 128 sequences, the ones finished when it started),
# v4-sample (its first 11 chunks: the ones committed when head-v2-cont7 started)
STEPS="${STEPS:-4000}"
RUN="${RUN:-head-v2}"
LR="${LR:-0.001}"
WARMUP="${WARMUP:-200}"
SEED="${SEED:-0}"
W_TV="${W_TV:-0}"  # weight of the total-variation loss (1 - sum min(p, q)); 0 in every run before head-v2-cont3
init=()
[ -n "${INIT:-}" ] && init=(--init-head "$INIT")  # ignored by a run that already has checkpoints (it resumes)
corpora=()
for spec in v2-greedy:0:6000 v2-sample:6000:11000 v3-sample:0:6000 v4-sample:6000:11000; do
    name="${spec%%:*}"; rows="${spec#*:}"
    [ -f "$CONT/$name/manifest.json" ] || continue
    [ -n "${CORPORA:-}" ] && [[ ",$CORPORA," != *",$name,"* ]] && continue  # only the corpora named
    corpora+=("$CACHE/corpus/head-$name-f${LAYERS/,/-}")
    if [ "$STAGE" = corpus ] || [ "$STAGE" = all ]; then
        "$PY" -m treespec.distill build-corpus --continuations "$CONT/$name" --rows "$rows" \
            --out "$CACHE/corpus/head-$name-f${LAYERS/,/-}" --feature-layers "$LAYERS" --topk 0 --batch-size 8 \
            --dtype auto --threads "$THREADS" \
            --time-limit "$MINUTES" --no-progress
    fi
done
if [ "$STAGE" = train ] || [ "$STAGE" = all ]; then
    IFS=, read -ra pins <<< "$PIN"
    # as many corpora as PIN gives counts (the runs before v3-sample: the first two); one count reads every corpus
    [ "${#pins[@]}" -gt 1 ] && corpora=("${corpora[@]:0:${#pins[@]}}")
    if [ -n "${CORPORA:-}" ]; then  # the corpora named, in this order (PIN: one count each)
        corpora=()
        IFS=, read -ra names <<< "$CORPORA"
        for name in "${names[@]}"; do corpora+=("$CACHE/corpus/head-$name-f${LAYERS/,/-}"); done
    fi
    (IFS=,; "$PY" -m treespec.distill train --corpus "${corpora[*]}" --run "$RUN" "${init[@]}" \
        --vocab-size 16384 --depths 3 --depth-decay 0.8 --feature-noise 0.05 --w-hard 0.1 \
        --steps "$STEPS" --batch-size 8 --seq-len 256 --lr "$LR" --warmup "$WARMUP" --ckpt-every 100 --max-shards "$PIN" --seed "$SEED" --w-tv "$W_TV" \
        --amp auto --dtype auto --threads "$THREADS" --time-limit "$MINUTES" --no-progress)
fi
