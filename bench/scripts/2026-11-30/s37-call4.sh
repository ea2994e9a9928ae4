#!/usr/bin/env bash
# Session 37, call 4 (H200): (1) hybrid_oracle, the whole file, at a4d830e (the 4a streamed test's final bar);
# (2) glm-4.5-air at 4 layers, hybrid decode with the CPU experts alone (INT4 g128, as #40's 1.73x was measured):
# KRASIS_GPU_PROFILE=1 breakdown, then every kernel's device time under ncu (--clock-control none, one metric,
# so no replay) for a 16-token prefill and 4 decode steps; the last steps' kernels listed in order.
B=device-bundle
export KRASIS_FIXTURES=$PWD/$B/fixtures KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc KRASIS_REQUIRE_GPU=1
t0=$(date +%s); T() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
N=$B/bin/krasis; W=/tmp/glm
T "hybrid_oracle (whole file)"
timeout 300 $B/tests/hybrid_oracle --test-threads 1 --nocapture 2>&1 | grep -E "^test |4a streamed|panicked|test result" | head -40
T "synth glm-4.5-air 4 layers"
$N synth --preset glm-4.5-air --layers 4 --out $W 2>&1 | tail -1
$N convert --model $W --cpu-expert-bits 4 2>&1 | grep -E "expert cache" | cut -c1-160
KH="bench --model $W --device hybrid --cache-strategy none --cpu-expert-bits 4"
for r in 1 2; do T "r$r glm profile"; KRASIS_GPU_PROFILE=1 timeout 120 $N $KH --prompt-tokens 512 --decode-tokens 64 2>&1 | grep -E "decode 64|per token:|in-run probe|GPU profile" | grep -v compiled; done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); T "ncu: $NCU"
timeout 300 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --log-file /tmp/ncu.csv $N $KH --prompt-tokens 16 --decode-tokens 4 > /tmp/ncu.out 2>&1; echo "ncu rc $?"; tail -3 /tmp/ncu.out
cp /tmp/ncu.csv $OUT/ 2>/dev/null
python3 - <<'PY'
import csv, collections
rows = [r for r in csv.DictReader(open('/tmp/ncu.csv')) if r.get('Metric Name') == 'gpu__time_duration.sum']
print('kernels profiled:', len(rows))
def us(r):
    v = float(r['Metric Value'].replace(',', '')); u = r['Metric Unit']
    return v / 1000 if u in ('nsecond', 'ns') else v * 1000 if u in ('msecond', 'ms') else v
last = rows[-160:]
for r in last: print(f"{us(r):9.2f} us  {r['Kernel Name'][:110]}")
tot = collections.defaultdict(lambda: [0, 0.0])
for r in rows[-160:]:
    n = r['Kernel Name'].split('(')[0][:70]; tot[n][0] += 1; tot[n][1] += us(r)
print('--- last 160 kernels by name: count, total us')
for n, (c, t) in sorted(tot.items(), key=lambda x: -x[1][1]): print(f"{c:4d} {t:9.1f}  {n}")
PY
T done
