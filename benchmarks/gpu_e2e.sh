#!/usr/bin/env bash
# The end-to-end rows of BENCHMARKS.md in one GPU session, most wanted first,
# each under its own time limit (a step that runs out is listed in the log,
# the next one starts).  Logs and each run's folder (table, JSON, CSV, plots,
# profiles) go to $OUT/e2e.tgz.  Peers are picked up from .whl/ as in
# gpu_check.sh (torchao for --quantize torchao-int8).  STEPS picks a subset:
#
#   STEPS="llama-startup qwen-startup" FUSEPASS_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_e2e.sh
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/e2e"
export PYTHONUNBUFFERED=1 FUSEPASS_COMMIT=${FUSEPASS_COMMIT:-unknown}
if ls .whl/*.whl >/dev/null 2>&1; then
  # flash-linear-attention is left out: with it installed, transformers routes
  # Gated DeltaNet to its kernels and the Qwen3.5 rows would time those.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v fla_core) \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
E="python3 -m fusepass.cli bench e2e"
L="--model llama3-8b --layers full --batch 1 --prompt 64 --new-tokens 64"
Q="--model qwen3.5-9b --layers 4"
# Steps run in the order of STEPS, those not yet in BENCHMARKS.md first; the limits are about 1.5x what
# each took on an H100 where it ran (d624c1b: llama-startup 160 s,
# qwen-startup 350 s, qwen-decode 55 s, llama-bf16 100 s per backend,
# llama-int8 115 s; 8914f03: llama-int4 about 120 s, llama-prefill and
# llama-b32 about 400 s together).
STEPS=${STEPS:-"torchao qwen3-decode qwen-prefill llama-int4 llama-prefill llama-b32 llama-startup qwen-startup qwen-decode llama-bf16 llama-int8"}

step() {  # name, seconds, arguments...
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  echo "== $name (limit ${limit} s): $E $*"
  timeout "$limit" $E "$@" --out "$OUT/e2e/$name" > "$OUT/e2e/$name.log" 2>&1
  echo "   exit $?"; grep -E "^(startup|prefill|decode|replay) " "$OUT/e2e/$name.log" | cut -c1-200
}

step llama-int4    240 $L --phases decode,replay --backends fusepass --quantize int4 --profile
step torchao       480 $L --phases decode --backends inductor,fusepass --quantize torchao-int8
step llama-prefill 360 --model llama3-8b --layers full --phases prefill --prefill 512,2048,8192 --backends eager,inductor,fusepass
step llama-b32     360 $L --batch 32 --phases decode,replay --backends inductor,fusepass
step qwen-prefill  540 $Q --phases prefill --prefill 512,2048,8192 --backends eager,inductor,fusepass
step qwen3-decode  300 --model qwen3-8b --layers full --batch 1 --prompt 64 --new-tokens 64 --phases decode,replay --backends inductor,fusepass
step llama-startup 200 --model llama3-8b --layers 4 --phases startup --repeat 1 --backends inductor,fusepass
step qwen-startup  420 $Q --phases startup --repeat 1 --prompt 4096 --backends inductor,fusepass --child-timeout 300
step qwen-decode   120 $Q --phases decode,replay --prompt 128 --new-tokens 64 --batch 1 --backends inductor,fusepass
step llama-bf16    300 $L --phases decode,replay --backends inductor,fusepass --profile
step llama-int8    240 $L --phases decode,replay --backends fusepass --quantize int8 --profile
(cd "$OUT" && tar czf e2e.tgz e2e && rm -rf e2e)
