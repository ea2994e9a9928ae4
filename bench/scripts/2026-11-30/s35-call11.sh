#!/usr/bin/env bash
# Session 35, call 11 (H200 host, after call 10 on the same machine): gpt-oss-120b at 4 layers,
# CPU engine prefill of 2048 tokens (64 tokens per expert: the BF16 tiles' side of the 32-token
# rule), the build before (krasis-old, 663108b) and this build alternated twice.
B=device-bundle; export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
for r in 1 2; do
  for b in old new; do
    K=$B/bin/krasis; [ $b = old ] && K=$B/bin/krasis-old
    echo "r$r $b cpu 2048"
    timeout 100 $K bench --model /tmp/oss --device cpu --prompt-tokens 2048 --decode-tokens 4 2>&1 | grep -E "^prefill|decode 4" | cut -c1-330
  done
done
