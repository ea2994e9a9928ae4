#!/usr/bin/env bash
# Session 43, call 6 (H200, a fresh machine): #40's "the CPU FP4 experts stream at ≥ 85 % of the in-run probe
# inside decode, as INT4 does", with the hybrid bench now printing the probe's five repetitions and the share
# against their median too. Alternated rounds on one synthetic model, Qwen3-30B-A3B's config with ModelOpt NVFP4
# experts at 8 layers: NVFP4 kept as stored (`auto`) against INT4 g128 of the same weights (`--cpu-expert-bits 4`);
# then gpt-oss-120b at 4 layers, MXFP4 as stored. Hybrid decode of 64 tokens after 512, the CPU experts alone.
K=device-bundle/bin/krasis; M=/dev/shm/q3nv; O=/dev/shm/oss4
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
fig() { grep -E "decode 64|per token:|in-run probe|routed experts on the CPU|error|panick" | grep -v compiled | cut -c1-330; }
[ -f $M/config.json ] || { T "synth nvfp4"; timeout 120 $K synth --config scripts/configs/qwen3-30b-a3b-nvfp4.json --layers 8 --out $M 2>&1 | tail -1; }
[ -f $O/config.json ] || { T "synth gpt-oss"; timeout 120 $K synth --preset gpt-oss-120b --layers 4 --out $O 2>&1 | tail -1; }
for r in $(seq 12); do
  [ $(( $(date +%s) - t0 )) -lt 200 ] || break
  T "r$r nvfp4 as stored"; timeout 120 $K $KH --model $M 2>&1 | fig
  T "r$r int4 g128 of the same weights"; timeout 120 $K $KH --model $M --cpu-expert-bits 4 2>&1 | fig
done
for r in $(seq 12); do
  [ $(( $(date +%s) - t0 )) -lt 330 ] || break
  T "r$r gpt-oss mxfp4 as stored"; timeout 150 $K $KH --model $O 2>&1 | fig
done
T done
