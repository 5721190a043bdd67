#!/bin/bash
# The quantized-linear measurements of the int4 work, on one GPU, in one go
# (about 6 minutes on an H100; fusepass and gemlite installed with pip):
#   1. the GPU tests of the dequant_matmul kernels;
#   2. the small-M sweep: int4 at M = 1, 16, 64, int8 and fp8 at M = 16, on
#      Llama-3-8B's shapes and the 3584/18944 stack's (outside the plan table),
#      with the heuristic timed beside the fastest config, and a %-of-floor
#      table; the fastest configs as plan files (to merge into the shipped table);
#   3. benchmarks/int4_floor.py: the acceptance stacks, fusepass against bf16
#      under Inductor and against the floor.
# Each step runs under faulthandler with its exit status printed: a sweep of
# an earlier version ended silently twice after its header (H100, d27199b),
# and its kernels ran correctly when launched alone.
#   STEPS=tests,sweeps bash benchmarks/gpu_int4.sh     (~7 min; from the repository root)
#   STEPS=floor GEMLITE=1 bash benchmarks/gpu_int4.sh   (~4 min; with gemlite)
# Logs and plan files go to $OUT (default gpu-out/int4, ignored by git).  The
# user's plan cache is left out: the plans measured are the shipped ones and
# the heuristic's.
set -u
STEPS=${STEPS:-tests,sweeps,floor}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
OUT=${OUT:-gpu-out/int4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEPASS_DEQUANT_MATMUL_CACHE=
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
PY="python -X faulthandler"

if has tests; then
timeout 150 $PY -m pytest -q -x -m gpu tests/test_dequant_matmul_kernels.py 2>&1 | tail -4
echo "tests: exit ${PIPESTATUS[0]}"
fi

if has sweeps; then
S="$PY benchmarks/sweep_dequant_matmul_small_m.py --rep 5 --no-hot --quick"
timeout 120 $S --formats int4 --ms 1 --shapes 4096x4096,14336x4096,4096x14336,1024x4096,18944x3584,3584x18944 \
  --plans "$OUT/plans_int4_m1.json" > "$OUT/sweep_int4_m1.log" 2>&1
echo "sweep int4 M1: exit $?"; grep -E "^\||Error|error|Fatal" "$OUT/sweep_int4_m1.log" | head -40
timeout 130 $S --formats int4 --ms 16,64 --shapes 4096x4096,14336x4096,4096x14336,18944x3584,3584x18944 \
  --plans "$OUT/plans_int4_m16_64.json" > "$OUT/sweep_int4_m16_64.log" 2>&1
echo "sweep int4 M16,64: exit $?"; grep -E "^\||Error|error|Fatal" "$OUT/sweep_int4_m16_64.log" | head -40
timeout 80 $S --formats int8,fp8 --ms 16 --shapes 4096x4096,14336x4096,4096x14336,18944x3584 \
  --plans "$OUT/plans_int8_fp8_m16.json" > "$OUT/sweep_int8_fp8.log" 2>&1
echo "sweep int8/fp8 M16: exit $?"; grep -E "^\||Error|error|Fatal" "$OUT/sweep_int8_fp8.log" | head -30
fi

if has floor; then
timeout 280 $PY benchmarks/int4_floor.py --out "$OUT/floor" --ms 1,16,64 --formats bf16,int4,int8,fp8 \
  ${GEMLITE:+--gemlite} > "$OUT/floor.log" 2>&1
echo "int4_floor: exit $?"; grep -E "^\||Error|Fatal" "$OUT/floor.log" | tail -80
fi
