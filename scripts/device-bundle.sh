#!/usr/bin/env bash
# Build here what the GPU box needs (it has no Rust and no network) into device-bundle/:
# the krasis binary, the CPU/quant/GPU test binaries, criterion benches, the HF oracle fixtures
# and the device scripts. Then run it there with the device tool:
#   run(command="bash device-bundle/device-run.sh", carry=["device-bundle"])   # CPU experts
#   run(command="bash device-bundle/device-gpu.sh", carry=["device-bundle"])   # GPU runtime
# `scripts/device-bundle.sh gpu|cpu` packs only that side's tests (the device tool carries at
# most 64 MiB); the default packs both.
set -euo pipefail
cd "$(dirname "$0")/.."
out=device-bundle
rm -rf "$out" && mkdir -p "$out/bin" "$out/tests"
cp "$(scripts/build-krasis.sh)" "$out/bin/"
# Test and bench executables, located through cargo's JSON messages.
exes() {
    cargo "$@" --release --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] != ["bin"]:
        print(m["target"]["name"], m["executable"])'
}
case "${1:-all}" in
    gpu) sel=(-p krasis-gpu --lib --tests) ;;
    cpu) sel=(-p krasis-cpu -p krasis-quant -p krasis-core -p krasis-tests --lib --tests) ;;
    *) sel=(-p krasis-cpu -p krasis-quant -p krasis-core -p krasis-gpu -p krasis-tests --lib --tests) ;;
esac
{
    exes test "${sel[@]}"
    if [ "${1:-all}" = gpu ]; then exes test -p krasis-tests --test gpu_oracle --test hybrid_oracle --test gpu_batch --test hybrid_gguf; fi
} | while read -r name exe; do
    cp "$exe" "$out/tests/$name-$(basename "$(dirname "$exe")")-$(basename "$exe" | tr -cd 'a-z0-9_-')"
done
strip "$out"/bin/* "$out"/tests/*
fixtures="${KRASIS_FIXTURES:-../shared/fixtures}"
[ -d "$fixtures" ] && cp -r "$fixtures" "$out/fixtures"
cp -r krasis-gpu/kernels "$out/kernels" 2>/dev/null || true
cp scripts/device-run.sh scripts/device-gpu.sh scripts/device-hybrid.sh scripts/device-gguf.sh scripts/device-amx.sh "$out/"
du -sh "$out"
