#!/usr/bin/env bash
# Issue 37, one device call (about 1 minute a variant): the drafter kernels' tile constants, each variant in a copy
# of the tree, timed by `breakdown` of a chain round at 32 rows, context 60 (the cell of the issue's 25% bar), with
# every kernel of the round listed. Per layer the draft runs attention (12 us on an H100), SwiGLU (6.0 us against
# 4.6 for XLA's comparable product), down and o_proj.
#   VARIANTS: space-separated KERNEL:NAME=VALUE,NAME=VALUE..., KERNEL one of attention, swiglu (the file
#   pallas_kernels/drafter_KERNEL.py), NAME a module-level constant of it (attention: BLOCK_L, BLOCK_H, NUM_WARPS,
#   NUM_STAGES; swiglu: BLOCK_ROWS, BLOCK_INNER, NUM_WARPS). "base" runs the tree as it is; it runs first and last,
#   to show the drift. A swiglu tile over MAX_TILE_BYTES runs the reference.
#   DDTREE_COMMIT=<hash> bash experiments/ab_drafter_tiles.sh   (OUT: the device tool's folder -> $OUT/all.tgz)
# Delete this script once the result is in the records.
set -u
PY=${PY:-python}
OUT=${OUT:-/tmp/ab_drafter_tiles}; mkdir -p "$OUT"
S=$(mktemp -d)
export TF_CPP_MIN_LOG_LEVEL=1 DDTREE_COMMIT=${DDTREE_COMMIT:-unknown}
CAP=${CAP:-70}  # seconds per run
DEFAULT="base attention:NUM_WARPS=2 attention:NUM_WARPS=8 attention:BLOCK_H=256 attention:NUM_STAGES=1
  swiglu:BLOCK_ROWS=32,NUM_WARPS=4 swiglu:BLOCK_INNER=32,NUM_WARPS=4 base"
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tee "$S/device.txt"
SECONDS=0
i=0
for variant in ${VARIANTS:-$DEFAULT}; do
  i=$((i + 1))
  tree=$(mktemp -d) && cp -a . "$tree"
  name=base
  if [ "$variant" != base ]; then
    kernel=${variant%%:*}
    file=$tree/pallas_kernels/drafter_$kernel.py
    name=$kernel
    IFS=, read -ra sets <<< "${variant#*:}"
    for set in "${sets[@]}"; do
      key=${set%%=*} value=${set#*=}
      grep -q "^$key = " "$file" || { echo "no constant $key in $file"; exit 2; }
      sed -i "s/^$key = [0-9a-z <]*/$key = $value  /" "$file"
      name=${name}_$(echo "$key" | tr 'A-Z' 'a-z' | tr -d _)$value
    done
    echo "== run $i: $(grep -E "^($(IFS='|'; echo "${sets[*]%%=*}" | tr ' ' '|')) =" "$file" | cut -d'#' -f1 | tr '\n' ' ')"
  fi
  echo "== run $i ($name) at ${SECONDS}s"
  (cd "$tree" && timeout "$CAP" "$PY" -m experiments.breakdown --out_dir="$S" --methods=dflash --concurrency=32 \
    --noexact --top_kernels=400 --repeats=5 --name="breakdown_c32_${name}_run$i" 2>&1 | grep '^| [dm]')
  rm -rf "$tree"
  tar czf "$OUT/all.tgz" -C "$S" .
done
echo "== total ${SECONDS}s"
