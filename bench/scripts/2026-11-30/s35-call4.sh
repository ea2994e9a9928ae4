#!/usr/bin/env bash
# Session 35, call 4 (H200 host): asymmetric INT4 g32 (`4a`) inside decode after the w2 runs of
# >= 128 columns, against INT4 g128 and against the build before (krasis-old, 663108b): v2-lite at
# 8 layers, CPU engine, 64 tokens after 512, three alternated rounds; then the hybrid (CPU experts
# alone) once per format.
B=device-bundle; W=/tmp/v2l8
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
N=$B/bin/krasis; O=$B/bin/krasis-old
[ -f $W/config.json ] || { T "synth"; $N synth --preset v2-lite --layers 8 --out $W 2>&1 | tail -1; }
T "caches"
for bits in 4 4a; do $N convert --model $W --cpu-expert-bits $bits 2>&1 | grep -E "expert cache" | cut -c1-160; done
for r in 1 2 3; do
  for run in "new 4a" "new 4" "old 4a"; do
    set -- $run; K=$N; [ $1 = old ] && K=$O
    T "r$r $1 cpu --cpu-expert-bits $2"
    timeout 90 $K bench --model $W --device cpu --cpu-expert-bits $2 --prompt-tokens 512 --decode-tokens 64 --decode-reps 2 2>&1 | grep -E "decode 64|bytes/token|all weights against" | cut -c1-330
  done
done
for bits in 4a 4; do
  T "new hybrid --cpu-expert-bits $bits"
  timeout 120 $N bench --model $W --device hybrid --cache-strategy none --cpu-expert-bits $bits --prompt-tokens 512 --decode-tokens 64 2>&1 | grep -E "decode 64|per token:|in-run probe"
done
T done
