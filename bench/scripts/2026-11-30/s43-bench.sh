#!/usr/bin/env bash
# Session 43, after `GLM_LAYERS=8 OSS_LAYERS=6 OW=/dev/shm SECTIONS=prep bash scripts/device-fp4.sh` on the same
# machine: glm-4.5-air at 8 layers (one dense, seven MoE) and gpt-oss-120b at 6, hybrid decode of 64 tokens after
# a 512-token prompt with the CPU experts alone (`--cache-strategy none`), alternated rounds: Krasis' defaults
# (BF16 GPU weights); Krasis with the GPU's own weights INT8 per output row (attention, shared experts, dense MLP,
# head; finer than llama.cpp's Q4_K_M, whose Q4_K / Q6_K blocks cover the same tensors); llama.cpp -ngl 99
# -ot exps=CPU -t $(nproc) (glm Q4_K_M, gpt-oss MXFP4). DEADLINE (epoch seconds): no round starts after it.
B=device-bundle; K=$B/bin/krasis; LB=/tmp/lb; W=/tmp; OW=${OW:-/dev/shm}
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
DEADLINE=${DEADLINE:-$(( t0 + 300 ))}
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
I8="--attention-quant int8 --shared-expert-quant int8 --dense-mlp-quant int8 --lm-head-quant int8"
fig() { grep -E "decode 64|per token:|in-run probe|error|panick" | grep -v compiled; }
llama_tg() { timeout 100 $LB/bin/llama-bench -m "$1" -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | grep -E "tg64|error"; }
for r in $(seq "${ROUNDS:-8}"); do
  [ "$(date +%s)" -lt "$DEADLINE" ] || break
  T "r$r glm default"; timeout 90 $K $KH --model $W/glm --cpu-expert-bits 4 2>&1 | fig
  T "r$r glm int8 gpu weights"; timeout 90 $K $KH --model $W/glm --cpu-expert-bits 4 $I8 2>&1 | fig
  T "r$r llama.cpp glm Q4_K_M"; llama_tg $W/glm-q4km.gguf
  [ "$(date +%s)" -lt "$(( DEADLINE + 30 ))" ] || break
  T "r$r gpt-oss default"; timeout 90 $K $KH --model $OW/oss 2>&1 | fig
  T "r$r gpt-oss int8 gpu weights"; timeout 90 $K $KH --model $OW/oss $I8 2>&1 | fig
  T "r$r llama.cpp gpt-oss MXFP4"; llama_tg $OW/oss-mxfp4.gguf
done
T done
