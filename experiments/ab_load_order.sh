#!/usr/bin/env bash
# A/B of the load order in the drafter's kernels on one GPU: `base` (a copy of the tree with the files under $BASE
# copied over it, e.g. BASE=ab_base holding the kernels as they were) against `hoist` (the tree: the drafter attention
# kernel loads its norm gains, q/k norm weights and RoPE rows before its projections, the SwiGLU kernel its weights
# before the norm waits on x, and exact_matmul its residual tile before the K loop; the arithmetic is unchanged).
# Runs, alternating so that drift on the machine falls on both, all sharing one XLA per-fusion autotune cache:
#   1-4. breakdown of the chain round at 32 rows, context 60, fast path (base, hoist, base, hoist);
#   5-6. the shipped drafter's forward alone at 32 rows (bench_drafter; base, hoist);
#   7-8. breakdown of the chain round at 32 rows with the exact numerics (the target's o_proj epilogue; base, hoist).
# Records: $OUT_DIR/<name>_<variant>_run<i>.json (OUT_DIR unset: experiments/results); each run capped at 100 s.
#   BASE=ab_base DDTREE_COMMIT=<sha> OUT_DIR=<dir> PY=python experiments/ab_load_order.sh   (about 6 min on an H100)
# PY (default .venv/bin/python) runs the modules: PY=echo prints the command lines instead.
# Delete this script once its result is in the records.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the base runs start elsewhere
: "${BASE:?BASE=<a folder of files to copy over the base variant tree>}"
BASE=$(cd "$BASE" && pwd)
OUT_DIR=${OUT_DIR:-experiments/results}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
export DDTREE_COMMIT=${DDTREE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  # the copy has no .git
CACHE=$(mktemp -d)
BASE_TREE=$(mktemp -d)
trap 'rm -rf "$CACHE" "$BASE_TREE"' EXIT
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=$CACHE"
tar --exclude=./.venv --exclude=./.git -cf - . | tar -xf - -C "$BASE_TREE"
cp -r "$BASE"/. "$BASE_TREE"/

failed=0
run() {  # run VARIANT I NAME MODULE ARGS...
  local variant=$1 i=$2 name=$3 tree=.
  shift 3
  [ "$variant" = base ] && tree=$BASE_TREE
  echo "== ${name}_${variant}_run$i"
  if ! (cd "$tree" && timeout 100 "$PY" -m "$@" --out_dir="$OUT_DIR" --name="${name}_${variant}_run$i"); then
    echo "!! ${name}_${variant}_run$i failed or ran past 100 s" >&2
    failed=1
  fi
}
ROUND=(experiments.breakdown --methods=dflash --concurrency=32 --top_kernels=400 --repeats=5)
run base 1 breakdown_c32 "${ROUND[@]}" --noexact
run hoist 2 breakdown_c32 "${ROUND[@]}" --noexact
run base 3 breakdown_c32 "${ROUND[@]}" --noexact
run hoist 4 breakdown_c32 "${ROUND[@]}" --noexact
DRAFTER=(experiments.bench_drafter --drafter_config=checkpoints/kimi-mini-dflash --modes=pallas --concurrency=32
  --allocations=2048)
run base 5 bench_drafter_mini "${DRAFTER[@]}"
run hoist 6 bench_drafter_mini "${DRAFTER[@]}"
run base 7 breakdown_c32_exact "${ROUND[@]}" --exact
run hoist 8 breakdown_c32_exact "${ROUND[@]}" --exact
exit "$failed"
