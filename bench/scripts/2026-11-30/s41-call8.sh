#!/usr/bin/env bash
# Session 41 call 8: the hand-off's stream wait by cuStreamWaitValue64 (A) or by a polling kernel (B): host_flag's
# round-trip timings; hybrid_oracle with B; glm-4.5-air 4 layers hybrid decode A against B, alternated.
B=device-bundle; KA=$B/bin/krasis-old; KB=$B/bin/krasis; W=/tmp
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T synth; $KB synth --preset glm-4.5-air --layers 4 --out $W/glm > /tmp/synth.log 2>&1 &
T host_flag; $B/tests/host_flag --test-threads 1 --nocapture 2>&1 | grep -E "^test |result|panicked|round trip"
T hybrid_oracle; $B/tests/hybrid_oracle --test-threads 1 2>&1 | grep -E "result|panicked|FAIL"
wait; tail -1 /tmp/synth.log
KH="bench --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 128 --model $W/glm --cpu-expert-bits 4"
fig() { grep -E "decode 128|per token:|error|Error|panick" | grep -v compiled; }
T "warm (cache)"; timeout 200 $KA $KH 2>&1 | fig | tail -2
for r in 1 2 3 4; do
  T "r$r A stream wait"; timeout 60 $KA $KH 2>&1 | fig
  T "r$r B polling kernel"; timeout 60 $KB $KH 2>&1 | fig
done
T "A profile"; KRASIS_GPU_PROFILE=1 timeout 60 $KA $KH 2>&1 | grep -E "decode, "
T "B profile"; KRASIS_GPU_PROFILE=1 timeout 60 $KB $KH 2>&1 | grep -E "decode, "
T done
