#!/usr/bin/env bash
# Issue 34, one device call (about 7 minutes): the exact products' K step (`BLOCK_K` in
# pallas_kernels/exact_matmul.py, 64 today) and o_proj's residual epilogue, each variant in a copy of the tree, timed by
# `breakdown --exact` at batch 1, context 60 (ar, the chain, DDTree b4 and b16: the cells whose exact verify costs
# 13-15% over the fast path, docs/exactness.md). A longer step shortens the serial loop of every exact product (K = 256
# for most of the shipped pair's); invariance holds at any step, which is a function of K alone.
#   VARIANTS: space-separated TREE:BLOCK_K[:ROW_BYTES], TREE "new" (this tree) or "base" (this tree with the files
#   under ab_base/ copied over it: the code before the epilogue); ROW_BYTES (128 today) sets the column tile.
#   DDTREE_COMMIT=<hash> bash experiments/ab_exact_block_k.sh     (OUT: the device tool's folder -> $OUT/all.tgz)
# Delete this script once the result is in the records.
set -u
PY=${PY:-python}
OUT=${OUT:-/tmp/ab_exact_block_k}; mkdir -p "$OUT"
S=$(mktemp -d)
export TF_CPP_MIN_LOG_LEVEL=1 DDTREE_COMMIT=${DDTREE_COMMIT:-unknown}
CAP=${CAP:-75}  # seconds per run
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tee "$S/device.txt"
SECONDS=0
i=0
for variant in ${VARIANTS:-base:64 new:64 new:256 new:128 new:256:64 base:64 new:64}; do
  i=$((i + 1))
  IFS=: read -r kind bk rb <<< "$variant"
  rb=${rb:-128}
  tree=$(mktemp -d) && cp -a . "$tree"
  if [ "$kind" = base ]; then cp -a ab_base/. "$tree"/; fi
  sed -i -e "s/^BLOCK_K = 64$/BLOCK_K = $bk/" -e "s/^ROW_BYTES = 128 /ROW_BYTES = $rb /" "$tree/pallas_kernels/exact_matmul.py"
  echo "== run $i: $kind $(grep -E '^(BLOCK_K|ROW_BYTES)' "$tree/pallas_kernels/exact_matmul.py" | tr '\n' ' ') at ${SECONDS}s"
  (cd "$tree" && timeout "$CAP" "$PY" -m experiments.breakdown --out_dir="$S" --methods=ar,dflash,ddtree \
    --budgets=4,16 --context=60 --exact --top_kernels=400 --repeats=5 \
    --name="breakdown_exact_ctx60_${kind}_k${bk}_rb${rb}_run$i" 2>&1 | grep '^| [adm]')
  rm -rf "$tree"
  tar czf "$OUT/all.tgz" -C "$S" .
done
echo "== total ${SECONDS}s"
