#!/usr/bin/env bash
# Session 35, call 10 (H200 host): gpt-oss-120b at 4 layers (MXFP4 experts as stored), prefill of
# 512 tokens now that the BF16 prefill tiles take the biased, clamped-SwiGLU experts, against the
# build before (krasis-old, 663108b), alternated twice: CPU engine, and the hybrid (whose biased
# experts stay on the CPU).
B=device-bundle; N=$B/bin/krasis; O=$B/bin/krasis-old; G=/tmp/oss
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
[ -f $G/config.json ] || { T "synth oss"; $N synth --preset gpt-oss-120b --layers 4 --out $G 2>&1 | tail -1; }
T "cache"; $N convert --model $G 2>&1 | grep -E "expert cache" | cut -c1-160
for r in 1 2; do
  for b in old new; do
    K=$N; [ $b = old ] && K=$O
    T "r$r $b cpu"
    timeout 100 $K bench --model $G --device cpu --prompt-tokens 512 --decode-tokens 8 2>&1 | grep -E "^prefill|decode 8" | cut -c1-200
    T "r$r $b hybrid"
    timeout 100 $K bench --model $G --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 8 2>&1 | grep -E "hybrid prefill" | cut -c1-200
  done
done
T done
