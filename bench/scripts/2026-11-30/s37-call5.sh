#!/usr/bin/env bash
# Session 37, call 5 (H200): does the hybrid's launching thread lose time to the CPU workers? glm-4.5-air at 4
# layers (CPU experts alone, INT4 g128, as #40's 1.73x) and v2-lite at 8 layers (auto: 4a), hybrid decode with
# --threads 16 (every physical core, the default) / 15 / 14, three rounds alternated.
B=device-bundle; N=$B/bin/krasis
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
fig() { grep -E "decode 64|per token:|in-run probe" | grep -v compiled | cut -c1-240; }
[ -f /tmp/glm/config.json ] || { $N synth --preset glm-4.5-air --layers 4 --out /tmp/glm 2>&1 | tail -1; $N convert --model /tmp/glm --cpu-expert-bits 4 2>&1 | tail -1 | cut -c1-120; }
[ -f /tmp/v2l8/config.json ] || { $N synth --preset v2-lite --layers 8 --out /tmp/v2l8 2>&1 | tail -1; $N convert --model /tmp/v2l8 2>&1 | tail -1 | cut -c1-120; }
for r in 1 2 3; do for t in 16 15 14; do
  T "r$r glm --threads $t"; timeout 90 $N bench --model /tmp/glm --device hybrid --cache-strategy none --cpu-expert-bits 4 --prompt-tokens 512 --decode-tokens 64 --threads $t 2>&1 | fig
done; done
for r in 1 2; do for t in 16 15; do
  T "r$r v2l8 auto --threads $t"; timeout 90 $N bench --model /tmp/v2l8 --device hybrid --cache-strategy none --prompt-tokens 512 --decode-tokens 64 --threads $t 2>&1 | fig
done; done
T done
