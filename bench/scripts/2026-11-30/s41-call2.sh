#!/usr/bin/env bash
# Session 41 call 2: a diagnostic build (extra profile marks inside attention and the MoE hand-off; not committed):
# glm-4.5-air 4 layers hybrid, per-kernel device ms; then core contention: --threads 16 (default) / 15 / 14 alternated.
B=device-bundle; K=$B/bin/krasis; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --model $W/glm --cpu-expert-bits 4"
fig() { grep -E "decode 64|per token:|in-run probe|profile|decode, |error|Error|panick" | grep -v compiled; }
T synth; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -1
T "warm (cache)"; timeout 200 $K $KH 2>&1 | fig
T "diag profile default"; KRASIS_GPU_PROFILE=1 timeout 60 $K $KH 2>&1 | fig
T "diag profile --threads 15"; KRASIS_GPU_PROFILE=1 timeout 60 $K $KH --threads 15 2>&1 | fig
T "diag all-GPU"; KRASIS_GPU_PROFILE=1 timeout 120 $K bench --device gpu --model $W/glm --prompt-tokens 512 --decode-tokens 64 2>&1 | fig
for r in 1 2 3; do
  for th in 16 15 14; do
    T "r$r threads $th"; timeout 60 $K $KH --threads $th 2>&1 | fig
  done
done
T "diag profile default 256 tokens"; KRASIS_GPU_PROFILE=1 timeout 60 $K bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 256 --model $W/glm --cpu-expert-bits 4 2>&1 | fig
T done
