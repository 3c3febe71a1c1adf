#!/usr/bin/env bash
# The whole experiment matrix in one command on one H200 (the stage caps below sum to about 16 minutes; a device
# call is at most 10, so pick stages with STAGES=...):
#   1. sweeps over budget and concurrency on the shipped pair (one process: compilations shared), `auto` beside the
#      fixed methods in every cell; without a calibration.json beside the drafter each sweep process first measures
#      auto's cost table of each axis over that axis's cells (sweep_<axis>_calibration.json)
#   2. round-time breakdown   3. full-size cost model (bench_round, BENCH_LAYERS real-size layers)   4. context sweep
#   5. float32 exactness at long context (sweep_context_float32)
#   6. tree build: Pallas kernel vs plain JAX, top-k variants (bench_tree_build)   7. REPORT.md + plots
#   on request only (STAGES=mla): the MLA kernels' key cells timed in a while loop that carries the cache, as the
#   engine calls them (bench_mla's default -> bench_mla_carry, the record of issue 5's bars; about 6 min)
#   and (STAGES=mla_profile) where its warps stall: Nsight Compute's sampled stall locations of the 64-head decode
#   and verify calls, per SASS instruction (profiles/ncu_mla_source.csv.gz, from the saved report
#   profiles/ncu_mla_source.ncu-rep), summarised by experiments.ncu_stalls (ncu_mla_stalls; about 1 min)
#   and (STAGES=mla_splits) the Mosaic kernel's decode at B8 over 4096 and 8192 slots, 64 and 8 heads, at split
#   counts 2-26 beside the one `wave_splits` picks (which leaves the merge's bytes out of its model) and beside
#   XLA reading the same bytes (bench_mla_decode_splits), and verify 8192 x 17 nodes x B8 x 64 heads at the
#   chosen 5 splits beside 6 and 10, timed before (bench_mla_split_model_verify); about 5 min
#   and (STAGES=layer_profile) one dense + one MoE Kimi K2.6 layer at full size, single GPU and one rank of 8: an AR
#   step and DDTree b8/b16 rounds at B 1 and 8 timed in loops that carry the whole state, device time, kernels and
#   bytes per piece of each layer against a copy rate timed in the same run (layer_profile; issue 32)
#   and (STAGES=drafter) breakdown at 32 rows with and without the drafter attention kernel (every kernel of a round
#   in the kernel's record, --top_kernels=400) and with the kernel's projections in XLA, (STAGES=drafter_bench) the
#   drafter's forward alone, bench_drafter: the K2.5 drafter at 2K and 8K allocations, and (STAGES=drafter_mini) the
#   shipped pair's at 32 rows with the block's projections in the kernel and in XLA (issue 37; about 5 + 3 + 2 min)
#   and (STAGES=exact_tests) the exact MLA kernel's packing tests compiled on the GPU (up to 5 min)
#   and (STAGES=exact_cost) breakdown at batch 1, context 1024 with and without the exact numerics (issue 34; 6 min)
#   and (STAGES=exact_segments) breakdown with the exact numerics at context 1024, batch 1 and 32, for exact MLA
#   segments of EXACT_SEGMENTS positions (64-1024; issue 34; about 9 min, 100-120 s a run: two calls, e.g.
#   EXACT_SEGMENTS="64 128 256" then "512 1024")
#   and (STAGES=exact_sweep) the sweeps with the exact numerics on: budget/concurrency 1-32 at context 60 and the
#   context 1024 cells, each `correct` against ar (issue 34; about 4 min)
#   and (STAGES=exact_check) the exact numerics: exact_probe, exact_check (issue 34; about 9 min; exact_probe_off:
#   the probe without them)
#   and (STAGES=auto) method=auto beside the fixed methods on the concurrency axis (batch 1-128, context 60) and the
#   context axis (batch 1, context 60/1024/1888), issue 37: sweep_{concurrency,context}_auto. auto chooses by one cost
#   table per axis over that axis's cells, sweep_<axis>_auto_calibration.json: experiments/results' one when it was
#   measured on this device kind, dtype and numerics over that grid, else measured in the same process just before
#   the axis's cells and written at once (concurrency first). The sweep runs with --ignore_eos, so its programs are
#   the tables' own and a table costs only their 1-token twins: 42 programs without tables, 21 with both (the
#   concurrency axis 30 / 15, the context axis 18 / 9). At 5.5-8 s a program (8 compile threads; the 2026-12-06 H100
#   call compiled 21 in 117 s; the runs themselves take seconds) that is about 5-6.5 min without tables, 3 with.
#   (STAGES=calibrate) measures only the tables (--calibrate_only; the same 42 programs, about 5-6.5 min).
#   and (STAGES=ticket) the "last program reduces" join across programs checked bit for bit and timed against a
#   second kernel, at the drafter's attention-output shape, 32 and 8 sequences (ticket_probe; about 1 min)
#   Five repeats of 128 tokens: with two of 64, one program timed twice at batch 1 differed by 5% (2026-12-07 H200),
#   and a table's round time is a difference of two walls; that is enough to mislead it where two candidates are
#   close. The runs take seconds; compilation takes the minutes.
#   One call:  STAGES=auto REPEATS=5 experiments/run_gpu_matrix.sh   (about 6 min; cap AUTO_S=450)
#   Cut short, it keeps each table measured and the cells swept. Split, each call about 3-5 min (the records and
#   tables of the two axes are separate files, so the calls merge by copying):
#     STAGES=auto REPEATS=5 AUTO_ARGS=--axis=concurrency experiments/run_gpu_matrix.sh   (30 programs)
#     STAGES=auto REPEATS=5 AUTO_ARGS=--axis=context experiments/run_gpu_matrix.sh       (18 programs)
#   Or tables first: STAGES=calibrate REPEATS=5 experiments/run_gpu_matrix.sh, copy the
#   sweep_*_auto_calibration.json it returns into experiments/results (and commit them), then STAGES=auto with the
#   same settings sweeps only (about 3 min). AUTO_ARGS narrows either stage (e.g. --axis=context).
#
# Results go to $OUT/results.tgz when OUT is set (the device tool's output folder), else experiments/results.
# Each stage has a wall-clock cap in seconds (override through the environment) and writes its records after
# every cell, so a stage cut short keeps what it measured. Shrink further with e.g. SWEEP_S=120 BENCH_S=120 REPEATS=2 MAX_NEW=64.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# The device tool returns at most 8 files from $OUT: with OUT set, the stages write to a scratch folder and what
# they wrote (records, profiles, REPORT.md) comes back packed as $OUT/results.tgz, also when a stage is cut short.
if [ -n "${OUT:-}" ]; then RES=$(mktemp -d); else RES=experiments/results; fi
SWEEP_S=${SWEEP_S:-300}
BREAKDOWN_S=${BREAKDOWN_S:-60}
BENCH_S=${BENCH_S:-150}
CONTEXT_S=${CONTEXT_S:-120}
EXACT_S=${EXACT_S:-120}
BENCH_LAYERS=${BENCH_LAYERS:-4}  # the projection scales one measured MoE layer to 61; 0: as many as fit
TREE_S=${TREE_S:-200}
MLA_S=${MLA_S:-560}
PROFILE_S=${PROFILE_S:-120}
LAYER_PROFILE_S=${LAYER_PROFILE_S:-540}
EXACT_CHECK_S=${EXACT_CHECK_S:-380}
AUTO_S=${AUTO_S:-450}
CALIBRATE_S=${CALIBRATE_S:-450}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
REPEATS=${REPEATS:-3}
MAX_NEW=${MAX_NEW:-128}
AXIS_BUDGETS=${AXIS_BUDGETS:-8}  # DDTree budgets on the concurrency and context axes
export DDTREE_COMMIT=${DDTREE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export TF_CPP_MIN_LOG_LEVEL=1
mkdir -p "$RES"
if [ -n "${OUT:-}" ]; then
  cp experiments/results/*.{json,md} "$RES"/ 2>/dev/null  # earlier records, for the report
  touch "$RES/.start"
  trap '(cd "$RES" && find . -type f -newer .start | tar czf "$OUT/results.tgz" -T -)' EXIT
fi
"$PY" -c 'import jax; print(jax.devices())'
SECONDS=0
stage() {  # stage NAME CAP_S COMMAND...: run with a wall-clock cap, report how it ended
  local name=$1 cap=$2
  shift 2
  timeout "$cap" "$@" || echo "$name stopped (rc $?, cap ${cap}s)"
  echo "== $name done at ${SECONDS}s"
}
SWEEP=(-m experiments.sweep --out_dir="$RES" --repeats="$REPEATS" --max_new_tokens="$MAX_NEW"
  --axis_budgets="$AXIS_BUDGETS")

STAGES=${STAGES:-sweep breakdown bench_round context exact tree}
want() { [[ " $STAGES " == *" $1 "* ]]; }
want sweep && stage sweep "$SWEEP_S" "$PY" "${SWEEP[@]}" --axis=budget,concurrency --concurrency=1,8,32,64,128
want breakdown && stage breakdown "$BREAKDOWN_S" "$PY" -m experiments.breakdown --out_dir="$RES" --budgets=8,16,32 --repeats=5
# Full-size Kimi K2.6 layers, random INT4 weights; stops starting new cells 30 s before its cap.
want bench_round && stage bench_round "$BENCH_S" "$PY" -m experiments.bench_round --out_dir="$RES" --sweep_json="$RES/sweep_budget.json" \
  --layers="$BENCH_LAYERS" --budgets=8,16,32,64 --concurrency=1,8,32 --contexts=1024,8192 --repeats=5 --time_limit_s=$((BENCH_S - 30))
want context && stage context "$CONTEXT_S" "$PY" "${SWEEP[@]}" --axis=context --contexts=60,1024,4096,8192
want exact && stage exact "$EXACT_S" "$PY" "${SWEEP[@]}" --axis=context --contexts=1024,4096 --axis_budgets=16 \
  --methods=ar,ddtree --dtype=float32 --repeats=1
want tree && stage tree "$TREE_S" "$PY" -m experiments.bench_tree_build --out_dir="$RES" --topk_vocabs=4096,163840 \
  --batches=1,32 --e2e_budgets=8,16
want mla && stage mla "$MLA_S" "$PY" -m experiments.bench_mla --out_dir="$RES" --preset=key \
  --kernels=triton,mosaic --name=bench_mla_carry
want mla_splits && stage mla_splits 240 "$PY" -m experiments.bench_mla --out_dir="$RES" --preset=custom \
  --contexts=4096,8192 --nodes=1 --batches=8 --heads=64,8 --kernels=mosaic --mosaic_splits=2,4,6,8,10,16,20,26 \
  --check=false --name=bench_mla_decode_splits
want mla_splits && stage mla_splits_verify 150 "$PY" -m experiments.bench_mla --out_dir="$RES" --preset=custom \
  --contexts=8192 --nodes=17 --batches=8 --heads=64 --kernels=mosaic --mosaic_splits=6,10 \
  --check=false --name=bench_mla_split_model_verify
# The drafter's attention (issue 37): its forward alone at 2K vs 8K allocation, then a chain / DDTree round at 32
# rows with the plain-JAX drafter attention beside the Pallas kernel.
want drafter_bench && stage bench_drafter 180 "$PY" -m experiments.bench_drafter --out_dir="$RES"
# The shipped pair's drafter at 32 rows: the Pallas block projecting in the kernel (its default at this size) vs in XLA.
want drafter_mini && stage bench_drafter_mini 90 "$PY" -m experiments.bench_drafter --out_dir="$RES" \
  --drafter_config=checkpoints/kimi-mini-dflash --modes=reference,pallas --concurrency=32 --allocations=256,2048 \
  --name=bench_drafter_mini
want drafter_mini && stage bench_drafter_mini_xla 60 "$PY" -m experiments.bench_drafter --out_dir="$RES" \
  --drafter_config=checkpoints/kimi-mini-dflash --modes=pallas --concurrency=32 --allocations=256,2048 \
  --projections=xla --name=bench_drafter_mini_xla_projections
want ticket && stage ticket 120 "$PY" -m experiments.ticket_probe --out_dir="$RES" --batches=32,8
want drafter && DDTREE_KERNELS=auto,drafter_attention=reference stage breakdown_ref 120 "$PY" -m experiments.breakdown \
  --out_dir="$RES" --methods=ar,dflash,ddtree --budgets=8 --concurrency=32 --noexact --name=breakdown_c32_drafter_reference
want drafter && stage breakdown_c32 120 "$PY" -m experiments.breakdown --out_dir="$RES" --methods=ar,dflash,ddtree \
  --budgets=8 --concurrency=32 --noexact --top_kernels=400 --name=breakdown_c32
want drafter && stage breakdown_c32_xla 120 "$PY" -m experiments.breakdown --out_dir="$RES" --methods=ar,dflash,ddtree \
  --budgets=8 --concurrency=32 --noexact --projections=xla --name=breakdown_c32_xla_projections
# Exact numerics (issue 34): layer by layer, decode steps vs block / tree / batch, with and without; then the same
# ragged requests at batch 1/8/32 as every method, compared with batch-1 ar, and tokens/s on vs off.
want exact_check && stage exact_probe 70 "$PY" -m experiments.exact_probe --out_dir="$RES"
# The exact MLA kernel's packing tests compiled on the device (its own arithmetic, bit for bit; output only).
want exact_tests && stage exact_tests 300 "$PY" -m pytest -x -q -p no:cacheprovider tests/test_mla_exact.py \
  -k "packing or packed"
# Where the exact numerics' cost sits at batch 1 and context 1024: rounds and the prefill with and without them, the
# cells exact_check finds slowest (dflash, ddtree 4) beside ar and ddtree 16, every kernel listed.
want exact_cost && stage breakdown_exact 200 "$PY" -m experiments.breakdown --out_dir="$RES" \
  --methods=ar,dflash,ddtree --budgets=4,16 --context=1024 --exact --top_kernels=400 --name=breakdown_exact_ctx1024
want exact_cost && stage breakdown_fast 170 "$PY" -m experiments.breakdown --out_dir="$RES" \
  --methods=ar,dflash,ddtree --budgets=4,16 --context=1024 --noexact --top_kernels=400 --name=breakdown_noexact_ctx1024
# The exact MLA kernel's segment length (fixed for every call; 256 today) at batch 1 and 32, context 1024.
for seg in ${EXACT_SEGMENTS:-64 128 256 512 1024}; do
  want exact_segments && stage "breakdown_exact_seg$seg" 120 "$PY" -m experiments.breakdown --out_dir="$RES" \
    --methods=ar,dflash,ddtree --budgets=16 --context=1024 --exact --exact_segment=$seg --name=breakdown_exact_seg$seg
  want exact_segments && stage "breakdown_exact_seg${seg}_c32" 120 "$PY" -m experiments.breakdown --out_dir="$RES" \
    --methods=ar,ddtree --budgets=16 --context=1024 --concurrency=32 --exact --exact_segment=$seg \
    --name=breakdown_exact_seg${seg}_c32
done
# The exact numerics' sweeps (issue 34's bar: every cell `correct`): budget and concurrency 1/8/32 at context 60,
# budgets 4/16/64 at context 1024, concurrency 8/32 at context 1024 (about 4 min with 16 compile threads).
EXACT_SWEEP=(-m experiments.sweep --out_dir="$RES" --exact --max_new_tokens=64 --repeats=1 --methods=ar,dflash,ddtree
  --compile_workers=16)
want exact_sweep && stage sweep_exact 200 "$PY" "${EXACT_SWEEP[@]}" --axis=budget,concurrency --concurrency=1,8,32 \
  --budgets=4,8,16,32,64 --axis_budgets=8 --tag=exact
want exact_sweep && stage sweep_context_exact 100 "$PY" "${EXACT_SWEEP[@]}" --axis=context --contexts=1024 \
  --axis_budgets=4,16,64 --tag=exact
want exact_sweep && stage sweep_concurrency_exact_ctx1024 100 "$PY" "${EXACT_SWEEP[@]}" --axis=concurrency \
  --prompt_len=1024 --concurrency=8,32 --axis_budgets=8 --tag=exact_ctx1024
want exact_probe_off && stage exact_probe_off 50 "$PY" -m experiments.exact_probe --out_dir="$RES" --noexact
# shellcheck disable=SC2086  # EXACT_CHECK_ARGS / AUTO_ARGS: extra flags, word-split on purpose
want exact_check && stage exact_check "$EXACT_CHECK_S" "$PY" -m experiments.exact_check --out_dir="$RES" \
  --max_new_tokens="$MAX_NEW" ${EXACT_CHECK_ARGS:-}
# method=auto (issue 37) beside the fixed methods over concurrency 1-128 and context 60-1888, each axis's cost table
# from experiments/results when it fits, else measured first in the same process; calibrate: the tables alone.
AUTO=("${SWEEP[@]}" --axis=concurrency,context --concurrency=1,8,32,64,128 --contexts=60,1024,1888 --ignore_eos
  --tag=auto --calibration_dir=experiments/results)
# shellcheck disable=SC2086
want calibrate && stage calibrate "$CALIBRATE_S" "$PY" "${AUTO[@]}" --calibrate_only ${AUTO_ARGS:-}
# shellcheck disable=SC2086
want auto && stage auto "$AUTO_S" "$PY" "${AUTO[@]}" ${AUTO_ARGS:-}
want layer_profile && stage layer_profile "$LAYER_PROFILE_S" "$PY" -m experiments.layer_profile --out_dir="$RES" \
  --layouts=single,rank --budgets=8,16 --concurrency=1,8 --context=1024
if want mla_profile; then
  mkdir -p "$RES/profiles"
  # No preallocation: ncu saves and restores the GPU memory XLA holds around every kernel replay. The CLI prints
  # only a summary of SourceCounters; the per-instruction stall table comes from the saved report's source page.
  XLA_PYTHON_CLIENT_PREALLOCATE=false stage mla_ncu "$PROFILE_S" "$NCU" -f -o "$RES/profiles/ncu_mla_source" \
    -k regex:mosaic --section SourceCounters --section WarpStateStats \
    "$PY" -m experiments.profile_mla --cells=8192/1/32/64,8192/17/8/64
  stage mla_ncu_source 30 "$NCU" -i "$RES/profiles/ncu_mla_source.ncu-rep" --page source --csv --print-source sass \
    --log-file "$RES/profiles/ncu_mla_source.csv"
  gzip -f "$RES/profiles/ncu_mla_source.csv"
  stage mla_stalls 60 "$PY" -m experiments.ncu_stalls --csv="$RES/profiles/ncu_mla_source.csv.gz" --out_dir="$RES"
fi
"$PY" -m experiments.report --results_dir="$RES"
echo "== total ${SECONDS}s; results in $RES"
