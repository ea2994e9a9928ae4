#!/usr/bin/env bash
# Session 41 call 9: the predicted next experts' pull between hand-offs (KRASIS_EXPERT_PREFETCH_MB, default 4): glm-4.5-air
# at 4 layers, hybrid decode, budgets 4 / 8 / 16 / 32 MiB alternated three rounds; then v2-lite at 8 layers, 4 / 16.
B=device-bundle; K=$B/bin/krasis; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T synth; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -1
$K synth --preset v2-lite --layers 8 --out $W/v2l > /tmp/v2l.log 2>&1 &
fig() { grep -E "decode 128|per token:|prediction|error|Error|panick" | grep -v compiled; }
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 128 --cpu-expert-bits 4"
T "warm (cache)"; timeout 200 $K $KH --model $W/glm 2>&1 | fig | tail -2
wait
for r in 1 2 3; do
  for mb in 4 8 16 32; do
    T "r$r glm prefetch $mb MiB"; KRASIS_EXPERT_PREFETCH_MB=$mb timeout 60 $K $KH --model $W/glm 2>&1 | fig
  done
done
T "v2l warm (cache)"; timeout 200 $K $KH --model $W/v2l 2>&1 | fig | tail -2
for r in 1 2; do
  for mb in 4 16; do
    T "r$r v2l prefetch $mb MiB"; KRASIS_EXPERT_PREFETCH_MB=$mb timeout 60 $K $KH --model $W/v2l 2>&1 | fig
  done
done
T done
