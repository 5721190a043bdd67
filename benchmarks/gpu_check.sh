#!/usr/bin/env bash
# One GPU session: versions, the GPU tests, the demo, then every per-op
# benchmark (`fusepass bench`).  Writes logs and the benchmark folder (table,
# JSON, CSV, plots) under $OUT (or ./gpu-out).  Liger-Kernel is picked up from
# .whl/ when a wheel was carried there.  End-to-end runs are separate commands
# (`fusepass bench e2e ...`: see BENCHMARKS.md).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
source "$(dirname "$0")/gpu_env.sh"
python3 -c "import torch; torch._dynamo.lookup_backend('fusepass'); print('backend resolves')"
timeout ${TEST_TIMEOUT:-360} python3 -m pytest -q -x -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout ${RULES_TIMEOUT:-150} python3 -m pytest -q tests/test_rules.py -p no:cacheprovider 2>&1 | tee "$OUT/rules_cuda.log" | tail -5
timeout 180 python3 -m fusepass.cli demo --model qwen3_5 --quantize int8 --json "$OUT/demo_report.json" 2>&1 | tee "$OUT/demo.log" | tail -25
PYTHONPATH=${PYTHONPATH:-}:/tmp/site-fla timeout ${BENCH_TIMEOUT:-300} python3 -m fusepass.cli bench --out "$OUT/bench" --max-seconds $(( ${BENCH_TIMEOUT:-300} - 60 )) ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
