#!/usr/bin/env bash
# Session 39, call 7 (H200): what --invariant-prefill costs the whole-GPU engine: v2-lite (27
# layers) with INT4 experts resident, prefill of 512 / 2048 / 8192 tokens and decode, default
# against --invariant-prefill, alternated twice.
B=device-bundle
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "synth v2-lite"; $B/bin/krasis synth --preset v2-lite --out /tmp/v2 2>&1 | tail -1
for r in 1 2; do
  for inv in "" "--invariant-prefill"; do
    for p in 512 2048 8192; do
      T "round $r ${inv:-default} prompt $p"
      timeout 200 $B/bin/krasis bench --model /tmp/v2 --device gpu --gpu-expert-bits 4 --prompt-tokens $p --decode-tokens 64 --kv-tokens 9000 $inv 2>&1 | grep -E "prefill|decode|error|Error" | head -3
    done
  done
done
T done
