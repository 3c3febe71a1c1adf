#!/usr/bin/env bash
# Issue 34, one device call (about 9 minutes), on the branch exact-mla-pack: the exact MLA kernel's node packing as
# shipped (PACK_MIN_PROGRAMS) against never packing (a copy of the tree with the threshold out of reach), by
# `breakdown --exact` of ar steps and ddtree 16 rounds at context 60, batch 32 (the rule packs there, unmeasured);
# then `exact_check` at contexts 1024 and 60 (bitwise against AR on the device, and the switch's cost).
#   DDTREE_COMMIT=<hash> bash experiments/ab_exact_mla_pack.sh   (OUT -> $OUT/all.tgz)
# Delete this script once the result is in the records.
set -u
PY=${PY:-python}
OUT=${OUT:-/tmp/ab_exact_mla_pack}; mkdir -p "$OUT"
S=$(mktemp -d)
export TF_CPP_MIN_LOG_LEVEL=1 DDTREE_COMMIT=${DDTREE_COMMIT:-unknown}
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | tee "$S/device.txt"
SECONDS=0
never=$(mktemp -d) && cp -a . "$never" &&
  sed -i 's/^PACK_MIN_PROGRAMS = .*/PACK_MIN_PROGRAMS = 2**62/' "$never/pallas_kernels/mla_exact.py" &&
  grep -c '^PACK_MIN_PROGRAMS = 2\*\*62' "$never/pallas_kernels/mla_exact.py"
i=0
for kind in pack never pack; do
  i=$((i + 1))
  tree=.; [ "$kind" = never ] && tree=$never
  echo "== run $i: $kind, batch 32, context 60 at ${SECONDS}s"
  (cd "$tree" && timeout 90 "$PY" -m experiments.breakdown --out_dir="$S" --methods=ar,ddtree --budgets=16 \
    --context=60 --concurrency=32 --exact --top_kernels=400 --repeats=3 \
    --name="breakdown_exact_ctx60_c32_${kind}_run$i" 2>&1 | grep '^| [ad]')
  tar czf "$OUT/all.tgz" -C "$S" .
done
for ctx in 1024 60; do
  echo "== exact_check, context $ctx at ${SECONDS}s"
  timeout 200 "$PY" -m experiments.exact_check --out_dir="$S" --contexts=$ctx --budgets=4,16 --max_new_tokens=128 \
    --compile_workers=16 --name=exact_check_cost_ctx$ctx 2>&1 | grep '^| o'
  tar czf "$OUT/all.tgz" -C "$S" .
done
echo "== total ${SECONDS}s"
