#!/usr/bin/env bash
# Session 36, dev VM (2 cores of an AMD EPYC Zen 4, AVX-512 VNNI, no AMX): CPU prefill and decode
# with the M > 2 row tiles (outputs in registers over all the groups) against the build before
# them (OLD, 5cda964's kernels), alternated twice. Models: `krasis synth --preset v2-lite --layers
# 4` (INT4 g128 and 4a experts, INT8 dense) and `krasis synth --config
# scripts/configs/qwen3-30b-a3b-nvfp4.json --layers 4` (NVFP4 experts as stored).
#   OLD=/tmp/krasis-old NEW=target/release/krasis bash bench/scripts/2026-11-30/s36-devvm-tiles.sh
set -euo pipefail
OLD=${OLD:?path of the old krasis}; NEW=${NEW:-target/release/krasis}
V2=${V2:-/tmp/v2l4}; NV=${NV:-/tmp/nv4}
[ -d "$V2" ] || "$NEW" synth --preset v2-lite --layers 4 --out "$V2"
[ -d "$NV" ] || "$NEW" synth --config scripts/configs/qwen3-30b-a3b-nvfp4.json --layers 4 --out "$NV"
for r in 1 2; do
  for case in "$V2 4" "$V2 4a" "$NV auto"; do
    set -- $case
    for b in "$OLD" "$NEW"; do
      for p in 64 512; do
        echo "== round $r: $(basename "$b") $(basename "$1") --cpu-expert-bits $2, prompt $p"
        "$b" bench --model "$1" --device cpu --cpu-expert-bits "$2" --prompt-tokens "$p" --prefill-reps 3 \
          --decode-tokens 32 --decode-reps 3 2>&1 | grep -E "^prefill $p|^prefill \(last|^decode runs|^bytes/token" | cut -c1-220
      done
    done
  done
done
