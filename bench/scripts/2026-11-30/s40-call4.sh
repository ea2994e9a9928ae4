#!/usr/bin/env bash
# Session 40 call 4 (same machine as call 3's prep): glm-4.5-air and gpt-oss-120b at 4 layers, hybrid decode with the CPU
# experts alone, alternated rounds: Krasis --pcie-routes 0 (the build before's decode), the default (2 of 8 routes over
# PCIe), the default with the GPU linears INT8, and llama.cpp -ot exps=CPU (glm Q4_K_M, gpt-oss MXFP4); then gpt-oss.
B=device-bundle; K=$B/bin/krasis; LB=/tmp/lb; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
Q8="--attention-quant int8 --shared-expert-quant int8 --dense-mlp-quant int8 --lm-head-quant int8"
fig() { grep -E "decode 64|per token:|in-run probe|error" | grep -v compiled; }
llama_tg() { timeout 100 $LB/bin/llama-bench -m "$1" -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | grep -E "tg64|error"; }
for r in 1 2 3 4; do
  [ $(( $(date +%s) - t0 )) -lt 420 ] || break
  T "r$r glm pcie 0"; timeout 60 $K $KH --model $W/glm --cpu-expert-bits 4 --pcie-routes 0 2>&1 | fig
  T "r$r glm default"; timeout 60 $K $KH --model $W/glm --cpu-expert-bits 4 2>&1 | fig
  T "r$r glm default + int8 linears"; timeout 60 $K $KH --model $W/glm --cpu-expert-bits 4 $Q8 2>&1 | fig
  T "r$r llama.cpp glm Q4_K_M"; llama_tg $W/glm-q4km.gguf
  T "r$r gpt-oss default"; timeout 60 $K $KH --model $W/oss 2>&1 | fig
  T "r$r llama.cpp gpt-oss MXFP4"; llama_tg $W/oss-mxfp4.gguf
done
T done
