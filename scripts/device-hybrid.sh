#!/usr/bin/env bash
# Runs ON the GPU box from the repository root, over device-bundle/ (scripts/device-bundle.sh gpu):
# the router tests, the HF oracle on --device gpu and --device hybrid, then a synthetic V2-Lite
# (27 layers) through the hybrid engine with INT4 experts: cached start, prefill at 512 / 2K,
# decode at 512 and 8K of context, each with the in-run bandwidth probe; and the whole-GPU decode
# with its per-part profile for comparison. Log: $OUT/hybrid.log.
#   run(command="bash device-bundle/device-hybrid.sh", carry=["device-bundle"])
# SECTIONS="tests model" (default both); V2L=/path reuses a synthesized model (e.g. peer-llama's
# /tmp/v2l); PREV=path/to/an/earlier/krasis also runs the 512-token bench with that binary.
set -uo pipefail
B=device-bundle
LOG="${OUT:-/tmp}/hybrid.log"
exec > >(tee -a "$LOG") 2>&1
export KRASIS_FIXTURES="$PWD/$B/fixtures" KRASIS_REQUIRE_FIXTURES=1 KRASIS_REQUIRE_GPU=1
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
K=$B/bin/krasis
SECTIONS="${SECTIONS:-tests model ncu}"
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
T "machine $(date -u +%FT%TZ): $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null); $(nproc) cores"
if has tests; then
    for t in $B/tests/krasis_gpu-* $B/tests/kernels-* $B/tests/linear-* $B/tests/moe-* $B/tests/router-* \
        $B/tests/sampling-* $B/tests/flash_prefill-* $B/tests/kv_cache-* $B/tests/attn_decode-* $B/tests/host_flag-*; do
        [ -x "$t" ] || continue
        T "-- $t"
        timeout 300 "$t" --test-threads=1 --nocapture 2>&1 | grep -E "test result|FAILED|panicked|failures:|^    [a-z_0-9]+$|assert|^bench|^router:" | head -30
    done
    for t in $B/tests/gpu_batch-* $B/tests/gpu_oracle-* $B/tests/hybrid_oracle-* $B/tests/hybrid_gguf-*; do
        [ -x "$t" ] || continue
        T "-- $t"
        timeout 400 "$t" --test-threads=1 --nocapture 2>&1 | grep -vE "^\s*$|^running|^test .* ok$|compiled kernel" | head -60
    done
fi
if has model; then
    V2L="${V2L:-/tmp/v2l}"
    [ -f $V2L/config.json ] || { T synth; $K synth --preset v2-lite --out $V2L --force 2>&1 | tail -1; }
    C=/tmp/krasis-cache
    T "convert INT4 (first start builds the cache)"
    timeout 400 $K convert --model $V2L --cpu-expert-bits 4 --cache-dir $C 2>&1 | tail -3
    H="--device hybrid --cpu-expert-bits 4 --cache-dir $C"
    T "hybrid, cached start, 512-token prompt, 64 decode steps"
    timeout 300 $K bench --model $V2L $H --prompt-tokens 512 --decode-tokens 64 2>&1 | tail -12
    if [ -x "${PREV:-}" ]; then
        # Alternating runs: instances drift (other tenants' memory traffic), so one pair can mislead.
        for i in 1 2; do
            T "previous version ($PREV), same bench ($i)"
            timeout 300 $PREV bench --model $V2L $H --prompt-tokens 512 --decode-tokens 64 2>&1 | tail -3
            T "this version, same bench ($i)"
            timeout 300 $K bench --model $V2L $H --prompt-tokens 512 --decode-tokens 64 2>&1 | tail -3
        done
    fi
    T "--device auto picks (whole model fits 80 GB: gpu; with a 20 GiB budget: hybrid)"
    timeout 200 $K generate --model $V2L --prompt "Hi" --max-new-tokens 4 --cache-dir $C 2>&1 | grep -E "^device:"
    timeout 200 $K generate --model $V2L --vram-budget 20GiB --prompt "Hi" --max-new-tokens 4 --cache-dir $C 2>&1 | grep -E "^device:|decode"
    T "hybrid, 2K prompt"
    timeout 300 $K bench --model $V2L $H --prompt-tokens 2048 --decode-tokens 32 2>&1 | tail -4
    T "hybrid, generate smoke"
    timeout 200 $K generate --model $V2L $H --prompt "The experts live in RAM" --max-new-tokens 16 2>&1 | tail -6
    T "whole-GPU decode with the per-part profile (for the GPU share of a step)"
    KRASIS_GPU_PROFILE=1 timeout 300 $K bench --model $V2L --device gpu --prompt-tokens 512 --decode-tokens 64 2>&1 | tail -6
    if has ncu && command -v ncu >/dev/null; then
        T "ncu: device time per kernel of the last whole-GPU decode step"
        timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
            $K bench --model $V2L --device gpu --prompt-tokens 16 --decode-tokens 2 > /tmp/ncu.csv 2>/tmp/ncu.err
        python3 - /tmp/ncu.csv <<'PY'
import csv, sys, collections
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
        if r.get("Metric Name") == "gpu__time_duration.sum"]
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
ks = [(r["Kernel Name"].split("(")[0][:60], float(r["Metric Value"].replace(",", "")) * scale.get(r["Metric Unit"], 1.0)) for r in rows]
last = max(i for i, (n, _) in enumerate(ks) if "embedding" in n)
step = ks[last:]
agg = collections.OrderedDict()
for n, us in step:
    c, t = agg.get(n, (0, 0.0)); agg[n] = (c + 1, t + us)
total = sum(t for _, t in agg.values())
print(f"one decode step: {len(step)} kernels, {total:.1f} us of kernel time")
for n, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"{t:9.1f} us {c:5d} x {t / c:7.2f} us  {n}")
PY
    fi
    if [ "${LONG:-0}" = 1 ]; then
        T "hybrid, 8K prompt (decode at 8K context)"
        timeout 400 $K bench --model $V2L $H --prompt-tokens 8192 --decode-tokens 32 2>&1 | tail -4
    fi
fi
T done
