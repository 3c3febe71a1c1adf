#!/usr/bin/env bash
# A/B of the exact merged W_UV product's load chain (branch merged-latency): this tree, whose merge takes the
# running max from one load of the maxes tile, against the same tree with main's pallas_kernels/mla_exact.py (a
# loop of one load per segment before the weighted sums). Batch-1 `ar` and `ddtree` b16 at context 1024 (5 segments
# of the exact kernel's 256), with and without the exact numerics. Run from the repo root on a GPU machine, $OUT set:
#   bash experiments/ab_merged_latency.sh
# Needs ab_base/mla_exact.py (untracked), the baseline kernel: it travels with the tree, else it is made here from
# `git show main:pallas_kernels/mla_exact.py` where git and the branch main are at hand. Each run is capped at
# 100 s (about 5 minutes in all). $OUT/r.tgz holds the three breakdown records (.json, .md) and each run's log.
set -u
export TF_CPP_MIN_LOG_LEVEL=1 PYTHONUNBUFFERED=1
: "${OUT:?set OUT to the results folder}"
ROOT=$(pwd)
R=$OUT/r
mkdir -p "$R" "$ROOT/ab_base"
if [ ! -s "$ROOT/ab_base/mla_exact.py" ] && git -C "$ROOT" rev-parse --verify -q main >/dev/null 2>&1; then
  git -C "$ROOT" show main:pallas_kernels/mla_exact.py >"$ROOT/ab_base/mla_exact.py" || exit 1
fi
if [ ! -s "$ROOT/ab_base/mla_exact.py" ]; then
  echo "ab_base/mla_exact.py missing and no git branch main to make it from" >&2
  exit 2
fi
if cmp -s "$ROOT/ab_base/mla_exact.py" "$ROOT/pallas_kernels/mla_exact.py"; then
  echo "warning: ab_base/mla_exact.py is this tree's own mla_exact.py: both sides run the same kernel" >&2
fi
nvidia-smi --query-gpu=name --format=csv,noheader
B="python -m experiments.breakdown --out_dir=$R --methods=ar,ddtree --budgets=16 --context=1024 --repeats=5"
which_kernel() {  # the mla_exact.py that python imports from the current folder, and its hash
  python -c "import hashlib, pallas_kernels.mla_exact as m; print(m.__file__, hashlib.sha1(open(m.__file__, 'rb').read()).hexdigest()[:12])"
}
run() {  # name, flags...: one breakdown, its table printed, its log kept beside the records
  local name=$1
  shift
  local t0=$SECONDS
  timeout 100 $B "$@" --name="$name" >"$R/$name.log" 2>&1
  echo "== $name: rc $? in $((SECONDS - t0)) s"
  grep '^|' "$R/$name.log" | tail -4
}
t0=$SECONDS
which_kernel
run breakdown_exact_ctx1024_latency --exact
rm -rf /tmp/base && mkdir /tmp/base && tar -C "$ROOT" --exclude=./.venv -cf - . | tar -C /tmp/base -xf - &&
  cp "$ROOT/ab_base/mla_exact.py" /tmp/base/pallas_kernels/mla_exact.py || exit 1
cd /tmp/base || exit 1
which_kernel
run breakdown_exact_ctx1024_base --exact
run breakdown_noexact_ctx1024 --noexact
echo "== all $((SECONDS - t0)) s"
tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$R"
