#!/usr/bin/env bash
# One GPU session: versions, the GPU tests, the demo, then every per-op
# benchmark (`fusepass bench`).  Writes logs and the benchmark folder (table,
# JSON, CSV, plots) under $OUT (or ./gpu-out).  Liger-Kernel is picked up from
# .whl/ when a wheel was carried there.  End-to-end runs are separate commands
# (`fusepass bench e2e ...`: see BENCHMARKS.md).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FUSEPASS_COMMIT=${FUSEPASS_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
# Peers from .whl/: flash-linear-attention goes to its own folder, on the path
# of the per-op benchmark only (installed, it is what transformers runs for
# Gated DeltaNet, and the tests here check fusepass on transformers' own
# path); gemlite is a source tree (.whl/gemlite_src/gemlite).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v fla_core) \
    && export PYTHONPATH=/tmp/site
  ls .whl/fla_core*.whl >/dev/null 2>&1 \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla .whl/fla_core*.whl
fi
[ -d .whl/gemlite_src ] && export PYTHONPATH=${PYTHONPATH:-}:$PWD/.whl/gemlite_src
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch; torch._dynamo.lookup_backend('fusepass'); print('backend resolves')"
timeout ${TEST_TIMEOUT:-360} python3 -m pytest -q -x -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout ${RULES_TIMEOUT:-150} python3 -m pytest -q tests/test_rules.py -p no:cacheprovider 2>&1 | tee "$OUT/rules_cuda.log" | tail -5
timeout 180 python3 -m fusepass.cli demo --model qwen3_5 --quantize int8 --json "$OUT/demo_report.json" 2>&1 | tee "$OUT/demo.log" | tail -25
PYTHONPATH=$PYTHONPATH:/tmp/site-fla timeout ${BENCH_TIMEOUT:-300} python3 -m fusepass.cli bench --out "$OUT/bench" --max-seconds $(( ${BENCH_TIMEOUT:-300} - 60 )) ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
