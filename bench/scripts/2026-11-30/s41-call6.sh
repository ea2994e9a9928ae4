#!/usr/bin/env bash
# Session 41 call 6: one-token BF16 GEMVs at 1 row per warp for every shape (64 registers), rmsnorm one thread per 4
# elements: linear + kernels suites, gpu_oracle + hybrid_oracle (fixtures); all-GPU profile; glm-4.5-air 4 layers
# hybrid decode against cb6154d, alternated 4 rounds.
B=device-bundle; K=$B/bin/krasis; KO=$B/bin/krasis-old; W=/tmp
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T synth; $K synth --preset glm-4.5-air --layers 4 --out $W/glm > /tmp/synth.log 2>&1 &
T linear; $B/tests/linear --test-threads 1 --nocapture 2>&1 | grep -E "^test |result|panicked|glm|lm_head" | grep -vE "m=2|m=4|m=8|worst" | head -40
T kernels; $B/tests/kernels --test-threads 1 2>&1 | grep -E "result|panicked"
T gpu_oracle; $B/tests/gpu_oracle --test-threads 1 2>&1 | grep -E "^test .*(FAIL|ok$)|result|panicked" | tail -5
T hybrid_oracle; $B/tests/hybrid_oracle --test-threads 1 2>&1 | grep -E "result|panicked|FAIL"
wait; tail -1 /tmp/synth.log
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 128 --model $W/glm --cpu-expert-bits 4"
fig() { grep -E "decode 128|per token:|error|Error|panick" | grep -v compiled; }
T "all-GPU new"; KRASIS_GPU_PROFILE=1 timeout 120 $K bench --device gpu --model $W/glm --prompt-tokens 512 --decode-tokens 128 2>&1 | grep -E "^decode:|decode 128"
T "all-GPU old"; KRASIS_GPU_PROFILE=1 timeout 120 $KO bench --device gpu --model $W/glm --prompt-tokens 512 --decode-tokens 128 2>&1 | grep -E "^decode:|decode 128"
T "warm (cache)"; timeout 200 $K $KH 2>&1 | fig | tail -2
for r in 1 2 3 4; do
  T "r$r new"; timeout 60 $K $KH 2>&1 | fig
  T "r$r old"; timeout 60 $KO $KH 2>&1 | fig
done
T "new profile"; KRASIS_GPU_PROFILE=1 timeout 60 $K $KH 2>&1 | grep -E "decode, "
T "old profile"; KRASIS_GPU_PROFILE=1 timeout 60 $KO $KH 2>&1 | grep -E "decode, "
T done
