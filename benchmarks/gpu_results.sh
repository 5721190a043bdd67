#!/usr/bin/env bash
# The GPU suite behind BENCHMARKS.md: every per-op benchmark and every
# whole-model row, then the page regenerated from their JSON.
#
#   pip install -e ".[bench]" liger-kernel flash-linear-attention gemlite torchao   # once: fusepass and the peers
#   bash benchmarks/gpu_results.sh                  # every part (about 50 min on one H100)
#   bash benchmarks/gpu_results.sh ops-norms-gdn ops-dequant page                   # some parts
#   bash benchmarks/gpu_results.sh --cpu-smoke [parts]   # the same commands on a CPU: tiny models, quick shapes
#
# Each part is one command under ten minutes (its limit below is about 1.5x
# what it took on an H100); a part that runs out is said so and the next one
# starts.  Outputs go to $RESULTS (default gpu-results/, ignored by git): a
# folder per part with its table, JSON, CSV and plots, a log per part; `page`
# writes BENCHMARKS.md from everything there, so parts run in separate
# commands on one machine add up.  Where $OUT names a folder (a runner that
# sends back what is written there), $RESULTS and BENCHMARKS.md are copied into
# it at the end.  The commit recorded is the checkout's (or FUSEPASS_COMMIT
# where the tree has no git history).
#
# Parts and their time on an H100 (earlier runs, set-up excluded):
#   ops-norms-gdn   rms_norm, add_rms_norm, swiglu, geglu, rms_norm_gated, gdn   ~250 s
#   ops-dequant     dequant_matmul (int8, int4, fp8; peers torchao, gemlite)      ~165 s
#   llama-decode    Llama-3-8B, 32 layers, B1: bf16 Inductor/fusepass, int8, int4 ~340 s
#   llama-prefill   Llama-3-8B, 32 layers, prefill T 512-8192 and decode B32      ~400 s
#   qwen-prefill    Qwen3.5-9B-shaped, 4 layers, prefill T 512-8192              ~420 s
#   qwen-decode     Qwen3.5-9B-shaped, 4 layers, decode B1 and B32               ~360 s
#   qwen3-decode    Qwen3-8B, 36 layers, decode B1                                ~275 s
#   startup         cold and warm start, Llama-3-8B 4 layers and Qwen3.5 T 4096   ~510 s
#   torchao         Llama-3-8B with torchao's Int8WeightOnlyConfig, decode B1     ~305 s
#   page            BENCHMARKS.md from $RESULTS                                    ~2 s
set -u
SMOKE=
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; shift; fi
RESULTS=${RESULTS:-gpu-results}
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1
OPS="python3 -m fusepass.cli bench"
TINY=
LLAMA="--model llama3-8b --layers full"
LLAMA4="--model llama3-8b --layers 4"
QWEN3="--model qwen3-8b --layers full"
# flash-linear-attention hidden from the whole-model rows: with it importable,
# transformers runs Gated DeltaNet on its kernels and the Qwen3.5 rows would
# time those, not the PyTorch code fusepass rewrites.
QWEN35="--model qwen3.5-9b --layers 4 --hide fla"
PAGE=BENCHMARKS.md
if [ -n "$SMOKE" ]; then  # every command as on the GPU; the last occurrence of an option wins
  OPS="$OPS --quick"
  TINY="--quick --device cpu --prefill 32 --prompt 16 --new-tokens 8 --batch 1 --repeat 1"
  LLAMA="--model tiny-llama --layers full"; LLAMA4="--model tiny-llama --layers 2"; QWEN3=$LLAMA
  QWEN35="--model tiny-qwen3.5 --layers 4 --hide fla"
  PAGE="$RESULTS/BENCHMARKS.md"
fi
L="$LLAMA --batch 1 --prompt 64 --new-tokens 64"
Q="$QWEN35"

