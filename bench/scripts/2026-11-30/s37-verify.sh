#!/usr/bin/env bash
# For the session after 36 (H200), one call: verify session 36's GPU work and measure it.
# Pack (on the dev box): cargo test --release --no-run --message-format=json -p krasis-gpu --test relayout > /tmp/t1.json;
#   cargo test --release --no-run --message-format=json -p krasis-tests --test hybrid_oracle > /tmp/t2.json;
#   OLD=<a build before session 36's kernels> FIX=1 TESTS_JSON="/tmp/t1.json /tmp/t2.json" bash /work/tools/pack.sh
# Run: cd device-bundle && tar -xJf b.tar.xz && cd .. && bash device-bundle/s37-verify.sh
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
N=$B/bin/krasis; O=$B/bin/krasis-old; W=/tmp/v2l8
T "relayout (4a -> int8 g32 on the device, byte for byte the host twin)"
timeout 120 $B/tests/relayout --test-threads 1 --nocapture 2>&1 | grep -E "^test |relayout|panicked|test result" | head -20
T "hybrid_oracle: 4a streams its one copy as int8; the streamed / split / pinned checks"
timeout 300 $B/tests/hybrid_oracle --test-threads 1 --nocapture int4a streamed 2>&1 | grep -E "^test |4a streamed|panicked|test result" | head -30
[ -f $W/config.json ] || { T synth; $N synth --preset v2-lite --layers 8 --out $W 2>&1 | tail -1; }
for bits in 4 4a; do $N convert --model $W --cpu-expert-bits $bits 2>&1 | grep -E "expert cache" | cut -c1-160; done
T "hybrid 4a: prefill streams the CPU cache (one copy, RSS) against INT4 g128"
for bits in 4a 4; do
  timeout 150 $N bench --model $W --device hybrid --cpu-expert-bits $bits --prompt-tokens 2048 --decode-tokens 64 2>&1 | grep -E "stream|hybrid prefill|per token:|RSS|in-run probe" | cut -c1-260
done
T "CPU prefill on the AMX host, short prompts (4a and FP4 have no AMX form), against the build before"
for r in 1 2; do for K in $O $N; do for p in 16 64 512; do
  echo "== r$r $(basename $K) 4a prompt $p"
  timeout 90 $K bench --model $W --device cpu --cpu-expert-bits 4a --prompt-tokens $p --prefill-reps 3 --decode-tokens 16 2>&1 | grep -E "^prefill $p|bytes/token" | cut -c1-200
done; done; done
T done
