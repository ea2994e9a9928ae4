#!/usr/bin/env bash
# Quick check on the GPU box: CPU tests (AVX-512 included) and the v2-lite decode benchmark.
set -uo pipefail
B=device-bundle; K=$B/bin/krasis
LOG="${OUT:-/tmp}/device-quick.log"; exec > >(tee -a "$LOG") 2>&1
export KRASIS_FIXTURES="$PWD/$B/fixtures" KRASIS_REQUIRE_FIXTURES=1
for t in $B/tests/krasis_cpu-* $B/tests/quant_fidelity-* $B/tests/oracle-*; do
  echo "-- $t"; "$t" 2>&1 | grep -E "test result|FAILED|panicked"
done
W=/tmp/krasis-work
[ -f $W/v2l/config.json ] || $K synth --preset v2-lite --out $W/v2l --force 2>&1 | tail -1
for cfg in "4 8" "8 8" "4 bf16"; do set -- $cfg; echo "== decode int$1 dense $2"
  $K bench --model $W/v2l --cpu-expert-bits $1 --cpu-dense-bits $2 --decode-tokens 32 --membw-bytes $((4 << 30)) 2>&1 | tail -3
done
