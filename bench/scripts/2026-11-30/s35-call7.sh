#!/usr/bin/env bash
# Session 35, call 7 (H200, after call 6's prep on the same machine): #40's hybrid decode, the
# build before this session (krasis-old, 663108b) and this one (krasis: the FP4 M = 2 loop and w2
# runs of >= 128 columns) alternated, three rounds,
# each round beside llama.cpp's llama-bench on the same weights (glm Q4_K_M, gpt-oss MXFP4;
# -ngl 99 -ot exps=CPU, all cores). glm-4.5-air and gpt-oss-120b at 4 layers; Krasis at
# --cache-strategy none (the CPU experts alone), glm --cpu-expert-bits 4, gpt-oss at auto (MXFP4
# as stored), 64 tokens after 512; KRASIS_GPU_PROFILE=1 for the device time per part.
B=device-bundle; K=$B/bin/krasis; KO=$B/bin/krasis-old; LB=/tmp/lb; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_GPU_PROFILE=1
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
fig() { grep -E "decode 64|per token:|in-run probe|GPU profile over 64" | grep -v compiled; }
llama_tg() { timeout 100 $LB/bin/llama-bench -m "$1" -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | grep -E "tg64|error"; }
for r in 1 2 3; do
    [ $(( $(date +%s) - t0 )) -lt 290 ] || break
    for b in old new; do k=$K; [ $b = old ] && k=$KO
        T "r$r $b glm"; timeout 90 $k $KH --model $W/glm --cpu-expert-bits 4 2>&1 | fig
    done
    T "r$r llama.cpp glm Q4_K_M"; llama_tg $W/glm-q4km.gguf
    for b in old new; do k=$K; [ $b = old ] && k=$KO
        T "r$r $b gpt-oss"; timeout 90 $k $KH --model $W/oss 2>&1 | fig
    done
    T "r$r llama.cpp gpt-oss MXFP4"; llama_tg $W/oss-mxfp4.gguf
done
T done
