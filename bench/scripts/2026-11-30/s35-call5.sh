#!/usr/bin/env bash
# Session 35, call 5 (H200 host): the FP4 CPU experts inside decode, this build only, four rounds:
# NVFP4 (Qwen3-30B-A3B's config with ModelOpt NVFP4 experts, 8 layers) and MXFP4 (gpt-oss-120b's
# preset, 4 layers, experts as OpenAI publishes them), each in the hybrid (CPU experts alone; the
# share of the in-run probe) and in the CPU engine (against the probes right before and after each
# run); INT4 g128 of the NVFP4 weights in the hybrid for reference. 64 tokens after 512.
B=device-bundle; N=$B/bin/krasis; Q=/tmp/q3nv; G=/tmp/oss
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
[ -f $Q/config.json ] || { T "synth q3nv"; $N synth --config scripts/configs/qwen3-30b-a3b-nvfp4.json --layers 8 --out $Q 2>&1 | tail -1; }
[ -f $G/config.json ] || { T "synth oss"; $N synth --preset gpt-oss-120b --layers 4 --out $G 2>&1 | tail -1; }
T "caches"
$N convert --model $Q 2>&1 | grep -E "expert cache" | cut -c1-160
$N convert --model $Q --cpu-expert-bits 4 2>&1 | grep -E "expert cache" | cut -c1-160
$N convert --model $G 2>&1 | grep -E "expert cache" | cut -c1-160
for r in 1 2 3 4; do
  for m in "nvfp4 $Q auto" "int4 $Q 4" "mxfp4 $G auto"; do
    set -- $m
    T "r$r hybrid $1"
    timeout 120 $N bench --model $2 --device hybrid --cache-strategy none --cpu-expert-bits $3 --prompt-tokens 512 --decode-tokens 64 2>&1 | grep -E "decode 64|per token:"
  done
  for m in "nvfp4 $Q" "mxfp4 $G"; do
    set -- $m
    T "r$r cpu $1"
    timeout 120 $N bench --model $2 --device cpu --prompt-tokens 512 --decode-tokens 64 --decode-reps 2 2>&1 | grep -E "decode 64|bytes/token|all weights against" | cut -c1-330
  done
done
T done
