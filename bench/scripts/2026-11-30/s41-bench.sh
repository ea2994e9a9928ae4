#!/usr/bin/env bash
# Session 41, after `SECTIONS=prep bash scripts/device-fp4.sh` on the same machine: glm-4.5-air and gpt-oss-120b at
# 4 layers, hybrid decode with the CPU experts alone, alternated rounds: this build (default), the build before
# (cb6154d, default), llama.cpp -ot exps=CPU (glm Q4_K_M, gpt-oss MXFP4); then gpt-oss this build and llama.cpp.
B=device-bundle; K=$B/bin/krasis; KO=$B/bin/krasis-old; LB=/tmp/lb; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
fig() { grep -E "decode 64|per token:|in-run probe|error" | grep -v compiled; }
llama_tg() { timeout 100 $LB/bin/llama-bench -m "$1" -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | grep -E "tg64|error"; }
for r in 1 2 3; do
  [ $(( $(date +%s) - t0 )) -lt 380 ] || break
  T "r$r glm this build"; timeout 60 $K $KH --model $W/glm --cpu-expert-bits 4 2>&1 | fig
  T "r$r glm cb6154d"; timeout 60 $KO $KH --model $W/glm --cpu-expert-bits 4 2>&1 | fig
  T "r$r llama.cpp glm Q4_K_M"; llama_tg $W/glm-q4km.gguf
  T "r$r gpt-oss this build"; timeout 60 $K $KH --model $W/oss 2>&1 | fig
  T "r$r llama.cpp gpt-oss MXFP4"; llama_tg $W/oss-mxfp4.gguf
done
T done
