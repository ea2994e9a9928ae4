#!/bin/bash
# On the warm GPU box after `peer/device.sh ... hybrid` (which leaves /tmp/v2l, /tmp/v2l-q4km.gguf and
# llama.cpp in /tmp/lb): v2-lite as llama.cpp's Q4_K_M GGUF through Krasis
# (CPU and hybrid decode) beside the safetensors-sourced INT4 path and llama.cpp on the same file.
K=${K:-$(dirname "$0")/bin/krasis}; G=/tmp/v2l-q4km.gguf; LB=/tmp/lb/bin/llama-bench
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
rm -f /tmp/v2l-q8.gguf
T "machine $(nvidia-smi --query-gpu=name --format=csv,noheader) $(nproc) cores; disk $(df -h /tmp | tail -1 | awk '{print $4}') free"
T "info on the GGUF"; timeout 120 $K info --model $G 2>&1 | tail -8
T "convert GGUF -> INT4 cache"; timeout 400 $K convert --model $G --cpu-expert-bits 4 --cache-dir /tmp/kc-gguf 2>&1 | tail -2
T "convert safetensors -> INT4 cache"; timeout 200 $K convert --model /tmp/v2l --cpu-expert-bits 4 --cache-dir /tmp/kc-st 2>&1 | tail -1
for i in 1 2; do
  for src in st gguf; do
    M=/tmp/v2l; [ $src = gguf ] && M=$G
    T "hybrid decode, $src ($i)"; timeout 200 $K bench --model $M --device hybrid --cpu-expert-bits 4 --cache-dir /tmp/kc-$src --prompt-tokens 512 --decode-tokens 64 2>&1 | grep -E "probe|tok/s|per token"
  done
done
for src in st gguf; do
  M=/tmp/v2l; [ $src = gguf ] && M=$G
  T "CPU decode, $src"; timeout 300 $K bench --model $M --device cpu --cpu-expert-bits 4 --cache-dir /tmp/kc-$src --prompt-tokens 64 --decode-tokens 32 2>&1 | grep -E "probe|tok/s|per token|load"
done
T "llama.cpp CPU only on the same Q4_K_M file (--repack 0)"; timeout 240 $LB -m $G -dev none -ngl 0 --repack 0 -t $(nproc) -p 64 -n 32 -r 2 -o md 2>&1 | grep "^|"
T done
