#!/usr/bin/env bash
# Session 39, call 2 (H200): (1) the tiny invariant-prefill test's own output; (2) `krasis serve
# --device hybrid --invariant-prefill` on v2-lite (27 layers): serve-load.py's 10-turn 8K
# conversation (TTFT per turn, /metrics' hits and reused tokens, turn 1 again equal to the cold
# one), then the 32-stream load with 4 8K prompts (chunked prefill with the invariant rule).
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "prefix_reuse an_invariant"
timeout 200 $B/tests/prefix_reuse --test-threads 1 --nocapture an_invariant 2>&1 | grep -vE "^\s*$|^note:" | tail -20
T "synth v2-lite"
[ -f /tmp/v2/config.json ] || $B/bin/krasis synth --preset v2-lite --out /tmp/v2 2>&1 | tail -1
T "krasis serve --device hybrid --invariant-prefill"
$B/bin/krasis serve --model /tmp/v2 --device hybrid --invariant-prefill --max-batch 32 --kv-tokens 16384 --port 8101 \
    --served-model-name v2-lite > /tmp/serve.log 2>&1 & KS=$!
up=0; for i in $(seq 240); do [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8101/health)" = 200 ] && { up=1; break; }; kill -0 $KS 2>/dev/null || break; sleep 1; done
T "up=$up"; grep -E "device|placement|invariant|serving|prefix" /tmp/serve.log | head -8
if [ $up = 1 ]; then
  T "prefix conversation"
  timeout 200 python3 scripts/serve-load.py --url http://127.0.0.1:8101 --model v2-lite --deadline 180 --json $OUT/prefix.json prefix --turns 10 --history-tokens 8192 --turn-tokens 64 --reply-tokens 32 2>&1 | tail -16
  grep -E "prefix cache|reused" /tmp/serve.log | tail -12
  curl -s http://127.0.0.1:8101/metrics | grep -E "^krasis_prefix" | head
  T "load: 32 streams, 4 of 8K"
  timeout 240 python3 scripts/serve-load.py --url http://127.0.0.1:8101 --model v2-lite --deadline 200 --json $OUT/load.json load --streams 32 --long 4 --long-tokens 8192 --short-tokens 128 --decode-tokens 256 2>&1 | tail -12
fi
kill $KS; sleep 2; cp /tmp/serve.log $OUT/serve.log
T done
