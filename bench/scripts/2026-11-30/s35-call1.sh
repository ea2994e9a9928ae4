#!/usr/bin/env bash
# Session 35, call 1 (H200): does the w2 pipeline's group granularity hold NVFP4 back at 16 workers?
# expert GEMV (avx512) with KRASIS_MOE_W2_RUN_K = 1 (the runner before), 64, 128, 256 and
# KRASIS_MOE_W2=whole, alternated twice; then NVFP4 inside a real model's decode (Qwen3-30B-A3B,
# NVFP4 experts, 8 layers), hybrid and CPU engine, RUN_K 1 against 64 and 128.
B=device-bundle; K=$B/bin/krasis; M=/tmp/q3nv
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
lscpu | grep -E "Model name|^CPU\(s\)"
for r in 1 2; do
  for v in 1 64 128 256 whole; do
    if [ $v = whole ]; then env="KRASIS_MOE_W2=whole"; else env="KRASIS_MOE_W2_RUN_K=$v"; fi
    T "r$r expert-gemv $env"
    env $env KRASIS_ISA=avx512 $K bench --expert-gemv --gemv-isa avx512 --gemv-bytes $((3 << 30)) --membw-bytes $((4 << 30)) 2>&1 | grep -E "bandwidth|membw|int4 |mxfp4|nvfp4|int4a" | cut -c1-220
  done
done
[ -f $M/config.json ] || { T "synth"; $K synth --config scripts/configs/qwen3-30b-a3b-nvfp4.json --layers 8 --out $M 2>&1 | tail -1; }
T "caches"; $K convert --model $M 2>&1 | grep -E "routed experts|expert cache" | cut -c1-200
$K convert --model $M --cpu-expert-bits 4 2>&1 | grep -E "routed experts|expert cache" | cut -c1-200
for r in 1 2; do
  [ $(( $(date +%s) - t0 )) -lt 480 ] || break
  for v in 1 64 128; do
    T "r$r hybrid nvfp4 RUN_K=$v"
    KRASIS_MOE_W2_RUN_K=$v timeout 90 $K bench --model $M --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 2>&1 | grep -E "decode 64|in-run probe|routed experts:"
  done
  T "r$r hybrid int4"
  timeout 90 $K bench --model $M --device hybrid --cache-strategy none --cpu-expert-bits 4 --prompt-tokens 512 --decode-tokens 64 2>&1 | grep -E "decode 64|in-run probe|routed experts:"
  for v in 1 64; do
    T "r$r cpu nvfp4 RUN_K=$v"
    KRASIS_MOE_W2_RUN_K=$v timeout 90 $K bench --model $M --device cpu --prompt-tokens 512 --decode-tokens 64 --decode-reps 2 2>&1 | grep -E "decode 64|bytes/token|membw|probe" | head -6
  done
done
T done
