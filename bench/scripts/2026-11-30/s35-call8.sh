#!/usr/bin/env bash
# Session 35, call 8 (H200, after calls 6-7 on the same machine): gpt-oss-120b at 4 layers, hybrid
# decode (CPU experts alone, MXFP4 as stored), the build before (krasis-old), this build, and this
# build with KRASIS_MOE_W2_RUN_K=1 (w2 calls of one group, as before), three rounds.
B=device-bundle; export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
for r in 1 2 3; do
  for v in old new new1; do
    k=$B/bin/krasis; [ $v = old ] && k=$B/bin/krasis-old
    e=""; [ $v = new1 ] && e="KRASIS_MOE_W2_RUN_K=1"
    echo "r$r $v"
    env $e timeout 60 $k bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --model /tmp/oss 2>&1 | grep -E "decode 64|per token" | cut -c1-150
  done
done
