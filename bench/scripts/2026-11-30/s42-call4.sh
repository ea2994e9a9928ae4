#!/usr/bin/env bash
# Session 42, call 4 (H200, the session's last device time): glm-4.5-air alone (gpt-oss's synth is skipped on
# purpose: OSS_SYNTH is an unknown flag, so every gpt-oss step finds no config and skips), device-fp4.sh's prep, then
# alternated rounds until 425 s in: this build with the GPU's own weights INT8, llama.cpp -ot exps=CPU Q4_K_M.
start=$(date +%s)
OSS_SYNTH=--skip-gpt-oss SECTIONS=prep bash scripts/device-fp4.sh > $OUT/prep.log 2>&1
tail -3 $OUT/prep.log
K=device-bundle/bin/krasis; LB=/tmp/lb; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
T() { echo "[+$(( $(date +%s) - start ))s] $*"; }
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64"
I8="--attention-quant int8 --shared-expert-quant int8 --dense-mlp-quant int8 --lm-head-quant int8"
for r in 1 2 3 4 5 6; do
  [ $(( $(date +%s) - start )) -lt 425 ] || break
  T "r$r glm int8 gpu weights"; timeout 40 $K $KH --model $W/glm --cpu-expert-bits 4 $I8 2>&1 | grep -E "decode 64|per token:|in-run probe|error"
  T "r$r llama.cpp glm Q4_K_M"; timeout 30 $LB/bin/llama-bench -m $W/glm-q4km.gguf -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | grep -E "tg64|error"
done 2>&1 | tee $OUT/bench.log
T done
