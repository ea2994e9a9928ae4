#!/usr/bin/env bash
# Session 43, calls 3 and 5 (H200, the machine of calls 1-2): #40's NVFP4 streaming bar in this session. Qwen3-30B-A3B's
# config with ModelOpt NVFP4 experts at 8 layers (synthetic, in /dev/shm), hybrid decode of 64 tokens after 512
# with the CPU experts alone, NVFP4 kept as stored (`auto`): the `per token: CPU experts … = N% of the probe` line,
# rounds until 200 s in (ROUNDS, default 5; DECODE tokens, default 64).
K=device-bundle/bin/krasis; M=/dev/shm/q3nv
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
[ -f $M/config.json ] || { T "synth"; timeout 120 $K synth --config scripts/configs/qwen3-30b-a3b-nvfp4.json --layers 8 --out $M 2>&1 | tail -1; }
for r in $(seq "${ROUNDS:-5}"); do
  [ $(( $(date +%s) - t0 )) -lt 200 ] || break
  T "r$r hybrid nvfp4 (auto: as stored)"
  timeout 90 $K bench --model $M --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens "${DECODE:-64}" 2>&1 \
    | grep -E "decode [0-9]+ tokens|per token:|in-run probe|routed experts|error|panick" | grep -v compiled | cut -c1-300
done
T done
