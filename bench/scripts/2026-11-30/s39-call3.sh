#!/usr/bin/env bash
# Session 39, call 3 (H200): after 'a layer whose pins hold every expert never streams' and the
# test fix: (1) prefix_reuse and hybrid_oracle; (2) the engine-level 10-turn conversation with the
# invariant prefill; (3) serve-load's conversation through `krasis serve --invariant-prefill`;
# (4) v2-lite hybrid prefill 512 / 8192 + decode, the build before (krasis-old, 896be3d) against
# this one (default, then --invariant-prefill), alternated twice.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in prefix_reuse hybrid_oracle; do
  T "$t"; timeout 300 $B/tests/$t --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|invariant|pinned|^Gpu|^Hybrid" | head -30
done
T "synth v2-lite"
$B/bin/krasis synth --preset v2-lite --out /tmp/v2 2>&1 | tail -1
export KRASIS_CONVERSATION_MODEL=/tmp/v2
T "conversation, invariant (engine)"
timeout 300 $B/tests/prefix_reuse --ignored --nocapture a_ten_turn 2>&1 | grep -E "turn|identical|panicked|test result" | tail -16
T "krasis serve --device hybrid --invariant-prefill"
$B/bin/krasis serve --model /tmp/v2 --device hybrid --invariant-prefill --max-batch 32 --kv-tokens 16384 --port 8101 \
    --served-model-name v2-lite > /tmp/serve.log 2>&1 & KS=$!
up=0; for i in $(seq 240); do [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8101/health)" = 200 ] && { up=1; break; }; kill -0 $KS 2>/dev/null || break; sleep 1; done
T "up=$up"; grep -E "placement" /tmp/serve.log | head -4
if [ $up = 1 ]; then
  timeout 200 python3 scripts/serve-load.py --url http://127.0.0.1:8101 --model v2-lite --deadline 180 --json $OUT/prefix.json prefix --turns 10 --history-tokens 8192 --turn-tokens 64 --reply-tokens 32 2>&1 | tail -14
  curl -s http://127.0.0.1:8101/metrics | grep -E "^krasis_prefix" | head
fi
kill $KS; sleep 2; cp /tmp/serve.log $OUT/serve.log
for r in 1 2; do
  for bin in krasis-old "krasis" "krasis --invariant-prefill"; do
    for p in 512 8192; do
      T "round $r $bin prompt $p"
      set -- $bin
      timeout 200 $B/bin/$1 bench --model /tmp/v2 --device hybrid --prompt-tokens $p --prefill-reps 3 --decode-tokens 64 --kv-tokens 9000 ${2:-} 2>&1 | grep -E "^hybrid prefill|error|Error" | head -3
    done
  done
done
T done
