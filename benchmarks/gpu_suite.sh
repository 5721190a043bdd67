#!/usr/bin/env bash
# The per-op suite (`fusepass bench`) on one GPU in two commands, each under
# the device's ten-minute limit per command:
#
#   FUSEPASS_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_suite.sh norms-gdn
#   FUSEPASS_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_suite.sh dequant
#
# (or `all` in one command where the limit allows).  Each part writes its folder
# (table, JSON, CSV, plots) to $OUT/bench-<part> and prints how long it took,
# set-up included, and where the time went.
set -u
T0=$SECONDS
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "set-up: $((SECONDS - T0)) s"
part() {  # name, ops
  local t=$SECONDS
  PYTHONPATH=${PYTHONPATH:-}:/tmp/site-fla python3 -m fusepass.cli bench --ops "$2" --out "$OUT/bench-$1" \
    ${BENCH_ARGS:-} > "$OUT/bench-$1.log" 2>&1
  echo "== $1: exit $?, $((SECONDS - t)) s"; tail -n 80 "$OUT/bench-$1.log"
}
case ${1:-all} in
  norms-gdn) part norms-gdn rms_norm,add_rms_norm,swiglu,geglu,rms_norm_gated,gdn ;;
  dequant)   part dequant dequant_matmul ;;
  gdn)       part gdn gdn ;;
  all)       part norms-gdn rms_norm,add_rms_norm,swiglu,geglu,rms_norm_gated,gdn; part dequant dequant_matmul ;;
  *) echo "gpu_suite.sh: no part '$1' (norms-gdn, dequant, gdn, all)"; exit 2 ;;
esac
echo "total: $((SECONDS - T0)) s"
