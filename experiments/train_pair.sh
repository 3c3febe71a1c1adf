#!/usr/bin/env bash
# Train the pair (target, then drafter, then optionally the drafter's self-distillation) on a GPU, time-boxed.
#   PY=python3 OUT=/some/dir bash experiments/train_pair.sh [extra flags for the target and drafter scripts]
# Needs experiments/data from `python -m experiments.train_target --stage=data`. STAGES (default "target drafter";
# also "selfdistill", flags in SELFDISTILL_FLAGS) picks the steps. Writes $OUT/target.tgz right after the target (so
# a failed drafter run keeps it), $OUT/drafter.tgz and $OUT/drafter_sd.tgz (each under 16 MiB). Windows are 2048
# tokens: the shipped pair, trained on 512-token windows, degrades past 512 tokens of context; the first 2048 run
# (185 s, 19 epochs of the 3M-token corpus) memorised its training files (experiments/notes_round.md). On an H200 the defaults take about 7.5 min for
# target + drafter (185 s of training each plus compilation and writing); self-distillation needs a second call.
set -euo pipefail
PY=${PY:-python3}
WORK=${WORK:-/tmp/pair}
TARGET_FLAGS=${TARGET_FLAGS:-"--batch=6 --seq_len=2048 --steps=100000 --max_seconds=185 --lr=3e-3"}
DRAFTER_FLAGS=${DRAFTER_FLAGS:-"--batch=8 --seq_len=2048 --anchors=256 --steps=100000 --max_seconds=185 --distill=0.8"}
SELFDISTILL_FLAGS=${SELFDISTILL_FLAGS:-}
STAGES=${STAGES:-"target drafter"}
for stage in $STAGES; do
  case $stage in
    target)
      rm -rf "$WORK" && mkdir -p "$WORK"
      $PY -m experiments.train_target --stage=train --out_dir="$WORK/kimi-mini" --results_dir="$WORK/results" \
        $TARGET_FLAGS "$@" 2>&1 | tee "$OUT/train_target.log"
      tar czf "$OUT/target.tgz" -C "$WORK" kimi-mini results ;;
    drafter)
      $PY -m experiments.train_dflash --target="$WORK/kimi-mini" --out_dir="$WORK/kimi-mini-dflash" \
        --results_dir="$WORK/results" $DRAFTER_FLAGS "$@" 2>&1 | tee "$OUT/train_dflash.log"
      tar czf "$OUT/drafter.tgz" -C "$WORK" kimi-mini-dflash results ;;
    selfdistill)  # needs $WORK/kimi-mini and $WORK/kimi-mini-dflash (e.g. unpacked from the tarballs above)
      $PY -m experiments.selfdistill_dflash --target="$WORK/kimi-mini" --drafter="$WORK/kimi-mini-dflash" \
        --out_dir="$WORK/kimi-mini-dflash-sd" --results_dir="$WORK/results" $SELFDISTILL_FLAGS \
        2>&1 | tee "$OUT/selfdistill.log"
      tar czf "$OUT/drafter_sd.tgz" -C "$WORK" kimi-mini-dflash-sd results ;;
    *) echo "error: unknown stage $stage (target, drafter, selfdistill)" >&2; exit 2 ;;
  esac
done
