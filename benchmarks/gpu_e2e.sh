#!/usr/bin/env bash
# The end-to-end rows of BENCHMARKS.md in one GPU session, most wanted first,
# each under its own time limit (a step that runs out is listed in the log,
# the next one starts).  Logs and each run's folder (table, JSON, CSV, plots,
# profiles) go to $OUT/e2e.tgz.  Peers are picked up from .whl/ as in
# gpu_check.sh (torchao for --quantize torchao-int8).  STEPS picks a subset:
#
#   STEPS="llama-startup qwen-startup" FUSEPASS_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_e2e.sh
#
# BUDGET (seconds, default none) caps the whole script: a step's limit shrinks
# to what is left and a step with under a minute left is skipped, so that the
# archive is written before an outer time limit (a device call's) ends it.
set -u
T0=$SECONDS
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/e2e"
# flash-linear-attention stays off the path: with it installed, transformers
# routes Gated DeltaNet to its kernels and the Qwen3.5 rows would time those.
source "$(dirname "$0")/gpu_env.sh"
E="python3 -m fusepass.cli bench e2e"
L="--model llama3-8b --layers full --batch 1 --prompt 64 --new-tokens 64"
Q="--model qwen3.5-9b --layers 4"
# Steps run in the order of STEPS, those not yet in BENCHMARKS.md first; the limits are about 1.5x what
# each took on an H100 where it ran (d624c1b: llama-startup 160 s,
# qwen-startup 350 s, qwen-decode 55 s, llama-bf16 100 s per backend,
# llama-int8 115 s; 8914f03: llama-int4 about 120 s, llama-prefill and
# llama-b32 about 400 s together; 7cb579e: qwen3-decode 275 s; c11019f:
# torchao 305 s, Inductor's compile with coordinate-descent tuning 200 s of it).
STEPS=${STEPS:-"qwen-prefill qwen-b32 torchao-profile torchao qwen3-decode llama-int4 llama-prefill llama-b32 llama-startup qwen-startup qwen-decode llama-bf16 llama-int8"}

run_step() {  # name, seconds, arguments...
  local name=$1 limit=$2; shift 2
  if [ -n "${BUDGET:-}" ]; then
    local left=$((BUDGET - (SECONDS - T0) - 15))
    if [ "$left" -lt 60 ]; then echo "== $name skipped: ${left} s left of BUDGET=${BUDGET}"; return; fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "== $name (limit ${limit} s): $E $*"
  timeout "$limit" $E "$@" --out "$OUT/e2e/$name" > "$OUT/e2e/$name.log" 2>&1
  echo "   exit $?"; grep -E "^(startup|prefill|decode|replay) " "$OUT/e2e/$name.log" | cut -c1-200
}

for name in $STEPS; do
  case $name in
    llama-int4)    run_step $name 240 $L --phases decode,replay --backends fusepass --quantize int4 --profile ;;
    torchao)       run_step $name 480 $L --phases decode --backends inductor,fusepass --quantize torchao-int8 ;;
    torchao-profile) run_step $name 300 $L --phases replay --backends fusepass --quantize torchao-int8 --profile ;;
    llama-prefill) run_step $name 360 --model llama3-8b --layers full --phases prefill --prefill 512,2048,8192 --backends eager,inductor,fusepass ;;
    llama-b32)     run_step $name 360 $L --batch 32 --phases decode,replay --backends inductor,fusepass ;;
    # Inductor last: its compile of the unrolled chunk loop grows with T (146 s at T = 4096), so a
    # budget cut takes its longest prompt, not fusepass's rows.
    qwen-prefill)  run_step $name 540 $Q --phases prefill --prefill 512,2048,8192 --backends eager,fusepass,inductor \
                     --max-seconds 420 ;;
    qwen-b32)      run_step $name 300 $Q --phases decode,replay --prompt 128 --new-tokens 64 --batch 32 \
                     --backends inductor,fusepass ;;
    qwen3-decode)  run_step $name 420 --model qwen3-8b --layers full --batch 1 --prompt 64 --new-tokens 64 --phases decode,replay --backends inductor,fusepass ;;
    llama-startup) run_step $name 200 --model llama3-8b --layers 4 --phases startup --repeat 1 --backends inductor,fusepass ;;
    qwen-startup)  run_step $name 420 $Q --phases startup --repeat 1 --prompt 4096 --backends inductor,fusepass --child-timeout 300 ;;
    qwen-decode)   run_step $name 120 $Q --phases decode,replay --prompt 128 --new-tokens 64 --batch 1 --backends inductor,fusepass ;;
    llama-bf16)    run_step $name 300 $L --phases decode,replay --backends inductor,fusepass --profile ;;
    llama-int8)    run_step $name 240 $L --phases decode,replay --backends fusepass --quantize int8 --profile ;;
    *) echo "== $name: no such step" ;;
  esac
done
(cd "$OUT" && tar czf e2e.tgz e2e && rm -rf e2e)
