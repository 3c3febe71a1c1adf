#!/usr/bin/env bash
# Train the pair on a GPU: the recipe of the shipped checkpoints (experiments/results/PROVENANCE.md, 2026-12-04).
#   PY=python3 OUT=/some/dir STAGES="target drafter selfdistill" bash experiments/train_pair.sh
# Needs experiments/data from `python -m experiments.train_target --stage=data`. Stages, in order:
#   target       train_target on 2048-token windows, 1500 steps (6 epochs of the 3M-token corpus; 19 epochs
#                memorised it, experiments/notes_round.md)                              -> $WORK/kimi-mini
#   drafter      train_dflash, wide6 drafter, data windows of 2048 tokens, distilling the target
#   selfdistill  selfdistill_dflash on the target's own greedy continuations
#   drafter2     train_dflash again from the self-distilled drafter (lower learning rate)
#   selfdistill2 selfdistill_dflash again, longer                                        -> $WORK/kimi-mini-dflash
# Each stage reads the previous stage's output under $WORK and packs its own into $OUT/<stage>.tgz, split into 15 MiB
# parts (the device tool returns at most 8 files of up to 16 MiB); logs and loss curves go to $OUT/results.tgz. Step
# counts are the ones the shipped run reached (two trainings shared the GPU, so it ran on wall-clock budgets); on a
# GPU of its own the recipe takes about 12 minutes: two device calls, STAGES="target drafter selfdistill", then
# STAGES="drafter2 selfdistill2" with TARGET and INIT naming the first call's target and drafter. The carry limit
# (64 MiB with the tracked tree) does not fit both beside checkpoints/: copy them over checkpoints/kimi-mini and
# checkpoints/kimi-mini-dflash for that call (TARGET=checkpoints/kimi-mini INIT=checkpoints/kimi-mini-dflash).
set -euo pipefail
PY=${PY:-python3}
WORK=${WORK:-/tmp/pair}
STAGES=${STAGES:-"target drafter selfdistill drafter2 selfdistill2"}
TARGET=${TARGET:-$WORK/kimi-mini}  # read by every stage after "target"
INIT=${INIT:-$WORK/d2}  # the drafter that drafter2 continues
DATA="--batch=8 --seq_len=2048 --anchors=256 --distill=0.8 --max_seconds=100000"
SD="--val_prompts=1024 --gen_batch=1024 --batch=64 --anchors=32 --distill=0.7 --lr=5e-4 --eval_every=500"
SD="$SD --max_seconds=100000"
pack() {  # pack STAGE DIR: $WORK/DIR -> $OUT/STAGE.tgz.00, .01, ...
  tar czf "$WORK/$1.tgz" -C "$WORK" "$2" && split -b 15M -d "$WORK/$1.tgz" "$OUT/$1.tgz."
}
mkdir -p "$WORK/results/logs"
for stage in $STAGES; do
  log="$WORK/results/logs/$stage.log"
  case $stage in
    target)
      $PY -m experiments.train_target --stage=train --out_dir="$WORK/kimi-mini" --results_dir="$WORK/results" \
        --batch=6 --seq_len=2048 --steps=1500 --max_seconds=100000 --lr=3e-3 2>&1 | tee "$log"
      pack target kimi-mini ;;
    drafter)
      $PY -m experiments.train_dflash --target="$TARGET" --out_dir="$WORK/d1" --results_dir="$WORK/results" \
        --preset=wide6 --steps=1159 $DATA 2>&1 | tee "$log"
      pack drafter d1 ;;
    selfdistill)
      $PY -m experiments.selfdistill_dflash --target="$TARGET" --drafter="$WORK/d1" --out_dir="$WORK/d2" \
        --results_dir="$WORK/results" --num_prompts=65536 --steps=2000 $SD 2>&1 | tee "$log"
      mv "$WORK/results/train_dflash_selfdistill_loss.json" "$WORK/results/train_dflash_selfdistill_stage1_loss.json"
      pack selfdistill d2 ;;
    drafter2)
      $PY -m experiments.train_dflash --target="$TARGET" --init="$INIT" --out_dir="$WORK/d3" \
        --results_dir="$WORK/results/drafter2" --steps=1251 --lr=1e-3 --seed=7 $DATA 2>&1 | tee "$log"
      mv "$WORK/results/drafter2/train_dflash_loss.json" "$WORK/results/train_dflash_stage2_loss.json"
      pack drafter2 d3 ;;
    selfdistill2)  # fresh sequences (another seed); the shipped run's generation stopped at 120832 on a time cap
      $PY -m experiments.selfdistill_dflash --target="$TARGET" --drafter="$WORK/d3" \
        --out_dir="$WORK/kimi-mini-dflash" --results_dir="$WORK/results" --num_prompts=120832 --steps=3500 \
        --seed=5 $SD 2>&1 | tee "$log"
      pack selfdistill2 kimi-mini-dflash ;;
    *) echo "error: unknown stage $stage (target, drafter, selfdistill, drafter2, selfdistill2)" >&2; exit 2 ;;
  esac
done
tar czf "$OUT/results.tgz" -C "$WORK" results
