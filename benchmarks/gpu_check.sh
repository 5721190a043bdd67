#!/usr/bin/env bash
# A GPU machine's check of fusepass: versions, the GPU tests, the rule tests on
# CUDA, and the README's demo, timed.  Assumes fusepass installed with pip
# (`pip install -e ".[test]"`); peers may be installed too.  Logs go to $OUT
# (default gpu-out/, ignored by git).  About 10 minutes on one H100.
#
#   bash benchmarks/gpu_check.sh
#
# flash-linear-attention, where installed, is kept out of these processes:
# transformers would run Gated DeltaNet on its kernels and the hybrid models'
# GDN rewrites would not be exercised.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
NO_FLA="import sys; sys.modules['fla'] = None"
timeout ${TEST_TIMEOUT:-420} python3 -c "$NO_FLA; import pytest; sys.exit(pytest.main(['-q', '-x', '-m', 'gpu', 'tests/', \
'-p', 'no:cacheprovider']))" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout ${RULES_TIMEOUT:-150} python3 -c "$NO_FLA; import pytest; sys.exit(pytest.main(['-q', 'tests/test_rules.py', \
'-p', 'no:cacheprovider']))" 2>&1 | tee "$OUT/rules_cuda.log" | tail -5
# README's demo: the target is under 90 s on an H100, the first process included.
T=$SECONDS
timeout 300 python3 -c "$NO_FLA; from fusepass.cli import main; sys.exit(main(['demo', '--model', 'qwen3_5_moe', \
'--quantize', 'int8', '--seq', '1', '--json', '$OUT/demo_report.json']))" 2>&1 | tee "$OUT/demo.log" | tail -30
echo "demo: exit ${PIPESTATUS[0]}, $((SECONDS - T)) s"
