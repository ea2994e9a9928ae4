#!/usr/bin/env bash
# Session 42, after `SECTIONS=prep bash scripts/device-fp4.sh` on the same machine: glm-4.5-air and gpt-oss-120b at
# 4 layers, hybrid decode with the CPU experts alone, alternated rounds: this build's defaults; this build and the
# build before (bin/krasis-old, 0e3d906) with the GPU's own weights INT8 per output row (attention, shared
# experts, dense MLP, head; finer than llama.cpp's Q4_K_M, whose Q4_K / Q6_K blocks cover the same tensors);
# llama.cpp -ot exps=CPU (glm Q4_K_M, gpt-oss MXFP4).
B=device-bundle; K=$B/bin/krasis; KO=$B/bin/krasis-old; LB=/tmp/lb; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-$(( t0 + 200 ))}   # epoch seconds: no round starts after it
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
I8="--attention-quant int8 --shared-expert-quant int8 --dense-mlp-quant int8 --lm-head-quant int8"
fig() { grep -E "decode 64|per token:|in-run probe|error" | grep -v compiled; }
llama_tg() { timeout 100 $LB/bin/llama-bench -m "$1" -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | grep -E "tg64|error"; }
for r in 1 2 3 4 5 6; do
  [ "$(date +%s)" -lt "$DEADLINE" ] || break
  T "r$r glm default"; timeout 60 $K $KH --model $W/glm --cpu-expert-bits 4 2>&1 | fig
  T "r$r glm int8 gpu weights"; timeout 60 $K $KH --model $W/glm --cpu-expert-bits 4 $I8 2>&1 | fig
  T "r$r glm int8 gpu weights, build before"; timeout 60 $KO $KH --model $W/glm --cpu-expert-bits 4 $I8 2>&1 | fig
  T "r$r llama.cpp glm Q4_K_M"; llama_tg $W/glm-q4km.gguf
  T "r$r gpt-oss int8 gpu weights"; timeout 60 $K $KH --model $W/oss $I8 2>&1 | fig
  T "r$r gpt-oss default"; timeout 60 $K $KH --model $W/oss 2>&1 | fig
  T "r$r llama.cpp gpt-oss MXFP4"; llama_tg $W/oss-mxfp4.gguf
done
T "all-GPU glm decode, int8 linears, GPU profile: this build, then the build before"
for k in $K $KO; do
  KRASIS_GPU_PROFILE=1 timeout 60 $k bench --device gpu --model $W/glm --prompt-tokens 512 --decode-tokens 64 $I8 2>&1 | grep -E "^decode:|decode 64"
done
T done
