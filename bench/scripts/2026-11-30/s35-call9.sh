#!/usr/bin/env bash
# Session 35, call 9 (H200, same machine as calls 6-8): gpt-oss-120b at 4 layers, hybrid decode of
# this build and the build before, each round beside llama.cpp's llama-bench on the MXFP4 GGUF
# (-ngl 99 -ot exps=CPU, all cores), five rounds.
B=device-bundle; export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
for r in 1 2 3 4 5; do
  for v in new old; do
    k=$B/bin/krasis; [ $v = old ] && k=$B/bin/krasis-old
    echo "r$r $v"
    timeout 60 $k bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --model /tmp/oss 2>&1 | grep -E "decode 64|per token" | cut -c1-150
  done
  echo "r$r llama"
  timeout 60 /tmp/lb/bin/llama-bench -m /tmp/oss-mxfp4.gguf -ngl 99 -ot "exps=CPU" -t "$(nproc)" -p 0 -n 64 -r 3 -o md 2>&1 | grep -E "tg64|error"
done
