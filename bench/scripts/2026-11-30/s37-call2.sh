#!/usr/bin/env bash
# Session 37, call 2 (H200): the 4a hybrid test with its INT8-derived bar; auto is now 4a on float experts
# (CPU engine and hybrid): what auto runs, and its speed against --cpu-expert-bits 4, alternated.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
N=$B/bin/krasis; W=/tmp/v2l8
T "hybrid_oracle: 4a streams its one copy as int8 (bar from each fixture's ideal INT8)"
timeout 200 $B/tests/hybrid_oracle --test-threads 1 --nocapture int4a 2>&1 | grep -E "^test |4a streamed|panicked|test result" | head -20
[ -f $W/config.json ] || { T synth; $N synth --preset v2-lite --layers 8 --out $W 2>&1 | tail -1; }
T "convert at auto (what generate at its defaults reads here), then 4"
$N convert --model $W 2>&1 | grep -E "routed experts|expert cache|note|INT4" | cut -c1-200
$N convert --model $W --cpu-expert-bits 4 2>&1 | grep -E "expert cache" | cut -c1-160
T "generate at the defaults: the device line and the experts"
$N generate --model $W --prompt-ids 1,2,3 --max-new-tokens 4 2>&1 | grep -E "device:|routed experts|placement|stream" | cut -c1-260
for r in 1 2 3; do for bits in auto 4; do
  T "r$r hybrid $bits"
  timeout 150 $N bench --model $W --device hybrid --cpu-expert-bits $bits --prompt-tokens 2048 --decode-tokens 64 2>&1 | grep -E "hybrid prefill|per token:|RSS|in-run probe" | cut -c1-220
done; done
for r in 1 2; do for bits in auto 4; do
  T "r$r cpu $bits"
  timeout 150 $N bench --model $W --device cpu --cpu-expert-bits $bits --prompt-tokens 512 --prefill-reps 2 --decode-tokens 32 --decode-reps 2 2>&1 | grep -E "^prefill|bytes/token|in-run probe|experts:" | cut -c1-220
done; done
T done
