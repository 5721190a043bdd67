#!/usr/bin/env bash
# A GPU machine's check of fusepass: versions, the GPU tests, the rule tests on
# CUDA, and the README's demo, timed.  Assumes fusepass installed with pip
# (`pip install -e ".[test]"`); peers may be installed too.  Logs go to $OUT
# (default gpu-out/, ignored by git).
#
#   PART=models bash benchmarks/gpu_check.sh   # test_gpu.py, test_ops.py, the demo (over 400 s + 45 s, H200)
#   PART=kernels bash benchmarks/gpu_check.sh  # the quantized-linear kernel tests, own formats
#   PART=library bash benchmarks/gpu_check.sh  # the libraries' layouts (minutes: real sizes)
#   PART=rest bash benchmarks/gpu_check.sh     # every other GPU test, and the rule tests on CUDA
#   bash benchmarks/gpu_check.sh               # all four, one after another
#
# The whole GPU suite takes more than 15 minutes on an H200 (2026-11-30: the
# first 39 of 139 tests, mostly test_dequant_matmul_kernels.py, 470 s;
# test_gpu.py's 18 and three of test_ops.py's four 400 s), more than one 600 s
# command of a lent machine: hence the parts, each under its own timeout with
# its durations in its log.  flash-linear-attention, where installed, is kept
# out of these processes: transformers would run Gated DeltaNet on its kernels
# and the hybrid models' GDN rewrites would not be exercised.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PART=${PART:-all}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
NO_FLA="import sys; sys.modules['fla'] = None"

gpu_tests() {  # name, timeout, -k expression ("" for all), test paths...
  local name=$1 limit=$2 expr=$3; shift 3
  local args; args=$(printf "'%s', " "$@")
  [ -n "$expr" ] && args="$args '-k', '$expr',"
  local T=$SECONDS
  timeout "$limit" python3 -c "$NO_FLA; import pytest; sys.exit(pytest.main(['-v', '-m', 'gpu', $args \
'-p', 'no:cacheprovider', '--durations=15', '-rfE']))" > "$OUT/gpu_tests_$name.log" 2>&1
  echo "gpu tests ($name): exit $?, $((SECONDS - T)) s"
  grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests_$name.log" | tail -15
}

if [ "$PART" = all ] || [ "$PART" = models ]; then
  gpu_tests models "${TEST_TIMEOUT:-480}" "" tests/test_gpu.py tests/test_ops.py
  # README's demo: the target is under 90 s on an H100, the first process included.
  T=$SECONDS
  timeout 300 python3 -c "$NO_FLA; from fusepass.cli import main; sys.exit(main(['demo', '--model', 'qwen3_5_moe', \
'--quantize', 'int8', '--seq', '1', '--json', '$OUT/demo_report.json']))" 2>&1 | tee "$OUT/demo.log" | tail -30
  echo "demo: exit ${PIPESTATUS[0]}, $((SECONDS - T)) s"
fi
if [ "$PART" = all ] || [ "$PART" = kernels ]; then
  gpu_tests kernels "${TEST_TIMEOUT:-560}" "not library" tests/test_dequant_matmul_kernels.py
fi
if [ "$PART" = all ] || [ "$PART" = library ]; then
  gpu_tests library "${TEST_TIMEOUT:-560}" "" tests/test_dequant_library_rules.py \
    "tests/test_dequant_matmul_kernels.py::test_gpu_library_gemv_loops" \
    "tests/test_dequant_matmul_kernels.py::test_gpu_library_layouts_real_sizes"
fi
if [ "$PART" = all ] || [ "$PART" = rest ]; then
  gpu_tests rest "${TEST_TIMEOUT:-420}" "" tests/test_rms_norm_kernels.py tests/test_rms_norm_gated_kernels.py \
    tests/test_gated_act_kernels.py tests/test_gdn_kernels.py tests/test_bench.py tests/test_all_reduce_one_shot.py \
    tests/test_tp.py
  timeout "${RULES_TIMEOUT:-150}" python3 -c "$NO_FLA; import pytest; sys.exit(pytest.main(['-q', 'tests/test_rules.py', \
'-p', 'no:cacheprovider']))" 2>&1 | tee "$OUT/rules_cuda.log" | tail -5
fi
