#!/usr/bin/env bash
# Session 35, call 3 (H200): the FP4 M = 2 loop (one chain per row from the bias) and the w2 run of
# >= 128 columns, against the build before (krasis-old = main at 663108b), alternated three times:
# expert GEMV (avx512), then NVFP4 inside a real model's decode (Qwen3-30B-A3B's config with
# ModelOpt NVFP4 experts, 8 layers): hybrid (CPU experts alone) and the CPU engine, 64 tokens
# after 512; INT4 g128 of the same weights in the hybrid once per round for reference.
B=device-bundle; M=/tmp/q3nv
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
lscpu | grep -E "Model name|^CPU\(s\)"
N=$B/bin/krasis; O=$B/bin/krasis-old
[ -f $M/config.json ] || { T "synth"; $N synth --config scripts/configs/qwen3-30b-a3b-nvfp4.json --layers 8 --out $M 2>&1 | tail -1; }
T "caches"; $N convert --model $M 2>&1 | grep -E "routed experts|expert cache" | cut -c1-160
$N convert --model $M --cpu-expert-bits 4 2>&1 | grep -E "routed experts|expert cache" | cut -c1-160
for r in 1 2 3; do
  for b in old new; do
    K=$N; [ $b = old ] && K=$O
    T "r$r $b expert-gemv"
    KRASIS_ISA=avx512 $K bench --expert-gemv --gemv-isa avx512 --gemv-bytes $((3 << 30)) --membw-bytes $((4 << 30)) 2>&1 | grep -E "^memory read|int4 |int4a|mxfp4|nvfp4" | cut -c1-200
  done
  for b in old new; do
    K=$N; [ $b = old ] && K=$O
    T "r$r $b hybrid nvfp4"
    timeout 90 $K bench --model $M --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 2>&1 | grep -E "decode 64|per token:|in-run probe"
  done
  T "r$r new hybrid int4"
  timeout 90 $N bench --model $M --device hybrid --cache-strategy none --cpu-expert-bits 4 --prompt-tokens 512 --decode-tokens 64 2>&1 | grep -E "decode 64|per token:|in-run probe"
  for b in old new; do
    K=$N; [ $b = old ] && K=$O
    T "r$r $b cpu nvfp4"
    timeout 90 $K bench --model $M --device cpu --prompt-tokens 512 --decode-tokens 64 --decode-reps 2 2>&1 | grep -E "decode 64|bytes/token|all weights against" | cut -c1-330
  done
done
T done
