#!/usr/bin/env bash
# Runs ON the GPU box from the repository root, over device-bundle/ built by scripts/device-bundle.sh.
# Everything goes to $OUT/device.log. Sections: machine, tests (CPU kernels on this CPU's ISAs,
# GPU kernels, HF oracle), memory bandwidth + expert GEMV, synth/convert/load/decode of v2-lite.
set -uo pipefail
B=device-bundle
LOG="${OUT:-/tmp}/device.log"
exec > >(tee -a "$LOG") 2>&1
export KRASIS_FIXTURES="$PWD/$B/fixtures" KRASIS_REQUIRE_FIXTURES=1 KRASIS_REQUIRE_GPU=1
K=$B/bin/krasis
echo "== machine $(date -u +%FT%TZ)"; nproc; grep -m1 "model name" /proc/cpuinfo; free -g | head -2
grep -o -w -E 'avx512f|avx512bw|avx512_vnni|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
nvidia-smi -L 2>/dev/null || true
echo "== tests"
for t in $B/tests/*; do echo "-- $t"; "$t" 2>&1 | grep -E "test result|FAILED|panicked|SKIPPED" ; done
echo "== membw + expert GEMV (all physical cores)"
$K bench --expert-gemv --gemv-bytes $((4 << 30))
W=/tmp/krasis-work; rm -rf $W; mkdir -p $W
echo "== synth v2-lite (27 layers)"
/usr/bin/time -f "synth: %e s, max RSS %M KB" $K synth --preset v2-lite --out $W/v2l --force 2>&1 | grep -v "^\s*$" | tail -2
for bits in 4 8; do
    echo "== convert int$bits"
    sync; echo 3 > /proc/sys/vm/drop_caches
    /usr/bin/time -f "convert: %e s, max RSS %M KB" $K convert --model $W/v2l --cpu-expert-bits $bits 2>&1 | tail -3
    echo "== cached load int$bits (page cache dropped)"
    sync; echo 3 > /proc/sys/vm/drop_caches
    $K convert --model $W/v2l --cpu-expert-bits $bits 2>&1 | tail -1
done
for cfg in "4 8" "8 8" "4 bf16"; do
    set -- $cfg
    echo "== decode bench experts int$1, dense $2"
    $K bench --model $W/v2l --cpu-expert-bits $1 --cpu-dense-bits $2 --decode-tokens 32 --prompt-tokens 16 2>&1 | tail -4
done
echo "== generate smoke"
$K generate --model $W/v2l --cpu-expert-bits 4 --cpu-dense-bits 8 --prompt "The experts live in RAM" --max-new-tokens 16 2>&1 | tail -4
echo "== done $(date -u +%FT%TZ)"
