#!/usr/bin/env bash
# Train the shipped pair (target, then drafter) in one go on a GPU, time-boxed (~3 min of training on an H200).
#   PY=python3 OUT=/some/dir bash experiments/train_pair.sh [extra flags for both scripts]
# Needs experiments/data from `python -m experiments.train_target --stage=data`. Writes $OUT/target.tgz right
# after the target (so a failed drafter run keeps it) and $OUT/drafter.tgz (each under 16 MiB). The shipped
# drafter was then fine-tuned with `python -m experiments.selfdistill_dflash` (CPU, 14 min).
set -euo pipefail
PY=${PY:-python3}
WORK=${WORK:-/tmp/pair}
TARGET_FLAGS=${TARGET_FLAGS:-"--batch=24 --seq_len=512 --steps=1500 --max_seconds=130 --lr=3e-3"}
DRAFTER_FLAGS=${DRAFTER_FLAGS:-"--batch=32 --seq_len=512 --anchors=64 --steps=30000 --max_seconds=150 --distill=0.8"}
rm -rf "$WORK" && mkdir -p "$WORK"
$PY -m experiments.train_target --stage=train --out_dir="$WORK/kimi-mini" --results_dir="$WORK/results" \
  $TARGET_FLAGS "$@" 2>&1 | tee "$OUT/train_target.log"
tar czf "$OUT/target.tgz" -C "$WORK" kimi-mini results
$PY -m experiments.train_dflash --target="$WORK/kimi-mini" --out_dir="$WORK/kimi-mini-dflash" \
  --results_dir="$WORK/results" $DRAFTER_FLAGS "$@" 2>&1 | tee "$OUT/train_dflash.log"
tar czf "$OUT/drafter.tgz" -C "$WORK" kimi-mini-dflash results
