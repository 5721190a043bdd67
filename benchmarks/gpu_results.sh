#!/usr/bin/env bash
# The GPU suite behind BENCHMARKS.md: every per-op benchmark and every
# whole-model row, then the page regenerated from their JSON.
#
#   pip install -e ".[bench]" liger-kernel flash-linear-attention gemlite torchao   # once: fusepass and the peers
#   bash benchmarks/gpu_results.sh                  # every part (about 50 min on one H100)
#   bash benchmarks/gpu_results.sh ops-norms-gdn ops-dequant page                   # some parts
#
# Each part is one command under ten minutes (its limit below is about 1.5x
# what it took on an H100); a part that runs out is said so and the next one
# starts.  Outputs go to $OUT (default gpu-results/, ignored by git): a folder
# per part with its table, JSON, CSV and plots, a log per part, and `page`
# writes BENCHMARKS.md from everything there.  The commit recorded is the
# checkout's (or FUSEPASS_COMMIT where the tree has no git history).
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
#   page            BENCHMARKS.md from $OUT                                        ~2 s
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
E="python3 -m fusepass.cli bench e2e"
L="--model llama3-8b --layers full --batch 1 --prompt 64 --new-tokens 64"
# flash-linear-attention hidden from the whole-model rows: with it importable,
# transformers runs Gated DeltaNet on its kernels and the Qwen3.5 rows would
# time those, not the PyTorch code fusepass rewrites.
Q="--model qwen3.5-9b --layers 4 --hide fla"

run() {  # part, limit (s), command...
  local part=$1 limit=$2; shift 2
  local t=$SECONDS
  echo "== $part (limit ${limit} s): $*"
  timeout "$limit" "$@" >> "$OUT/$part.log" 2>&1
  echo "   exit $?, $((SECONDS - t)) s"
}

part() {
  case $1 in
    ops-norms-gdn) run "$1" 400 python3 -m fusepass.cli bench --ops rms_norm,add_rms_norm,swiglu,geglu,rms_norm_gated,gdn \
                     --out "$OUT/ops-norms-gdn" ;;
    ops-dequant)   run "$1" 300 python3 -m fusepass.cli bench --ops dequant_matmul --out "$OUT/ops-dequant" ;;
    llama-decode)  run "$1" 240 $E $L --phases decode,replay --backends inductor,fusepass --out "$OUT/e2e/llama-bf16"
                   run "$1" 180 $E $L --phases decode,replay --backends fusepass --quantize int8 --out "$OUT/e2e/llama-int8"
                   run "$1" 180 $E $L --phases decode,replay --backends fusepass --quantize int4 --out "$OUT/e2e/llama-int4" ;;
    llama-prefill) run "$1" 360 $E --model llama3-8b --layers full --phases prefill --prefill 512,2048,8192 \
                     --backends eager,inductor,fusepass --out "$OUT/e2e/llama-prefill"
                   run "$1" 300 $E $L --batch 32 --phases decode,replay --backends inductor,fusepass --out "$OUT/e2e/llama-b32" ;;
    # Inductor last: its compile of the unrolled chunk loop grows with T.
    qwen-prefill)  run "$1" 560 $E $Q --phases prefill --prefill 512,2048,8192 --backends eager,fusepass,inductor \
                     --max-seconds 450 --out "$OUT/e2e/qwen-prefill" ;;
    qwen-decode)   run "$1" 150 $E $Q --phases decode,replay --prompt 128 --new-tokens 64 --batch 1 \
                     --backends inductor,fusepass --out "$OUT/e2e/qwen-decode"
                   run "$1" 300 $E $Q --phases decode,replay --prompt 128 --new-tokens 64 --batch 32 \
                     --backends inductor,fusepass --out "$OUT/e2e/qwen-b32" ;;
    qwen3-decode)  run "$1" 420 $E --model qwen3-8b --layers full --batch 1 --prompt 64 --new-tokens 64 \
                     --phases decode,replay --backends inductor,fusepass --out "$OUT/e2e/qwen3-decode" ;;
    startup)       run "$1" 240 $E --model llama3-8b --layers 4 --phases startup --repeat 1 --backends inductor,fusepass \
                     --out "$OUT/e2e/llama-startup"
                   run "$1" 360 $E $Q --phases startup --repeat 1 --prompt 4096 --backends inductor,fusepass \
                     --child-timeout 300 --out "$OUT/e2e/qwen-startup" ;;
    torchao)       run "$1" 480 $E $L --phases decode --backends inductor,fusepass --quantize torchao-int8 \
                     --out "$OUT/e2e/torchao" ;;
    page)          python3 -m fusepass.bench.page "$OUT" --out BENCHMARKS.md ;;
    *) echo "gpu_results.sh: no part '$1'"; return 2 ;;
  esac
}

T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
PARTS=${*:-"ops-norms-gdn ops-dequant llama-decode llama-prefill qwen-prefill qwen-decode qwen3-decode startup torchao page"}
for p in $PARTS; do part "$p"; done
echo "total: $((SECONDS - T0)) s"
