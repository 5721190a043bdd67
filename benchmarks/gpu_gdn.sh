#!/usr/bin/env bash
# Gated DeltaNet on one GPU, most wanted first, each step under its own time
# limit: the GPU tests of the GDN and conv kernels, compute-sanitizer memcheck
# of their every launch path (caching allocator off) with the FLA decode
# sequence once seen to fault, gdn_chunk against FLA 0.6 on the acceptance
# shapes in both input layouts (strided views + L2 norm in the kernel;
# contiguous, already normalised), decode against FLA, the short-convolution
# benchmark.  Logs and outputs go to $OUT/gdn.  STEPS picks a subset:
#
#   STEPS="gdn-vs-fla gdn-memcheck" bash benchmarks/gpu_gdn.sh
#
# Assumes fusepass and flash-linear-attention installed with pip
# (`pip install -e ".[test]" flash-linear-attention`).  BUDGET (seconds) caps
# the whole script: a step's limit shrinks to what is left.  FLA autotunes on
# its first call of every head configuration (45-65 s on an H100), which is
# most of gdn-vs-fla's and gdn-vs-fla-dims' time.
set -u
T0=$SECONDS
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/gdn"
export PYTHONUNBUFFERED=1
ISSUE="B1-T8192-H32-D128,B1-T16384-H32-D128,B2-T3000-H32-D128,B16-T1024-H32-D128,B8-T512-H32-D128,B4-T4096-Hk16-Hv32-D128"
DIMS="B1-T4096-H16-D64,B1-T4096-H16-D256,B1-T4096-H30-dk96-dv192"
STEPS=${STEPS:-"gdn-tests gdn-memcheck gdn-vs-fla gdn-decode conv-bench gdn-vs-fla-dims"}

run_step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  if [ -n "${BUDGET:-}" ]; then
    local left=$((BUDGET - (SECONDS - T0) - 15))
    if [ "$left" -lt 45 ]; then echo "== $name skipped: ${left} s left of BUDGET=${BUDGET}"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name (limit ${limit} s): $*"
  timeout "$limit" bash -c "$*" > "$OUT/gdn/$name.log" 2>&1
  echo "   exit $? ($((SECONDS - T0)) s)"; tail -n 25 "$OUT/gdn/$name.log" | cut -c1-160
}

for name in $STEPS; do
  case $name in
    gdn-tests)     run_step $name 240 "python3 -m pytest -q -m gpu tests/test_gdn_kernels.py tests/test_gdn_conv.py" ;;
    gdn-memcheck)  run_step $name 300 "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
                     --error-exitcode 9 python3 benchmarks/memcheck.py --ops gdn,conv --quick --peers" ;;
    gdn-vs-fla)    run_step $name 300 "python3 -m fusepass.bench.registry.gdn --variants split,fused --shapes $ISSUE \
                     --sweep-shapes B1-T16384-H32-D128,B2-T3000-H32-D128,B4-T4096-Hk16-Hv32-D128 \
                     --breakdown-at B1-T16384-H32-D128,B4-T4096-Hk16-Hv32-D128 --rep 50 --out $OUT/gdn" ;;
    gdn-decode)    run_step $name 180 "python3 -m fusepass.bench.registry.gdn --shapes decode-B1-H32-D128,decode-B64-H32-D128 \
                     --inductor none --eager none --out $OUT/gdn/decode" ;;
    conv-bench)    run_step $name 150 "python3 -m fusepass.cli bench --ops causal_conv1d --out $OUT/gdn/conv" ;;
    gdn-vs-fla-dims) run_step $name 300 "python3 -m fusepass.bench.registry.gdn --variants split,fused --shapes $DIMS \
                     --rep 50 --out $OUT/gdn/dims" ;;
    *) echo "unknown step $name" ;;
  esac
done
tar czf "$OUT/gdn.tgz" -C "$OUT" gdn && echo "wrote $OUT/gdn.tgz"
