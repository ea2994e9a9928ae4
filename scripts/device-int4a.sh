#!/usr/bin/env bash
# Issue #38 item 5: the speed of asymmetric INT4 g32 (`--cpu-expert-bits 4a`) beside INT4 g128 on
# the GPU box's CPU (16 Xeon cores). Two steps:
#   here:  scripts/device-int4a.sh bundle      # builds int4a-bench/ (krasis, the criterion bench)
#   there: run(command="bash int4a-bench/device-int4a.sh", carry=["int4a-bench"])
# int4a-bench/ must be ignored (`echo /int4a-bench/ >> .git/info/exclude`). The log comes back as
# $OUT/int4a-speed.log. DECODE=0 skips the v2-lite decode runs (about 3 of its 6 minutes).
set -uo pipefail
if [ "${1:-}" = bundle ]; then
    set -e
    cd "$(dirname "$0")/.."
    B=int4a-bench
    rm -rf "$B" && mkdir -p "$B"
    cp "$(scripts/build-krasis.sh)" "$B/krasis"
    exe=$(cargo bench -p krasis-cpu --bench int4a_matmul --no-run --message-format=json 2>/dev/null |
        grep -o '"executable":"[^"]*int4a_matmul[^"]*"' | tail -n 1 | cut -d'"' -f4)
    cp "$exe" "$B/int4a_matmul"
    strip "$B/krasis" "$B/int4a_matmul"
    cp scripts/device-int4a.sh "$B/"
    du -sh "$B"
    exit 0
fi
B=int4a-bench; K=$B/krasis
LOG="${OUT:-/tmp}/int4a-speed.log"; exec > >(tee -a "$LOG") 2>&1
date -u; lscpu | grep -E "Model name|^CPU\(s\)|Thread|L3"
echo "== krasis bench --expert-gemv (avx512; M = 2 per token: value and residual rows)"
KRASIS_ISA=avx512 $K bench --expert-gemv --gemv-isa avx512 --gemv-bytes $((3 << 30)) --membw-bytes $((4 << 30)) 2>&1 | grep -vE "^\s*$"
echo "== criterion int4a_matmul, M = 1, 2 and 8, avx512"
$B/int4a_matmul --bench 'avx512/m1/|avx512/m2/|avx512/m8/|read/' --warm-up-time 1 --measurement-time 2 2>&1 |
    grep -E "^(int4a_matmul|\s+thrpt)" | paste - - | sed -E 's/ +/ /g'
if [ "${DECODE:-1}" = 1 ]; then
    W=/tmp/krasis-work
    $K synth --preset v2-lite --layers 8 --out $W/v2l8 --force 2>&1 | tail -1
    for bits in 4 4a 4 4a; do
        echo "== decode, v2-lite 8 layers, --cpu-expert-bits $bits"
        $K bench --model $W/v2l8 --cpu-expert-bits $bits --cpu-dense-bits 8 --decode-tokens 64 --membw-bytes $((4 << 30)) 2>&1 | tail -4
    done
fi
