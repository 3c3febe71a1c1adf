#!/usr/bin/env bash
# Issue 34, one device call (about 9 minutes), on the branch exact-mla-pack: the exact MLA kernel with a row's nodes
# packed in a program's query rows (the tree) against the kernel of main (BASE: a folder holding main's
# pallas_kernels/mla_exact.py and ddtree_jax/memory.py, copied over a copy of the tree), by `breakdown --exact` of
# ar steps and ddtree 16 rounds at context 1024, batch 32, 8 and 1, every kernel listed; first the kernel's tests
# compiled on the GPU (bitwise tree = decode steps on the device's own arithmetic).
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
timeout 150 "$PY" -m pytest -x -q -p no:cacheprovider tests/test_mla_exact.py 2>&1 | tail -3 | tee "$S/tests.txt"
echo "== tests done at ${SECONDS}s"
base=$(mktemp -d) && cp -a . "$base" && cp "$BASE/pallas_kernels/mla_exact.py" "$base/pallas_kernels/" &&
  cp "$BASE/ddtree_jax/memory.py" "$base/ddtree_jax/"
i=0
for run in pack:32 base:32 pack:32 pack:8 base:8 pack:1 base:1; do
  i=$((i + 1))
  kind=${run%%:*} rows=${run#*:}
  tree=.; [ "$kind" = base ] && tree=$base
  echo "== run $i: $kind, batch $rows at ${SECONDS}s"
  (cd "$tree" && timeout 100 "$PY" -m experiments.breakdown --out_dir="$S" --methods=ar,ddtree --budgets=16 \
    --context=1024 --concurrency="$rows" --exact --top_kernels=400 --repeats=3 \
    --name="breakdown_exact_ctx1024_c${rows}_${kind}_run$i" 2>&1 | grep '^| [ad]')
  tar czf "$OUT/all.tgz" -C "$S" .
done
echo "== total ${SECONDS}s"
