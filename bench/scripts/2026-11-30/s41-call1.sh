#!/usr/bin/env bash
# Session 41 call 1: where glm-4.5-air's (4 layers) hybrid decode token goes. KRASIS_GPU_PROFILE=1 device time per part
# (start, attention, ffn incl. the wait for the CPU, head+sampling), hybrid default / --pcie-routes 0 / INT8 head, and the
# all-GPU engine (BF16 experts resident) for the GPU chain alone.
B=device-bundle; K=$B/bin/krasis; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "machine: $(nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader); $(nproc) cores"
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --model $W/glm --cpu-expert-bits 4"
fig() { grep -E "decode 64|per token:|in-run probe|profile|decode, |error|Error|panick" | grep -v compiled; }
T synth; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -1
T "warm (cache)"; timeout 200 $K $KH --pcie-routes 0 2>&1 | fig
for r in 1 2; do
  T "r$r profile default"; KRASIS_GPU_PROFILE=1 timeout 60 $K $KH 2>&1 | fig
  T "r$r profile pcie 0"; KRASIS_GPU_PROFILE=1 timeout 60 $K $KH --pcie-routes 0 2>&1 | fig
  T "r$r default"; timeout 60 $K $KH 2>&1 | fig
  T "r$r int8 head"; timeout 60 $K $KH --lm-head-quant int8 2>&1 | fig
done
T "all-GPU BF16 profile"; KRASIS_GPU_PROFILE=1 timeout 120 $K bench --device gpu --model $W/glm --prompt-tokens 512 --decode-tokens 64 2>&1 | fig
T "all-GPU BF16 profile, int8 linears"; KRASIS_GPU_PROFILE=1 timeout 120 $K bench --device gpu --model $W/glm --prompt-tokens 512 --decode-tokens 64 --attention-quant int8 --shared-expert-quant int8 --dense-mlp-quant int8 --lm-head-quant int8 2>&1 | fig
T done
