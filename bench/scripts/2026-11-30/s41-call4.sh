#!/usr/bin/env bash
# Session 41 call 4: (1) krasis-gpu kernels (rmsnorm_residual with one thread per 4 elements) and the BF16 GEMV timings
# with GLM-4.5-Air's shapes; (2) glm-4.5-air 4 layers hybrid decode, this build against cb6154d, alternated.
B=device-bundle; K=$B/bin/krasis; KO=$B/bin/krasis-old; W=/tmp
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T synth; $K synth --preset glm-4.5-air --layers 4 --out $W/glm 2>&1 | tail -1 &
T kernels; $B/tests/kernels --test-threads 1 2>&1 | grep -E "^test |result|panicked" | head -40
T "gemv timings"; $B/tests/linear bf16_gemv_timings --nocapture --test-threads 1 2>&1 | grep -E "glm|o_proj|lm_head|result|panicked" | grep -E "m=1|result|panicked"
wait
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 128 --model $W/glm --cpu-expert-bits 4"
fig() { grep -E "decode 128|per token:|error|Error|panick" | grep -v compiled; }
T "warm (cache)"; timeout 200 $K $KH 2>&1 | fig | tail -2
for r in 1 2 3; do
  T "r$r new"; timeout 60 $K $KH 2>&1 | fig
  T "r$r old"; timeout 60 $KO $KH 2>&1 | fig
done
T "new profile"; KRASIS_GPU_PROFILE=1 timeout 60 $K $KH 2>&1 | grep -E "decode, "
T "old profile"; KRASIS_GPU_PROFILE=1 timeout 60 $KO $KH 2>&1 | grep -E "decode, "
T done
