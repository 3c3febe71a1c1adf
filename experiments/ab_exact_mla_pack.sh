#!/usr/bin/env bash
# Issue 34, one device call (about 3 minutes), on the branch exact-mla-pack: where the packing rule packs nothing
# (batch 1 at context 1024, batch 32 at context 60), the branch's kernel against main's (BASE: a folder holding
# main's pallas_kernels/mla_exact.py and ddtree_jax/memory.py, copied over a copy of the tree), by `breakdown
# --exact` of ar steps and ddtree 16 rounds, every kernel listed.
#   mkdir -p ab_base/pallas_kernels ab_base/ddtree_jax   (inside the repository, untracked, so that it travels)
#   git show main:pallas_kernels/mla_exact.py > ab_base/pallas_kernels/mla_exact.py
#   git show main:ddtree_jax/memory.py > ab_base/ddtree_jax/memory.py
#   DDTREE_COMMIT=<hash> BASE=ab_base bash experiments/ab_exact_mla_pack.sh   (OUT -> $OUT/all.tgz)
# Delete this script once the result is in the records.
set -u
PY=${PY:-python}
OUT=${OUT:-/tmp/ab_exact_mla_pack}; mkdir -p "$OUT"
BASE=${BASE:?a folder with main\'s pallas_kernels/mla_exact.py and ddtree_jax/memory.py}
S=$(mktemp -d)
export TF_CPP_MIN_LOG_LEVEL=1 DDTREE_COMMIT=${DDTREE_COMMIT:-unknown}
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tee "$S/device.txt"
SECONDS=0
base=$(mktemp -d) && cp -a . "$base" && cp "$BASE/pallas_kernels/mla_exact.py" "$base/pallas_kernels/" &&
  cp "$BASE/ddtree_jax/memory.py" "$base/ddtree_jax/"
i=0
for run in branch:1:1024 base:1:1024 branch:32:60 base:32:60; do
  i=$((i + 1))
  IFS=: read -r kind rows ctx <<< "$run"
  tree=.; [ "$kind" = base ] && tree=$base
  echo "== run $i: $kind, batch $rows, context $ctx at ${SECONDS}s"
  (cd "$tree" && timeout 70 "$PY" -m experiments.breakdown --out_dir="$S" --methods=ar,ddtree --budgets=16 \
    --context="$ctx" --concurrency="$rows" --exact --top_kernels=400 --repeats=3 \
    --name="breakdown_exact_ctx${ctx}_c${rows}_${kind}_run$i" 2>&1 | grep '^| [ad]')
  tar czf "$OUT/all.tgz" -C "$S" .
done
echo "== total ${SECONDS}s"
