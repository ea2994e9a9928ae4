#!/usr/bin/env bash
# Session 39, call 1 (H200): the row-invariant prefill (GpuOptions::invariant_prefill,
# --invariant-prefill). (1) krasis-gpu linear + moe tests (fixed rows bit for bit); (2)
# prefix_reuse (the invariant resume at rel 0 on GPU and hybrid); (3) v2-lite (27 layers) synth,
# the 10-turn 8K conversation with and without the option; (4) v2-lite hybrid prefill 512 / 8192
# and decode, with and without the option, alternated twice.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_FIXTURES_NEXT=$PWD/$B/next KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
for t in linear moe prefix_reuse; do
  T "$t"; timeout 300 $B/tests/$t --test-threads 1 --nocapture 2>&1 | grep -E "^test .*(FAILED|ignored)|panicked|test result|invariant|resumed at|fixed rows" | head -40
done
T "synth v2-lite"
$B/bin/krasis synth --preset v2-lite --out /tmp/v2 2>&1 | tail -2
export KRASIS_CONVERSATION_MODEL=/tmp/v2
T "conversation, invariant"
timeout 400 $B/tests/prefix_reuse --ignored --nocapture a_ten_turn 2>&1 | grep -vE "^\s*$" | tail -22
T "conversation, default"
KRASIS_CONVERSATION_DEFAULT=1 timeout 300 $B/tests/prefix_reuse --ignored --nocapture a_ten_turn 2>&1 | grep -E "turn|identical|panicked|test result" | tail -16
for r in 1 2; do
  for inv in "" "--invariant-prefill"; do
    for p in 512 8192; do
      T "round $r ${inv:-default} prompt $p"
      timeout 200 $B/bin/krasis bench --model /tmp/v2 --device hybrid --prompt-tokens $p --prefill-reps 3 --decode-tokens 64 --kv-tokens 9000 $inv 2>&1 | grep -E "^hybrid prefill|prefill [0-9]:|error|Error" | head -5
    done
  done
done
T done
