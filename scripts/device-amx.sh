#!/usr/bin/env bash
# Runs ON the GPU box (Sapphire/Emerald Rapids: AMX-INT8) from the repository root, over
# device-bundle/ built by `scripts/device-bundle.sh cpu`: the CPU kernel tests with AMX required
# (KRASIS_REQUIRE_AMX=1: a missing AMX fails instead of skipping), the VNNI/AMX crossover per shape
# (the ignored test amx_crossover, to set AMX_MIN_ROWS), and the 512-token CPU prefill of a
# synthetic V2-Lite with the AMX tiles on (default) and off (KRASIS_ISA=avx512), INT8 and INT4
# experts, INT8 dense weights, with the per-part breakdown. Log: $OUT/amx.log.
#   run(command="bash device-bundle/device-amx.sh", carry=["device-bundle"])
# V2L=/path reuses a synthesized V2-Lite; SECTIONS="tests crossover prefill" (default all).
set -uo pipefail
B=device-bundle
LOG="${OUT:-/tmp}/amx.log"
exec > >(tee -a "$LOG") 2>&1
K=$B/bin/krasis
SECTIONS="${SECTIONS:-tests crossover prefill}"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
echo "== machine $(date -u +%FT%TZ)"; nproc; grep -m1 "model name" /proc/cpuinfo; uname -r
grep -o -w -E 'avx512_vnni|amx_tile|amx_int8|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
for t in $B/tests/krasis_cpu-*; do
    [ -x "$t" ] || continue
    if has tests; then
        echo "== $t (KRASIS_REQUIRE_AMX=1)"
        KRASIS_REQUIRE_AMX=1 timeout 600 "$t" 2>&1 | grep -E "test result|FAILED|panicked|SKIPPED|failures:|^    [a-z_0-9:]+$"
    fi
    if has crossover; then
        echo "== amx_crossover (one thread, best of 7 per point)"
        timeout 600 "$t" amx_crossover --ignored --nocapture --test-threads=1 2>&1 | grep -vE "^running|^test |^$"
    fi
done
if has prefill; then
    if [ -z "${V2L:-}" ]; then
        V2L=/tmp/krasis-amx/v2l
        mkdir -p /tmp/krasis-amx
        [ -f $V2L/config.json ] || $K synth --preset v2-lite --out $V2L --force 2>&1 | tail -1
    fi
    for bits in 8 4; do
        for isa in amx avx512; do
            echo "== prefill 512 tokens, experts int$bits, dense int8, KRASIS_ISA=$isa"
            KRASIS_ISA=$isa $K bench --model "$V2L" --device cpu --cpu-expert-bits $bits --cpu-dense-bits 8 \
                --prompt-tokens 512 --decode-tokens 8 2>&1 | grep -E "kernels:|^prefill|^membw|memory read"
        done
    done
fi
echo "== done $(date -u +%FT%TZ)"
