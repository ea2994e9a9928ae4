#!/usr/bin/env bash
# Session 42, call 5 (H200, the machine of calls 3 and 4, still warm with their prep): gpt-oss-120b at 4 layers,
# alternated rounds until 100 s in: this build with the GPU's own weights INT8, its defaults, llama.cpp -ot exps=CPU
# on the MXFP4 GGUF.
start=$(date +%s)
K=device-bundle/bin/krasis; LB=/tmp/lb; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
T() { echo "[+$(( $(date +%s) - start ))s] $*"; }
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
I8="--attention-quant int8 --shared-expert-quant int8 --dense-mlp-quant int8 --lm-head-quant int8"
for r in 1 2 3 4 5; do
  [ $(( $(date +%s) - start )) -lt 100 ] || break
  T "r$r gpt-oss int8 gpu weights"; timeout 30 $K $KH --model $W/oss $I8 2>&1 | grep -E "decode 64|per token:|in-run probe|error"
  T "r$r gpt-oss default"; timeout 30 $K $KH --model $W/oss 2>&1 | grep -E "decode 64|per token:|in-run probe|error"
  T "r$r llama.cpp gpt-oss MXFP4"; timeout 30 $LB/bin/llama-bench -m $W/oss-mxfp4.gguf -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | grep -E "tg64|error"
done 2>&1 | tee $OUT/bench.log
T done
