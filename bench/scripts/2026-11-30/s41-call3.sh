#!/usr/bin/env bash
# Session 41 call 3: diagnostic build 2 (host-side timestamps per decode step; not committed): glm-4.5-air 4 layers,
# hybrid and all-GPU: where the launching thread's time goes between the GPU's end of one step and the start of the next.
B=device-bundle; K=$B/bin/krasis; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 128 --model $W/glm --cpu-expert-bits 4"
fig() { grep -E "decode 128|per token:|in-run probe|profile|decode, |error|Error|panick|DIAGH" | grep -v compiled; }
T synth; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -1
T "warm (cache)"; timeout 200 $K $KH 2>&1 | fig | tail -3
for r in 1 2; do
T "r$r hybrid"; timeout 60 $K $KH 2>&1 | fig
T "r$r hybrid profile"; KRASIS_GPU_PROFILE=1 timeout 60 $K $KH 2>&1 | fig
T "r$r all-GPU"; KRASIS_GPU_PROFILE=1 timeout 120 $K bench --device gpu --model $W/glm --prompt-tokens 512 --decode-tokens 128 2>&1 | fig
done
T done
