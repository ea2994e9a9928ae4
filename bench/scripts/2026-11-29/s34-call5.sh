#!/usr/bin/env bash
# Session 34, call 5 (H200): NVFP4 experts inside a real model's decode (#40: the CPU FP4 kernels
# at >= 85 % of the in-run probe). Qwen3-30B-A3B's published config with ModelOpt NVFP4 experts
# (scripts/configs/qwen3-30b-a3b-nvfp4.json), cut to 8 layers; `auto` keeps NVFP4 as stored,
# against the same weights requantised to INT4 g128, alternated: hybrid decode (CPU experts alone)
# and the CPU engine's decode, 64 tokens after 512.
B=device-bundle; K=$B/bin/krasis; M=/tmp/q3nv
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
[ -f $M/config.json ] || { T "synth"; $K synth --config scripts/configs/qwen3-30b-a3b-nvfp4.json --layers 8 --out $M 2>&1 | tail -1; }
T "caches"; $K convert --model $M 2>&1 | grep -E "routed experts|expert cache" | cut -c1-200
$K convert --model $M --cpu-expert-bits 4 2>&1 | grep -E "routed experts|expert cache" | cut -c1-200
for r in 1 2 3; do
    [ $(( $(date +%s) - t0 )) -lt 420 ] || break
    for bits in auto 4; do
        T "r$r hybrid --cpu-expert-bits $bits"
        timeout 90 $K bench --model $M --device hybrid --cache-strategy none --cpu-expert-bits $bits --prompt-tokens 512 --decode-tokens 64 2>&1 | grep -E "decode 64|per token:|in-run probe|routed experts:"
    done
    for bits in auto 4; do
        T "r$r cpu --cpu-expert-bits $bits"
        timeout 90 $K bench --model $M --device cpu --cpu-expert-bits $bits --prompt-tokens 512 --decode-tokens 64 --decode-reps 2 2>&1 | grep -E "decode 64|bytes/token|membw|probe" | head -8
    done
done
T done
