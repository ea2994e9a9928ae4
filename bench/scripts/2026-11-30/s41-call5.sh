#!/usr/bin/env bash
# Session 41 call 5: the m=1 BF16 GEMVs held to 64 registers (4 blocks of 256 per SM: GLM's o_proj's 512 blocks and
# q/k/v's 448 in one wave), with the rmsnorm change: linear (every test, GEMV timings with GLM's shapes), kernels;
# glm-4.5-air 4 layers all-GPU profile and hybrid decode against cb6154d, alternated.
B=device-bundle; K=$B/bin/krasis; KO=$B/bin/krasis-old; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T synth; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -1 &
T linear; $B/tests/linear --test-threads 1 --nocapture 2>&1 | grep -E "^test |result|panicked|m=1" | grep -vE "m=2|m=4|m=8" | head -60
T kernels; $B/tests/kernels --test-threads 1 2>&1 | grep -E "result|panicked"
wait
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 128 --model $W/glm --cpu-expert-bits 4"
fig() { grep -E "decode 128|per token:|error|Error|panick" | grep -v compiled; }
T "all-GPU new"; KRASIS_GPU_PROFILE=1 timeout 120 $K bench --device gpu --model $W/glm --prompt-tokens 512 --decode-tokens 128 2>&1 | grep -E "^decode:|decode 128"
T "all-GPU old"; KRASIS_GPU_PROFILE=1 timeout 120 $KO bench --device gpu --model $W/glm --prompt-tokens 512 --decode-tokens 128 2>&1 | grep -E "^decode:|decode 128"
T "warm (cache)"; timeout 200 $K $KH 2>&1 | fig | tail -2
for r in 1 2 3; do
  T "r$r new"; timeout 60 $K $KH 2>&1 | fig
  T "r$r old"; timeout 60 $KO $KH 2>&1 | fig
done
T "new profile"; KRASIS_GPU_PROFILE=1 timeout 60 $K $KH 2>&1 | grep -E "decode, "
T "old profile"; KRASIS_GPU_PROFILE=1 timeout 60 $KO $KH 2>&1 | grep -E "decode, "
T done