run() {  # part, limit (s), command...
  local part=$1 limit=$2; shift 2
  local t=$SECONDS
  [ -n "$SMOKE" ] && limit=$((limit * 4))  # a 2-core CPU compiles slower than an H100's host
  echo "== $part (limit ${limit} s): $*"
  timeout "$limit" "$@" >> "$RESULTS/$part.log" 2>&1
  echo "   exit $?, $((SECONDS - t)) s"
}
e2e() {  # part, limit (s), fusepass bench e2e arguments...
  local part=$1 limit=$2; shift 2
  run "$part" "$limit" python3 -m fusepass.cli bench e2e "$@" $TINY
}

part() {
  case $1 in
    ops-norms-gdn) run "$1" 400 $OPS --ops rms_norm,add_rms_norm,swiglu,geglu,rms_norm_gated,gdn \
                     --out "$RESULTS/ops-norms-gdn" ;;
    ops-dequant)   run "$1" 300 $OPS --ops dequant_matmul --out "$RESULTS/ops-dequant" ;;
    llama-decode)  e2e "$1" 240 $L --phases decode,replay --backends inductor,fusepass --out "$RESULTS/e2e/llama-bf16"
                   e2e "$1" 180 $L --phases decode,replay --backends fusepass --quantize int8 --out "$RESULTS/e2e/llama-int8"
                   e2e "$1" 180 $L --phases decode,replay --backends fusepass --quantize int4 --out "$RESULTS/e2e/llama-int4" ;;
    llama-prefill) e2e "$1" 360 $LLAMA --phases prefill --prefill 512,2048,8192 \
                     --backends eager,inductor,fusepass --out "$RESULTS/e2e/llama-prefill"
                   e2e "$1" 300 $L --batch 32 --phases decode,replay --backends inductor,fusepass --out "$RESULTS/e2e/llama-b32" ;;
    # Inductor last: its compile of the unrolled chunk loop grows with T.
    qwen-prefill)  e2e "$1" 560 $Q --phases prefill --prefill 512,2048,8192 --backends eager,fusepass,inductor \
                     --max-seconds 450 --out "$RESULTS/e2e/qwen-prefill" ;;
    qwen-decode)   e2e "$1" 150 $Q --phases decode,replay --prompt 128 --new-tokens 64 --batch 1 \
                     --backends inductor,fusepass --out "$RESULTS/e2e/qwen-decode"
                   e2e "$1" 300 $Q --phases decode,replay --prompt 128 --new-tokens 64 --batch 32 \
                     --backends inductor,fusepass --out "$RESULTS/e2e/qwen-b32" ;;
    qwen3-decode)  e2e "$1" 420 $QWEN3 --batch 1 --prompt 64 --new-tokens 64 \
                     --phases decode,replay --backends inductor,fusepass --out "$RESULTS/e2e/qwen3-decode" ;;
    startup)       e2e "$1" 240 $LLAMA4 --phases startup --repeat 1 --backends inductor,fusepass \
                     --out "$RESULTS/e2e/llama-startup"
                   e2e "$1" 360 $Q --phases startup --repeat 1 --prompt 4096 --backends inductor,fusepass \
                     --child-timeout 300 --out "$RESULTS/e2e/qwen-startup" ;;
    torchao)       e2e "$1" 480 $L --phases decode --backends inductor,fusepass --quantize torchao-int8 \
                     --out "$RESULTS/e2e/torchao" ;;
    page)          python3 -m fusepass.bench.page "$RESULTS" --out "$PAGE" ;;
    *) echo "gpu_results.sh: no part '$1'"; return 2 ;;
  esac
}

T0=$SECONDS
[ -z "$SMOKE" ] && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
PARTS=${*:-"ops-norms-gdn ops-dequant llama-decode llama-prefill qwen-prefill qwen-decode qwen3-decode startup torchao page"}
for p in $PARTS; do part "$p"; done
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp -r "$RESULTS" "$OUT"/ && { [ -z "$SMOKE" ] && [ -f BENCHMARKS.md ] && cp BENCHMARKS.md "$OUT"/ || true; }
fi
echo "total: $((SECONDS - T0)) s"
