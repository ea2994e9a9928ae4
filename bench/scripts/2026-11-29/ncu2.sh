#!/usr/bin/env bash
# Per-kernel device time (ncu) of glm-4.5-air 4-layer decode on the GPU engine: krasis-old vs krasis.
export KRASIS_NVRTC_CACHE=/tmp/krasis-nvrtc
NCU=$(which ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for b in krasis-old krasis; do
  echo "== $b"
  timeout 200 $NCU --clock-control none --metrics gpu__time_duration.sum --csv --page raw device-bundle/bin/$b bench --model /tmp/glm --device gpu --prompt-tokens 16 --decode-tokens 12 > /tmp/ncu-$b.csv 2>/tmp/ncu.err
  python3 - /tmp/ncu-$b.csv <<'PY'
import csv,collections,sys
rows=[r for r in csv.reader(open(sys.argv[1])) if len(r)>5]
hdr=rows[0]; data=rows[2:]
ni=hdr.index('Kernel Name'); ti=hdr.index('gpu__time_duration.sum')
tail=data[int(len(data)*0.6):]
agg=collections.defaultdict(lambda:[0,0.0])
for r in tail:
    try: v=float(r[ti].replace(',',''))
    except: continue
    a=agg[r[ni][:40]]; a[0]+=1; a[1]+=v
tot=sum(v for _,v in agg.values())
print('unit', rows[1][ti], 'kernels', len(tail))
for k,(n,v) in sorted(agg.items(), key=lambda x:-x[1][1])[:22]:
    print(f"{v/1e3:9.1f} us {n:4d} calls {v/n/1e3:7.2f} us/call  {k}")
print('total us %.1f' % (tot/1e3))
PY
done
